"""ddl_lab/studies/bench_pretrain_scaling.py: its plan, statistics and report against runs whose differences are known.

The runs are synthetic (`bench_pretrain.train_one` and the data are replaced): each variant's final loss is the
baseline's plus a chosen difference per width and learning rate, so every number the analysis reports has a
closed form. The real training path is bench_pretrain's, tested in test_bench_pretrain.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from ddl_lab.studies import bench_pretrain
from ddl_lab.studies import bench_pretrain_scaling as scaling

ROOT = Path(__file__).resolve().parents[2]

#: Δ to the baseline per variant at the smallest / middle / largest width (shared learning rate)
DELTA = {
    "ref_dv1": (0.30, 0.20, 0.10),
    "ref_dv4_tc": (-0.20, -0.25, -0.30),
    "ref_dv4_cc": (0.10, 0.10, 0.10),
    "additive_dv1": (0.05, 0.00, -0.05),
    "gpt2_tc_id": (-0.40, -0.40, -0.40),
}
COST = {"gpt2": 1.0, "ref_dv1": 1.1, "ref_dv4_tc": 2.0, "ref_dv4_cc": 1.5, "additive_dv1": 1.1, "gpt2_tc_id": 1.2}
PLAN = scaling.Plan("quick", widths=(16, 24, 32), seeds=(3, 3, 2), sweep_lrs=(1.5e-3, 3e-3, 6e-3),
                    tokens_per_param=1.0, min_steps=0, fixed_steps=10, workers=0)  # fmt: skip


def seed_noise(seed: int) -> float:
    return 0.01 * (seed - 1) ** 2


def fake_final(variant: str, width: int, lr: float, seed: int) -> float:
    """Baseline 4.0 at the shared lr, 3.9 at 6e-3 for every row but ref_dv1 (best at 1.5e-3); a seed's noise is
    shared by the rows plus a small per-(variant, seed) part."""
    base = {1.5e-3: 4.1, 3e-3: 4.0, 6e-3: 3.9}[lr]
    if variant == "ref_dv1":
        base = {1.5e-3: 3.8, 3e-3: 4.0, 6e-3: 4.2}[lr]
    delta = 0.0 if variant == "gpt2" else DELTA[variant][PLAN.widths.index(width)]
    own = 0.003 * ((7 * len(variant) + 3 * seed) % 5 - 2) if variant != "gpt2" else 0.0
    return base + delta + seed_noise(seed) + own


@pytest.fixture
def synthetic(monkeypatch, tmp_path):
    trained = []

    def prepare_data(args, preset):
        folder = bench_pretrain.cache_root(args, preset)
        (folder / "data").mkdir(parents=True, exist_ok=True)
        stats = {"vocab_size": 512, "train_blocks": 1000, "train_tokens": 64_000, "valid_blocks": 32,
                 "valid_tokens": 2048, "valid_unigram_entropy": 5.2, "epochs": 0.5}  # fmt: skip
        (folder / "data" / "stats.json").write_text(json.dumps(stats))
        return {"folder": folder, "stats": stats}

    def train_one(args, preset, variant, seed):
        trained.append((preset.arch, preset.n_embd, preset.learning_rate, variant, seed))
        final = fake_final(variant, preset.n_embd, preset.learning_rate, seed)
        run = {"variant": variant, "seed": seed, "params": 1000 * preset.n_embd, "final_valid_loss": final,
               "curve": [(0, 6.0), (preset.steps, final)], "steps": preset.steps,
               "step_cpu_seconds": 0.01 * COST[variant]}  # fmt: skip
        if variant != "gpt2":
            run["beta_regimes"] = {"L0.attn": {"keep": 0.5, "project": 0.3, "reflect": 0.2, "mean": 0.8}}
        return run

    monkeypatch.setattr(bench_pretrain, "prepare_data", prepare_data)
    monkeypatch.setattr(bench_pretrain, "train_one", train_one)
    monkeypatch.setitem(scaling.PLANS, "quick", PLAN)
    studies = tmp_path / "studies.md"
    studies.write_text(f"# title\n\nbefore\n\n{scaling.STUDIES_BEGIN}\nold\n{scaling.STUDIES_END}\n\nafter\n")
    threads = torch.get_num_threads()  # the study sets one thread per run; later tests keep the suite's count
    yield trained, studies, tmp_path
    torch.set_num_threads(threads)


def test_study_reports_the_differences_trends_and_learning_rates_it_was_given(synthetic):
    trained, studies, tmp_path = synthetic
    argv = ["--quick", "--cache-dir", str(tmp_path / "cache"), "--output-dir", str(tmp_path / "out")]
    results = scaling.main(argv)
    # The plan: every row x seed at each width, the sweep's seed 0 at the two other lrs, GPT-2 rows at the middle,
    # then the remaining seeds of each row whose best lr is not the shared one (every row: 6e-3 or 1.5e-3).
    rows = len(scaling.ROWS)
    first = rows * sum(PLAN.seeds) + rows * 2 + rows * 3
    assert results["runs_planned"] == results["runs_done"] == first + rows * 2 == len(trained)
    assert len(set(trained)) == len(trained)  # no run trained twice
    a = results["analysis"]
    for i, width in enumerate(PLAN.widths):
        size = a["sizes"][f"llama-{width}"]
        assert size["variants"]["gpt2"]["seeds"] == list(range(PLAN.seeds[i]))
        for variant, deltas in DELTA.items():
            row = size["variants"][variant]
            assert row["equal_steps"]["mean"] == pytest.approx(deltas[i], abs=0.01)
            assert row["cost_ratio"] == pytest.approx(COST[variant])
            assert row["equal_steps"]["per_seed"] == pytest.approx(
                [fake_final(variant, width, 3e-3, s) - fake_final("gpt2", width, 3e-3, s) for s in row["seeds"]]
            )
    for variant, deltas in DELTA.items():  # the trend: largest minus smallest, Welch interval around it
        t = a["trends"][variant]["equal_steps"]
        assert t["mean"] == pytest.approx(deltas[-1] - deltas[0], abs=0.01)
        assert t["ci_low"] < t["mean"] < t["ci_high"]
    assert scaling.trend_verdict(a["trends"]["ref_dv1"]["equal_steps"]) == "gains with size"
    assert scaling.trend_verdict(a["trends"]["ref_dv4_cc"]["equal_steps"]) == "no resolved trend"
    sweep = a["sweep"]
    assert sweep["best_lr"] == {row: (1.5e-3 if row == "ref_dv1" else 6e-3) for row in scaling.ROWS}
    at_best = sweep["at_best"]["ref_dv1"]  # 3.8 + 0.20 at 1.5e-3 against the baseline's 3.9 at 6e-3
    assert at_best["seeds"] == [0, 1, 2] and at_best["equal_steps"]["mean"] == pytest.approx(0.10, abs=0.01)
    assert "gpt2-24" in a["sizes"] and set(a["sizes"]["gpt2-24"]["variants"]) == set(scaling.ROWS)
    out = tmp_path / "out"
    report = (out / "pretrain_scaling_quick.md").read_text()
    sweep_table = report.split("## Learning rates")[1].split("\n\n")[2].splitlines()[2:]
    assert len(sweep_table) == len(scaling.ROWS) and all(line.count("**") == 2 for line in sweep_table)
    assert "## The trend" in report
    assert (out / "pretrain_scaling_quick.png").stat().st_size > 10_000
    assert json.loads((out / "pretrain_scaling_quick.json").read_text())["runs_done"] == len(trained)
    # A second invocation finds every run in its cache and reports the same analysis.
    again = scaling.main([*argv, "--report-only"])
    assert again["analysis"]["trends"] == a["trends"] and again["analysis"]["sweep"] == a["sweep"]
    assert len(trained) == results["runs_done"]
    # The block in docs/studies.md is regenerated between its markers, the rest kept.
    scaling.update_studies(results, studies)
    text = studies.read_text()
    assert text.startswith("# title\n\nbefore\n\n") and text.endswith("\n\nafter\n") and "old" not in text
    assert text.count("| reference d_v=4 TC |") == 1


def test_the_studies_doc_holds_the_one_block_the_study_rewrites():
    """A finished study rewrites its table in docs/studies.md; a missing or doubled marker would stop it at the end."""
    text = scaling.STUDIES.read_text(encoding="utf-8")
    assert text.count(scaling.STUDIES_BEGIN) == 1 and text.count(scaling.STUDIES_END) == 1
    block = text[text.index(scaling.STUDIES_BEGIN) : text.index(scaling.STUDIES_END)]
    assert "| reference d_v=4 TC |" in block
    assert scaling.STUDIES_BEGIN not in (ROOT / "README.md").read_text(encoding="utf-8")


def test_trend_is_welchs_interval():
    from scipy import stats

    small, large = [0.30, 0.32, 0.29], [0.10, 0.14]
    t = scaling.trend({"per_seed": small}, {"per_seed": large})
    reference = stats.ttest_ind(large, small, equal_var=False).confidence_interval(0.95)
    assert t["mean"] == pytest.approx(sum(large) / 2 - sum(small) / 3)
    assert (t["ci_low"], t["ci_high"]) == pytest.approx((reference.low, reference.high))
    assert math.isnan(scaling.trend({"per_seed": [0.1]}, {"per_seed": large})["ci_low"])


def test_plan_gives_every_width_tokens_for_its_parameters_within_two_passes():
    plan = scaling.PLANS["full"]
    cells = scaling.cells(plan)
    tokens_per_step = bench_pretrain.PRESETS["cpu"].batch_size * bench_pretrain.PRESETS["cpu"].block_size
    params = {w: scaling.baseline_params(plan, "llama", w) for w in plan.widths}
    assert params[plan.widths[-1]] >= 16 * params[plan.widths[0]]  # the span the study promises
    for (_, width, _), cell in cells.items():
        assert cell.steps * tokens_per_step >= params[width]
        assert cell.steps * tokens_per_step <= 2 * 1_659_264  # the bundled training text, at most two passes
    assert {lr for (_, w, lr) in cells if w == 80} == set(plan.sweep_lrs)
    assert {arch for (arch, _, _) in cells} == {"llama", "gpt2"}
    preset = dataclasses.replace(bench_pretrain.PRESETS["cpu"], n_embd=32, arch="llama", init="reference")
    model = bench_pretrain.build_models(preset, 512, "ref_dv4_tc", 0)
    assert model.config.delta_value == "sigmoid" and model.config.delta_shared_read
    assert model.config.rms_norm_eps == 1e-5 and model.config.intermediate_size == 8 * 32 // 3
