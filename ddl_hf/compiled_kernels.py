"""The Delta update compiled by `torch.compile`, for eager training on GPUs (opt-in: `enable_compiled_delta_update()`).

An eager Delta residual's write runs as a dozen small tensor ops forward and as many backward (`delta_ops`'
`_fused_delta_forward` and `_fused_delta_backward`), each its own kernel launch and its own pass over the state. On
the first H200 run (docs/performance.md) the Delta models' eager training step cost 1.45-2.3x GPT-2's, against
1.02-1.07x on a CPU. Compiling the whole model fuses them (`torch_compile=True`); this backend compiles only the
update, the same two functions, so that a model that runs eagerly (peft, a custom loop, generation) gets inductor's
fused kernels for it. Nothing is hand-written: the math stays in `delta_ops`, and inductor generates the kernels.

It registers as the "delta_update" kernel (`delta_ops.register_kernel`), from outside the model files, and runs where
it applies: tensors on the chosen devices (CUDA by default), outside `torch.compile` (a compiled model fuses the
update itself), including the mixed dtypes of autocast (a float32 state beside a bf16 h). Off by default until a GPU
run measures it (`checks/gpu_check.py` times it against GPT-2 and against the tensor ops).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from .delta_ops import (
    DeltaKernel,
    _fused_delta_backward,
    _fused_delta_forward,
    register_kernel,
    registered_kernel,
)


def _forward(state, h, beta, value, eps, additive, erase):
    """The kernel layout's forward (`DeltaKernel`): state `[N, D, d_v]`, h `[N, D]`, beta `[N]`, value `[N, d_v]`.
    d_v = 1 takes the vector form (products and sums over D, no batched matrix product for inductor to hand to a
    library); the size-1 dim is static under `dynamic=True`, so each form is its own graph."""
    vector = state.shape[-1] == 1
    out, r, hx = _fused_delta_forward(
        state.squeeze(-1) if vector else state, h, beta.unsqueeze(-1), value, eps, additive, erase
    )
    return out.unsqueeze(-1) if vector else out, r, hx


def _backward(grad, state, h, beta, value, r, hx, additive, erase, needs, state_dtype):
    vector = grad.shape[-1] == 1
    if vector:
        grad, state = grad.squeeze(-1), None if state is None else state.squeeze(-1)
    d_state, d_h, d_beta, d_value = _fused_delta_backward(
        grad, state, h, beta.unsqueeze(-1), value, r, hx, additive, erase, needs, state_dtype
    )
    if vector and d_state is not None:
        d_state = d_state.unsqueeze(-1)
    return d_state, d_h, None if d_beta is None else d_beta.squeeze(-1), d_value


def compiled_delta_update_kernel(
    backend: str = "inductor", devices: Sequence[str] = ("cuda",), **compile_options
) -> DeltaKernel:
    """The "delta_update" kernel: `delta_ops`' forward and backward of the Delta write, each `torch.compile`d (with
    `backend` and `compile_options`), applying to tensors on `devices` outside a compiled region.

    `dynamic=True`: the number of tokens is symbolic, so one graph serves every batch and sequence length of a model
    (a single token, batch-1 decoding, is a graph of its own). Each other case is a graph of its own too: d_v = 1 or
    more, the mode, erase, the dtypes. A model uses a few; dynamo keeps at most `torch._dynamo.config.recompile_limit`
    (8) per function and process, and past that warns and runs the tensor ops."""
    compile_fn = functools.partial(torch.compile, backend=backend, dynamic=True, **compile_options)
    compiled_forward, compiled_backward = compile_fn(_forward), compile_fn(_backward)
    device_types = frozenset(devices)

    # Detached: the autograd node hands over its inputs, which may require grad, and dynamo would keep a graph for
    # each combination of those flags (the node's backward computes every gradient itself).
    def forward(state, h, beta, value, eps, additive, erase):
        return compiled_forward(state.detach(), h.detach(), beta.detach(), value.detach(), eps, additive, erase)

    def kernel_backward(grad, state, h, beta, value, r, hx, eps, additive, erase, needs):
        # Without erase the state is not saved: its gradient comes in grad's dtype, and autograd casts it to the
        # state's, as it does every gradient to its input's dtype.
        dtype = grad.dtype if state is None else state.dtype
        return compiled_backward(grad, state, h, beta, value, r, hx, additive, erase, tuple(needs), dtype)

    def applies(x: torch.Tensor) -> bool:
        return x.device.type in device_types and not torch.compiler.is_compiling()

    return DeltaKernel(forward, kernel_backward, applies, mixed_dtypes=True)


_replaced: list[DeltaKernel | None] = []


def enable_compiled_delta_update(
    backend: str = "inductor", devices: Sequence[str] = ("cuda",), **compile_options
) -> Callable[[], None]:
    """Run every Delta residual's write through `compiled_delta_update_kernel` (process-wide, as `register_kernel`).
    Returns a function that puts back the kernel it replaced (the native CPU kernel, say); so does
    `disable_compiled_delta_update()`."""
    _replaced.append(registered_kernel("delta_update"))
    register_kernel("delta_update", compiled_delta_update_kernel(backend, devices, **compile_options))
    return disable_compiled_delta_update


def disable_compiled_delta_update() -> None:
    """Back to the kernel registered before `enable_compiled_delta_update` (or the tensor ops)."""
    if _replaced:
        register_kernel("delta_update", _replaced.pop())


__all__ = ["compiled_delta_update_kernel", "disable_compiled_delta_update", "enable_compiled_delta_update"]
