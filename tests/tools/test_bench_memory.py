"""ddl_lab/benchmarks/bench_memory.py: peak training memory of each variant against its baseline, on tiny shapes."""

from __future__ import annotations

import json

import pytest

from ddl_hf import DeltaGPTConfig
from ddl_lab.benchmarks import bench_memory as bench


@pytest.mark.parametrize("variant", ["dv1", "cc", "tc", "tc_ec"])
def test_a_reference_row_is_the_authors_preset(variant):
    value_channels, mode, fields = bench.reference(variant)
    built = DeltaGPTConfig(delta_mode=mode, delta_value_channels=value_channels, **fields)
    preset = DeltaGPTConfig.reference(variant)
    differ = {k for k, v in preset.to_dict().items() if k.startswith("delta_") and built.to_dict()[k] != v}
    assert differ <= {"delta_beta_init"}  # the one field that moves no byte


def test_quick_run_measures_every_row_against_its_baseline(tmp_path):
    results = bench.main(["--quick", "--out", str(tmp_path)])
    written = json.loads((tmp_path / "memory_quick.json").read_text())
    assert [r["row"] for r in written["rows"]] == list(bench.ROWS)
    for row in written["rows"]:
        for key in ("plain", "checkpointing", "saved_activations"):
            entry = row[key]
            assert entry["ratio"] == pytest.approx(entry["delta_bytes"] / entry["baseline_bytes"], rel=1e-12)
        # checkpointing keeps a layer's inputs only: never more than without it, for either model (equal where the
        # optimizer step, not the activations, sets the peak, as at the tiny Llama shape)
        assert row["checkpointing"]["ratio"] <= row["plain"]["ratio"]
        for model in ("baseline_bytes", "delta_bytes"):
            assert row["checkpointing"][model] <= row["plain"][model]
        assert row["saved_activations"]["ratio"] > 1.0  # every variant keeps at least the sublayer output h
    # The allocator's accounting is deterministic: the same baseline measures the same in every row (the A/A).
    assert set(written["aa_spread"].values()) == {0.0}
    assert results["rows"][0]["plain"]["delta_bytes"] == written["rows"][0]["plain"]["delta_bytes"]
    markdown = (tmp_path / "memory_quick.md").read_text()
    assert all(f"| {name} |" in markdown for name in bench.ROWS)
