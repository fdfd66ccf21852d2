"""ddl_lab/studies/bench_finetune.py end to end: its documented `--base DIR` command on a tiny GPT-2 saved here."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from ddl_hf.corpus import gpt2_tokenizer
from ddl_lab.studies import bench_finetune


@pytest.mark.slow
def test_a_saved_base_is_fine_tuned_with_its_additive_conversion_paired(tmp_path):
    base = tmp_path / "base"
    tokenizer = gpt2_tokenizer()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_layer=1, n_embd=32, n_head=2, n_positions=64)
    GPT2LMHeadModel(config).save_pretrained(base)
    tokenizer.save_pretrained(base)
    small = ["--steps", "2", "--batch-size", "2", "--block-size", "32", "--eval-every", "1", "--eval-blocks", "2"]
    argv = ["--base", str(base), *small, "--seeds", "0", "--variants", "gpt2", "additive"]
    results = bench_finetune.main([*argv, "--output-dir", str(tmp_path), "--name", "finetune_tiny"])

    runs = results["runs"]
    assert [r["seed"] for r in runs["gpt2"]] == [r["seed"] for r in runs["additive"]] == [0]
    # the additive conversion starts as the base's function: the same loss before any step
    assert runs["additive"][0]["eval_loss_before"] == pytest.approx(runs["gpt2"][0]["eval_loss_before"], abs=1e-6)
    assert results["analysis"]["additive"]["vs_gpt2"]["n"] == 1
    written = json.loads((tmp_path / "finetune_tiny.json").read_text())
    assert written["provenance"]["command"].startswith("python -m ddl_lab.studies.bench_finetune --base ")
    assert "| DeltaGPT additive, Delta lr x1 |" in (tmp_path / "finetune_tiny.md").read_text()
    assert (tmp_path / "finetune_tiny.png").stat().st_size > 0
