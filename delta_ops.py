"""Deep Delta Learning ops: the Delta residual update over depth, the reads of the expanded state, and the delta rule
over time (DeltaNet).

The one place where the Delta math lives. Plain tensor functions, no modules and no parameters, so that every model
family and every test can share them. Each op has one entry point that the layers call, and its readable reference
beside it (as fla keeps `naive.py` beside its kernels; the tests compare the two):

| op | entry point (what the layers call) | readable reference |
| --- | --- | --- |
| Delta residual write (eq. 2.5) | `fused_delta_update` | `delta_update(X, unit_direction(h), ...)` |
| TC read (temporal conv, then the read vector) | `temporal_conv_read` | `temporal_conv(...).sum(-1)` |
| CC read (channel conv, then the read vector) | `channel_conv_read` | `channel_conv(X, W) @ r` |
| EC expansion of the embedding | `temporal_conv` | itself |
| DeltaNet rule over time | `delta_rule` (a kernel, or `delta_rule_chunkwise`) | `delta_rule_recurrent` |
| a whole residual: gate, value and write | `DeltaKernels.residual` (a kernel) | `DeltaResidual`'s tensor ops |

Optional kernels are chosen per model, as transformers chooses attention: `config.delta_implementation` ("auto",
"eager", "triton", "native") names them, `delta_kernels` loads them from the `ddl_hf` package (Triton's on CUDA, the
native CPU kernels of `ddl_hf.native`, fla's delta rule), and a layer hands its entry point the kernel, which runs
where its `applies` says so; the tensor ops run everywhere else. No kernel is registered process-wide.

Self-contained Hub custom-code file: it imports only torch and, for torch's `scan` op, its sibling `delta_compat.py`.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from .delta_compat import DELTA_NET_DYNAMIC_EXPORT, scan

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
      `_FusedDeltaUpdate.backward` define them.
    - `tc_read`: `forward(x, weight, past, same_document) -> read` and `backward(grad, x, weight, past,
      same_document, need_x, need_weight) -> (d_x, d_weight)`, as `_TemporalConvRead` defines them.

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
      the inputs and outputs of `delta_rule_recurrent`, differentiable itself (fla's ops); None where it declines.
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
# The Delta residual write (paper eq. 2.5): the readable reference, then the fused entry point.
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


# The fused Delta update: the same math as `delta_update(state, unit_direction(h), ...)` in fewer passes over memory.
# With k = r h and r = 1 / sqrt(|h|^2 + eps^2), the whole write is one broadcast multiply-add of h:
#     X' = X + h s^T,   s = r beta (v - r h^T X)  (+ 1 in additive mode),   s in R^{d_v} per token,
# so k is never materialised. The backward keeps only X and h (X is saved by the next LayerNorm or read anyway)
# plus per-token scalars, and recomputes the rest:
#     dX = g - h (r^2 beta h^T g)^T                       (= A^T g, A symmetric)
#     dk = g c - X (beta k^T g),  c = beta (v - k^T X)
#     dh = g s + X (-r beta k^T g) - h r^3 (h^T dk)         (chain rule through k = r h; g 1 is in g s)
#     dbeta = (k^T g) . (v - k^T X),   dv = beta k^T g
# Without the erase term (write-only) every `k^T X` above is 0: s = r beta v, dX = g and dh loses its X term.


def _dot(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """h^T x over the hidden dim: `[..., 1]` for a vector x `[..., D]`, `[..., d_v]` for an expanded `[..., D, d_v]`."""
    if x.dim() == h.dim():
        return (h * x).sum(-1, keepdim=True)
    return (h.unsqueeze(-2) @ x).squeeze(-2)


def _outer(h: torch.Tensor, s: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h and s shaped so that `h * s` broadcasts to the rank-1 `h s^T` in the layout of `like`."""
    if like.dim() == h.dim():
        return h, s
    return h.unsqueeze(-1), s.unsqueeze(-2)


