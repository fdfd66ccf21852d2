"""The CC read, `ddl_hf::channel_read`: the channel convolution folded into the read vector inside the kernel
(`delta_fused.channel_conv_read`), forward and backward as one op."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import launch
from .launch import hidden_tile, token_block


@triton.jit
def _shifted_read(R, chans, j, V, K: tl.constexpr):
    """r[c + left - j] (0 outside [0, V)), left = (K - 1) // 2: the read weight that tap j of a channel convolution
    brings to input channel c (`delta_fused.channel_conv_read_weight`)."""
    index = chans + (K - 1) // 2 - j
    return tl.load(R + index, mask=(index >= 0) & (index < V), other=0.0)


@triton.jit
def _folded_weight(W, R, cols, dmask, chans, V, swd, swk, K: tl.constexpr, ACC: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr):  # fmt: skip
    """w[d, c] = sum_j W[d, j] r[c + left - j], a `[BLOCK_D, BLOCK_V]` tile."""
    folded = tl.zeros([BLOCK_D, BLOCK_V], dtype=ACC)
    for j in tl.static_range(K):
        w_j = tl.load(W + cols * swd + j * swk, mask=dmask, other=0.0).to(ACC)
        folded += w_j[:, None] * _shifted_read(R, chans, j, V, K).to(ACC)[None, :]
    return folded


@triton.jit
def _channel_forward_kernel(
    X, W, R, OUT, N, D, V, sxn, sxd, sxv, swd, swk,
    K: tl.constexpr, ACC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    rows, chans, rmask, vmask = token_block(tl.program_id(0), N, V, BLOCK_N, BLOCK_V)
    for d0 in range(0, D, BLOCK_D):
        cols, dmask, m2, m3 = hidden_tile(d0, D, rmask, vmask, BLOCK_D)
        folded = _folded_weight(W, R, cols, dmask, chans, V, swd, swk, K, ACC, BLOCK_D, BLOCK_V)
        x = tl.load(X + rows[:, None, None] * sxn + cols[None, :, None] * sxd + chans[None, None, :] * sxv, mask=m3,
                    other=0.0).to(ACC)  # fmt: skip
        out = tl.sum(x * folded[None, :, :], axis=2)
        tl.store(OUT + rows[:, None] * D + cols[None, :], out.to(OUT.dtype.element_ty), mask=m2)


@triton.jit
def _channel_backward_kernel(
    X, W, R, G, DX, PARTIAL, N, D, V, sxn, sxd, sxv, swd, swk, sgn, sgd,
    K: tl.constexpr, ACC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """dX = g w^T; PARTIAL row per program: [dW (D x K) | dr (V)] over its tokens, through the folded weight:
    dW[d, j] = sum_c dw[d, c] r[c + left - j] and dr[i] = sum_{d, j} dw[d, i - left + j] W[d, j], with
    dw[d, c] = sum_n g[n, d] X[n, d, c] (read at the shifted channels for dr)."""
    pid = tl.program_id(0)
    rows, chans, rmask, vmask = token_block(pid, N, V, BLOCK_N, BLOCK_V)
    row = PARTIAL + pid.to(tl.int64) * (D * K + V)
    d_r = tl.zeros([BLOCK_V], dtype=ACC)
    for d0 in range(0, D, BLOCK_D):
        cols, dmask, m2, m3 = hidden_tile(d0, D, rmask, vmask, BLOCK_D)
        folded = _folded_weight(W, R, cols, dmask, chans, V, swd, swk, K, ACC, BLOCK_D, BLOCK_V)
        g = tl.load(G + rows[:, None] * sgn + cols[None, :] * sgd, mask=m2, other=0.0).to(ACC)
        offsets = rows[:, None, None] * (D * V) + cols[None, :, None] * V + chans[None, None, :]
        tl.store(DX + offsets, (g[:, :, None] * folded[None, :, :]).to(DX.dtype.element_ty), mask=m3)
        x_rows = X + rows[:, None, None] * sxn + cols[None, :, None] * sxd
        d_folded = tl.sum(
            g[:, :, None] * tl.load(x_rows + chans[None, None, :] * sxv, mask=m3, other=0.0).to(ACC), axis=0
        )
        for j in tl.static_range(K):
            d_w_j = tl.sum(d_folded * _shifted_read(R, chans, j, V, K).to(ACC)[None, :], axis=1)  # [BLOCK_D]
            tl.store(row + cols * K + j, d_w_j, mask=dmask)
            source = chans - (K - 1) // 2 + j  # dr[i] takes dw[d, i - left + j]
            shifted = tl.load(x_rows + source[None, None, :] * sxv,
                              mask=m3 & ((source >= 0) & (source < V))[None, None, :], other=0.0).to(ACC)  # fmt: skip
            w_j = tl.load(W + cols * swd + j * swk, mask=dmask, other=0.0).to(ACC)
            d_r += tl.sum(tl.sum(g[:, :, None] * shifted, axis=0) * w_j[:, None], axis=0)
    tl.store(row + D * K + chans, d_r, mask=vmask)


@launch.on_its_device
def _channel_read(state: torch.Tensor, weight: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
    """`delta_fused.channel_conv_read`: state `[..., D, d_v]`, the channel convolution `[D, K]`, the read vector
    `[d_v]` -> `[..., D]` in the state's dtype."""
    tokens, dim, channels, x3 = launch.state_rows(state)
    _, tl_acc = launch.accumulator(state, weight)
    out = torch.empty(state.shape[:-1], dtype=state.dtype, device=state.device)  # [N, D] rows
    if tokens:
        _channel_forward_kernel[(launch.programs(tokens),)](
            x3, weight, read.contiguous(), out, tokens, dim, channels, *x3.stride(), *weight.stride(),
            K=weight.shape[-1], ACC=tl_acc, **launch.blocks(dim, channels),
        )  # fmt: skip
    return out


