"""ddl_lab/studies/bench_pretrain_controls.py: the write-only twins, the plan, and the `--quick` pipeline end to end."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from ddl_lab.studies import bench_pretrain
from ddl_lab.studies import bench_pretrain_controls as controls
from ddl_lab.studies import bench_pretrain_scaling as scaling


@pytest.fixture
def registered(monkeypatch):
    """The twins registered into copies of bench_pretrain's globals, restored afterwards."""
    monkeypatch.setattr(bench_pretrain, "VARIANTS", dict(bench_pretrain.VARIANTS))
    monkeypatch.setattr(bench_pretrain, "build_models", bench_pretrain.build_models)
    threads = torch.get_num_threads()  # the study sets one thread per run; later tests keep the suite's count
    controls.register_variants()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("row", ["ref_dv1", "ref_dv4_cc", "ref_dv4_tc"])
def test_write_only_twin_is_its_row_without_the_erase_term(registered, row):
    preset = dataclasses.replace(bench_pretrain.PRESETS["quick"], n_embd=16, n_head=4, arch="llama", init="reference")
    delta = bench_pretrain.build_models(preset, 512, row, 3)
    twin = bench_pretrain.build_models(preset, 512, controls.TWIN[row], 3)
    assert delta.config.delta_erase and not twin.config.delta_erase
    assert all(b.erase for b in delta.delta_residuals().values())
    assert not any(b.erase for b in twin.delta_residuals().values())
    # Same state, read, compressor, value and starting weights: only the update differs.
    assert twin.config.to_dict() | {"delta_erase": True} == delta.config.to_dict()
    a, b = delta.state_dict(), twin.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert not torch.allclose(delta(ids).logits, twin(ids).logits)


def test_plans_keep_selection_and_comparison_seeds_apart():
    full = controls.PLANS["full"]
    assert not set(full.selection_seeds) & set(full.comparison_seeds)
    assert len(full.lrs) >= 4 and len(full.selection_seeds) >= 2 and len(full.comparison_seeds) >= 5
    assert full.widths == (160,)
    # Study 2's cell at its largest width, rate and seed is the same run (same steps, warm-up and cache folder).
    study2 = scaling.cells(scaling.PLANS["full"])["llama", 160, scaling.SHARED_LR]
    assert controls.cells(full, 160)[scaling.SHARED_LR] == study2
    with pytest.raises(ValueError, match="overlap"):
        dataclasses.replace(full, selection_seeds=(4, 100))


def test_a_run_that_started_elsewhere_than_its_twins_at_the_other_rates_is_refused():
    """Same row and seed at every rate: same weights, same data, so the same step-0 loss. One that differs trained on
    other code (study 3 met two: runs started during a shared-read bug, fixed in b47c596) and is named."""

    def run(start: float, first_step: int = 0) -> dict:
        return {"curve": [[first_step, start], [50, start - 1.0]]}

    runs = {lr: {"gpt2": {0: run(6.25), 1: run(6.31)}, "ref_dv4_cc": {0: run(6.2669711)}} for lr in (1e-3, 2e-3, 4e-3)}
    controls.check_starts(runs)  # consistent
    runs[2e-3]["gpt2"][1] = run(6.31, first_step=50)  # no step-0 point (a curve without one): not compared
    controls.check_starts(runs)
    runs[4e-3]["ref_dv4_cc"][0] = run(6.2721848)
    with pytest.raises(SystemExit, match=r"ref_dv4_cc seed 0 at lr 0.004: 6.272185 \(the other rates: 6.266971\)"):
        controls.check_starts(runs)


def test_code_versions_count_runs_per_commit():
    codes = [{"commit": "abc1234", "dirty": False}] * 3 + [{"commit": "abc1234", "dirty": True}, None, None]
    codes.append({"commit": None, "dirty": None, "error": "not a git checkout"})
    assert controls.code_versions(codes) == {
        "abc1234": 3,
        "abc1234 (dirty)": 1,
        "not a git checkout": 1,
        "unrecorded": 2,
    }


def test_estimate_from_study_2_step_costs(tmp_path):
    plan = controls.PLANS["full"]
    costs = controls.step_costs(160, 1_311_200)
    assert costs["ref_dv1_write_only"] == costs["ref_dv1"] > costs["gpt2"]
    est = controls.estimate(plan, controls.ROWS, str(tmp_path))  # an empty cache: every run
    n = len(controls.ROWS) * (len(plan.lrs) * len(plan.selection_seeds) + len(plan.comparison_seeds))
    assert est["runs"] == n and est["workers"] == 2
    assert 120 < est["wall_seconds"] / n * 2 < 900  # each run a few minutes at d = 160, two side by side


