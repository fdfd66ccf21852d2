"""flash-linear-attention's delta-rule kernels for the DeltaNet mixer on CUDA (`pip install 'ddl-hf[fla]'`).

`fla` (the `fla-core` package) is the field's library for the delta rule: Triton kernels for the chunked form
(`chunk_delta_rule`, half precision) and the recurrent one (`fused_recurrent_delta_rule`), with their own backward.
A DeltaNet model runs them with `delta_implementation="auto"` (the default) or `"triton"` where fla is installed
(`ddl_hf.kernels`; found, not imported: fla and Triton load on the first call), as transformers' Qwen3-Next uses fla's
gated delta rule: CUDA tensors, outside `torch.compile` (inductor compiles the torch form into its own kernels there).
The torch forms run everywhere else, and on CUDA without fla `delta_net_ops.delta_rule` warns once.

The mapping (`fla_delta_rule`), ours -> fla: q, k, v `[B, H, T, d]` -> `[B, T, H, d]`; beta `[B, H, T]` ->
`[B, T, H]`; the state `[B, H, d_v, d_k]` (o = S q) -> fla's `[B, H, K, V]` (its transpose); `scale=1` (DeltaNet's
read is S q, unscaled; fla defaults to 1/sqrt(K)); q and k arrive unit-norm, so fla's in-kernel l2norm stays off.
The chunked kernel takes bf16 / fp16 inputs; float32 models take the recurrent kernel. Declined (the torch forms
run): the write-only rule (`erase=False`, which fla has no kernel for) and packed rows (`document_starts`): fla
takes them as `cu_seqlens`, whose lengths its kernels read on the host, and the models keep every forward free of
host reads. tests/ops/test_fla_kernels.py checks the mapping on the CPU through Triton's interpreter against
`delta_rule_recurrent`; on a GPU, tests/gpu/test_gpu_kernels.py checks fla's kernels against the float64 recurrence.
"""

from __future__ import annotations

import importlib.util

import torch

HALF = (torch.bfloat16, torch.float16)


def fla_available() -> bool:
    """Whether fla can be imported here (without importing it: it imports Triton, which takes seconds)."""
    return importlib.util.find_spec("fla") is not None


def fla_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    erase: bool,
    document_starts: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`delta_rule_recurrent`'s result through fla's kernels, or None where they do not take these inputs without a
    host read: the write-only rule (fla has no kernel for it), packed rows given only as `document_starts` (finding
    the boundaries would read the mask), and packed rows in half precision (fla's chunked form counts its chunks per
    document on the host: one sync per layer). Packed rows with their `cu_seqlens` (one row of documents, as
    `DataCollatorWithFlattening` gives them, no carried state) in float32, or one token, run fla's varlen recurrent
    form, which reads the boundaries on the device. Declined under `torch.compile` too: inductor compiles the torch
    form there."""
    if not erase or torch.compiler.is_compiling():
        return None
    chunked = v.dtype in HALF and q.shape[2] > 1
    varlen = {}
    if document_starts is not None:
        if cu_seqlens is None or q.shape[0] != 1 or initial_state is not None or chunked:
            return None
        varlen = {"cu_seqlens": cu_seqlens.long()}
    from fla.ops.delta_rule import chunk_delta_rule, fused_recurrent_delta_rule

    rule = chunk_delta_rule if chunked else fused_recurrent_delta_rule
    # fla's kernels take q, k and v in one dtype; under autocast DeltaNet's q and k come from `normalize`, whose norm
    # autocast runs in float32, while v is the projection's bf16 / fp16: v's dtype is the kernel's.
    q, k, v = (x.transpose(1, 2).to(v.dtype).contiguous() for x in (q, k, v))  # [B, T, H, d]
    beta = beta.transpose(1, 2).to(v.dtype).contiguous()  # [B, T, H]
    if initial_state is not None:
        initial_state = initial_state.transpose(-1, -2).float().contiguous()  # [B, H, d_k, d_v]
    o, state = rule(q, k, v, beta, scale=1.0, initial_state=initial_state, output_final_state=True, **varlen)
    if varlen:  # one final state per document: the row's is its last document's
        state = state[-1:]
    return o.transpose(1, 2), state.transpose(-1, -2)


__all__ = ["fla_available", "fla_delta_rule"]
