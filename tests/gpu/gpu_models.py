"""What the GPU tests build, and how they bound an error: the variants (`GPU_VARIANTS`) and shapes of the GPU check.

Every Delta model is its baseline converted by the library (`convert_gpt2` / `convert_llama`: every baseline weight
shared, the Delta ones new) with the gate opened to beta = 0.5, so that at any beta the Delta model and its baseline
differ only in their Delta residuals. The baselines are transformers' own GPT-2 and Llama (`builders`).

Bounds, derived rather than guessed:
- two float32 evaluations that differ only in summation order (TF32 off): a D-term dot product rounds to about
  sqrt(D)·eps₃₂, once per residual update (2 per layer), with 8x headroom: `fp32_bound`;
- bf16 autocast against float32: 4 times the reference route's own bf16 error (the baseline's, or "eager"'s), at
  least bf16's eps: `bf16_bound`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from transformers import PreTrainedModel

import ddl_hf
from ddl_lab.builders import GPU_VARIANTS
from tests.builders import build_source, gpt2_model

#: name -> (baseline family, Delta fields): the GPU check's variants, one table for the tests and the cost report.
VARIANTS = GPU_VARIANTS
#: The gate of every converted variant: open (additive mode at beta = 0 would be the baseline exactly).
BETA = 0.5

#: Correctness: deep and wide enough that rounding accumulates. Kernels: GPT-2 small (124M), the cost shape.
CHECK = dict(n_layer=6, n_embd=384, n_head=6, vocab_size=8192, batch=2, seq=128, prompt=16, new_tokens=16)
SMALL = dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, llama_vocab_size=32000, batch=8, seq=1024)

EPS_FP32 = torch.finfo(torch.float32).eps  # 2^-23
EPS_BF16 = torch.finfo(torch.bfloat16).eps  # 2^-7


def fp32_bound(shape: dict) -> float:
    """max|Δ logits| / max|logits| between two float32 evaluations in different summation orders: 8·ε₃₂·2L·√D."""
    return 8 * EPS_FP32 * 2 * shape["n_layer"] * math.sqrt(shape["n_embd"])


def bf16_bound(reference_error: float) -> float:
    """What a bf16-autocast route may miss float32 by: 4 times the reference route's own bf16 error, at least ε_bf16."""
    return 4 * max(reference_error, EPS_BF16)


def baseline(family: str, shape: dict) -> PreTrainedModel:
    """transformers' GPT-2 (dropout off, <|endoftext|> the last token) or a Llama of the same depth and width (GQA,
    SwiGLU 8/3·D), random weights from seed 0, SDPA attention, on the CPU."""
    width, heads = shape["n_embd"], shape["n_head"]
    if family == "llama":
        model = build_source(
            "llama",
            num_hidden_layers=shape["n_layer"],
            hidden_size=width,
            num_attention_heads=heads,
            num_key_value_heads=heads // 2,
            head_dim=width // heads,
            intermediate_size=64 * math.ceil(8 * width / 3 / 64),
            vocab_size=shape.get("llama_vocab_size", shape["vocab_size"]),
            max_position_embeddings=1024,
        )
    else:
        end = shape["vocab_size"] - 1
        fields = {k: shape[k] for k in ("n_layer", "n_embd", "n_head", "vocab_size")}
        model = gpt2_model(**fields, n_positions=1024, bos_token_id=end, eos_token_id=end, pad_token_id=None)
    model.set_attn_implementation("sdpa")
    return model


def delta_of(variant: str, source: PreTrainedModel, implementation: str = "auto") -> PreTrainedModel:
    """`source` converted to the Delta model of `variant` (its own copy of the weights), running `implementation`."""
    family, fields = VARIANTS[variant]
    convert = ddl_hf.convert_llama if family == "llama" else ddl_hf.convert_gpt2
    torch.manual_seed(1)  # the new Delta weights (value maps, read convolutions)
    model = convert(source, **fields, delta_beta_init=BETA, delta_implementation=implementation).eval()
    model.set_attn_implementation("sdpa")
    return model


def random_ids(vocab: int, batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b|, in float64 (b the reference)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@contextlib.contextmanager
def exact_fp32() -> Iterator[None]:
    """IEEE float32 matmuls and convolutions on CUDA (no TF32), restored afterwards."""
    targets = [t for t in (torch.backends.cuda.matmul, getattr(torch.backends.cudnn, "conv", None)) if t is not None]
    if not all(hasattr(t, "fp32_precision") for t in targets):  # before torch 2.9: the legacy flags
        saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
        return
    saved = [t.fp32_precision for t in targets]
    for t in targets:
        t.fp32_precision = "ieee"
    try:
        yield
    finally:
        for t, value in zip(targets, saved):
            t.fp32_precision = value


def bf16_autocast(device: torch.device, enabled: bool = True) -> contextlib.AbstractContextManager:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


def logits_of(model: torch.nn.Module, ids: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    with torch.no_grad(), bf16_autocast(ids.device, bf16):
        return model(input_ids=ids).logits.float()


@contextlib.contextmanager
def running(model: PreTrainedModel, implementation: str) -> Iterator[PreTrainedModel]:
    """`model` with `delta_implementation=implementation` inside the block, the one it had before afterwards."""
    before = model.config.delta_implementation
    model.set_delta_implementation(implementation)
    try:
        yield model
    finally:
        model.set_delta_implementation(before)


def loss_and_grads(model: PreTrainedModel, ids: torch.Tensor, bf16: bool) -> tuple[torch.Tensor, dict]:
    """The language-modelling loss and every parameter's gradient of one forward and backward, the gradients cleared
    again afterwards."""
    model.zero_grad(set_to_none=True)
    with bf16_autocast(ids.device, bf16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach().float(), grads


def assert_bf16_training_matches_float32_eager(model: PreTrainedModel, ids: torch.Tensor, implementation: str) -> None:
    """`model`'s bf16-autocast loss and every parameter's gradient with `implementation` against the same model in
    float32 with "eager" (the tensor ops, TF32 off), each within `bf16_bound` of "eager"'s own bf16 error against that
    reference (per parameter)."""
    with running(model, "eager"):
        with exact_fp32():
            reference = loss_and_grads(model, ids, bf16=False)
        eager = loss_and_grads(model, ids, bf16=True)
    with running(model, implementation):
        loss, grads = loss_and_grads(model, ids, bf16=True)
    limit = bf16_bound(rel_err(eager[0], reference[0]))
    assert rel_err(loss, reference[0]) <= limit, (loss, reference[0], limit)
    assert grads.keys() == reference[1].keys()
    errors = {
        name: (rel_err(grads[name], exact), bf16_bound(rel_err(eager[1][name], exact)))
        for name, exact in reference[1].items()
    }
    over = {name: pair for name, pair in errors.items() if pair[0] > pair[1]}
    assert not over, f"gradients past the bound (error, bound): {over}"
