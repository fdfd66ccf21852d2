"""A whole Delta residual as one op, forward and backward, in Triton (`delta_implementation="triton"`).

An eager Delta residual is some 20 small operations forward and 40 backward (the gate and value GEMVs, rho, the norm
of h, h^T X, the write, their casts): on a GPU each is a launch and a host round, and the first H200 run put the eager
training step at 1.45-2.26x GPT-2's. Here the gate, the value, k = h / |h|, k^T X and the write are one program per
block of tokens (`_forward_kernel`), and the backward is one more (`_backward_kernel`) plus one sum over the programs'
partial weight gradients. Half-precision inputs are loaded as they are and accumulated in float32 (float64 stays
float64, for the tests); nothing is saved but the inputs.

The readable reference is `DeltaResidual`'s tensor ops (`delta_layers.py`, with the math in `delta_ops.py`); the
tests compare the two under Triton's interpreter on the CPU (tests/ops/test_triton_delta.py). The op is a
`torch.library` custom op, `ddl_hf::delta_residual`, with its autograd and fake implementations registered, so eager
dispatch, `torch.compile` (fullgraph) and `torch.export` see one node. Triton is imported with this module; the model
files never import it (`delta_ops.residual_kernel` loads it for a model whose `delta_implementation` asks for it).

Per token, with g = w_g . c + b_g, beta = 2 sigmoid(g) clamp(rho, 0, 1), v = W_v c + b_v (linear), s sigmoid(W_v x +
b_v) (sigmoid) or a constant, r = 1 / sqrt(|h|^2 + eps^2) and `hx = h^T X`:

    s_j = r beta (v_j - r hx_j) (+ 1 additive; without erase no `- r hx_j`),    X' = X + h s^T

The backward is `delta_ops._fused_delta_backward`'s formulas, then the chain rule through the gate and value:
dg = dbeta 2 rho sigma (1 - sigma), drho = dbeta 2 sigma (rho's clamp passes its gradient straight through, as
`straight_through_clamp`), dc = dg w_g + W_v^T dv (linear value), dx = W_v^T (dv s sigma_v (1 - sigma_v)) (sigmoid).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .delta_ops import VALUE_CONSTANT, VALUE_SIGMOID, ResidualWeights

BLOCK_TOKENS = 16  # tokens a program takes: the backward's partial weight gradients are one row per program
BLOCK_HIDDEN = 128  # the hidden dim is walked in chunks of this many (a power of two)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _token_sums(
    X, XR, C, H, GW, VW, G,
    rows, rmask, chans, vmask, D,
    sxn, sxd, sxv, srn, src, scn, scd, shn, shd, sgn, sgd, sgv,
    ACC: tl.constexpr, VALUE: tl.constexpr, ERASE: tl.constexpr, GRAD: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """One walk over the hidden dim: per token, the gate's pre-activation g (bias not added), |h|^2, h^T X and the
    value's pre-activation W_v u (u = c, or the read x for the sigmoid value); with GRAD also h^T G."""
    g = tl.zeros([BLOCK_N], dtype=ACC)
    hh = tl.zeros([BLOCK_N], dtype=ACC)
    hx = tl.zeros([BLOCK_N, BLOCK_V], dtype=ACC)
    z = tl.zeros([BLOCK_N, BLOCK_V], dtype=ACC)
    hg = tl.zeros([BLOCK_N, BLOCK_V], dtype=ACC)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        dmask = cols < D
        m2 = rmask[:, None] & dmask[None, :]
        m3 = m2[:, :, None] & vmask[None, None, :]
        c = tl.load(C + rows[:, None] * scn + cols[None, :] * scd, mask=m2, other=0.0).to(ACC)
        h = tl.load(H + rows[:, None] * shn + cols[None, :] * shd, mask=m2, other=0.0).to(ACC)
        w = tl.load(GW + cols, mask=dmask, other=0.0).to(ACC)
        g += tl.sum(c * w[None, :], axis=1)
        hh += tl.sum(h * h, axis=1)
        if ERASE:
            x_ptr = X + rows[:, None, None] * sxn + cols[None, :, None] * sxd + chans[None, None, :] * sxv
            hx += tl.sum(h[:, :, None] * tl.load(x_ptr, mask=m3, other=0.0).to(ACC), axis=1)
        if GRAD:
            g_ptr = G + rows[:, None, None] * sgn + cols[None, :, None] * sgd + chans[None, None, :] * sgv
            hg += tl.sum(h[:, :, None] * tl.load(g_ptr, mask=m3, other=0.0).to(ACC), axis=1)
        if VALUE != 2:
            if VALUE == 1:  # noqa: SIM108 (a constexpr branch: Triton compiles only the taken side)
                u = tl.load(XR + rows[:, None] * srn + cols[None, :] * src, mask=m2, other=0.0).to(ACC)
            else:
                u = c
            wv = tl.load(VW + chans[None, :] * D + cols[:, None], mask=dmask[:, None] & vmask[None, :], other=0.0)
            z += tl.sum(u[:, :, None] * wv.to(ACC)[None, :, :], axis=1)
    return g, hh, hx, z, hg


