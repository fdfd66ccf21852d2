"""What a new user meets first: a quiet corpus pipeline, the cache location, and a base that is a causal LM."""

from __future__ import annotations

import torch
from datasets import Dataset
from transformers import GPT2LMHeadModel
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

from ddl_hf import training
from ddl_hf.corpus import gpt2_tokenizer, tokenize_and_chunk
from ddl_hf.training import BaseSpec, base_gpt2, default_cache_dir
from tests.workflow_utils import tiny_gpt2_dir


def test_chunking_a_long_paragraph_does_not_warn_but_real_calls_still_do():
    tokenizer = gpt2_tokenizer()
    long_paragraph = "It is a truth universally acknowledged. " * 300  # ~2,400 tokens > model_max_length 1024
    rows = Dataset.from_dict({"text": [long_paragraph, "A short one."]})
    tokenizer_logger = logging.get_logger("transformers.tokenization_utils_base")
    with CaptureLogger(tokenizer_logger) as captured:
        blocks = tokenize_and_chunk(rows, tokenizer, block_size=128)
    assert "Token indices sequence length" not in captured.out
    n_tokens = sum(len(tokenizer(text + "\n\n", verbose=False)["input_ids"]) for text in rows["text"])
    assert n_tokens > 1024 and len(blocks) == n_tokens // 128  # nothing lost
    # The tokenizer itself is untouched: a direct call that would overflow the model still gets the warning.
    with CaptureLogger(tokenizer_logger) as captured:
        tokenizer(long_paragraph)
    assert "Token indices sequence length" in captured.out


def test_cache_dir_follows_hf_conventions_at_call_time(monkeypatch, tmp_path):
    monkeypatch.delenv("DDL_HF_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "ddl_hf"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "ddl_hf"
    old_constant = training.DEFAULT_CACHE_DIR  # kept for compatibility, now resolved when read
    assert old_constant == tmp_path / "xdg" / "ddl_hf"
    monkeypatch.setenv("DDL_HF_CACHE", str(tmp_path / "own"))
    assert default_cache_dir() == tmp_path / "own"
    monkeypatch.setenv("DDL_HF_CACHE", "")  # empty means unset, as for HF_HOME
    assert default_cache_dir() == tmp_path / "xdg" / "ddl_hf"

    # base_gpt2 looks there when no cache_dir is given: a cache entry placed under $XDG_CACHE_HOME is used.
    spec = BaseSpec(n_layer=2, n_embd=16, n_head=2, n_positions=64, steps=1)
    tiny_gpt2_dir(tmp_path / "xdg" / "ddl_hf" / "base" / spec.key())
    model, _, origin = base_gpt2(spec=spec)
    assert origin == f"cached small GPT-2 at {tmp_path / 'xdg' / 'ddl_hf' / 'base' / spec.key()}"
    # It is a causal LM for Trainer's loss accounting and for the loss_function lookup (no loss_type warning).
    assert model.loss_type == "ForCausalLM"
    ids = torch.tensor([[464, 3290, 318, 257]])
    with CaptureLogger(logging.get_logger("transformers.modeling_utils")) as captured:
        loss = model(ids, labels=ids).loss
    assert "loss_type" not in captured.out and torch.isfinite(loss)
    assert isinstance(model, GPT2LMHeadModel)
