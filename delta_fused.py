"""The fused Delta ops: the entry points the layers call, the readable math of `delta_ops.py` in fewer passes over
memory, with hand-derived backwards.

As fla keeps `naive.py` beside its kernels, each op's readable reference is in `delta_ops.py` and its fused form here
(the tests compare the two, values and gradients):

| op | entry point (its fused form) | readable reference (`delta_ops.py`) |
| --- | --- | --- |
| Delta residual write (eq. 2.5) | `fused_delta_update` (`_FusedDeltaUpdate`) | `delta_update(X, unit_direction(h))` |
| TC read | `temporal_conv_read` (`_TemporalConvRead`) | `temporal_conv(cat([past, x]), w).sum(-1)` |
| CC read | `channel_conv_read` (`channel_conv_read_weight`) | `channel_conv(X, W) @ r` |

Each entry point takes a model's kernel for its op (`delta_ops.delta_kernels`), which runs where its `applies` says
so; these tensor ops run everywhere else.

Self-contained Hub custom-code file: it imports only torch and its sibling `delta_ops.py`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .delta_ops import DeltaKernel, at_least_float32

# ----------------------------------------------------------------------------------------------------------------
# The Delta residual write (paper eq. 2.5), fused.
# ----------------------------------------------------------------------------------------------------------------


# The same math as `delta_ops.delta_update(state, unit_direction(h), ...)` in fewer passes over memory.
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


# ----------------------------------------------------------------------------------------------------------------
# The reads of the expanded state (TC, CC; docs/variants.md), each in one pass over the state.
# ----------------------------------------------------------------------------------------------------------------


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


__all__ = [
    "channel_conv_read",
    "channel_conv_read_weight",
    "fused_delta_update",
    "temporal_conv_read",
]
