"""ddl_lab/benchmarks/bench_code_versions.py: another checkout's Hub files against the installed code, same weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ddl_lab.benchmarks import bench_code_versions as bench
from ddl_lab.builders import SHAPES, build_pair

ROOT = Path(__file__).resolve().parents[2]


def test_the_other_version_is_the_same_model_with_the_other_files_classes():
    """Built from the Hub files of a checkout (here this one, as transformers loads Hub code): another class, the
    same config and weights, the same logits."""
    mine = build_pair(SHAPES["tiny"], 4, "paper")[1].eval()
    other = bench.other_version(ROOT, mine).eval()
    assert type(other) is not type(mine) and type(other).__name__ == type(mine).__name__
    assert type(other).__module__.startswith("transformers_modules")
    ids = torch.randint(0, SHAPES["tiny"]["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(other(ids).logits, mine(ids).logits)


@pytest.mark.slow
def test_a_run_writes_both_pairs_with_provenance(tmp_path):
    argv = ["--code", str(ROOT), "--shape", "tiny", "--pairs", "1", "--gen-pairs", "1", "--gen-tokens", "2"]
    bench.main([*argv, "--out", str(tmp_path)])
    results = json.loads((tmp_path / "code_versions.json").read_text())
    assert results["provenance"]["command"].startswith("python -m ddl_lab.benchmarks.bench_code_versions --code")
    assert set(results["rows"]) == {"other vs other (A/A)", "other vs this"}
    for row in results["rows"].values():
        for metric in ("train_step", "generation_b1"):
            assert row[metric]["ratio"] > 0
    assert "| other | this |" in (tmp_path / "code_versions.md").read_text()
