"""Deep Delta Learning kernels: the Delta residual update over depth, and the delta rule over time (DeltaNet).

The one place where the Delta math lives. Plain tensor functions, no modules and no parameters, so that every
model family and every test can share them:

* `delta_update`: the readable reference of the Delta residual write (paper eq. 2.5), and `fused_delta_update`,
  the same math in fewer passes over memory with a hand-derived backward (what the models run).
* `delta_rule_recurrent` / `delta_rule_chunkwise`: DeltaNet's delta rule over the sequence, one token at a time
  (the reference and the decoding step) and chunkwise-parallel (training and prefill).

Self-contained Hub custom-code file: it imports only torch. `modeling_delta_gpt.py` imports it relatively, and
transformers' `save_pretrained` copies it next to the weights with the other two code files.
"""

from __future__ import annotations

import torch
from torch import nn

# ----------------------------------------------------------------------------------------------------------------
# The Delta math: the one place where the update rule lives.
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


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the Delta math: float32 for half precision; float32 and float64 stay (float64 for gradcheck)."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """`x` in `compute_dtype`: half precision upcast to float32, float32 and float64 unchanged."""
    dtype = compute_dtype(x.dtype)
    return x if x.dtype == dtype else x.to(dtype)


def unit_direction(h: torch.Tensor, eps: float) -> torch.Tensor:
    """k = h / sqrt(|h|^2 + eps^2) in float32: unit norm for any non-negligible h, and 0 (no-op) for h = 0."""
    h = at_least_float32(h)
    return h * torch.rsqrt(h.square().sum(-1, keepdim=True) + eps * eps)


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
        return (h * x).sum(-1, keepdim=True)  # what vecdot does on CPU, in fewer dispatches
    return (h.unsqueeze(-2) @ x).squeeze(-2)  # a batched matvec; cheaper than einsum's set-up when decoding


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
    backward)."""
    hf = at_least_float32(h)
    r = torch.rsqrt((hf * hf).sum(-1, keepdim=True) + eps * eps)
    if erase:
        hx = _dot(hf, at_least_float32(state))
        scale = (r * beta.unsqueeze(-1)) * torch.addcmul(value, r, hx, value=-1.0)  # r beta (v - k^T X)
    else:
        hx = None
        scale = (r * beta.unsqueeze(-1)) * value  # r beta v
    if additive:
        scale = scale + 1.0  # exactly 1 when beta == 0, so X' == X + h bit for bit
    out = torch.addcmul(state, *_outer(h, scale, state))
    out_dtype = torch.promote_types(state.dtype, h.dtype) if additive and h.dtype != state.dtype else state.dtype
    return (out if out.dtype == out_dtype else out.to(out_dtype)), r, hx


class _FusedDeltaUpdate(torch.autograd.Function):
    """One autograd node per Delta block with a hand-derived backward (see the formulas above)."""

    @staticmethod
    def forward(ctx, state, h, beta, value, eps, additive, erase):
        out, r, hx = _fused_delta_forward(state, h, beta, value, eps, additive, erase)
        # Write-only never reads X after the forward pass: it is not saved.
        ctx.save_for_backward(state if erase else None, h, beta, value, r, hx)
        ctx.additive, ctx.erase, ctx.state_dtype = additive, erase, state.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        state, h, beta, value, r, hx = ctx.saved_tensors
        erase = ctx.erase
        g, hf = at_least_float32(grad_out), at_least_float32(h)
        b = beta.unsqueeze(-1)
        hg = _dot(hf, g)  # h^T g, so k^T g = r hg
        residual = value - r * hx if erase else value  # v - k^T X
        b_kg = b * r * hg  # beta k^T g = dL/dv
        grad_state = grad_h = None
        if ctx.needs_input_grad[0]:
            grad_state = torch.addcmul(g, *_outer(hf, -r * b_kg, g)) if erase else g
            grad_state = grad_state.to(ctx.state_dtype)
        if ctx.needs_input_grad[1]:
            coef = b * residual
            scale = r * coef + 1.0 if ctx.additive else r * coef
            h_dot_dk = (hg * coef - hx * b_kg if erase else hg * coef).sum(-1, keepdim=True)
            grad_h = _mix(g, scale) - hf * (r * r * r * h_dot_dk)
            if erase:
                grad_h = grad_h + _mix(at_least_float32(state), -r * b_kg)
            grad_h = grad_h.to(h.dtype)
        grad_beta = (r * hg * residual).sum(-1) if ctx.needs_input_grad[2] else None
        grad_value = b_kg if ctx.needs_input_grad[3] else None
        return grad_state, grad_h, grad_beta, grad_value, None, None, None


