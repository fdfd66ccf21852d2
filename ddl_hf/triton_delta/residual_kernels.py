"""The Triton kernels of a whole Delta residual, forward and backward (the op: `residual_op.py`).

An eager Delta residual is some 20 small operations forward and 40 backward (the gate and value GEMVs, rho, the norm
of h, h^T X, the write, their casts): on a GPU each is a launch and a host round, and the first H200 run put the eager
training step at 1.45-2.26x GPT-2's. Here the gate, the value, k = h / |h|, k^T X and the write are one program per
block of tokens (`_forward_kernel`), and the backward is one more (`_backward_kernel`) plus one sum over the programs'
partial weight gradients. Half-precision inputs are loaded as they are and accumulated in float32 (float64 stays
float64, for the tests); nothing is saved but the inputs.

Per token, with g = w_g . c + b_g, beta = 2 sigmoid(g) clamp(rho, 0, 1), v = W_v c + b_v (linear), s sigmoid(W_v x +
b_v) (sigmoid) or a constant, r = 1 / sqrt(|h|^2 + eps^2) and `hx = h^T X`:

    s_j = r beta (v_j - r hx_j) (+ 1 additive; without erase no `- r hx_j`),    X' = X + h s^T

The backward is `delta_fused._fused_delta_backward`'s formulas, then the chain rule through the gate and value:
dg = dbeta 2 rho sigma (1 - sigma), drho = dbeta 2 sigma (rho's clamp passes its gradient straight through, as
`straight_through_clamp`), dc = dg w_g + W_v^T dv (linear value), dx = W_v^T (dv s sigma_v (1 - sigma_v)) (sigmoid).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .launch import hidden_tile, token_block


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
        cols, dmask, m2, m3 = hidden_tile(d0, D, rmask, vmask, BLOCK_D)
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
    rows, chans, rmask, vmask = token_block(tl.program_id(0), N, V, BLOCK_N, BLOCK_V)
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
        cols, _, m2, m3 = hidden_tile(d0, D, rmask, vmask, BLOCK_D)
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
    rows, chans, rmask, vmask = token_block(pid, N, V, BLOCK_N, BLOCK_V)
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
        cols, dmask, m2, m3 = hidden_tile(d0, D, rmask, vmask, BLOCK_D)
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
