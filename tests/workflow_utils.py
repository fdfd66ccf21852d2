"""Helpers for the workflow tests: a tiny GPT-2 with the real GPT-2 tokenizer, and loading and running the example
scripts."""

from __future__ import annotations

import importlib.util
import socket
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from transformers import GPT2LMHeadModel

from ddl_hf.corpus import gpt2_tokenizer
from tests.builders import gpt2_config

ROOT = Path(__file__).resolve().parent.parent


def tiny_gpt2_dir(path: Path, seed: int = 0, dropout: float = 0.1) -> Path:
    """Save a 2-layer, 16-wide GPT-2 with GPT-2's real 50257-token vocabulary (and its tokenizer) to `path`."""
    torch.manual_seed(seed)
    tokenizer = gpt2_tokenizer()
    config = gpt2_config(
        vocab_size=len(tokenizer),
        n_embd=16,
        n_head=2,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=None,
    )
    GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def free_port() -> int:
    """A TCP port free on localhost now: for a launcher that would otherwise take its fixed default (accelerate's
    29500), so that two launches at once (parallel test workers) never meet on one port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_example(name: str) -> ModuleType:
    """Import `examples/<name>.py` as a module (the examples are scripts, not a package)."""
    path = ROOT / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def flags(**options: object) -> list[str]:
    """Command-line flags from keywords, spelled as the examples spell them: `block_size=16` -> `--block-size 16`;
    `True` is a switch (`tiny=True` -> `--tiny`)."""
    argv = []
    for name, value in options.items():
        argv.append(f"--{name.replace('_', '-')}")
        if value is not True:
            argv.append(str(value))
    return argv


def run_example(name: str, tmp_path: Path, **options: object) -> Any:
    """`examples/<name>.py`'s `main` on a tiny GPT-2 without dropout saved in `tmp_path / "base"`, writing to
    `tmp_path / "out"`; `options`: the other flags (see `flags`)."""
    base = tiny_gpt2_dir(tmp_path / "base", dropout=0.0)
    return load_example(name).main(flags(base=base, output_dir=tmp_path / "out", **options))


def state_dict_equal(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    """Names of the parameters/buffers that differ (empty when bit-identical)."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return [k for k in sa if not torch.equal(sa[k], sb[k])]