def _mix(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x s over the value channels: `[..., D]` (x * s for a vector state)."""
    if x.dim() == s.dim():
        return x * s
    return torch.einsum("...dv,...v->...d", x, s)


def _fused_delta_forward(
    state: torch.Tensor,
    h: torch.Tensor,
    beta: torch.Tensor,
    value: torch.Tensor,
    eps: float,
    additive: bool,
    erase: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The new state, r `[..., 1]` and h^T X `[..., d_v]` (None without erase; the last two are saved for the
    backward). beta is `[..., 1]`."""
    hf = at_least_float32(h)
    r = torch.rsqrt(_dot(hf, hf) + eps * eps)
    rb = r * beta
    if erase:
        hx = _dot(hf, at_least_float32(state))
        coefficient = torch.addcmul(value, r, hx, value=-1.0)  # v - k^T X
    else:
        hx, coefficient = None, value
    # r beta (v - k^T X), + 1 in additive mode: exactly 1 when beta == 0, so X' == X + h bit for bit.
    scale = torch.addcmul(rb.new_ones(()), rb, coefficient) if additive else rb * coefficient
    out = torch.addcmul(state, *_outer(h, scale, state))
    out_dtype = torch.promote_types(state.dtype, h.dtype) if additive and h.dtype != state.dtype else state.dtype
    return out.to(out_dtype), r, hx


def _fused_delta_backward(
    grad_out: torch.Tensor,
    state: torch.Tensor | None,
    h: torch.Tensor,
    beta: torch.Tensor,
    value: torch.Tensor,
    r: torch.Tensor,
    hx: torch.Tensor | None,
    additive: bool,
    erase: bool,
    needs: tuple[bool, ...],
    state_dtype: torch.dtype,
) -> tuple[torch.Tensor | None, ...]:
    """The gradients of `_fused_delta_forward` (the formulas above) with respect to state, h, beta `[..., 1]` and
    value, each None where `needs` says it is not needed; `state` None without erase (not saved)."""
    g, hf = at_least_float32(grad_out), at_least_float32(h)
    hg = _dot(hf, g)  # h^T g, so k^T g = r hg
    residual = value - r * hx if erase else value  # v - k^T X
    b_kg = beta * r * hg  # beta k^T g = dL/dv
    grad_state = grad_h = None
    if needs[0]:
        grad_state = torch.addcmul(g, *_outer(hf, -r * b_kg, g)) if erase else g
        grad_state = grad_state.to(state_dtype)
    if needs[1]:
        coef = beta * residual
        scale = r * coef + 1.0 if additive else r * coef
        h_dot_dk = (hg * coef - hx * b_kg if erase else hg * coef).sum(-1, keepdim=True)
        grad_h = _mix(g, scale) - hf * (r * r * r * h_dot_dk)
        if erase:
            grad_h = grad_h + _mix(at_least_float32(state), -r * b_kg)
        grad_h = grad_h.to(h.dtype)
    grad_beta = (r * hg * residual).sum(-1, keepdim=True) if needs[2] else None
    grad_value = b_kg if needs[3] else None
    return grad_state, grad_h, grad_beta, grad_value


def _flat(state, h, beta, value) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """state, h, beta, value as a kernel takes them: `[N, D, d_v]`, `[N, D]`, `[N]`, `[N, d_v]` (d_v = 1 for a vector
    state). Views where the tensors are contiguous."""
    dim, channels = h.shape[-1], value.shape[-1]
    tokens = h.numel() // dim
    return (
        state.reshape(tokens, dim, channels),
        h.reshape(tokens, dim),
        beta.reshape(tokens),
        value.reshape(tokens, channels),
    )


class _FusedDeltaUpdate(torch.autograd.Function):
    """One autograd node per Delta block with a hand-derived backward (see the formulas above); `kernel` (a
    registered "delta_update" kernel, or None) runs the same forward and backward."""

    @staticmethod
    def forward(ctx, state, h, beta, value, eps, additive, erase, kernel):
        if kernel is not None:
            out, r, hx = kernel.forward(*_flat(state, h, beta, value), eps, additive, erase)
            out = out.view(state.shape)
        else:
            out, r, hx = _fused_delta_forward(state, h, beta, value, eps, additive, erase)
        # Write-only never reads X after the forward pass: it is not saved.
        ctx.save_for_backward(state if erase else None, h, beta, value, r, hx)
        ctx.additive, ctx.erase, ctx.state_dtype, ctx.eps, ctx.kernel = additive, erase, state.dtype, eps, kernel
        return out

    @staticmethod
    def backward(ctx, grad_out):
        state, h, beta, value, r, hx = ctx.saved_tensors
        erase = ctx.erase
        if ctx.kernel is not None:
            grad_flat, h_flat, beta_flat, value_flat = _flat(grad_out, h, beta, value)
            x_flat = None if state is None else state.reshape(grad_flat.shape)
            needs = list(ctx.needs_input_grad[:4])
            grads = ctx.kernel.backward(
                grad_flat, x_flat, h_flat, beta_flat, value_flat, r, hx, ctx.eps, ctx.additive, erase, needs
            )
            shaped = (
                g.view(like.shape) if need else None for g, like, need in zip(grads, (grad_out, h, beta, value), needs)
            )
            return (*shaped, None, None, None, None)
        grads = _fused_delta_backward(
            grad_out, state, h, beta, value, r, hx, ctx.additive, erase, ctx.needs_input_grad[:4], ctx.state_dtype
        )
        return (*grads, None, None, None, None)


def fused_delta_update(
    state: torch.Tensor,
    branch_output: torch.Tensor,
    beta: torch.Tensor,
    value: torch.Tensor,
    eps: float,
    additive: bool,
    erase: bool = True,
    kernel: DeltaKernel | None = None,
) -> torch.Tensor:
    """The Delta residual write, the entry point every Delta residual calls:
    `delta_update(state, unit_direction(h, eps), beta, value, h if additive else None, erase)`, fused.

    state `[..., D]` or `[..., D, d_v]` (its dtype is kept), h `[..., D]`, beta `[..., 1]` (or `[...]`) and value
    `[..., d_v]` (float32 or float64). Under autograd it is one node that saves only X, h and per-token scalars;
    without autograd a plain function (what generation runs). `kernel` (a model's `delta_update` kernel, or None)
    runs where it applies.
    """
    if beta.dim() != branch_output.dim():
        beta = beta.unsqueeze(-1)  # [...] -> [..., 1]
    tokens = branch_output.shape[:-1]
    if (
        kernel is not None
        and not (
            kernel.applies(state)
            # one dtype unless the kernel takes mixed ones, no broadcasting
            and (kernel.mixed_dtypes or state.dtype == branch_output.dtype == beta.dtype == value.dtype)
            and state.shape[: branch_output.dim()] == branch_output.shape
            and beta.shape[:-1] == value.shape[:-1] == tokens
        )
    ):
        kernel = None
    if torch.is_grad_enabled() and (
        state.requires_grad or branch_output.requires_grad or beta.requires_grad or value.requires_grad
    ):
        return _FusedDeltaUpdate.apply(state, branch_output, beta, value, eps, additive, erase, kernel)
    if kernel is not None:
        return kernel.forward(*_flat(state, branch_output, beta, value), eps, additive, erase)[0].view(state.shape)
    return _fused_delta_forward(state, branch_output, beta, value, eps, additive, erase)[0]


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
# convolutions, over tokens or over the value channels.
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


def _taps(x: torch.Tensor, past: torch.Tensor | None, size: int):
    """Tap j of a causal window of `size` over x `[B, T, ...]`, as (j, output rows, input, input rows of x or None):
    tap j of output t reads token t - lag, lag = size - 1 - j; inputs before x come from `past` `[B, size - 1, ...]`
    (None: zeros, which contribute nothing and are skipped). Views only: nothing is copied."""
    steps = x.shape[1]
    for j in range(size):
        lag = size - 1 - j
        if lag < steps:
            yield j, slice(lag, steps), x[:, : steps - lag], slice(0, steps - lag)
        if past is not None and lag > 0:
            n = min(lag, steps)
            yield j, slice(0, n), past[:, size - 1 - lag : size - 1 - lag + n], None


def _tc_read_forward(x, w, past, same_document) -> torch.Tensor:
    """The TC read's forward with tensor ops: the taps accumulate in place into one `[B, T, D, d_v]` buffer, summed
    over the value channels once. The buffer is `new_zeros`, not `zeros_like(x)`: under torch.compile the joint graph
    would merge it with the backward's `zeros_like(x)` and keep a state-sized buffer of zeros for the backward."""
    taps = x.new_zeros(x.shape)
    for j, rows, source, _ in _taps(x, past, w.shape[-1]):
        if same_document is not None:
            source = source * same_document[:, rows, j, None, None].to(x.dtype)
        taps[:, rows].addcmul_(source, w[..., j])
    return taps.sum(-1)


class _TemporalConvRead(torch.autograd.Function):
    """`temporal_conv(cat([past, x]), weight).sum(-1)` without the padded history; the backward saves only x (which
    the Delta update keeps anyway). `past` is a cached window: no gradient. `kernel`: a model's `tc_read` kernel, or
    None."""

    @staticmethod
    def forward(ctx, x, weight, past, same_document, kernel):
        w = weight.to(x.dtype)
        ctx.save_for_backward(x, w, past, same_document)
        ctx.weight_dtype, ctx.kernel = weight.dtype, kernel
        if kernel is not None:
            return kernel.forward(x, w, past, same_document)
        return _tc_read_forward(x, w, past, same_document)

    @staticmethod
    def backward(ctx, grad_out):
        x, w, past, same_document = ctx.saved_tensors
        if ctx.kernel is not None:
            need_x, need_w = ctx.needs_input_grad[:2]
            grad_x, grad_w = ctx.kernel.backward(grad_out, x, w, past, same_document, need_x, need_w)
            return grad_x if need_x else None, grad_w.to(ctx.weight_dtype) if need_w else None, None, None, None
        grad_x = torch.zeros_like(x) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(w) if ctx.needs_input_grad[1] else None
        for j, rows, source, x_rows in _taps(x, past, w.shape[-1]):
            g = grad_out[:, rows]
            if same_document is not None:
                g = g * same_document[:, rows, j, None].to(g.dtype)
            g = g.unsqueeze(-1)
            # isinstance, not `x_rows is not None`: dynamo guards a compiled backward on that slice's length
            if grad_x is not None and isinstance(x_rows, slice):
                grad_x[:, x_rows].addcmul_(g, w[..., j])
            if grad_w is not None:
                grad_w[..., j] += (g * source).sum((0, 1))
        return grad_x, None if grad_w is None else grad_w.to(ctx.weight_dtype), None, None, None


def temporal_conv_read(
    x: torch.Tensor,
    weight: torch.Tensor,
    past: torch.Tensor | None = None,
    same_document: torch.Tensor | None = None,
    kernel: DeltaKernel | None = None,
) -> torch.Tensor:
    """The TC read, the entry point: `temporal_conv(cat([past or zeros, x], 1), weight, same_document).sum(-1)` in one
    pass over the state.

    x `[B, T, D, d_v]`, weight `[D, d_v, K]` (the kernels already scaled by the read vector), past `[B, K - 1, D,
    d_v]` (the cached inputs; None: zeros), same_document as in `temporal_conv`. Returns `[B, T, D]`. The expression
    above is the readable definition (tests compare them, values and gradients, in float64). `kernel` (a model's
    `tc_read`) runs where it applies."""
    kernel = kernel if kernel is not None and kernel.applies(x) else None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _TemporalConvRead.apply(x, weight, past, same_document, kernel)
    w = weight.to(x.dtype)
    if kernel is not None:
        return kernel.forward(x, w, past, same_document)
    return _tc_read_forward(x, w, past, same_document)


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


def channel_conv_read_weight(weight: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
    """The `[D, d_v]` weight w with `channel_conv(x, weight) @ read == (x * w).sum(-1)`.

    `w[d, c] = sum_j weight[d, j] * read[c + p - j]` (zero outside [0, d_v)): each input channel collects the read
    weights of the outputs its taps reach.
    """
    size, channels = weight.shape[-1], read.shape[-1]
    left = (size - 1) // 2
    padded = nn.functional.pad(read, (size - 1 - left, left))  # padded[i] = read[i - (size - 1 - left)]
    # shifted[j, c] = read[c + left - j] = padded[c + size - 1 - j]
    shifted = torch.stack([padded[size - 1 - j : size - 1 - j + channels] for j in range(size)])
    return weight @ shifted.to(weight.dtype)


def channel_conv_read(
    state: torch.Tensor, weight: torch.Tensor, read: torch.Tensor, op: Callable | None = None
) -> torch.Tensor:
    """The CC read, the entry point: `channel_conv(state, weight) @ read` (its readable definition) in one pass over
    the state, with the convolution folded into the read vector (`channel_conv_read_weight`). `[..., D, d_v]` ->
    `[..., D]`. `op`: a model's `channel_read`, which takes the whole read, or None."""
    if op is not None:
        return op(state, weight, read)
    return (state * channel_conv_read_weight(weight, read).to(state.dtype)).sum(-1)


# ----------------------------------------------------------------------------------------------------------------
# DeltaNet: the delta rule over time (paper §4.2), as a token mixer that can replace GPT-2's attention.
#
#   S_t = S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T,   o_t = S_t q_t,   S_t in R^{d_v x d_k} per head.
#
# DDL applies this rank-1 Delta Operator over depth; DeltaNet applies it over the sequence.
# ----------------------------------------------------------------------------------------------------------------


def delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    *,
    erase: bool = True,
    document_starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule one token at a time: the reference form, and the decoding step (constant work per token).

    Args:
        q, k: `[B, H, T, d_k]`. DeltaNet uses unit-norm k (then every step is a contraction for beta in [0, 2]);
            the rule itself is computed exactly for any k.
        v: `[B, H, T, d_v]`.
        beta: `[B, H, T]`, in (0, 1), or (0, 2) for the negative-eigenvalue variant.
        initial_state: `[B, H, d_v, d_k]`, or None for zeros.
        erase: False drops the `- beta k k^T` term, i.e. purely additive linear attention `S_t = S_{t-1} + beta v k^T`.
        document_starts: `[B, T]` bool, or None: True where a new document starts (packed rows). The state carried
            into such a token is zeroed first, so each document runs as if it were alone (a start at t = 0 drops
            `initial_state`).

    Returns:
        `o` `[B, H, T, d_v]` with `o_t = S_t q_t`, in v's dtype, and the final state `S_T` `[B, H, d_v, d_k]`
        (float32 for half-precision inputs).
    """
    out_dtype, dtype = v.dtype, compute_dtype(v.dtype)  # the state accumulates over T
    batch, heads, _, d_k = k.shape
    d_v = v.shape[-1]
    q, k, v, beta = q.to(dtype), k.to(dtype), v.to(dtype), beta.to(dtype)
    state = q.new_zeros(batch, heads, d_v, d_k) if initial_state is None else initial_state.to(dtype)
    outputs = []
    # unbind, not k[:, :, t]: the backward of one unbind is one stack, that of T slices is T full-size zero tensors.
    steps = zip(q.unsqueeze(-1).unbind(2), k.unsqueeze(-1).unbind(2), v.unsqueeze(-1).unbind(2), beta.unbind(2))
    keeps = [None] * q.shape[2] if document_starts is None else (~document_starts).to(dtype)[:, None, None].unbind(-1)
    for (q_t, k_t, v_t, beta_t), keep_t in zip(steps, keeps):  # q_t, k_t: [B, H, d_k, 1]; v_t: [B, H, d_v, 1]
        if keep_t is not None:
            state = state * keep_t[..., None]  # [B, 1, 1, 1]: 0 at a document start
        write = v_t - state @ k_t if erase else v_t  # v_t - S_{t-1} k_t: replace what the memory returns for k_t
        state = state + beta_t[..., None, None] * write @ k_t.transpose(-1, -2)
        outputs.append(state @ q_t)
    if not outputs:
        return v.new_zeros(batch, heads, 0, d_v).to(out_dtype), state
    return torch.cat(outputs, dim=-1).transpose(-1, -2).to(out_dtype), state


def _diagonal_block_inverses(a: torch.Tensor, block: int) -> torch.Tensor:
    """The inverses of the `block`-sized diagonal blocks of `I + A`, `[..., C // block, block, block]`.

    Recursive doubling: with the inverses X11, X22 of two neighbouring diagonal blocks of size s known, the inverse
    of their 2s block is [[X11, 0], [-X22 A21 X11, X22]]. log2(block) steps, each one batched matmul pair over all
    blocks of that size; rounding like forward substitution (unlike the nilpotent product prod_j (I + (-A)^(2^j)),
    whose large intermediate powers cancel badly when keys are correlated and beta is near 2). C and `block` are
    powers of two.
    """
    size, batch = a.shape[-1], a.shape[:-2]
    inverse = a.new_ones(*batch, size, 1, 1)  # the 1x1 diagonal blocks of I + A
    s = 1
    while s < block:
        m = size // (2 * s)
        pairs = a.reshape(*batch, m, 2 * s, m, 2 * s).diagonal(dim1=-4, dim2=-2).movedim(-1, -3)  # [..., m, 2s, 2s]
        x11, x22 = inverse[..., 0::2, :, :], inverse[..., 1::2, :, :]
        x21 = -(x22 @ pairs[..., s:, :s] @ x11)
        inverse = torch.cat([torch.cat([x11, torch.zeros_like(x11)], -1), torch.cat([x21, x22], -1)], -2)
        s *= 2
    return inverse


def _pad_to_power_of_two(a: torch.Tensor) -> tuple[torch.Tensor, int]:
    c = a.shape[-1]
    size = 1 << max(0, (c - 1).bit_length())
    return (nn.functional.pad(a, (0, size - c, 0, size - c)) if size != c else a), size


def unit_lower_triangular_inverse(a: torch.Tensor) -> torch.Tensor:
    """`(I + A)^{-1}` for strictly lower-triangular `A` `[..., C, C]`, with matmuls only (exportable, any dtype).

    See `_diagonal_block_inverses`; C is zero-padded to a power of two (the padded rows and columns leave the
    leading block alone).
    """
    c = a.shape[-1]
    padded, size = _pad_to_power_of_two(a)
    return _diagonal_block_inverses(padded, size).reshape(*a.shape[:-2], size, size)[..., :c, :c]


def unit_lower_triangular_solve(a: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """`(I + A)^{-1} rhs` for strictly lower-triangular `A` `[..., C, C]` and `rhs` `[..., C, n]`, matmuls only.

    The inverses of the two diagonal halves, then one block forward substitution: cheaper than forming the whole
    inverse (its largest block and the largest copies are never built).
    """
    c = a.shape[-1]
    if c == 1:
        return rhs
    padded, size = _pad_to_power_of_two(a)
    rhs = nn.functional.pad(rhs, (0, 0, 0, size - c)) if size != c else rhs
    half = size // 2
    inverses = _diagonal_block_inverses(padded, half)
    top = inverses[..., 0, :, :] @ rhs[..., :half, :]
    bottom = inverses[..., 1, :, :] @ (rhs[..., half:, :] - padded[..., half:, :half] @ top)
    return torch.cat([top, bottom], dim=-2)[..., :c, :]


def _to_chunks(x: torch.Tensor, n_chunks: int, chunk: int, exporting: bool) -> torch.Tensor:
    """`[B, H, T, d]` -> `[B, H, n_chunks, chunk, d]`, zero-padded at the end.

    Exporting: copied into a zero tensor of the padded length by index, not padded nor sliced: with a symbolic T,
    torch.export's shape solver cannot prove `T <= chunk * n_chunks` (which a pad or a slice guards on).
    """
    batch, heads, seq_len, d = x.shape
    if not exporting:
        return nn.functional.pad(x, (0, 0, 0, n_chunks * chunk - seq_len)).view(batch, heads, n_chunks, chunk, d)
    positions = torch.arange(seq_len, device=x.device)
    out = x.new_zeros(batch, heads, n_chunks * chunk, d).index_copy(2, positions, x)
    return out.view(batch, heads, n_chunks, chunk, d)


def delta_rule_chunkwise(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    *,
    erase: bool = True,
    document_starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule, chunkwise-parallel: the same inputs and outputs as `delta_rule_recurrent`, T/chunk_size steps.

    Within a chunk that starts from state S_0, the chunk's rank-1 updates have a WY/UT form. With
    `A = strict_lower(diag(beta) K K^T)`, the pseudo-values `U = (I + A)^{-1} diag(beta) V` and
    `W = (I + A)^{-1} diag(beta) K` come from one unit-lower-triangular solve (for all chunks at once), and

        U' = U - W S_0^T,    O = Q S_0^T + causal(Q K^T) U',    S_C = S_0 + U'^T K,

    so only the cheap state hand-over between chunks is sequential. T is zero-padded to whole chunks; padded steps
    have beta = 0 and k = 0 and leave the state unchanged. `erase=False`: A = 0 and W = 0.

    Document starts (packed rows): a start zeroes the state carried into its token, so within a chunk tokens only
    interact with tokens of the same document: A and the causal scores are masked to same-document pairs (then
    (I + A) is block diagonal per document and so is its inverse), S_0 reaches only the tokens before the chunk's
    first start (`U' = U - (W * first) S_0^T`, `O = (Q * first) S_0^T + ...`), and the state handed on is that of
    the chunk's last document: `S_C = [no start in chunk] S_0 + (U' * last)^T K`.

    Exportable (`torch.export` with a dynamic T, `torch.onnx.export(dynamo=True)`; torch >= 2.13): no
    shape-dependent branch but the static ones; under export the chunk hand-over is a `scan` (the eager Python loop
    is faster, and its backward much faster) and T is padded with one more chunk so the number of chunks is always
    >= 2. On an older torch an export traces the eager loop: a program for the traced length only.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    out_dtype, dtype = v.dtype, compute_dtype(v.dtype)  # the state accumulates over T
    batch, heads, seq_len, d_k = k.shape
    d_v = v.shape[-1]
    q, k, v, beta = q.to(dtype), k.to(dtype), v.to(dtype), beta.to(dtype)
    state = q.new_zeros(batch, heads, d_v, d_k) if initial_state is None else initial_state.to(dtype)
    # The export path (a `scan` over a symbolic number of chunks) where this torch can export it; elsewhere an export
    # traces the eager loop for the traced length (delta_compat.DELTA_NET_DYNAMIC_EXPORT).
    exporting = DELTA_NET_DYNAMIC_EXPORT and torch.compiler.is_exporting()
    if seq_len == 0 and not exporting:
        return v.new_zeros(batch, heads, 0, d_v).to(out_dtype), state

    chunk = chunk_size
    # Whole chunks, always (a symbolic pad of 0 is fine). Exporting: >= 2 chunks for every T (scan and the shape
    # checks would otherwise guard on T).
    n_chunks = (seq_len + 2 * chunk - 1) // chunk if exporting else (seq_len + chunk - 1) // chunk
    padding = n_chunks * chunk - seq_len
    q, k, v, beta = (_to_chunks(x, n_chunks, chunk, exporting) for x in (q, k, v, beta.unsqueeze(-1)))

    # Within chunks, all chunks at once: the UT transform and the causal scores.
    k_beta, v_beta = k * beta, v * beta
    # Triangles as products with a constant mask: tril on the batched [B, H, N, C, C] is several times slower.
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    scores = (q @ k.transpose(-1, -2)) * causal  # diagonal included: o_r reads the state after token r's write
    last = keep = None
    if document_starts is not None:
        starts = nn.functional.pad(document_starts, (0, padding)).reshape(batch, 1, n_chunks, chunk)
        segment = starts.to(torch.int32).cumsum(-1)  # the document of each token, counted within its chunk
        same = (segment.unsqueeze(-1) == segment.unsqueeze(-2)).to(dtype)  # [B, 1, N, C, C]
        first = (segment == 0).to(dtype).unsqueeze(-1)  # tokens that see S_0
        last = (segment == segment[..., -1:]).to(dtype).unsqueeze(-1)  # tokens whose writes reach S_C
        keep = (segment[..., -1] == 0).to(dtype)[..., None, None]  # S_0 reaches S_C
        scores = scores * same
    if erase:
        strict = causal.logical_not().transpose(0, 1)  # i < r
        a_strict = (k_beta @ k.transpose(-1, -2)) * (strict if document_starts is None else strict * same)
        # A[r, i] = beta_r k_r . k_i for i < r; [U W] = (I + A)^{-1} diag(beta) [V K]
        u, w = unit_lower_triangular_solve(a_strict, torch.cat([v_beta, k_beta], dim=-1)).split([d_v, d_k], -1)
    else:
        u, w = v_beta, None
    q_carry = q
    if document_starts is not None:
        q_carry = q * first
        w = w * first if w is not None else None

    def hand_over(state: torch.Tensor, xs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        q_n, k_n, u_n, scores_n, *rest = xs
        if erase:  # unpacked, not rest.pop(0): torch 2.7's dynamo traces the starred rest as a tuple
            w_n, *rest = rest
            u_n = u_n - w_n @ state.transpose(-1, -2)
        o_n = q_n @ state.transpose(-1, -2) + scores_n @ u_n
        if rest:  # document starts: keep S_0 only without a start in the chunk; write only the last document
            last_n, keep_n = rest
            return state * keep_n + (u_n * last_n).transpose(-1, -2) @ k_n, o_n
        return state + u_n.transpose(-1, -2) @ k_n, o_n

    xs = (q_carry, k, u, scores, *([w] if erase else []), *([last, keep] if last is not None else []))
    if exporting:
        state, o = scan(hand_over, state, xs, dim=2)  # torch's scan op, through delta_compat
    else:  # across chunks: carry the state (unbind: see delta_rule_recurrent)
        outputs = []
        for xs_n in zip(*(x.unbind(2) for x in xs)):
            state, o_n = hand_over(state, xs_n)
            outputs.append(o_n)
        o = torch.stack(outputs, dim=2)
    o = o.reshape(batch, heads, n_chunks * chunk, d_v)
    o = o.index_select(2, torch.arange(seq_len, device=o.device)) if exporting else o[:, :, :seq_len]
    return o.to(out_dtype), state


_warned_no_gpu_kernel = False


def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    *,
    erase: bool = True,
    document_starts: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    kernel: Callable | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The DeltaNet mixer's entry point: `kernel` (a model's `delta_rule` kernel: fla's, on CUDA,
    `ddl_hf.fla_kernels`) where it takes these inputs, else the tensor ops: one recurrent step when decoding one
    token, the chunkwise form otherwise. Same inputs and outputs as `delta_rule_recurrent`; `cu_seqlens` (packed
    rows, where the caller gave them: flash-attention's `cu_seq_lens_q`) say where the documents of `document_starts`
    start, for a kernel that takes boundaries rather than a mask. On CUDA without a kernel, one warning."""
    if kernel is not None:
        out = kernel(q, k, v, beta, initial_state, erase, document_starts, cu_seqlens)
        if out is not None:
            return out
    elif v.is_cuda and not torch.compiler.is_compiling():
        _warn_no_gpu_kernel()
    if q.shape[2] == 1:  # decoding: one rank-1 update (a shape-only branch: export with T >= 2 never sees it)
        return delta_rule_recurrent(q, k, v, beta, initial_state, erase=erase, document_starts=document_starts)
    return delta_rule_chunkwise(q, k, v, beta, chunk_size, initial_state, erase=erase, document_starts=document_starts)


def _warn_no_gpu_kernel() -> None:
    global _warned_no_gpu_kernel
    if not _warned_no_gpu_kernel:
        _warned_no_gpu_kernel = True
        warnings.warn(
            "DeltaNet on CUDA runs the torch chunkwise form of the delta rule: flash-linear-attention's kernels are "
            "faster. Install them (`pip install 'ddl-hf[fla]'`, or `fla-core`) and load the model with "
            "delta_implementation='auto' (the default) or 'triton'.",
            stacklevel=3,
        )


__all__ = [
    "DELTA_IMPLEMENTATIONS",
    "VALUE_CONSTANT",
    "VALUE_LINEAR",
    "VALUE_SIGMOID",
    "DeltaKernel",
    "DeltaKernels",
    "ResidualWeights",
    "channel_conv",
    "channel_conv_read",
    "channel_conv_read_weight",
    "delta_gate",
    "delta_kernels",
    "delta_rule",
    "delta_rule_chunkwise",
    "delta_rule_recurrent",
    "delta_update",
    "fused_delta_update",
    "prepare_delta_kernels",
    "same_document_taps",
    "straight_through_clamp",
    "temporal_conv",
    "temporal_conv_read",
    "unit_direction",
    "unit_lower_triangular_inverse",
    "unit_lower_triangular_solve",
]
