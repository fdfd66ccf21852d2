"""Deep Delta Learning's math: the Delta residual update over depth and the reads of the expanded state, as
readable tensor functions, and the choice of the kernels that run them.

The home of the Delta math. Plain tensor functions, no modules and no parameters, so that every model family and every
test can share them. Each op has one entry point that the layers call and its readable reference here; as fla keeps
`naive.py` beside its kernels, the fused forms sit beside this file (the tests compare the two):

| op | entry point (what the layers call) | readable reference |
| --- | --- | --- |
| Delta residual write (eq. 2.5) | `delta_fused.fused_delta_update` | `delta_update(X, unit_direction(h), ...)` |
| TC read (temporal conv, then the read vector) | `delta_fused.temporal_conv_read` | `temporal_conv(...).sum(-1)` |
| CC read (channel conv, then the read vector) | `delta_fused.channel_conv_read` | `channel_conv(X, W) @ r` |
| EC expansion of the embedding | `temporal_conv` | itself |
| DeltaNet rule over time | `delta_net_ops.delta_rule` (a kernel, or the chunkwise form) | `delta_rule_recurrent` |
| a whole residual: gate, value and write | `DeltaKernels.residual` (a kernel) | `DeltaResidual`'s tensor ops |

Optional kernels are chosen per model, as transformers chooses attention: `config.delta_implementation` ("auto",
"eager", "triton", "native") names them, `delta_kernels` loads them from the `ddl_hf` package (Triton's on CUDA, the
native CPU kernels of `ddl_hf.native`, fla's delta rule), and a layer hands its entry point the kernel, which runs
where its `applies` says so; the tensor ops run everywhere else. No kernel is registered process-wide.

Self-contained Hub custom-code file: it imports only torch.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

# ----------------------------------------------------------------------------------------------------------------
# Optional kernels, chosen per model (`config.delta_implementation`), as transformers chooses attention.
# ----------------------------------------------------------------------------------------------------------------

DELTA_IMPLEMENTATIONS = ("auto", "eager", "triton", "native")


class DeltaKernel(NamedTuple):
    """A backend's implementation of one op with a hand-written backward: its forward, its backward and where it
    applies.

    - `delta_update`: `forward(state [N, D, d_v], h [N, D], beta [N], value [N, d_v], eps, additive, erase) ->
      (new_state, r [N, 1], h^T X [N, d_v] or None)` and `backward(grad, state, h, beta, value, r, hx, eps, additive,
      erase, needs_input_grad[4]) -> (d_state, d_h, d_beta, d_value)`, as `_fused_delta_forward` and
      `_FusedDeltaUpdate.backward` (`delta_fused.py`) define them.
    - `tc_read`: `forward(x, weight, past, same_document) -> read` and `backward(grad, x, weight, past,
      same_document, need_x, need_weight) -> (d_x, d_weight)`, as `_TemporalConvRead` (`delta_fused.py`)
      defines them.

    `applies(tensor) -> bool` says whether the kernel can take this op's inputs (device, dtype, not while compiling).
    `mixed_dtypes` (`delta_update` only): the kernel also takes a state, h, beta and value of different float dtypes
    (what bf16 / fp16 autocast gives: a float32 state beside a half-precision h), as the tensor ops do.
    """

    forward: Callable
    backward: Callable
    applies: Callable[[torch.Tensor], bool]
    mixed_dtypes: bool = False


class DeltaKernels(NamedTuple):
    """What a model's `delta_implementation` runs on one device type; None everywhere is the tensor ops ("eager").

    - `residual`: `(state, x, c, h, weights: ResidualWeights) -> (new_state, beta [...])`: a whole Delta residual
      after its sublayer (gate, value, write) as one op, with autograd; `DeltaResidual`'s tensor ops are the reference.
    - `residual_step`: the same without autograd (generation), or None where it declines these inputs.
    - `read`: `(state [..., D, d_v], weight [d_v] or [D, d_v]) -> [..., D]`, `sum_v X[..., d, v] w[(d,) v]` in the
      state's dtype, with autograd: the linear read (`state @ w`).
    - `channel_read`: `(state, conv_weight [D, K], read [d_v]) -> [..., D]`, `channel_conv_read` as one op.
    - `temporal_read`: `(x, weight, read, past, same_document, history) -> ([B, T, D], window)`,
      `temporal_conv_read` with the kernels `weight * read[:, None]` (read None: `weight`) as one op with its own
      autograd (Triton's), and the next window without gradient: `[past or zeros, x]` (`history`: what assisted
      decoding crops) or its last K - 1 rows; `tc_read` is the TC read as a forward / backward pair (the native
      kernels').
    - `delta_update`, `tc_read`: a `DeltaKernel` for the Delta write and the TC read.
    - `delta_rule`: `(q, k, v, beta, initial_state, erase, document_starts, cu_seqlens) -> (o, final_state) or None`,
      the inputs and outputs of `delta_rule_recurrent` (`delta_net_ops.py`), differentiable itself (fla's ops);
      None where it declines.
    """

    residual: Callable | None = None
    residual_step: Callable | None = None
    read: Callable | None = None
    channel_read: Callable | None = None
    temporal_read: Callable | None = None
    delta_update: DeltaKernel | None = None
    tc_read: DeltaKernel | None = None
    delta_rule: Callable | None = None


TENSOR_OPS = DeltaKernels()
_CHOSEN: dict[tuple[str, str], DeltaKernels] = {}


def delta_kernels(implementation: str, tensor: torch.Tensor) -> DeltaKernels:
    """The kernels `implementation` runs for `tensor`'s device type. "eager" is the tensor ops; "auto", "triton" and
    "native" come from the `ddl_hf` package (`ddl_hf.kernels`), loaded once per device type, before any forward
    (`prepare_delta_kernels`, which a model calls when it is built or its implementation is set, so that a compiled
    forward only looks them up): without `ddl_hf` installed (a Hub directory loaded alone) "auto" is the tensor ops,
    the others a clear error."""
    return _kernels_on(implementation, tensor.device.type)


def _kernels_on(implementation: str, device_type: str) -> DeltaKernels:
    if implementation == "eager" or device_type == "meta":
        return TENSOR_OPS
    kernels = _CHOSEN.get((implementation, device_type))
    if kernels is None:  # a device the model was not prepared for (moved there after it was built)
        kernels = _CHOSEN[(implementation, device_type)] = _load_kernels(implementation, device_type)
    return kernels


def _kernel_backends(implementation: str):
    """`ddl_hf.kernels`, or None where "auto" / "eager" run without it; a clear error for "triton" / "native" where
    `ddl_hf` is not installed. "auto" takes `ddl_hf`'s kernels only where `ddl_hf` is imported: loading a saved
    directory through its Hub code alone imports nothing beyond these files."""
    if implementation not in DELTA_IMPLEMENTATIONS:
        raise ValueError(
            f"delta_implementation={implementation!r} is invalid: expected one of {DELTA_IMPLEMENTATIONS}."
        )
    if implementation == "eager" or (implementation == "auto" and "ddl_hf" not in sys.modules):
        return None
    try:
        return importlib.import_module("ddl_hf.kernels")
    except ImportError:
        if implementation == "auto":
            return None
        raise ImportError(
            f"delta_implementation={implementation!r} runs kernels of the ddl_hf package, which is not installed "
            "(pip install ddl-hf); delta_implementation='eager' runs the tensor ops of these files alone."
        ) from None


def prepare_delta_kernels(implementation: str, device_type: str | None = None) -> None:
    """Check that `implementation` can run here and load its kernels for every device type it runs on here (the CPU,
    CUDA where available), so that forwards, compiled ones included, only look them up. A clear error where it
    cannot run: an unknown name, its kernels missing, or (given `device_type`, the model's) not on that device."""
    backends = _kernel_backends(implementation)
    if backends is None:
        return
    for device, kernels in backends.prepare(implementation).items():
        _CHOSEN.setdefault((implementation, device), _as_these_kernels(kernels))
    if device_type is not None:
        _kernels_on(implementation, device_type)


def _load_kernels(implementation: str, device_type: str) -> DeltaKernels:
    backends = _kernel_backends(implementation)
    return TENSOR_OPS if backends is None else _as_these_kernels(backends.kernels_for(implementation, device_type))


def _as_these_kernels(kernels) -> DeltaKernels:
    """`ddl_hf`'s answer as this file's `DeltaKernels`, by field name: a saved directory's copy of this file and the
    installed `ddl_hf` may be of different versions, and a field one of them lacks is the tensor ops."""
    return DeltaKernels(**{name: getattr(kernels, name, None) for name in DeltaKernels._fields})


# ----------------------------------------------------------------------------------------------------------------
# The Delta residual write (paper eq. 2.5): the readable reference (the entry point: `delta_fused.py`).
# ----------------------------------------------------------------------------------------------------------------


def delta_update(
    state: torch.Tensor,
    k: torch.Tensor,
    beta: torch.Tensor,
    value: torch.Tensor,
    branch_output: torch.Tensor | None = None,
    erase: bool = True,
) -> torch.Tensor:
    """Delta residual write (paper eq. 2.5): `X + beta k (v^T - k^T X)`, plus `F(x) 1^T` in additive mode.

    Args:
        state: residual state X, `[..., D]` (d_v = 1) or `[..., D, d_v]`.
        k: unit-norm direction, `[..., D]`, float32.
        beta: gate, `[...]`, float32.
        value: written value v, `[..., d_v]`, float32.
        branch_output: the sublayer output h `[..., D]` for the additive mode, None for the paper mode.
        erase: False drops `- k^T X`: the write-only ablation `X + beta k v^T` (the authors list it as open work).

    `k^T X` and the rank-1 coefficient are formed in k's dtype (float32 or wider); the result has the state's
    dtype. When beta is exactly 0 the Delta term is exactly 0, so the additive mode returns `X + h` bit for bit.
    """
    expanded = state.dim() == k.dim() + 1
    x = state if expanded else state.unsqueeze(-1)  # [..., D, d_v]
    if erase:
        k_dot_x = torch.einsum("...d,...dv->...v", k, at_least_float32(x))  # erase: the state's coordinate along k
        coefficient = beta.unsqueeze(-1) * (value - k_dot_x)  # [..., d_v]: write minus erase, gated
    else:
        coefficient = beta.unsqueeze(-1) * value  # write only
    delta = (k.unsqueeze(-1) * coefficient.unsqueeze(-2)).to(state.dtype)  # rank-1: k (beta (v - k^T X))^T
    new_state = x if branch_output is None else x + branch_output.unsqueeze(-1)
    new_state = new_state + delta
    return new_state if expanded else new_state.squeeze(-1)


_WIDE_FLOATS = (torch.float32, torch.float64)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the Delta math: float32 for half precision; float32 and float64 stay (float64 for gradcheck)."""
    return dtype if dtype in _WIDE_FLOATS else torch.float32


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """`x` in `compute_dtype`: half precision upcast to float32, float32 and float64 unchanged."""
    return x if x.dtype in _WIDE_FLOATS else x.to(torch.float32)


def unit_direction(h: torch.Tensor, eps: float) -> torch.Tensor:
    """k = h / sqrt(|h|^2 + eps^2) in float32: unit norm for any non-negligible h, and 0 (no-op) for h = 0."""
    h = at_least_float32(h)
    return h * torch.rsqrt(h.square().sum(-1, keepdim=True) + eps * eps)


def delta_gate(logit: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """beta = 2 sigmoid(g) rho, the gate of every Delta residual, in [0, 2] (shaped like the logit)."""
    return 2.0 * torch.sigmoid(logit) * rho


def straight_through_clamp(x: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """clamp(x, low, high) in the forward pass, identity gradient in the backward pass.

    The gate opening `rho` uses it so that beta can be *exactly* 0 at initialisation (rho = 0) and still receive a
    gradient there, and so that a gate pushed below 0 can come back when training wants it.
    """
    return x.clamp(low, high).detach() + (x - x.detach())  # value exactly clamp(x) (x - x == 0), gradient 1


class ResidualWeights(NamedTuple):
    """A Delta residual's parameters and settings as a whole-residual kernel takes them (`DeltaKernels.residual`): a
    linear gate `beta = 2 sigmoid(gate_weight c + gate_bias) clamp(beta_open, 0, 1)`, a linear value (of c; of the
    read x with `value_scale`, the sigmoid value) or the constant `value_constant` (`value_weight` None), and the
    update's settings (`delta_update`)."""

    gate_weight: torch.Tensor
    gate_bias: torch.Tensor
    beta_open: torch.Tensor
    value_weight: torch.Tensor | None
    value_bias: torch.Tensor | None
    value_scale: float | None
    value_constant: float
    eps: float
    additive: bool
    erase: bool

    def value_kind(self, x: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """The value's kind as a whole-residual kernel takes it (`VALUE_*`), and the tensor it reads besides c: the
        read x for the sigmoid value, else None."""
        if self.value_weight is None:
            return VALUE_CONSTANT, None
        return (VALUE_LINEAR, None) if self.value_scale is None else (VALUE_SIGMOID, x)


#: The value's kinds (`ResidualWeights.value_kind`): `W_v c + b_v`, `scale sigmoid(W_v x + b_v)`, a constant.
VALUE_LINEAR, VALUE_SIGMOID, VALUE_CONSTANT = 0, 1, 2


# ----------------------------------------------------------------------------------------------------------------
# The reads of the expanded state used by the paper's variants (TC, CC, EC; docs/variants.md): short depthwise
# convolutions, over tokens or over the value channels (the TC and CC reads' entry points: `delta_fused.py`).
# ----------------------------------------------------------------------------------------------------------------


def temporal_conv(
    history: torch.Tensor, weight: torch.Tensor, same_document: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal depthwise convolution over tokens: `y_t = sum_j weight[..., j] * x_{t - K + 1 + j}`.

    Args:
        history: `[B, K - 1 + T, *channels]`: the K - 1 inputs before the T new ones (zeros at the start of a
            sequence, the cached ones when decoding), then the T new inputs.
        weight: `[*channels, K]`, one kernel per channel; the last tap multiplies the current token.
        same_document: `[B, T, K]` bool, or None: whether tap j of output t reads a token of t's own document
            (packed rows); a tap into an earlier document reads 0, as if the document were alone.

    Returns `[B, T, *channels]`. K shifted multiply-adds (K is small) rather than conv1d: no transposes of the state.
    """
    size = weight.shape[-1]
    steps = history.shape[1] - size + 1
    weight = weight.to(history.dtype)
    out = None
    for j in range(size):
        tap = history[:, j : j + steps]
        if same_document is not None:
            keep = same_document[:, :, j].to(history.dtype)
            tap = tap * keep.view(*keep.shape, *([1] * (history.dim() - 2)))
        out = tap * weight[..., j] if out is None else out + tap * weight[..., j]
    return out


def same_document_taps(document_starts: torch.Tensor, size: int) -> torch.Tensor:
    """`[B, T, K]` bool for `temporal_conv`: tap j of token t (which reads token t - K + 1 + j) stays in t's
    document. `document_starts` `[B, T]` is True where a packed row starts a new document."""
    document = nn.functional.pad(document_starts.long().cumsum(-1), (size - 1, 0))  # inputs before the row: apart
    steps = document_starts.shape[1]
    target = document[:, size - 1 :]
    return torch.stack([document[:, j : j + steps] == target for j in range(size)], dim=-1)


def channel_conv(state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Convolution across the d_v value channels, per hidden unit, zero-padded to keep d_v channels.

    `y[..., d, o] = sum_j weight[d, j] * x[..., d, o - p + j]` with p = (K - 1) // 2 (centred, as in the reference
    code's default non-causal channel convolution); state `[..., D, d_v]`, weight `[D, K]`, K <= d_v.
    """
    size = weight.shape[-1]
    channels = state.shape[-1]
    left = (size - 1) // 2
    padded = nn.functional.pad(state, (left, size - 1 - left))
    weight = weight.to(state.dtype)
    out = padded[..., :channels] * weight[:, :1]
    for j in range(1, size):
        out = out + padded[..., j : j + channels] * weight[:, j : j + 1]
    return out


__all__ = [
    "DELTA_IMPLEMENTATIONS",
    "VALUE_CONSTANT",
    "VALUE_LINEAR",
    "VALUE_SIGMOID",
    "DeltaKernel",
    "DeltaKernels",
    "ResidualWeights",
    "channel_conv",
    "delta_gate",
    "delta_kernels",
    "delta_update",
    "prepare_delta_kernels",
    "same_document_taps",
    "straight_through_clamp",
    "temporal_conv",
    "unit_direction",
]