@triton.jit
def _forward_kernel(
    X, XR, C, H, GW, GB, RHO, VW, VB, OUT, BETA,
    N, D, V, value_scale, value_constant, eps,
    sxn, sxd, sxv, srn, src, scn, scd, shn, shd,
    ACC: tl.constexpr, VALUE: tl.constexpr, ADDITIVE: tl.constexpr, ERASE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # offsets past 2**31 elements
    rmask = rows < N
    chans = tl.arange(0, BLOCK_V)
    vmask = chans < V
    g, hh, hx, z, _ = _token_sums(
        X, XR, C, H, GW, VW, X, rows, rmask, chans, vmask, D,
        sxn, sxd, sxv, srn, src, scn, scd, shn, shd, 0, 0, 0,
        ACC, VALUE, ERASE, False, BLOCK_N, BLOCK_D, BLOCK_V,
    )  # fmt: skip
    rho = tl.minimum(tl.maximum(tl.load(RHO).to(ACC), 0.0), 1.0)
    beta = 2.0 * _sigmoid(g + tl.load(GB).to(ACC)) * rho
    if VALUE == 2:
        v = tl.zeros([BLOCK_N, BLOCK_V], dtype=ACC) + value_constant
    else:
        z += tl.load(VB + chans, mask=vmask, other=0.0).to(ACC)[None, :]
        v = value_scale * _sigmoid(z) if VALUE == 1 else z
    r = 1.0 / tl.sqrt(hh + eps * eps)
    rb = (r * beta)[:, None]
    coefficient = v - r[:, None] * hx if ERASE else v
    s = rb * coefficient + 1.0 if ADDITIVE else rb * coefficient  # exactly 1 at beta = 0: X + h bit for bit
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        m2 = rmask[:, None] & (cols < D)[None, :]
        m3 = m2[:, :, None] & vmask[None, None, :]
        h = tl.load(H + rows[:, None] * shn + cols[None, :] * shd, mask=m2, other=0.0).to(ACC)
        x_ptr = X + rows[:, None, None] * sxn + cols[None, :, None] * sxd + chans[None, None, :] * sxv
        x = tl.load(x_ptr, mask=m3, other=0.0).to(ACC)
        out = x + h[:, :, None] * s[:, None, :]
        out_ptr = OUT + rows[:, None, None] * (D * V) + cols[None, :, None] * V + chans[None, None, :]
        tl.store(out_ptr, out.to(OUT.dtype.element_ty), mask=m3)
    tl.store(BETA + rows, beta.to(BETA.dtype.element_ty), mask=rmask)


@triton.jit
def _backward_kernel(
    X, XR, C, H, GW, GB, RHO, VW, VB, G, GBETA,
    DX, DXR, DC, DH, PARTIAL, WIDTH,
    N, D, V, value_scale, value_constant, eps,
    sxn, sxd, sxv, srn, src, scn, scd, shn, shd, sgn, sgd, sgv, sbn,
    ACC: tl.constexpr, VALUE: tl.constexpr, ADDITIVE: tl.constexpr, ERASE: tl.constexpr,
    HAS_GBETA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """PARTIAL row per program (WIDTH long): [dw_g (D) | db_g | drho | dW_v (V x D) | db_v (V)] (no dW_v, db_v for
    the constant value), summed over programs after."""
    pid = tl.program_id(0)
    rows = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # offsets past 2**31 elements
    rmask = rows < N
    chans = tl.arange(0, BLOCK_V)
    vmask = chans < V
    g, hh, hx, z, hg = _token_sums(
        X, XR, C, H, GW, VW, G, rows, rmask, chans, vmask, D,
        sxn, sxd, sxv, srn, src, scn, scd, shn, shd, sgn, sgd, sgv,
        ACC, VALUE, ERASE, True, BLOCK_N, BLOCK_D, BLOCK_V,
    )  # fmt: skip
    rho = tl.load(RHO).to(ACC)
    rho_open = tl.minimum(tl.maximum(rho, 0.0), 1.0)
    sigma = _sigmoid(g + tl.load(GB).to(ACC))
    beta = 2.0 * sigma * rho_open
    if VALUE == 2:
        v = tl.zeros([BLOCK_N, BLOCK_V], dtype=ACC) + value_constant
    else:
        z += tl.load(VB + chans, mask=vmask, other=0.0).to(ACC)[None, :]
        sigma_v = _sigmoid(z)
        v = value_scale * sigma_v if VALUE == 1 else z
    r = 1.0 / tl.sqrt(hh + eps * eps)
    r2 = r[:, None]
    residual = v - r2 * hx if ERASE else v  # v - k^T X
    b_kg = beta[:, None] * r2 * hg  # beta k^T G = dL/dv
    coef = beta[:, None] * residual
    scale = r2 * coef + 1.0 if ADDITIVE else r2 * coef
    h_dot_dk = tl.sum(hg * coef - hx * b_kg if ERASE else hg * coef, axis=1)
    cube = r * r * r * h_dot_dk
    d_beta = tl.sum(tl.where(vmask[None, :], r2 * hg * residual, 0.0), axis=1)
    if HAS_GBETA:
        d_beta += tl.load(GBETA + rows * sbn, mask=rmask, other=0.0).to(ACC)
    d_beta = tl.where(rmask, d_beta, 0.0)
    d_logit = d_beta * 2.0 * rho_open * sigma * (1.0 - sigma)  # dL/dg
    d_rho = tl.sum(d_beta * 2.0 * sigma, axis=0)  # straight through the clamp
    if VALUE == 1:  # noqa: SIM108 (a constexpr branch)
        d_z = b_kg * value_scale * sigma_v * (1.0 - sigma_v)
    else:
        d_z = b_kg
    d_z = tl.where(rmask[:, None] & vmask[None, :], d_z, 0.0)
    erase_coef = -r2 * b_kg  # the erase term's weight on X in dh and on h in dX
    row = PARTIAL + pid.to(tl.int64) * WIDTH
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        dmask = cols < D
        m2 = rmask[:, None] & dmask[None, :]
        m3 = m2[:, :, None] & vmask[None, None, :]
        h = tl.load(H + rows[:, None] * shn + cols[None, :] * shd, mask=m2, other=0.0).to(ACC)
        c = tl.load(C + rows[:, None] * scn + cols[None, :] * scd, mask=m2, other=0.0).to(ACC)
        grad = tl.load(
            G + rows[:, None, None] * sgn + cols[None, :, None] * sgd + chans[None, None, :] * sgv, mask=m3, other=0.0
        ).to(ACC)
        d_h = tl.sum(grad * scale[:, None, :], axis=2) - h * cube[:, None]
        offsets = rows[:, None, None] * (D * V) + cols[None, :, None] * V + chans[None, None, :]
        if ERASE:
            x_ptr = X + rows[:, None, None] * sxn + cols[None, :, None] * sxd + chans[None, None, :] * sxv
            x = tl.load(x_ptr, mask=m3, other=0.0).to(ACC)
            d_h += tl.sum(x * erase_coef[:, None, :], axis=2)
            d_x = grad + h[:, :, None] * erase_coef[:, None, :]
        else:
            d_x = grad
        tl.store(DX + offsets, d_x.to(DX.dtype.element_ty), mask=m3)
        tl.store(DH + rows[:, None] * D + cols[None, :], d_h.to(DH.dtype.element_ty), mask=m2)
        w = tl.load(GW + cols, mask=dmask, other=0.0).to(ACC)
        d_c = d_logit[:, None] * w[None, :]
        tl.store(row + cols, tl.sum(d_logit[:, None] * c, axis=0), mask=dmask)
        if VALUE != 2:
            wmask = dmask[:, None] & vmask[None, :]
            wv = tl.load(VW + chans[None, :] * D + cols[:, None], mask=wmask, other=0.0).to(ACC)  # [BLOCK_D, V]
            d_u = tl.sum(d_z[:, None, :] * wv[None, :, :], axis=2)
            if VALUE == 1:
                u = tl.load(XR + rows[:, None] * srn + cols[None, :] * src, mask=m2, other=0.0).to(ACC)
                tl.store(DXR + rows[:, None] * D + cols[None, :], d_u.to(DXR.dtype.element_ty), mask=m2)
            else:
                u = c
                d_c += d_u
            d_wv = tl.sum(d_z[:, None, :] * u[:, :, None], axis=0)  # [BLOCK_D, V]
            tl.store(row + D + 2 + chans[None, :] * D + cols[:, None], d_wv, mask=wmask)
        tl.store(DC + rows[:, None] * D + cols[None, :], d_c.to(DC.dtype.element_ty), mask=m2)
    tl.store(row + D, tl.sum(d_logit, axis=0))
    tl.store(row + D + 1, d_rho)
    if VALUE != 2:
        tl.store(row + D + 2 + V * D + chans, tl.sum(d_z, axis=0), mask=vmask)


@triton.jit
def _read_forward_kernel(
    X, W, OUT, N, D, V, sxn, sxd, sxv, swd, swv,
    ACC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """x[n, d] = sum_v X[n, d, v] w[d, v] (a read vector: swd = 0), summed over v as a tree."""
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # offsets past 2**31 elements
    chans = tl.arange(0, BLOCK_V)
    rmask, vmask = rows < N, chans < V
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        m2 = rmask[:, None] & (cols < D)[None, :]
        m3 = m2[:, :, None] & vmask[None, None, :]
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
    rows = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # offsets past 2**31 elements
    chans = tl.arange(0, BLOCK_V)
    rmask, vmask = rows < N, chans < V
    d_w = tl.zeros([BLOCK_V], dtype=ACC)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        dmask = cols < D
        m2 = rmask[:, None] & dmask[None, :]
        m3 = m2[:, :, None] & vmask[None, None, :]
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


# ----------------------------------------------------------------------------------------------------------------
# Each op twice over the same functions: a `torch.library` custom op (what torch.compile, export and fake tensors see:
# one node) and, in eager mode, a plain autograd.Function. The custom op's Python dispatch costs ~0.3 ms of host time
# a residual on a 2-core CPU (forward and backward, kernels stubbed; ddl_lab/benchmarks/bench_launches.py), more than
# the tensor ops it replaces.
# ----------------------------------------------------------------------------------------------------------------


def _on_its_device(function: Callable) -> Callable:
    """Run `function` with its first argument's CUDA device current: Triton launches on the current device and stream,
    not on the tensors' (a model spread over GPUs, a process that never called `torch.cuda.set_device`)."""

    @functools.wraps(function)
    def guarded(first: torch.Tensor, *args, **kwargs):  # every op's first argument is a tensor
        if not first.is_cuda:
            return function(first, *args, **kwargs)
        with torch.cuda.device(first.device):
            return function(first, *args, **kwargs)

    return guarded


class _Spec(NamedTuple):
    """An op's forward (the custom op's function), its autograd `setup_context` and `backward`, and its eager
    autograd node (an `_Eager` named after the op: profiles count it under the op's name)."""

    forward: Callable
    setup_context: Callable
    backward: Callable
    function: type


class _Eager(torch.autograd.Function):
    """`spec`'s forward and backward as one autograd node, outside torch.compile (real tensors only: tracing takes
    the custom op)."""

    @staticmethod
    def forward(ctx, spec: _Spec, *args):
        out = spec.forward(*args)
        spec.setup_context(ctx, args, out)
        ctx.spec = spec
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        return None, *ctx.spec.backward(ctx, *grads)


def _specs(
    name: str, op, forward: Callable, setup_context: Callable, backward: Callable, backward_op, backward_function
) -> _Spec:
    """Register `op`'s autograd (its backward through the backward custom op, which tracing sees) and return the
    eager spec (the same backward through the backward op's function, in a node named `name`, the op's)."""
    op.register_autograd(functools.partial(backward, backward_op=backward_op), setup_context=setup_context)
    eager = type(name, (_Eager,), {"__module__": __name__})
    return _Spec(forward, setup_context, functools.partial(backward, backward_op=backward_function), eager)


def _call(op, spec: _Spec, *args):
    return op(*args) if torch.compiler.is_compiling() else spec.function.apply(spec, *args)


# ----------------------------------------------------------------------------------------------------------------
# The op: `ddl_hf::delta_residual`, its backward, autograd and fake implementations.
# ----------------------------------------------------------------------------------------------------------------


def _accumulator(*tensors: torch.Tensor) -> tuple[torch.dtype, tl.dtype]:
    """float64 where an input is float64 (gradcheck, the tests' tight reference), float32 otherwise."""
    if any(t.dtype == torch.float64 for t in tensors):
        return torch.float64, tl.float64
    return torch.float32, tl.float32


def _layout(state: torch.Tensor, h: torch.Tensor) -> tuple[int, int, int, torch.Tensor]:
    """Tokens N, hidden D, value channels V, and the state as `[N, D, V]` (a view where the strides allow: an expanded
    X_0 keeps its stride 0 over V)."""
    dim = h.shape[-1]
    channels = 1 if state.dim() == h.dim() else state.shape[-1]
    tokens = h.numel() // dim if dim else 0
    return tokens, dim, channels, state.reshape(tokens, dim, channels)


def _rows(t: torch.Tensor | None, tokens: int, dim: int) -> torch.Tensor | None:
    return None if t is None else t.reshape(tokens, dim)


# Launch sizes in plain Python: `triton.cdiv` and `triton.next_power_of_2` are constexpr functions, whose host-side
# calls cost microseconds each, on every op.


def _programs(tokens: int) -> int:
    return -(-tokens // BLOCK_TOKENS)


def _block_d(dim: int) -> int:
    return min(BLOCK_HIDDEN, 1 << (dim - 1).bit_length())


def _block_v(channels: int) -> int:
    return max(2, 1 << (channels - 1).bit_length())


def _residual_rows(read, c, h, tokens: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The read, c and h as `[N, D]` rows (views where the strides allow; c stands in for an absent read)."""
    c2, h2 = _rows(c, tokens, dim), _rows(h, tokens, dim)
    return (c2 if read is None else _rows(read, tokens, dim)), c2, h2


def _residual_weights(gate_weight, gate_bias, beta_open, value_weight, value_bias) -> tuple[torch.Tensor, ...]:
    """The weights as the kernels read them, contiguous (no-op for an `nn.Linear`'s); the gate's stand in for an
    absent value (the constant value reads none)."""
    gate_weight, gate_bias, beta_open = gate_weight.contiguous(), gate_bias.contiguous(), beta_open.contiguous()
    value_weight = gate_weight if value_weight is None else value_weight.contiguous()
    value_bias = gate_bias if value_bias is None else value_bias.contiguous()
    return gate_weight, gate_bias, beta_open, value_weight, value_bias


def _out_dtype(state: torch.Tensor, h: torch.Tensor, additive: bool) -> torch.dtype:
    """What the tensor ops return (`delta_ops._fused_delta_forward`): the state's dtype, promoted with h's in additive
    mode (X + h)."""
    return torch.promote_types(state.dtype, h.dtype) if additive else state.dtype


@_on_its_device
def _delta_residual(
    state: torch.Tensor,
    read: torch.Tensor | None,
    c: torch.Tensor,
    h: torch.Tensor,
    gate_weight: torch.Tensor,
    gate_bias: torch.Tensor,
    beta_open: torch.Tensor,
    value_weight: torch.Tensor | None,
    value_bias: torch.Tensor | None,
    value_mode: int,
    value_scale: float,
    value_constant: float,
    eps: float,
    additive: bool,
    erase: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A Delta residual after its sublayer: `(X', beta)`, X' shaped like the state (`[..., D]` or `[..., D, d_v]`),
    beta `[...]`. `read` is the read x (the sigmoid value's input; None otherwise)."""
    tokens, dim, channels, x3 = _layout(state, h)
    acc, tl_acc = _accumulator(state, h, c, gate_weight)
    out = torch.empty(state.shape, dtype=_out_dtype(state, h, additive), device=state.device)  # [N, D, V] rows
    beta = torch.empty(h.shape[:-1], dtype=acc, device=state.device)
    if tokens:
        r2, c2, h2 = _residual_rows(read, c, h, tokens, dim)
        gate_weight, gate_bias, beta_open, vw, vb = _residual_weights(
            gate_weight, gate_bias, beta_open, value_weight, value_bias
        )
        _forward_kernel[(_programs(tokens),)](
            x3, r2, c2, h2, gate_weight, gate_bias, beta_open, vw, vb, out, beta,
            tokens, dim, channels, value_scale, value_constant, eps,
            *x3.stride(), *r2.stride(), *c2.stride(), *h2.stride(),
            ACC=tl_acc, VALUE=value_mode, ADDITIVE=additive, ERASE=erase,
            BLOCK_N=BLOCK_TOKENS, BLOCK_D=_block_d(dim), BLOCK_V=_block_v(channels),
        )  # fmt: skip
    return out, beta


delta_residual = torch.library.custom_op("ddl_hf::delta_residual", _delta_residual, mutates_args=())


@delta_residual.register_fake
def _(state, read, c, h, gate_weight, gate_bias, beta_open, value_weight, value_bias, value_mode, value_scale,
      value_constant, eps, additive, erase):  # fmt: skip
    acc, _ = _accumulator(state, h, c, gate_weight)
    out = state.new_empty(state.shape, dtype=_out_dtype(state, h, additive))
    return out, h.new_empty(h.shape[:-1], dtype=acc)


@_on_its_device
def _delta_residual_backward(
    grad_state: torch.Tensor,
    grad_beta: torch.Tensor | None,
    state: torch.Tensor | None,
    read: torch.Tensor | None,
    c: torch.Tensor,
    h: torch.Tensor,
    gate_weight: torch.Tensor,
    gate_bias: torch.Tensor,
    beta_open: torch.Tensor,
    value_weight: torch.Tensor | None,
    value_bias: torch.Tensor | None,
    value_mode: int,
    value_scale: float,
    value_constant: float,
    eps: float,
    additive: bool,
    erase: bool,
    state_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(d_state, d_read, d_c, d_h, d_weights)`: d_read is empty unless the value reads x (sigmoid); d_weights packs
    `[d gate_weight (D) | d gate_bias | d beta_open | d value_weight (d_v x D) | d value_bias (d_v)]` in the
    accumulation dtype. `state` is None without erase (the write-only backward never reads X)."""
    tokens, dim, channels, g3 = _layout(grad_state, h)
    acc, tl_acc = _accumulator(grad_state, h, c, gate_weight)
    programs = _programs(tokens)
    width = _weights_width(dim, channels, value_mode)
    d_state = torch.empty((tokens, dim, channels), dtype=state_dtype, device=h.device)
    d_c, d_h = c.new_empty(c.shape), h.new_empty(h.shape)  # row-major, as the kernel writes them
    d_read = read.new_empty(read.shape) if value_mode == VALUE_SIGMOID else h.new_empty(0)
    partial = torch.empty((programs, width), dtype=acc, device=h.device)  # every program writes its whole row
    if tokens:
        x3 = g3 if state is None else state.reshape(tokens, dim, channels)
        gb = g3 if grad_beta is None else grad_beta.reshape(tokens)  # a stride 0 where autograd expanded a scalar
        r2, c2, h2 = _residual_rows(read, c, h, tokens, dim)
        gate_weight, gate_bias, beta_open, vw, vb = _residual_weights(
            gate_weight, gate_bias, beta_open, value_weight, value_bias
        )
        _backward_kernel[(programs,)](
            x3, r2, c2, h2, gate_weight, gate_bias, beta_open, vw, vb, g3, gb,
            d_state, d_read if read is not None else d_c, d_c, d_h, partial, width,
            tokens, dim, channels, value_scale, value_constant, eps,
            *x3.stride(), *r2.stride(), *c2.stride(), *h2.stride(), *g3.stride(), gb.stride(0),
            ACC=tl_acc, VALUE=value_mode, ADDITIVE=additive, ERASE=erase, HAS_GBETA=grad_beta is not None,
            BLOCK_N=BLOCK_TOKENS, BLOCK_D=_block_d(dim), BLOCK_V=_block_v(channels),
        )  # fmt: skip
    return d_state.view(grad_state.shape), d_read, d_c, d_h, partial.sum(0)


delta_residual_backward = torch.library.custom_op(
    "ddl_hf::delta_residual_backward", _delta_residual_backward, mutates_args=()
)


@delta_residual_backward.register_fake
def _(grad_state, grad_beta, state, read, c, h, gate_weight, gate_bias, beta_open, value_weight, value_bias,
      value_mode, value_scale, value_constant, eps, additive, erase, state_dtype):  # fmt: skip
    acc, _ = _accumulator(grad_state, h, c, gate_weight)
    channels = 1 if grad_state.dim() == h.dim() else grad_state.shape[-1]
    dim = h.shape[-1]
    d_read = read.new_empty(read.shape) if value_mode == VALUE_SIGMOID else h.new_empty(0)
    width = _weights_width(dim, channels, value_mode)
    return (
        grad_state.new_empty(grad_state.shape, dtype=state_dtype),
        d_read,
        c.new_empty(c.shape),
        h.new_empty(h.shape),
        h.new_empty(width, dtype=acc),
    )


def _weights_width(dim: int, channels: int, value_mode: int) -> int:
    """The packed weight gradients' length: the gate's `dim + 1`, rho's 1, the value's `channels * (dim + 1)`."""
    return dim + 2 + (0 if value_mode == VALUE_CONSTANT else channels * (dim + 1))


def _setup_context(ctx, inputs, output) -> None:
    state, read, c, h, gate_weight, gate_bias, beta_open, value_weight, value_bias, *settings = inputs
    ctx.set_materialize_grads(False)  # beta's gradient is None unless beta is used: no tensor of zeros for it
    ctx.settings = settings
    ctx.state_dtype = state.dtype
    ctx.out_shape, ctx.out_dtype = output[0].shape, output[0].dtype
    erase = settings[-1]
    ctx.save_for_backward(state if erase else None, read, c, h, gate_weight, gate_bias, beta_open, value_weight,
                          value_bias)  # fmt: skip


def _backward(ctx, grad_state, grad_beta, backward_op):
    state, read, c, h, gate_weight, gate_bias, beta_open, value_weight, value_bias = ctx.saved_tensors
    if grad_state is None:  # only beta was used (grads are not materialised): the state's gradient is zero
        grad_state = h.new_zeros(ctx.out_shape, dtype=ctx.out_dtype)
    d_state, d_read, d_c, d_h, d_weights = backward_op(
        grad_state, grad_beta, state, read, c, h, gate_weight, gate_bias, beta_open, value_weight, value_bias,
        *ctx.settings, ctx.state_dtype,
    )  # fmt: skip
    dim = h.shape[-1]
    d_weights = d_weights.to(gate_weight.dtype)
    d_gate_weight, d_gate_bias, d_open, d_value = d_weights.split([dim, 1, 1, d_weights.numel() - dim - 2])
    d_value_weight = d_value_bias = None
    if value_weight is not None:
        d_value_weight, d_value_bias = d_value.split([value_weight.numel(), value_bias.numel()])
        d_value_weight = d_value_weight.view(value_weight.shape)
    return (
        d_state,
        d_read if read is not None else None,
        d_c,
        d_h,
        d_gate_weight.view(gate_weight.shape),
        d_gate_bias,
        d_open,
        d_value_weight,
        d_value_bias,
        None,
        None,
        None,
        None,
        None,
        None,
    )


_RESIDUAL = _specs(
    "ddl_hf::delta_residual",
    delta_residual,
    _delta_residual,
    _setup_context,
    _backward,
    delta_residual_backward,
    _delta_residual_backward,
)


def residual(
    state: torch.Tensor, x: torch.Tensor, c: torch.Tensor, h: torch.Tensor, weights: ResidualWeights
) -> tuple[torch.Tensor, torch.Tensor]:
    """`DeltaResidual`'s `(X', beta)` as one `ddl_hf::delta_residual` call (training and inference alike)."""
    mode, read = weights.value_kind(x)
    return _call(
        delta_residual, _RESIDUAL,
        state, read, c, h, weights.gate_weight, weights.gate_bias, weights.beta_open, weights.value_weight,
        weights.value_bias, mode, 1.0 if weights.value_scale is None else weights.value_scale,
        weights.value_constant, weights.eps, weights.additive, weights.erase,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# The read of an expanded state: `ddl_hf::delta_read` (a read vector, or any per-hidden `[D, d_v]` weight).
# ----------------------------------------------------------------------------------------------------------------


def _read_layout(state: torch.Tensor, weight: torch.Tensor) -> tuple[int, int, int, torch.Tensor, torch.Tensor]:
    """N, D, V, the state `[N, D, V]` and the weight as `[D, V]` (a read vector `[V]` with stride 0 over D)."""
    dim, channels = state.shape[-2], state.shape[-1]
    tokens = state.numel() // (dim * channels) if dim * channels else 0
    w2 = weight.expand(dim, channels) if weight.dim() == 1 else weight
    return tokens, dim, channels, state.reshape(tokens, dim, channels), w2


@_on_its_device
def _delta_read(state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x = X w over the value channels: state `[..., D, d_v]`, weight `[d_v]` (the read vector) or `[D, d_v]`;
    `[..., D]` in the state's dtype (under autocast too: the read is not rounded to half precision)."""
    tokens, dim, channels, x3, w2 = _read_layout(state, weight)
    _, tl_acc = _accumulator(state, weight)
    out = torch.empty(state.shape[:-1], dtype=state.dtype, device=state.device)  # [N, D] rows
    if tokens:
        _read_forward_kernel[(_programs(tokens),)](
            x3, w2, out, tokens, dim, channels, *x3.stride(), *w2.stride(),
            ACC=tl_acc, BLOCK_N=BLOCK_TOKENS, BLOCK_D=_block_d(dim),
            BLOCK_V=_block_v(channels),
        )  # fmt: skip
    return out


delta_read = torch.library.custom_op("ddl_hf::delta_read", _delta_read, mutates_args=())


@delta_read.register_fake
def _(state, weight):
    return state.new_empty(state.shape[:-1])


@_on_its_device
def _delta_read_backward(
    grad: torch.Tensor, state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(d_state, d_weight)`, d_weight in the accumulation dtype, shaped like `weight`."""
    tokens, dim, channels, x3, w2 = _read_layout(state, weight)
    acc, tl_acc = _accumulator(state, weight)
    per_hidden = weight.dim() == 2
    programs = _programs(tokens)
    d_state = torch.empty((tokens, dim, channels), dtype=state.dtype, device=state.device)
    partial = torch.empty((programs, dim * channels if per_hidden else channels), dtype=acc, device=state.device)
    if tokens:
        g2 = grad.reshape(tokens, dim)
        _read_backward_kernel[(programs,)](
            x3, w2, g2, d_state, partial, tokens, dim, channels, *x3.stride(), *w2.stride(), *g2.stride(),
            ACC=tl_acc, PER_HIDDEN=per_hidden, BLOCK_N=BLOCK_TOKENS,
            BLOCK_D=_block_d(dim), BLOCK_V=_block_v(channels),
        )  # fmt: skip
    return d_state.view(state.shape), partial.sum(0).view(weight.shape)


delta_read_backward = torch.library.custom_op("ddl_hf::delta_read_backward", _delta_read_backward, mutates_args=())


@delta_read_backward.register_fake
def _(grad, state, weight):
    acc, _ = _accumulator(state, weight)
    return state.new_empty(state.shape), weight.new_empty(weight.shape, dtype=acc)


def _read_setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _read_backward(ctx, grad, backward_op):
    state, weight = ctx.saved_tensors
    d_state, d_weight = backward_op(grad, state, weight)
    return d_state, d_weight.to(weight.dtype)


_READ = _specs(
    "ddl_hf::delta_read",
    delta_read,
    _delta_read,
    _read_setup_context,
    _read_backward,
    delta_read_backward,
    _delta_read_backward,
)


def read(state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`DeltaRead`'s `state @ w` (a read vector `[d_v]`; also a per-hidden `[D, d_v]` weight) as one
    `ddl_hf::delta_read` call."""
    return _call(delta_read, _READ, state, weight)


# ----------------------------------------------------------------------------------------------------------------
# The TC read: `ddl_hf::temporal_read`, a causal depthwise convolution over tokens summed over the value channels.
# ----------------------------------------------------------------------------------------------------------------


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
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # offsets past 2**31 elements
    rmask = rows < N
    b, t = rows // T, rows % T
    chans = tl.arange(0, BLOCK_V)
    vmask = chans < V
    r = tl.load(R + chans, mask=vmask, other=0.0).to(ACC) if HAS_READ else tl.full([BLOCK_V], 1.0, ACC)
    length, shift = (K - 1 + T, 0) if HISTORY else (K - 1, -T)  # the window's rows; history row h is its row h + shift
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        dmask = cols < D
        m3 = (rmask[:, None] & dmask[None, :])[:, :, None] & vmask[None, None, :]
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
    rows = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # offsets past 2**31 elements
    rmask = rows < N
    b, t = rows // T, rows % T
    chans = tl.arange(0, BLOCK_V)
    vmask = chans < V
    r = tl.load(R + chans, mask=vmask, other=0.0).to(ACC) if HAS_READ else tl.full([BLOCK_V], 1.0, ACC)
    d_r = tl.zeros([BLOCK_V], dtype=ACC)
    row = PARTIAL + pid.to(tl.int64) * (D * V * K + (V if HAS_READ else 0))
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        dmask = cols < D
        m2 = rmask[:, None] & dmask[None, :]
        m3 = m2[:, :, None] & vmask[None, None, :]
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


@_on_its_device
def _temporal_read(
    x: torch.Tensor,
    weight: torch.Tensor,
    read: torch.Tensor | None,
    past: torch.Tensor | None,
    same_document: torch.Tensor | None,
    history: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`delta_ops.temporal_conv_read` with the kernels `weight * read[:, None]`: x `[B, T, D, d_v]`, weight
    `[D, d_v, K]`, read `[d_v]` or None, past `[B, K - 1, D, d_v]` or None, same_document `[B, T, K]` bool or None ->
    `(y [B, T, D], window)` in x's dtype; the window is `[past or zeros, x]` `[B, K - 1 + T, D, d_v]` (`history`),
    else its last K - 1 rows: the next step's past."""
    r, tokens, steps, dim, channels, p, sd, strides = _temporal_args(x, weight, read, past, same_document)
    _, tl_acc = _accumulator(x, weight)
    out = torch.empty(x.shape[:-1], dtype=x.dtype, device=x.device)
    window = _window_like(x, weight, history)
    if tokens:
        _temporal_forward_kernel[(_programs(tokens),)](
            x, weight, r, p, sd, out, window, tokens, steps, dim, channels, *strides,
            K=weight.shape[-1], HAS_READ=read is not None, HAS_PAST=past is not None,
            HAS_DOC=same_document is not None, HISTORY=history, ACC=tl_acc,
            BLOCK_N=BLOCK_TOKENS, BLOCK_D=_block_d(dim), BLOCK_V=_block_v(channels),
        )  # fmt: skip
    return out, window


def _window_like(x: torch.Tensor, weight: torch.Tensor, history: bool) -> torch.Tensor:
    """The next window's storage, in x's dtype: `[B, K - 1 + T, D, d_v]` (`history`) or `[B, K - 1, D, d_v]`."""
    return x.new_empty(x.shape[0], weight.shape[-1] - 1 + (x.shape[1] if history else 0), *x.shape[2:])


temporal_read = torch.library.custom_op("ddl_hf::temporal_read", _temporal_read, mutates_args=())


@temporal_read.register_fake
def _(x, weight, read, past, same_document, history=False):
    return x.new_empty(x.shape[:-1]), _window_like(x, weight, history)


@_on_its_device
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
    acc, tl_acc = _accumulator(x, weight)
    programs = _programs(tokens)
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
            BLOCK_N=BLOCK_TOKENS, BLOCK_D=_block_d(dim), BLOCK_V=_block_v(channels),
        )  # fmt: skip
    return d_x, partial.sum(0)


temporal_read_backward = torch.library.custom_op(
    "ddl_hf::temporal_read_backward", _temporal_read_backward, mutates_args=()
)


@temporal_read_backward.register_fake
def _(grad, x, weight, read, past, same_document):
    acc, _ = _accumulator(x, weight)
    reads = 0 if read is None else x.shape[-1]
    return x.new_empty(x.shape), weight.new_empty(weight.numel() + reads, dtype=acc)


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


_TEMPORAL = _specs(
    "ddl_hf::temporal_read",
    temporal_read,
    _temporal_read,
    _temporal_setup_context,
    _temporal_backward,
    temporal_read_backward,
    _temporal_read_backward,
)


def temporal_conv_read(
    x: torch.Tensor,
    weight: torch.Tensor,
    read: torch.Tensor | None,
    past: torch.Tensor | None,
    same_document: torch.Tensor | None,
    history: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A TC read (`DeltaKernels.temporal_read`) as one `ddl_hf::temporal_read` call: `(y, next window)`."""
    return _call(temporal_read, _TEMPORAL, x, weight, read, past, same_document, history)


# ----------------------------------------------------------------------------------------------------------------
# The CC read: `ddl_hf::channel_read`, the channel convolution folded into the read vector inside the kernel.
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _shifted_read(R, chans, j, V, K: tl.constexpr):
    """r[c + left - j] (0 outside [0, V)), left = (K - 1) // 2: the read weight that tap j of a channel convolution
    brings to input channel c (`delta_ops.channel_conv_read_weight`)."""
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
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # offsets past 2**31 elements
    chans = tl.arange(0, BLOCK_V)
    rmask, vmask = rows < N, chans < V
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        dmask = cols < D
        m2 = rmask[:, None] & dmask[None, :]
        m3 = m2[:, :, None] & vmask[None, None, :]
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
    rows = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # offsets past 2**31 elements
    chans = tl.arange(0, BLOCK_V)
    rmask, vmask = rows < N, chans < V
    row = PARTIAL + pid.to(tl.int64) * (D * K + V)
    d_r = tl.zeros([BLOCK_V], dtype=ACC)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        dmask = cols < D
        m2 = rmask[:, None] & dmask[None, :]
        m3 = m2[:, :, None] & vmask[None, None, :]
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


@_on_its_device
def _channel_read(state: torch.Tensor, weight: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
    """`delta_ops.channel_conv_read`: state `[..., D, d_v]`, the channel convolution `[D, K]`, the read vector
    `[d_v]` -> `[..., D]` in the state's dtype."""
    dim, channels = state.shape[-2], state.shape[-1]
    tokens = state.numel() // (dim * channels) if dim * channels else 0
    x3 = state.reshape(tokens, dim, channels)
    _, tl_acc = _accumulator(state, weight)
    out = torch.empty(state.shape[:-1], dtype=state.dtype, device=state.device)  # [N, D] rows
    if tokens:
        _channel_forward_kernel[(_programs(tokens),)](
            x3, weight, read.contiguous(), out, tokens, dim, channels, *x3.stride(), *weight.stride(),
            K=weight.shape[-1], ACC=tl_acc, BLOCK_N=BLOCK_TOKENS,
            BLOCK_D=_block_d(dim), BLOCK_V=_block_v(channels),
        )  # fmt: skip
    return out


channel_read = torch.library.custom_op("ddl_hf::channel_read", _channel_read, mutates_args=())


@channel_read.register_fake
def _(state, weight, read):
    return state.new_empty(state.shape[:-1])


@_on_its_device
def _channel_read_backward(
    grad: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, read: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(d_state, d_weights)`: d_weights packs `[d weight (D x K) | d read (d_v)]` in the accumulation dtype."""
    dim, channels = state.shape[-2], state.shape[-1]
    tokens = state.numel() // (dim * channels) if dim * channels else 0
    x3 = state.reshape(tokens, dim, channels)
    acc, tl_acc = _accumulator(state, weight)
    programs = _programs(tokens)
    d_state = torch.empty((tokens, dim, channels), dtype=state.dtype, device=state.device)
    partial = torch.empty((programs, weight.numel() + channels), dtype=acc, device=state.device)
    if tokens:
        g2 = grad.reshape(tokens, dim)
        _channel_backward_kernel[(programs,)](
            x3, weight, read.contiguous(), g2, d_state, partial, tokens, dim, channels, *x3.stride(), *weight.stride(),
            *g2.stride(), K=weight.shape[-1], ACC=tl_acc, BLOCK_N=BLOCK_TOKENS,
            BLOCK_D=_block_d(dim), BLOCK_V=_block_v(channels),
        )  # fmt: skip
    return d_state.view(state.shape), partial.sum(0)


channel_read_backward = torch.library.custom_op(
    "ddl_hf::channel_read_backward", _channel_read_backward, mutates_args=()
)


@channel_read_backward.register_fake
def _(grad, state, weight, read):
    acc, _ = _accumulator(state, weight)
    return state.new_empty(state.shape), weight.new_empty(weight.numel() + state.shape[-1], dtype=acc)


def _channel_setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _channel_backward(ctx, grad, backward_op):
    state, weight, read = ctx.saved_tensors
    d_state, d_weights = backward_op(grad, state, weight, read)
    d_weight, d_read = d_weights.to(weight.dtype).split([weight.numel(), read.numel()])
    return d_state, d_weight.view(weight.shape), d_read


_CHANNEL = _specs(
    "ddl_hf::channel_read",
    channel_read,
    _channel_read,
    _channel_setup_context,
    _channel_backward,
    channel_read_backward,
    _channel_read_backward,
)


def channel_conv_read(state: torch.Tensor, weight: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
    """A CC read (`DeltaKernels.channel_read`) as one `ddl_hf::channel_read` call."""
    return _call(channel_read, _CHANNEL, state, weight, read)