@launch.on_its_device
def _channel_read_backward(
    grad: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, read: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(d_state, d_weights)`: d_weights packs `[d weight (D x K) | d read (d_v)]` in the accumulation dtype."""
    tokens, dim, channels, x3 = launch.state_rows(state)
    acc, tl_acc = launch.accumulator(state, weight)
    programs = launch.programs(tokens)
    d_state = torch.empty((tokens, dim, channels), dtype=state.dtype, device=state.device)
    partial = torch.empty((programs, weight.numel() + channels), dtype=acc, device=state.device)
    if tokens:
        g2 = grad.reshape(tokens, dim)
        _channel_backward_kernel[(programs,)](
            x3, weight, read.contiguous(), g2, d_state, partial, tokens, dim, channels, *x3.stride(), *weight.stride(),
            *g2.stride(), K=weight.shape[-1], ACC=tl_acc, **launch.blocks(dim, channels),
        )  # fmt: skip
    return d_state.view(state.shape), partial.sum(0)


def _channel_backward(ctx, grad, backward_op):
    state, weight, read = ctx.saved_tensors
    d_state, d_weights = backward_op(grad, state, weight, read)
    d_weight, d_read = d_weights.to(weight.dtype).split([weight.numel(), read.numel()])
    return d_state, d_weight.view(weight.shape), d_read


_CHANNEL = launch.define_op(
    "ddl_hf::channel_read", _channel_read, _channel_read_backward, launch.save_inputs, _channel_backward
)
channel_read, channel_read_backward = _CHANNEL.op, _CHANNEL.backward_op  # the custom ops, as tracing sees them


@channel_read.register_fake
def _(state, weight, read):
    return state.new_empty(state.shape[:-1])


@channel_read_backward.register_fake
def _(grad, state, weight, read):
    acc, _ = launch.accumulator(state, weight)
    return state.new_empty(state.shape), weight.new_empty(weight.numel() + state.shape[-1], dtype=acc)


def channel_conv_read(state: torch.Tensor, weight: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
    """A CC read (`DeltaKernels.channel_read`) as one `ddl_hf::channel_read` call."""
    return launch.call(_CHANNEL, state, weight, read)
