"""GPT-2 checkpoints the conversion tests build themselves (this machine cannot download any); configs: `builders`.

A byte-level GPT-2 tokenizer (token id = byte value, 256 = <|endoftext|>, no merges) keeps the vocabulary at 257
while going through the real GPT2Tokenizer code, so tokenizer copying is tested with a genuine GPT-2 tokenizer.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from transformers import GPT2LMHeadModel, GPT2Tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from tests.builders import BYTE_LEVEL, gpt2_config

EOS = BYTE_LEVEL["eos_token_id"]  # <|endoftext|>

# Training text for the GPT-2 trained inside the tests (original text; SAMPLE_TEXT in ddl_hf.conversion is held out).
TRAIN_TEXT = (
    "The river runs past the mill and under the old stone bridge. In the morning the miller opens the sluice and "
    "the wheel begins to turn; by noon the sacks of flour stand in a row by the door. The baker comes at one, "
    "counts the sacks, and pays in coins that the miller keeps in a tin on the shelf. In the evening the miller "
    "closes the sluice, the wheel stops, and the river runs on past the mill and under the bridge. On market days "
    "the baker brings bread back to the mill, and the miller and the baker eat it on the bridge while the river "
    "runs under them. When it rains the river rises, the wheel turns faster, and the miller grinds until dark. "
) * 3


def byte_tokenizer() -> GPT2Tokenizer:
    byte_to_char = bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    vocab["<|endoftext|>"] = EOS
    return GPT2Tokenizer(vocab=vocab, merges=[])


def text_ids(text: str) -> torch.Tensor:
    return torch.tensor([list(text.encode("utf-8"))])


def train_gpt2(steps: int = 60, seed: int = 0) -> GPT2LMHeadModel:
    """A tiny GPT-2 trained for a few steps on TRAIN_TEXT, so its weights are not an initialisation pattern."""
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(gpt2_config(BYTE_LEVEL, n_embd=64, n_head=4))
    data = text_ids(TRAIN_TEXT)[0]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    # transformers finds no loss type in the name GPT2LMHeadModel and warns that it uses the causal-LM loss; say so.
    # Reset afterwards: the fixture is a Hub GPT-2 in every other respect (whose config has no loss_type).
    model.loss_type = "ForCausalLM"
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - 65, (8,))
        batch = torch.stack([data[s : s + 64] for s in starts.tolist()])
        loss = model(batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.loss_type = None
    return model.eval()


@functools.cache
def trained_gpt2() -> GPT2LMHeadModel:
    """One trained GPT-2 shared by the test modules (read-only: conversion clones the weights)."""
    return train_gpt2()


def save_source(model: GPT2LMHeadModel, directory: Path, tokenizer: bool = True) -> Path:
    model.save_pretrained(directory)
    if tokenizer:
        byte_tokenizer().save_pretrained(directory)
    return directory
