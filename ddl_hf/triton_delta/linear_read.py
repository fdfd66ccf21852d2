"""The linear read of an expanded state, `ddl_hf::delta_read`: `x = X w` over the value channels, with a read vector
`[d_v]` or any per-hidden `[D, d_v]` weight (`DeltaRead`'s `state @ w`), forward and backward as one op."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import launch
from .launch import hidden_tile, token_block


@triton.jit
def _read_forward_kernel(
    X, W, OUT, N, D, V, sxn, sxd, sxv, swd, swv,
    ACC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """x[n, d] = sum_v X[n, d, v] w[d, v] (a read vector: swd = 0), summed over v as a tree."""
    rows, chans, rmask, vmask = token_block(tl.program_id(0), N, V, BLOCK_N, BLOCK_V)
    for d0 in range(0, D, BLOCK_D):
        cols, _, m2, m3 = hidden_tile(d0, D, rmask, vmask, BLOCK_D)
        x = tl.load(X + rows[:, None, None] * sxn + cols[None, :, None] * sxd + chans[None, None, :] * sxv, mask=m3,
                    other=0.0).to(ACC)  # fmt: skip
        w = tl.load(
            W + cols[:, None] * swd + chans[None, :] * swv, mask=(cols < D)[:, None] & vmask[None, :], other=0.0
        )
        out = tl.sum(x * w.to(ACC)[None, :, :], axis=2)
        tl.store(OUT + rows[:, None] * D + cols[None, :], out.to(OUT.dtype.element_ty), mask=m2)


@triton.jit
def _read_backward_kernel(
    X, W, G, DX, PARTIAL, N, D, V, sxn, sxd, sxv, swd, swv, sgn, sgd,
    ACC: tl.constexpr, PER_HIDDEN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    """dX[n, d, v] = g[n, d] w[d, v]; PARTIAL row per program: dw summed over its tokens, `[D, V]` (PER_HIDDEN) or
    also over d, `[V]` (a read vector)."""
    pid = tl.program_id(0)
    rows, chans, rmask, vmask = token_block(pid, N, V, BLOCK_N, BLOCK_V)
    d_w = tl.zeros([BLOCK_V], dtype=ACC)
    for d0 in range(0, D, BLOCK_D):
        cols, dmask, m2, m3 = hidden_tile(d0, D, rmask, vmask, BLOCK_D)
        g = tl.load(G + rows[:, None] * sgn + cols[None, :] * sgd, mask=m2, other=0.0).to(ACC)
        w = tl.load(W + cols[:, None] * swd + chans[None, :] * swv, mask=dmask[:, None] & vmask[None, :], other=0.0)
        offsets = rows[:, None, None] * (D * V) + cols[None, :, None] * V + chans[None, None, :]
        tl.store(DX + offsets, (g[:, :, None] * w.to(ACC)[None, :, :]).to(DX.dtype.element_ty), mask=m3)
        x = tl.load(X + rows[:, None, None] * sxn + cols[None, :, None] * sxd + chans[None, None, :] * sxv, mask=m3,
                    other=0.0).to(ACC)  # fmt: skip
        d_wd = tl.sum(g[:, :, None] * x, axis=0)  # [BLOCK_D, BLOCK_V]
        if PER_HIDDEN:
            tl.store(PARTIAL + pid.to(tl.int64) * D * V + cols[:, None] * V + chans[None, :], d_wd,
                     mask=dmask[:, None] & vmask[None, :])  # fmt: skip
        else:
            d_w += tl.sum(d_wd, axis=0)
    if not PER_HIDDEN:
        tl.store(PARTIAL + pid.to(tl.int64) * V + chans, d_w, mask=vmask)


def _read_layout(state: torch.Tensor, weight: torch.Tensor) -> tuple[int, int, int, torch.Tensor, torch.Tensor]:
    """N, D, V, the state `[N, D, V]` and the weight as `[D, V]` (a read vector `[V]` with stride 0 over D)."""
    tokens, dim, channels, x3 = launch.state_rows(state)
    w2 = weight.expand(dim, channels) if weight.dim() == 1 else weight
    return tokens, dim, channels, x3, w2


@launch.on_its_device
def _delta_read(state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x = X w over the value channels: state `[..., D, d_v]`, weight `[d_v]` (the read vector) or `[D, d_v]`;
    `[..., D]` in the state's dtype (under autocast too: the read is not rounded to half precision)."""
    tokens, dim, channels, x3, w2 = _read_layout(state, weight)
    _, tl_acc = launch.accumulator(state, weight)
    out = torch.empty(state.shape[:-1], dtype=state.dtype, device=state.device)  # [N, D] rows
    if tokens:
        _read_forward_kernel[(launch.programs(tokens),)](
            x3, w2, out, tokens, dim, channels, *x3.stride(), *w2.stride(),
            ACC=tl_acc, **launch.blocks(dim, channels),
        )  # fmt: skip
    return out


@launch.on_its_device
def _delta_read_backward(
    grad: torch.Tensor, state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(d_state, d_weight)`, d_weight in the accumulation dtype, shaped like `weight`."""
    tokens, dim, channels, x3, w2 = _read_layout(state, weight)
    acc, tl_acc = launch.accumulator(state, weight)
    per_hidden = weight.dim() == 2
    programs = launch.programs(tokens)
    d_state = torch.empty((tokens, dim, channels), dtype=state.dtype, device=state.device)
    partial = torch.empty((programs, dim * channels if per_hidden else channels), dtype=acc, device=state.device)
    if tokens:
        g2 = grad.reshape(tokens, dim)
        _read_backward_kernel[(programs,)](
            x3, w2, g2, d_state, partial, tokens, dim, channels, *x3.stride(), *w2.stride(), *g2.stride(),
            ACC=tl_acc, PER_HIDDEN=per_hidden, **launch.blocks(dim, channels),
        )  # fmt: skip
    return d_state.view(state.shape), partial.sum(0).view(weight.shape)


def _read_backward(ctx, grad, backward_op):
    state, weight = ctx.saved_tensors
    d_state, d_weight = backward_op(grad, state, weight)
    return d_state, d_weight.to(weight.dtype)


_READ = launch.define_op("ddl_hf::delta_read", _delta_read, _delta_read_backward, launch.save_inputs, _read_backward)
delta_read, delta_read_backward = _READ.op, _READ.backward_op  # the custom ops, as tracing sees them


@delta_read.register_fake
def _(state, weight):
    return state.new_empty(state.shape[:-1])


@delta_read_backward.register_fake
def _(grad, state, weight):
    acc, _ = launch.accumulator(state, weight)
    return state.new_empty(state.shape), weight.new_empty(weight.shape, dtype=acc)


def read(state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`DeltaRead`'s `state @ w` (a read vector `[d_v]`; also a per-hidden `[D, d_v]` weight) as one
    `ddl_hf::delta_read` call."""
    return launch.call(_READ, state, weight)