def test_quick_pipeline_writes_every_comparison_with_its_intervals(registered, tmp_path):
    out = tmp_path / "out"
    argv = ["--quick", "--cache-dir", str(tmp_path / "cache"), "--output-dir", str(out)]
    results = controls.main(argv)
    plan = controls.PLANS["quick"]
    saved = json.loads((out / "pretrain_controls_quick.json").read_text())
    assert saved["rows"] == list(controls.ROWS)
    assert (
        saved["runs_planned"] == saved["runs_done"] == len(controls.ROWS) * (len(plan.lrs) + len(plan.comparison_seeds))
    )
    assert not set(saved["plan"]["selection_seeds"]) & set(saved["plan"]["comparison_seeds"])
    assert saved["provenance"]["command"] and "commit" in saved["provenance"]["git"] and saved["provenance"]["machine"]
    (size,) = saved["analysis"]
    # Each run records the commit it trained at (this checkout's, dirty or not): all of them, none unrecorded.
    assert sum(size["code"].values()) == saved["runs_done"] and "unrecorded" not in size["code"]
    assert {name.removesuffix(" (dirty)") for name in size["code"]} == {saved["provenance"]["git"]["commit"]}
    for row, entry in size["rows"].items():
        assert entry["lr"] in plan.lrs and set(entry["selection"]) == {str(lr) for lr in plan.lrs}
        assert entry["seeds"] == list(plan.comparison_seeds)
        if row != bench_pretrain.BASELINE:  # β regimes per residual, shares summing to 1
            assert entry["beta_regimes"]
            for shares in entry["beta_regimes"].values():
                assert shares["keep"] + shares["project"] + shares["reflect"] == pytest.approx(1.0)
    for row, twin in controls.TWIN.items():
        if row in controls.ROWS:
            assert size["rows"][row]["params"] == size["rows"][twin]["params"]
    expected = {"ref_dv1 - ref_dv1_write_only", "ref_dv4_cc - ref_dv4_cc_write_only"}
    expected |= {f"{row} - gpt2" for row in controls.ROWS[1:]}
    assert set(size["comparisons"]) == expected
    for c in size["comparisons"].values():
        assert c["seeds"] == list(plan.comparison_seeds) and c["cost_ratio"] > 0
        for key in ("equal_steps", "equal_compute"):
            d = c[key]
            assert d["n"] == len(plan.comparison_seeds) and len(d["per_seed"]) == d["n"]
            assert math.isfinite(d["ci_low"]) and d["ci_low"] <= d["mean"] <= d["ci_high"]
            assert d["p"] <= d["p_holm"] <= 1  # adjusted over the whole table: never below the test's own
    report = (out / "pretrain_controls_quick.md").read_text()
    assert "reference d_v=4 CC − reference d_v=4 CC write-only" in report and "β regimes" in report
    assert (out / "pretrain_controls_quick.png").stat().st_size > 10_000
    # A second invocation finds every run in its cache and reports the same comparisons.
    again = controls.main([*argv, "--report-only"])
    assert again["analysis"][0]["comparisons"] == results["analysis"][0]["comparisons"]
    assert again["estimate"]["runs"] == 0 and results["estimate"]["runs"] == saved["runs_planned"]


@pytest.mark.parametrize("seed", range(5))
def test_holm_is_closed_testing_with_bonferroni(seed):
    """Holm's adjusted p of a hypothesis is, by the closed testing principle, the largest Bonferroni p of any
    intersection of hypotheses that contains it: max over subsets S containing i of min(1, |S| min_{j in S} p_j).
    Brute force over every subset, with ties and a NaN (a test that could not run) among the p-values."""
    import itertools
    import random

    rng = random.Random(seed)
    ps = [rng.choice([rng.random() * 0.1, rng.random(), 0.02]) for _ in range(7)] + [float("nan")]
    rng.shuffle(ps)
    real = [i for i, p in enumerate(ps) if not math.isnan(p)]
    subsets = [s for k in range(1, len(real) + 1) for s in itertools.combinations(real, k)]
    reference = {i: max(min(1.0, len(s) * min(ps[j] for j in s)) for s in subsets if i in s) for i in real}
    adjusted = controls.holm(ps)
    assert all(adjusted[i] == pytest.approx(reference[i], abs=1e-12) for i in real)
    assert [math.isnan(a) for a in adjusted] == [math.isnan(p) for p in ps]
