"""ddl_lab/studies/bench_pretrain_length.py: plan, rate search and trend against closed forms; `--quick` end to end."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import numpy as np
import pytest
import torch
from scipy import stats

from ddl_lab.studies import bench_pretrain
from ddl_lab.studies import bench_pretrain_length as length
from ddl_lab.studies import bench_pretrain_scaling as scaling


def test_full_plan_spans_sixteenfold_with_disjoint_seeds_and_study_2s_first_cell():
    plan = length.PLANS["full"]
    assert plan.lengths == tuple(sorted(plan.lengths)) and max(plan.lengths) / min(plan.lengths) >= 16
    assert len(plan.lengths) >= 3 and len(plan.comparison_seeds) >= 5
    assert not set().union(*plan.selection_seeds) & set(plan.comparison_seeds)
    assert {"ref_dv1", "ref_dv4_cc", "ref_dv4_tc"} <= set(plan.rows) and plan.rows[0] == bench_pretrain.BASELINE
    # 1 token per parameter at d = 80 is study 2's own cell: same steps, warm-up and cache folder.
    study2 = scaling.cells(scaling.PLANS["full"])["llama", 80, 3e-3]
    assert length.cell(plan, 1.0, 0) == study2
    # Longer lengths stretch the whole schedule: steps and warm-up grow with the length, the rate does not move them.
    first, last = length.cell(plan, plan.lengths[0], 0), length.cell(plan, plan.lengths[-1], -1)
    assert last.steps == math.ceil(16 * 348_720 / 1024) and last.warmup == round(last.steps * 50 / 900)
    assert last.steps / first.steps == pytest.approx(16, rel=0.01) and last.lr == 1.5e-3
    with pytest.raises(ValueError, match="overlap"):
        dataclasses.replace(plan, comparison_seeds=(0, 100))


def fake_runs(losses: dict[tuple[int, int], float], seeds=(100, 101)):
    """runs(i, exp) for a selection whose every seed ends at losses[i, exp] (a missing key: not trained)."""

    def runs(i, exp):
        if (i, exp) not in losses:
            return {}
        return {"gpt2": {s: {"final_valid_loss": losses[i, exp] + 0.001 * s} for s in seeds}}

    return runs


def test_rate_search_centres_each_length_on_the_last_choice_and_grows_past_an_edge():
    plan = dataclasses.replace(length.PLANS["full"], max_extend=2)
    first = {(0, e): 3.0 + 0.1 * abs(e - 1) for e in (-2, -1, 0, 1, 2)}  # best at exponent 1 (6e-3), inside
    sel = length.select(plan, 0, "gpt2", fake_runs(first))
    assert sel.choice == 1 and not sel.at_edge and sel.extended == 0 and rate(sel.choice) == 6e-3
    # The next length tries 3e-3, 6e-3, 1.2e-2; nothing trained yet: all three missing for both selection seeds.
    sel = length.select(plan, 1, "gpt2", fake_runs(first))
    assert sel.exps == [0, 1, 2] and sel.choice is None and len(sel.missing) == 6
    # Its best is the lowest rate: the grid grows downwards, twice at most, and stops at an interior minimum.
    second = first | {(1, e): 2.0 + 0.1 * abs(e + 1) for e in (-2, -1, 0, 1, 2)}  # best at -1
    sel = length.select(plan, 1, "gpt2", fake_runs({k: v for k, v in second.items() if k != (1, -1)}))
    assert sel.exps == [-1, 0, 1, 2] and sel.missing == [(-1, 100), (-1, 101)]
    sel = length.select(plan, 1, "gpt2", fake_runs(second))
    assert sel.exps == [-2, -1, 0, 1, 2] and sel.choice == -1 and not sel.at_edge and sel.extended == 2
    # A minimum beyond two extensions stays at the edge, and says so.
    third = second | {(2, e): 1.0 + 0.1 * e for e in range(-6, 3)}  # ever lower rates win
    sel = length.select(plan, 2, "gpt2", fake_runs(third))
    assert sel.exps == [-4, -3, -2, -1, 0] and sel.choice == -4 and sel.at_edge and sel.extended == 2
    # A length whose predecessor has not chosen has no grid yet.
    assert length.select(plan, 2, "gpt2", fake_runs(first)).exps == []


def rate(exp: int) -> float:
    return length.rate(exp)


@pytest.mark.parametrize("seed", range(3))
def test_paired_slope_is_the_fixed_effects_regression_with_the_slopes_t_interval(seed):
    """The mean of per-seed least-squares slopes (balanced lengths) equals the slope of a regression of every Δ on
    log2(length) with one intercept per seed, and its interval is the one-sample t-interval of the slopes."""
    rng = np.random.default_rng(seed)
    xs = [0.0, 2.0, 4.0]
    by_seed = {s: list(0.05 - 0.01 * np.array(xs) + rng.normal(0, 0.02, 3)) for s in range(5)}
    got = length.paired_slope(xs, by_seed)
    # Brute force: least squares over all points with a dummy column per seed.
    rows = [(x, s, y) for s, ys in by_seed.items() for x, y in zip(xs, ys, strict=True)]
    design = np.array([[x] + [float(s == t) for t in by_seed] for x, s, _ in rows])
    coef = np.linalg.lstsq(design, np.array([y for *_, y in rows]), rcond=None)[0]
    assert got["mean"] == pytest.approx(coef[0], abs=1e-12)
    slopes = [np.polyfit(xs, ys, 1)[0] for ys in by_seed.values()]
    assert list(got["per_seed"].values()) == pytest.approx(slopes, abs=1e-12)
    test = stats.ttest_1samp(slopes, 0.0)
    low, high = test.confidence_interval(0.95)
    assert (got["ci_low"], got["ci_high"], got["p"]) == pytest.approx((low, high, test.pvalue), abs=1e-12)


def test_paired_slope_of_exactly_linear_differences_is_their_common_slope():
    xs = [0.0, 1.0, 3.0, 4.0]
    got = length.paired_slope(xs, {s: [0.1 * s - 0.02 * x for x in xs] for s in range(4)})
    assert got["mean"] == pytest.approx(-0.02, abs=1e-15) and got["std"] == pytest.approx(0, abs=1e-15)


def fake_lengths(deltas: dict[float, list[float]], seeds=(0, 1, 2, 3)) -> list[dict]:
    """`analyse_length` outputs with one contrast whose per-seed Δ at each length is given (both budgets alike)."""
    return [
        {
            "tokens_per_param": x,
            "comparisons": {
                "ref_dv1 - gpt2": {
                    "seeds": list(seeds),
                    "equal_steps": {"per_seed": ys},
                    "equal_compute": {"per_seed": [-y for y in ys]},
                }
            },
        }
        for x, ys in deltas.items()
    ]


def test_a_turn_shows_in_the_segments_that_the_straight_line_averages_away():
    """Δ that rises 0.3 from 1x to 4x and falls 0.3 from 4x to 16x, plus a per-seed offset: the line's slope is 0,
    each step's slope is ±0.3 / 2 doublings, for every seed (closed form)."""
    offsets = [0.01, -0.02, 0.03, 0.0]
    got = length.trends(length.PLANS["full"], fake_lengths({1: offsets, 4: [o + 0.3 for o in offsets], 16: offsets}))
    t = got["ref_dv1 - gpt2"]
    assert t["equal_steps"]["mean"] == pytest.approx(0.0, abs=1e-12)
    assert [seg["lengths"] for seg in t["segments"]] == [[1, 4], [4, 16]]
    for seg, slope in zip(t["segments"], (0.15, -0.15), strict=True):
        assert list(seg["equal_steps"]["per_seed"].values()) == pytest.approx([slope] * 4, abs=1e-12)
        assert seg["equal_compute"]["mean"] == pytest.approx(-slope, abs=1e-12)
    # Two lengths: the line is the one step, and no segment repeats it.
    assert (
        length.trends(length.PLANS["full"], fake_lengths({1: offsets, 4: offsets}))["ref_dv1 - gpt2"]["segments"] == []
    )


