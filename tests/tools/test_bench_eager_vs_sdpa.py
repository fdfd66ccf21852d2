"""ddl_lab/benchmarks/bench_eager_vs_sdpa.py end to end: every row, its provenance, and differences that are fp16's."""

from __future__ import annotations

import json

from ddl_lab.benchmarks import bench_eager_vs_sdpa as bench


def test_a_run_writes_every_row_with_provenance(tmp_path):
    bench.main(["--out", str(tmp_path)])
    results = json.loads((tmp_path / "eager_vs_sdpa.json").read_text())
    assert results["provenance"]["command"].startswith("python -m ddl_lab.benchmarks.bench_eager_vs_sdpa")
    assert [(r["model"], r["inputs"]) for r in results["rows"]] == [
        (model, inputs) for model in bench.MODELS for inputs in ("plain", "left-padded, no mask")
    ]
    fp16 = 2.0**-11  # the eager / SDPA and fp16 / float32 differences are rounding: above 0, far below 1
    keys = ("eager_vs_sdpa_fp16", "fp16_vs_fp32")
    assert all(fp16 / 100 < row[key] < 100 * fp16 for row in results["rows"] for key in keys)
    assert "| DeltaLlama paper | plain |" in (tmp_path / "eager_vs_sdpa.md").read_text()