def fused_delta_update(
    state: torch.Tensor,
    branch_output: torch.Tensor,
    beta: torch.Tensor,
    value: torch.Tensor,
    eps: float,
    additive: bool,
    erase: bool = True,
) -> torch.Tensor:
    """`delta_update(state, unit_direction(h, eps), beta, value, h if additive else None, erase)`, fused.

    Under autograd it is one node that saves only X, h and per-token scalars; without autograd it is a plain
    function (no node, fewest ops: what generation runs).
    """
    tensors = (state, branch_output, beta, value)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _FusedDeltaUpdate.apply(*tensors, eps, additive, erase)
    return _fused_delta_forward(*tensors, eps, additive, erase)[0]


# ----------------------------------------------------------------------------------------------------------------
# The reads of the expanded state used by the paper's variants (TC, CC, EC; docs/variants.md): short depthwise
# convolutions, over tokens or over the value channels. Plain functions like the rest of this file.
# ----------------------------------------------------------------------------------------------------------------


def temporal_conv(history: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Causal depthwise convolution over tokens: `y_t = sum_j weight[..., j] * x_{t - K + 1 + j}`.

    Args:
        history: `[B, K - 1 + T, *channels]`: the K - 1 inputs before the T new ones (zeros at the start of a
            sequence, the cached ones when decoding), then the T new inputs.
        weight: `[*channels, K]`, one kernel per channel; the last tap multiplies the current token.

    Returns `[B, T, *channels]`. K shifted multiply-adds (K is small) rather than conv1d: no transposes of the state.
    """
    size = weight.shape[-1]
    steps = history.shape[1] - size + 1
    weight = weight.to(history.dtype)
    out = history[:, :steps] * weight[..., 0]
    for j in range(1, size):
        out = out + history[:, j : j + steps] * weight[..., j]
    return out


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
    """The `[D, d_v]` weight w with `channel_conv(x, weight) @ read == (x * w).sum(-1)`: CC then the read vector in
    one pass over the state (the model's fast path; `channel_conv` is its readable reference).

    `w[d, c] = sum_j weight[d, j] * read[c + p - j]` (zero outside [0, d_v)): each input channel collects the read
    weights of the outputs its taps reach.
    """
    size, channels = weight.shape[-1], read.shape[-1]
    left = (size - 1) // 2
    padded = nn.functional.pad(read, (size - 1 - left, left))  # padded[i] = read[i - (size - 1 - left)]
    # shifted[j, c] = read[c + left - j] = padded[c + size - 1 - j]
    shifted = torch.stack([padded[size - 1 - j : size - 1 - j + channels] for j in range(size)])
    return weight @ shifted.to(weight.dtype)


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule one token at a time: the reference form, and the decoding step (constant work per token).

    Args:
        q, k: `[B, H, T, d_k]`. DeltaNet uses unit-norm k (then every step is a contraction for beta in [0, 2]);
            the rule itself is computed exactly for any k.
        v: `[B, H, T, d_v]`.
        beta: `[B, H, T]`, in (0, 1), or (0, 2) for the negative-eigenvalue variant.
        initial_state: `[B, H, d_v, d_k]`, or None for zeros.
        erase: False drops the `- beta k k^T` term, i.e. purely additive linear attention `S_t = S_{t-1} + beta v k^T`.

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
    for q_t, k_t, v_t, beta_t in steps:  # q_t, k_t: [B, H, d_k, 1]; v_t: [B, H, d_v, 1]; beta_t: [B, H]
        write = v_t - state @ k_t if erase else v_t  # v_t - S_{t-1} k_t: replace what the memory returns for k_t
        state = state + beta_t[..., None, None] * write @ k_t.transpose(-1, -2)
        outputs.append(state @ q_t)
    if not outputs:
        return v.new_zeros(batch, heads, 0, d_v).to(out_dtype), state
    return torch.cat(outputs, dim=-1).transpose(-1, -2).to(out_dtype), state


def delta_rule_chunkwise(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    *,
    erase: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule, chunkwise-parallel: the same inputs and outputs as `delta_rule_recurrent`, T/chunk_size steps.

    Within a chunk that starts from state S_0, the chunk's rank-1 updates have a WY/UT form. With
    `A = strict_lower(diag(beta) K K^T)`, the pseudo-values `U = (I + A)^{-1} diag(beta) V` and
    `W = (I + A)^{-1} diag(beta) K` come from one unit-lower-triangular solve (for all chunks at once), and

        U' = U - W S_0^T,    O = Q S_0^T + causal(Q K^T) U',    S_C = S_0 + U'^T K,

    so only the cheap state hand-over between chunks is sequential. T is zero-padded to a multiple of the chunk
    size; padded steps have beta = 0 and k = 0 and leave the state unchanged. `erase=False`: A = 0 and W = 0.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    out_dtype, dtype = v.dtype, compute_dtype(v.dtype)  # the state accumulates over T
    batch, heads, seq_len, d_k = k.shape
    d_v = v.shape[-1]
    q, k, v, beta = q.to(dtype), k.to(dtype), v.to(dtype), beta.to(dtype)
    state = q.new_zeros(batch, heads, d_v, d_k) if initial_state is None else initial_state.to(dtype)
    if seq_len == 0:
        return v.new_zeros(batch, heads, 0, d_v).to(out_dtype), state

    chunk = min(chunk_size, seq_len)
    padding = -seq_len % chunk
    if padding:
        q, k, v = (nn.functional.pad(x, (0, 0, 0, padding)) for x in (q, k, v))
        beta = nn.functional.pad(beta, (0, padding))
    n_chunks = (seq_len + padding) // chunk
    q, k, v = (x.reshape(batch, heads, n_chunks, chunk, x.shape[-1]) for x in (q, k, v))
    beta = beta.reshape(batch, heads, n_chunks, chunk, 1)

    # Within chunks, all chunks at once: the UT transform and the causal scores.
    k_beta, v_beta = k * beta, v * beta
    if erase:
        a_strict = (k_beta @ k.transpose(-1, -2)).tril(-1)  # A[r, i] = beta_r k_r . k_i for i < r
        # unitriangular=True reads only the strict lower part, so this solves (I + A) [U W] = diag(beta) [V K].
        u, w = torch.linalg.solve_triangular(
            a_strict, torch.cat([v_beta, k_beta], dim=-1), upper=False, unitriangular=True
        ).split([d_v, d_k], dim=-1)
    else:
        u, w = v_beta, None
    scores = (q @ k.transpose(-1, -2)).tril()  # diagonal included: o_r reads the state after token r's write

    # Across chunks: carry the state (unbind: see delta_rule_recurrent).
    outputs = []
    w_chunks = w.unbind(2) if w is not None else [None] * n_chunks
    for q_n, k_n, u_n, w_n, scores_n in zip(q.unbind(2), k.unbind(2), u.unbind(2), w_chunks, scores.unbind(2)):
        if w_n is not None:
            u_n = u_n - w_n @ state.transpose(-1, -2)
        outputs.append(q_n @ state.transpose(-1, -2) + scores_n @ u_n)
        state = state + u_n.transpose(-1, -2) @ k_n
    o = torch.stack(outputs, dim=2).reshape(batch, heads, n_chunks * chunk, d_v)[:, :, :seq_len]
    return o.to(out_dtype), state


__all__ = [
    "channel_conv",
    "channel_conv_read_weight",
    "delta_rule_chunkwise",
    "delta_rule_recurrent",
    "delta_update",
    "fused_delta_update",
    "straight_through_clamp",
    "temporal_conv",
    "unit_direction",
]
