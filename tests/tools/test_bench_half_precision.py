"""ddl_lab/benchmarks/bench_half_precision.py --quick: each row with its error ratios, the tiny-h case, provenance."""

from __future__ import annotations

import json
import math

import pytest

from ddl_lab.benchmarks import bench_half_precision as bench


@pytest.mark.slow
def test_quick_run_writes_every_row_with_ratios_and_provenance(tmp_path):
    bench.main(["--quick", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "half_precision.json").read_text())

    prov = results["provenance"]
    assert prov["command"].startswith("python -m ddl_lab.benchmarks.bench_half_precision --quick")
    assert {"command", "git", "machine", "versions", "date"} <= set(prov)

    expected = {
        (family, model, mode)
        for family, variants in bench.VARIANTS.items()
        for model in (bench.FAMILY_MODEL[family], *variants)
        for mode in bench.MODES
    }
    rows = {(row["family"], row["model"], row["mode"]): row for row in results["rows"]}
    assert set(rows) == expected
    for key, row in rows.items():
        for stat in ("max_error", "mean_error"):
            assert math.isfinite(row[stat]["mean"]) and row[stat]["mean"] > 0, key
        if row["delta"]:
            for stat in ("ratio_max_error", "ratio_mean_error"):
                assert math.isfinite(row[stat]["mean"]) and row[stat]["mean"] > 0, key
            assert row["effect_of_delta"]["mean"] > 0.05, key  # the opened Delta term moves the logits
    assert set(results["headline"]) == set(bench.MODES)

    tiny = results["tiny_h"]["rows"]
    assert {(row["scale"], row["mode"]) for row in tiny} == {
        (s, m) for s in bench.TINY_SCALES for m in ("fp16", "bf16")
    }
    for row in tiny:
        # k = h / |h| in float32 moves by at most twice h's relative rounding error: the Delta math adds none
        assert row["k_from_rounded_h"]["finite"]
        assert row["k_from_rounded_h"]["max"] <= 2 * row["h_rounding_relative_error"]["max"] + 1e-6

    report = (tmp_path / "half_precision.md").read_text()
    assert "> Command: `python -m ddl_lab.benchmarks.bench_half_precision --quick" in report
    assert "| fp16 |" in report and "| autocast-bf16 |" in report