def test_curve_shape_reads_minimum_late_drop_and_gap():
    curve = [(0, 6.0), (50, 4.0), (90, 3.5), (100, 3.6)]
    runs = [{"curve": curve, "train_loss": [(50, 4.2), (100, 3.0)]}, {"curve": curve, "train_loss": []}]
    shape = length.curve_shape(runs)
    assert shape["steps"] == 100 and shape["min_step"] == 90
    assert shape["late_drop"] == pytest.approx(3.5 - 3.6) and shape["gap"] == pytest.approx(3.6 - 3.0)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """The quick study once for the tests below (threads restored: the study sets one)."""
    threads = torch.get_num_threads()
    tmp = tmp_path_factory.mktemp("length")
    argv = ["--quick", "--cache-dir", str(tmp / "cache"), "--output-dir", str(tmp / "out")]
    results = length.main(argv)
    torch.set_num_threads(threads)
    return tmp, argv, results


def test_quick_study_lists_every_cell_and_the_trend_of_every_contrast(quick, tmp_path):
    tmp, argv, results = quick
    plan = length.PLANS["quick"]
    saved = json.loads((tmp / "out" / "pretrain_length_quick.json").read_text())
    assert saved["runs_done"] == saved["runs_planned"] > 0 and saved["provenance"]["git"]
    sizes = saved["analysis"]["lengths"]
    assert [s["tokens_per_param"] for s in sizes] == list(plan.lengths)
    for s in sizes:
        assert not set(s["selection_seeds"]) & set(s["comparison_seeds"])
        assert s["steps"] > 0 and s["passes"] > 0 and s["tokens"] == s["steps"] * 8 * 64
        assert sum(s["code"].values()) == sum(len(v) for c in s["cells"] for v in c["runs"].values())
        for row, entry in s["rows"].items():
            assert entry["lr"] in entry["grid"] and entry["seeds"] == list(plan.comparison_seeds)
            assert set(entry["selection"]) == {str(lr) for lr in entry["grid"]}
            if row != bench_pretrain.BASELINE:
                for shares in entry["beta_regimes"].values():
                    assert shares["keep"] + shares["project"] + shares["reflect"] == pytest.approx(1.0)
        assert set(s["comparisons"]) == {"ref_dv1 - ref_dv1_write_only", "ref_dv1 - gpt2", "ref_dv1_write_only - gpt2"}
    trends = saved["analysis"]["trends"]
    assert set(trends) == set(sizes[0]["comparisons"])
    for name, t in trends.items():
        assert t["lengths"] == list(plan.lengths) and t["seeds"] == list(plan.comparison_seeds)
        for key in ("equal_steps", "equal_compute"):
            # The trend's per-seed slopes are those of the Δs the length tables report.
            ys = {
                s: [size["comparisons"][name][key]["per_seed"][k] for size in sizes] for k, s in enumerate(t["seeds"])
            }
            xs = [math.log2(x) for x in t["lengths"]]
            assert t[key]["mean"] == pytest.approx(length.paired_slope(xs, ys)["mean"], abs=1e-12)
            assert math.isfinite(t[key]["ci_low"]) and t[key]["p"] <= t[key]["p_holm"] <= 1
            for j, seg in enumerate(t["segments"]):  # each step between neighbouring lengths, Holm with the lines
                pair = {s: ys[s][j : j + 2] for s in t["seeds"]}
                assert seg[key]["mean"] == pytest.approx(length.paired_slope(xs[j : j + 2], pair)["mean"], abs=1e-12)
                assert seg[key]["p"] <= seg[key]["p_holm"] <= 1
        assert len(t["segments"]) == len(plan.lengths) - 1
    report = (tmp / "out" / "pretrain_length_quick.md").read_text()
    assert "slope of Δ against log2" in report and "β regimes per length" in report and "Partial" not in report
    assert (tmp / "out" / "pretrain_length_quick.png").stat().st_size > 10_000
    kept = (tmp / "out" / "pretrain_length_quick_runs.jsonl").read_text().splitlines()
    assert len(kept) == saved["runs_done"]

    # An empty cache (another session) gets every run back from the kept file and reports the same numbers.
    fresh = tmp_path / "fresh"
    again = length.main([*argv[:2], str(fresh), *argv[3:], "--report-only"])
    assert json.dumps(again["analysis"], sort_keys=True) == json.dumps(results["analysis"], sort_keys=True)
    assert again["estimate"]["runs"] == 0


def test_a_comparison_run_that_started_elsewhere_at_another_length_is_refused(quick, tmp_path):
    tmp, _, _ = quick
    cache = tmp_path / "cache"
    shutil.copytree(tmp / "cache", cache)
    plan = length.PLANS["quick"]
    chosen = length.select(plan, 2, "ref_dv1", length.loader(plan, str(cache))).choice
    path = bench_pretrain.run_path(length.folder(plan, plan.lengths[2], chosen, str(cache)), "ref_dv1", 1)
    run = json.loads(path.read_text())
    run["curve"][0][1] += 0.01
    path.write_text(json.dumps(run))
    out = ["--output-dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit, match=r"ref_dv1 seed 1 at tokens/parameter 2: .* \(the other lengths: "):
        length.main(["--quick", "--cache-dir", str(cache), *out, "--report-only"])
