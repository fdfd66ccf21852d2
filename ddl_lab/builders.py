"""The models the lab builds: benchmark shapes, each baseline with its Delta model over the same weights, tiny test
models, and opened gates.

    from ddl_lab.builders import SHAPES, build_pair

    gpt2, delta = build_pair(SHAPES["small"], 4, "paper")   # GPT-2 and a DeltaGPT sharing every GPT-2 weight

Benchmarks, studies and checks import these; the test suite imports some of them too (the lab never imports the
tests).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedModel

import ddl_hf
from ddl_hf import DeltaGPTConfig, DeltaGPTForCausalLM, DeltaLlamaConfig, DeltaLlamaForCausalLM

#: What is timed on a shape: batch and sequence length, and `memory_batch` for peak training memory. On the ~100M
#: shapes training memory is measured at batch 2, where activations (not AdamW) set the peak; time at batch 1.
_TIMED_SMALL = dict(batch=8, seq=256, memory_batch=8)
_TIMED_100M = dict(batch=1, seq=256, memory_batch=2)
#: The small models people train to try an architecture out (a from-scratch study: a small BPE vocabulary).
_SMALL = dict(n_layer=4, n_embd=256, n_head=4, vocab_size=8192, **_TIMED_SMALL)

#: The benchmark shapes, by name: the model (layers, width, heads, vocabulary; `arch="llama"` for the Llama family)
#: and what is timed on it (batch, sequence length; `memory_batch` for peak training memory).
SHAPES = {
    "tiny": dict(n_layer=2, n_embd=64, n_head=4, vocab_size=512, batch=4, seq=64, memory_batch=4),
    "small": _SMALL,
    "gpt2-small": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, **_TIMED_100M),
    # Llama-family shapes: transformers' LlamaForCausalLM against DeltaLlama over it; RoPE, RMSNorm, SwiGLU and
    # grouped-query attention (kv_heads). The first is "small" on that backbone, the second SmolLM-135M's shape (30
    # narrow layers).
    "llama-small": dict(_SMALL, arch="llama", kv_heads=2, intermediate=688),
    "smollm-135m": dict(
        arch="llama", n_layer=30, n_embd=576, n_head=9, kv_heads=3, intermediate=1536, vocab_size=49152, **_TIMED_100M
    ),
}


def gpt2_dropout(p: float) -> dict[str, float]:
    """GPT-2's three dropout probabilities (residual, embedding, attention), all `p`, as config fields."""
    return dict.fromkeys(("resid_pdrop", "embd_pdrop", "attn_pdrop"), p)


def base_config(shape: dict, **fields) -> GPT2Config | LlamaConfig:
    """The baseline's config: GPT-2, or Llama for the Llama-family shapes; `fields`: further config fields."""
    if shape.get("arch") == "llama":
        return LlamaConfig(
            num_hidden_layers=shape["n_layer"],
            hidden_size=shape["n_embd"],
            num_attention_heads=shape["n_head"],
            num_key_value_heads=shape["kv_heads"],
            intermediate_size=shape["intermediate"],
            vocab_size=shape["vocab_size"],
            max_position_embeddings=1024,
            **fields,
        )
    return GPT2Config(
        n_layer=shape["n_layer"],
        n_embd=shape["n_embd"],
        n_head=shape["n_head"],
        vocab_size=shape["vocab_size"],
        n_positions=1024,
        **fields,
    )


def build_baseline(shape: dict, **fields) -> PreTrainedModel:
    """transformers' GPT-2 (or Llama) of `shape` (`fields`: as `base_config`), random weights from seed 0, SDPA
    attention."""
    torch.manual_seed(0)
    config = base_config(shape, **fields)
    config._attn_implementation = "sdpa"
    return (LlamaForCausalLM if isinstance(config, LlamaConfig) else GPT2LMHeadModel)(config)


def delta_over(baseline: PreTrainedModel, fields: dict, implementation: str = "eager") -> PreTrainedModel:
    """The Delta model of `fields` (Delta config fields) over `baseline`'s architecture, holding every baseline weight
    (the Delta parameters are extra, initialised from torch's global generator), running `implementation`."""
    llama = isinstance(baseline, LlamaForCausalLM)
    excluded = ("model_type", "transformers_version")
    architecture = {k: v for k, v in baseline.config.to_dict().items() if k not in excluded}
    if llama:
        config = DeltaLlamaConfig(source_model_type="llama", **architecture, **fields)
    else:
        config = DeltaGPTConfig(**architecture, **fields)
    config._attn_implementation = "sdpa"
    delta = (DeltaLlamaForCausalLM if llama else DeltaGPTForCausalLM)(config)
    missing, unexpected = delta.load_state_dict(baseline.state_dict(), strict=False)
    if unexpected or not set(missing) <= set(delta.delta_parameters()):
        raise RuntimeError(f"baseline weights do not map onto the Delta model: {missing=} {unexpected=}")
    delta.set_delta_implementation(implementation)
    return delta


def build_pair(
    shape: dict, value_channels: int, mode: str, fields: dict | None = None, implementation: str = "eager"
) -> tuple[PreTrainedModel, PreTrainedModel]:
    """The baseline (GPT-2 or Llama) and its Delta model sharing every baseline weight (the Delta parameters are
    extra); `fields`: variant fields; `implementation`: the Delta model's `delta_implementation` (default the tensor
    ops, "eager"; "native": the CPU kernels of `ddl_hf.native`)."""
    base = build_baseline(shape)
    delta_fields = dict(
        delta_mode=mode,
        delta_value_channels=value_channels,
        delta_beta_init=0.5,  # no shortcut for beta == 0 exists, but use a generic gate anyway
        **(fields or {}),
    )
    return base, delta_over(base, delta_fields, implementation)


@contextlib.contextmanager
def delta_implementation(model: PreTrainedModel, implementation: str) -> Iterator[None]:
    """`model` (a Delta model) runs `implementation` inside the block, the one it had before afterwards. Per model:
    the baseline and every other model are untouched."""
    before = model.config.delta_implementation
    model.set_delta_implementation(implementation)
    try:
        yield
    finally:
        model.set_delta_implementation(before)


#: A tiny Llama (2 layers, hidden 32, grouped-query attention), the test suite's: fast enough for any check.
LLAMA_TINY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


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


#: The GPU check's variants, name -> (baseline family, Delta fields): both modes, d_v = 1 and 4, the temporal and
#: channel-conv reads, DeltaLlama. `ddl_lab.checks.gpu_check` reports their cost, tests/gpu their correctness.
GPU_VARIANTS: dict[str, tuple[str, dict]] = {
    "additive-dv1": ("gpt2", dict(delta_mode="additive", delta_value_channels=1)),
    "paper-dv1": ("gpt2", dict(delta_mode="paper", delta_value_channels=1)),
    "additive-dv4": ("gpt2", dict(delta_mode="additive", delta_value_channels=4)),
    "paper-dv4": ("gpt2", dict(delta_mode="paper", delta_value_channels=4)),
    "paper-dv4-tc": ("gpt2", dict(delta_mode="paper", delta_value_channels=4, delta_state_read="temporal_conv")),
    "paper-dv4-cc": ("gpt2", dict(delta_mode="paper", delta_value_channels=4, delta_state_read="channel_conv")),
    "llama-additive-dv1": ("llama", dict(delta_mode="additive", delta_value_channels=1)),
    "llama-paper-dv4": ("llama", dict(delta_mode="paper", delta_value_channels=4)),
}
