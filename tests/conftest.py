"""Shared fixtures: tiny GPT-2 / DeltaGPT models that the tests build themselves (no downloads)."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import ddl_hf

VOCAB = 97


def tiny_gpt2_config(**overrides) -> GPT2Config:
    """A 2-layer GPT-2 small enough for CPU tests; dropout off so runs are deterministic."""
    fields = dict(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    fields.update(overrides)
    return GPT2Config(**fields)


def tiny_gpt2(seed: int = 0, **overrides) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(tiny_gpt2_config(**overrides)).eval()
    # GPT-2 initialises biases and LayerNorms to constants; randomise them so equivalence tests see every weight.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "bias" in name or "ln" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model


def tiny_delta_config(**overrides) -> ddl_hf.DeltaGPTConfig:
    return ddl_hf.DeltaGPTConfig(**{**tiny_gpt2_config().to_diff_dict(), **overrides})


def tiny_delta(seed: int = 0, **overrides) -> ddl_hf.DeltaGPTForCausalLM:
    torch.manual_seed(seed)
    return ddl_hf.DeltaGPTForCausalLM(tiny_delta_config(**overrides)).eval()


def open_gates(model: torch.nn.Module, seed: int = 0) -> None:
    """Give every Delta block a random, token-dependent beta in (0, 2) and a non-trivial value map."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, ddl_hf.DeltaResidual):
                module.beta_open.fill_(0.5 + 0.5 * torch.rand((), generator=generator).item())
                for param in module.beta_proj.parameters():
                    param.copy_(torch.randn(param.shape, generator=generator))
                if module.v_proj is not None:  # None with delta_value="constant"
                    module.v_proj.weight.copy_(torch.randn(module.v_proj.weight.shape, generator=generator))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run fastest on one intra-op thread, and do not slow down when the machine is busy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def token_batch() -> torch.Tensor:
    return torch.randint(1, VOCAB, (3, 12), generator=torch.Generator().manual_seed(1))
