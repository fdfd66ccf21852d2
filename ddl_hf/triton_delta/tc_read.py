"""The TC read, `ddl_hf::temporal_read`: a causal depthwise convolution over tokens summed over the value channels
(`delta_fused.temporal_conv_read` with the kernels `weight * read[:, None]`), forward and backward as one op, which
also writes the next step's window of inputs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import launch
from .launch import hidden_tile, token_block


@triton.jit
def _tap(X, P, b, src, offsets_x, offsets_p, m3, sxb, sxt, spb, spt, K: tl.constexpr, HAS_PAST: tl.constexpr):
    """X[b, src] for src >= 0, else the cached window's entry before the sequence, past[b, K - 1 + src] (0 without
    one); `offsets_*` address the hidden and value channels."""
    inside = src >= 0
    value = tl.load(X + b[:, None, None] * sxb + src[:, None, None] * sxt + offsets_x, mask=m3 & inside[:, None, None],
                    other=0.0)  # fmt: skip
    if HAS_PAST:
        row = K - 1 + src
        value += tl.load(P + b[:, None, None] * spb + row[:, None, None] * spt + offsets_p,
                         mask=m3 & (~inside & (row >= 0))[:, None, None], other=0.0)  # fmt: skip
    return value


@triton.jit
def _temporal_forward_kernel(
    X, W, R, P, SD, OUT, WIN, N, T, D, V,
    sxb, sxt, sxd, sxv, swd, swv, swk, spb, spt, spd, spv, ssb, sst, ssk,
    K: tl.constexpr, HAS_READ: tl.constexpr, HAS_PAST: tl.constexpr, HAS_DOC: tl.constexpr, HISTORY: tl.constexpr,
    ACC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """y[b, t, d] = sum_j sum_v w[d, v, j] r[v] X[b, t - (K - 1 - j), d, v] (x keep[b, t, j] in packed rows; r the
    read vector, 1 without), and the next window WIN[b]: [past (or zeros), X] `[K - 1 + T, D, V]` (HISTORY), else its
    last K - 1 rows (the rows of X by their own programs, the past's by each sequence's first token's)."""
    rows, chans, rmask, vmask = token_block(tl.program_id(0), N, V, BLOCK_N, BLOCK_V)
    b, t = rows // T, rows % T
    r = tl.load(R + chans, mask=vmask, other=0.0).to(ACC) if HAS_READ else tl.full([BLOCK_V], 1.0, ACC)
    length, shift = (K - 1 + T, 0) if HISTORY else (K - 1, -T)  # the window's rows; history row h is its row h + shift
    for d0 in range(0, D, BLOCK_D):
        cols, dmask, _, m3 = hidden_tile(d0, D, rmask, vmask, BLOCK_D)
        offsets_x = cols[None, :, None] * sxd + chans[None, None, :] * sxv
        offsets_p = cols[None, :, None] * spd + chans[None, None, :] * spv
        offsets_w = cols[None, :, None] * V + chans[None, None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
        for j in tl.static_range(K):
            tap = _tap(X, P, b, t - (K - 1 - j), offsets_x, offsets_p, m3, sxb, sxt, spb, spt, K, HAS_PAST)
            w = tl.load(W + cols[:, None] * swd + chans[None, :] * swv + j * swk,
                        mask=dmask[:, None] & vmask[None, :], other=0.0).to(ACC) * r[None, :]  # fmt: skip
            term = tl.sum(tap.to(ACC) * w[None, :, :], axis=2)
            if HAS_DOC:
                keep = tl.load(SD + b * ssb + t * sst + j * ssk, mask=rmask, other=0).to(ACC)
                term = term * keep[:, None]
            acc += term
            if j == K - 1:  # the tap of the token itself, X[b, t]: history row K - 1 + t
                slot = K - 1 + t + shift
                tl.store(WIN + (b * length + slot)[:, None, None] * (D * V) + offsets_w, tap,
                         mask=m3 & (slot >= 0)[:, None, None])  # fmt: skip
        tl.store(OUT + rows[:, None] * D + cols[None, :], acc.to(OUT.dtype.element_ty),
                 mask=rmask[:, None] & dmask[None, :])  # fmt: skip
        for i in tl.static_range(K - 1):  # history row i: the past's row i (zeros without one)
            first = m3 & ((t == 0) & ((t + i >= T) | HISTORY))[:, None, None]  # i >= T, per row
            if HAS_PAST:
                kept = tl.load(P + b[:, None, None] * spb + i * spt + offsets_p, mask=first, other=0.0)
            else:
                kept = tl.zeros([BLOCK_N, BLOCK_D, BLOCK_V], dtype=ACC)
            tl.store(WIN + (b * length + i + shift)[:, None, None] * (D * V) + offsets_w, kept, mask=first)


@triton.jit
def _temporal_backward_kernel(
    X, W, R, P, SD, G, DX, PARTIAL, N, T, D, V,
    sxb, sxt, sxd, sxv, swd, swv, swk, spb, spt, spd, spv, ssb, sst, ssk, sgn, sgd,
    K: tl.constexpr, HAS_READ: tl.constexpr, HAS_PAST: tl.constexpr, HAS_DOC: tl.constexpr, ACC: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """dX[b, s, d, v] = sum_j g[b, s + K - 1 - j, d] w[d, v, j] r[v] (keep) over the taps that stay inside the
    sequence; PARTIAL row per program: [dw (D x V x K) | dr (V, with a read vector)] summed over its output rows."""
    pid = tl.program_id(0)
    rows, chans, rmask, vmask = token_block(pid, N, V, BLOCK_N, BLOCK_V)
    b, t = rows // T, rows % T
    r = tl.load(R + chans, mask=vmask, other=0.0).to(ACC) if HAS_READ else tl.full([BLOCK_V], 1.0, ACC)
    d_r = tl.zeros([BLOCK_V], dtype=ACC)
    row = PARTIAL + pid.to(tl.int64) * (D * V * K + (V if HAS_READ else 0))
    for d0 in range(0, D, BLOCK_D):
        cols, dmask, m2, m3 = hidden_tile(d0, D, rmask, vmask, BLOCK_D)
        wmask = dmask[:, None] & vmask[None, :]
        offsets_x = cols[None, :, None] * sxd + chans[None, None, :] * sxv
        offsets_p = cols[None, :, None] * spd + chans[None, None, :] * spv
        g = tl.load(G + rows[:, None] * sgn + cols[None, :] * sgd, mask=m2, other=0.0).to(ACC)
        d_x = tl.zeros([BLOCK_N, BLOCK_D, BLOCK_V], dtype=ACC)
        for j in tl.static_range(K):
            lag = K - 1 - j
            w_raw = tl.load(W + cols[:, None] * swd + chans[None, :] * swv + j * swk, mask=wmask, other=0.0).to(ACC)
            w = w_raw * r[None, :]
            # dX: this program's rows as sources s, read by output t = s + lag
            out_t = t + lag
            reach = rmask & (out_t < T)
            g_ptr = G + (b * T + out_t)[:, None] * sgn + cols[None, :] * sgd
            g_out = tl.load(g_ptr, mask=reach[:, None] & dmask[None, :], other=0.0).to(ACC)
            if HAS_DOC:
                keep = tl.load(SD + b * ssb + out_t * sst + j * ssk, mask=reach, other=0).to(ACC)
                g_out = g_out * keep[:, None]
            d_x += g_out[:, :, None] * w[None, :, :]
            # dw: this program's rows as outputs t, reading source t - lag
            tap = _tap(X, P, b, t - lag, offsets_x, offsets_p, m3, sxb, sxt, spb, spt, K, HAS_PAST).to(ACC)
            g_keep = g
            if HAS_DOC:
                keep_t = tl.load(SD + b * ssb + t * sst + j * ssk, mask=rmask, other=0).to(ACC)
                g_keep = g * keep_t[:, None]
            d_w = tl.sum(g_keep[:, :, None] * tap, axis=0)  # [BLOCK_D, BLOCK_V]: d(w r)
            tl.store(row + cols[:, None] * (V * K) + chans[None, :] * K + j, d_w * r[None, :], mask=wmask)
            if HAS_READ:
                d_r += tl.sum(d_w * w_raw, axis=0)
        offsets = rows[:, None, None] * (D * V) + cols[None, :, None] * V + chans[None, None, :]
        tl.store(DX + offsets, d_x.to(DX.dtype.element_ty), mask=m3)
    if HAS_READ:
        tl.store(row + D * V * K + chans, d_r, mask=vmask)


def _temporal_args(x, weight, read, past, same_document):
    """The kernels' common arguments: the read vector (contiguous) or weight (unused), x `[B, T, D, V]`, weight
    `[D, V, K]`, past `[B, K - 1, D, V]` or x (unused), same_document `[B, T, K]` as int8 or x (unused), strides."""
    r = weight if read is None else read.contiguous()
    batch, steps, dim, channels = x.shape
    p = x if past is None else past
    sd = x if same_document is None else same_document.to(torch.int8)
    strides = (*x.stride(), *weight.stride(), *p.stride(), *(sd.stride() if same_document is not None else (0, 0, 0)))
    return r, batch * steps, steps, dim, channels, p, sd, strides


@launch.on_its_device
def _temporal_read(
    x: torch.Tensor, weight: torch.Tensor, read: torch.Tensor | None,
    past: torch.Tensor | None, same_document: torch.Tensor | None, history: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`delta_fused.temporal_conv_read` with the kernels `weight * read[:, None]`: x `[B, T, D, d_v]`, weight
    `[D, d_v, K]`, read `[d_v]` or None, past `[B, K - 1, D, d_v]` or None, same_document `[B, T, K]` bool or None ->
    `(y [B, T, D], window)` in x's dtype; the window is `[past or zeros, x]` `[B, K - 1 + T, D, d_v]` (`history`),
    else its last K - 1 rows: the next step's past."""
    r, tokens, steps, dim, channels, p, sd, strides = _temporal_args(x, weight, read, past, same_document)
    _, tl_acc = launch.accumulator(x, weight)
    out = torch.empty(x.shape[:-1], dtype=x.dtype, device=x.device)
    window = _window_like(x, weight, history)
    if tokens:
        _temporal_forward_kernel[(launch.programs(tokens),)](
            x, weight, r, p, sd, out, window, tokens, steps, dim, channels, *strides,
            K=weight.shape[-1], HAS_READ=read is not None, HAS_PAST=past is not None,
            HAS_DOC=same_document is not None, HISTORY=history, ACC=tl_acc,
            **launch.blocks(dim, channels),
        )  # fmt: skip
    return out, window


def _window_like(x: torch.Tensor, weight: torch.Tensor, history: bool) -> torch.Tensor:
    """The next window's storage, in x's dtype: `[B, K - 1 + T, D, d_v]` (`history`) or `[B, K - 1, D, d_v]`."""
    return x.new_empty(x.shape[0], weight.shape[-1] - 1 + (x.shape[1] if history else 0), *x.shape[2:])


@launch.on_its_device
def _temporal_read_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    read: torch.Tensor | None,
    past: torch.Tensor | None,
    same_document: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(d_x, d_weights)`: d_weights packs `[d weight (D x d_v x K) | d read (d_v; none without)]` in the
    accumulation dtype."""
    r, tokens, steps, dim, channels, p, sd, strides = _temporal_args(x, weight, read, past, same_document)
    acc, tl_acc = launch.accumulator(x, weight)
    programs = launch.programs(tokens)
    d_x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    reads = 0 if read is None else channels
    partial = torch.empty((programs, weight.numel() + reads), dtype=acc, device=x.device)
    if tokens:
        g2 = grad.reshape(tokens, dim)
        _temporal_backward_kernel[(programs,)](
            x, weight, r, p, sd, g2, d_x, partial, tokens, steps, dim, channels,
            *strides, *g2.stride(),
            K=weight.shape[-1], HAS_READ=read is not None, HAS_PAST=past is not None,
            HAS_DOC=same_document is not None, ACC=tl_acc,
            **launch.blocks(dim, channels),
        )  # fmt: skip
    return d_x, partial.sum(0)


def _temporal_setup_context(ctx, inputs, output) -> None:
    ctx.mark_non_differentiable(output[1])  # the window: inputs kept for the next step, as `x.detach()` would be
    ctx.set_materialize_grads(False)  # no tensor of zeros for the window's gradient (a launch per read)
    ctx.save_for_backward(*inputs[:5])


def _temporal_backward(ctx, grad, _grad_window, backward_op):
    if grad is None:  # the read was not used
        return None, None, None, None, None, None
    x, weight, read, past, same_document = ctx.saved_tensors
    d_x, d_weights = backward_op(grad, x, weight, read, past, same_document)
    d_weight, d_read = d_weights.to(weight.dtype).split([weight.numel(), d_weights.numel() - weight.numel()])
    return d_x, d_weight.view(weight.shape), None if read is None else d_read, None, None, None


_TEMPORAL = launch.define_op(
    "ddl_hf::temporal_read", _temporal_read, _temporal_read_backward, _temporal_setup_context, _temporal_backward
)
temporal_read, temporal_read_backward = _TEMPORAL.op, _TEMPORAL.backward_op  # the custom ops, as tracing sees them


@temporal_read.register_fake
def _(x, weight, read, past, same_document, history=False):
    return x.new_empty(x.shape[:-1]), _window_like(x, weight, history)


@temporal_read_backward.register_fake
def _(grad, x, weight, read, past, same_document):
    acc, _ = launch.accumulator(x, weight)
    reads = 0 if read is None else x.shape[-1]
    return x.new_empty(x.shape), weight.new_empty(weight.numel() + reads, dtype=acc)


def temporal_conv_read(
    x: torch.Tensor,
    weight: torch.Tensor,
    read: torch.Tensor | None,
    past: torch.Tensor | None,
    same_document: torch.Tensor | None,
    history: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A TC read (`DeltaKernels.temporal_read`) as one `ddl_hf::temporal_read` call: `(y, next window)`."""
    return launch.call(_TEMPORAL, x, weight, read, past, same_document, history)
