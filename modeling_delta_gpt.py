"""PyTorch DeltaGPT: GPT-2 whose every attention and MLP residual is a Deep Delta Learning block.

Deep Delta Learning (Zhang, Liu, Wang, Gu; arXiv 2601.00417) replaces the identity shortcut `X + F(X)` with the
Delta Operator `A = I - beta k k^T` and a synchronous rank-1 write: `X' = A X + beta k v^T`.
GPT-2's own attention and MLP (`GPT2Attention`, `GPT2MLP`) are the sublayers, so every attention backend,
the `Conv1D` weights and GPT-2's parameter names carry over; only the Delta parameters are new.

Self-contained Hub custom-code file: it imports only torch, transformers and `configuration_delta_gpt`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import BCEWithLogitsLoss, CrossEntropyLoss, MSELoss
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache, LinearAttentionLayer
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPastAndCrossAttentions,
    CausalLMOutputWithCrossAttentions,
    SequenceClassifierOutputWithPast,
    TokenClassifierOutput,
)
from transformers.modeling_utils import PreTrainedModel, slice_logits_to_keep
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP, GPT2Attention
from transformers.pytorch_utils import Conv1D
from transformers.utils import can_return_tuple, logging
from transformers.utils.generic import maybe_autocast, merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .configuration_delta_gpt import DeltaGPTConfig

logger = logging.get_logger(__name__)


# ----------------------------------------------------------------------------------------------------------------
# The Delta math: the one place where the update rule lives.
# ----------------------------------------------------------------------------------------------------------------


def delta_update(
    state: torch.Tensor,
    k: torch.Tensor,
    beta: torch.Tensor,
    value: torch.Tensor,
    branch_output: torch.Tensor | None = None,
) -> torch.Tensor:
    """Delta residual write (paper eq. 2.5): `X + beta k (v^T - k^T X)`, plus `F(x) 1^T` in additive mode.

    Args:
        state: residual state X, `[..., D]` (d_v = 1) or `[..., D, d_v]`.
        k: unit-norm direction, `[..., D]`, float32.
        beta: gate, `[...]`, float32.
        value: written value v, `[..., d_v]`, float32.
        branch_output: the sublayer output h `[..., D]` for the additive mode, None for the paper mode.

    `k^T X` and the rank-1 coefficient are formed in k's dtype (float32 or wider); the result has the state's
    dtype. When beta is exactly 0 the Delta term is exactly 0, so the additive mode returns `X + h` bit for bit.
    """
    expanded = state.dim() == k.dim() + 1
    x = state if expanded else state.unsqueeze(-1)  # [..., D, d_v]
    k_dot_x = torch.einsum("...d,...dv->...v", k, _at_least_float32(x))  # erase: the state's coordinate along k
    coefficient = beta.unsqueeze(-1) * (value - k_dot_x)  # [..., d_v]: write minus erase, gated
    delta = (k.unsqueeze(-1) * coefficient.unsqueeze(-2)).to(state.dtype)  # rank-1: k (beta (v - k^T X))^T
    new_state = x if branch_output is None else x + branch_output.unsqueeze(-1)
    new_state = new_state + delta
    return new_state if expanded else new_state.squeeze(-1)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the Delta math: float32 for half precision; float32 and float64 stay (float64 for gradcheck)."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """`x` in `_compute_dtype`: half precision upcast to float32, float32 and float64 unchanged."""
    dtype = _compute_dtype(x.dtype)
    return x if x.dtype == dtype else x.to(dtype)


def unit_direction(h: torch.Tensor, eps: float) -> torch.Tensor:
    """k = h / sqrt(|h|^2 + eps^2) in float32: unit norm for any non-negligible h, and 0 (no-op) for h = 0."""
    h = _at_least_float32(h)
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
    state: torch.Tensor, h: torch.Tensor, beta: torch.Tensor, value: torch.Tensor, eps: float, additive: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The new state, r `[..., 1]` and h^T X `[..., d_v]` (the last two are saved for the backward)."""
    hf = _at_least_float32(h)
    r = torch.rsqrt((hf * hf).sum(-1, keepdim=True) + eps * eps)
    hx = _dot(hf, _at_least_float32(state))
    scale = (r * beta.unsqueeze(-1)) * torch.addcmul(value, r, hx, value=-1.0)  # r beta (v - k^T X)
    if additive:
        scale = scale + 1.0  # exactly 1 when beta == 0, so X' == X + h bit for bit
    out = torch.addcmul(state, *_outer(h, scale, state))
    out_dtype = torch.promote_types(state.dtype, h.dtype) if additive and h.dtype != state.dtype else state.dtype
    return (out if out.dtype == out_dtype else out.to(out_dtype)), r, hx


class _FusedDeltaUpdate(torch.autograd.Function):
    """One autograd node per Delta block with a hand-derived backward (see the formulas above)."""

    @staticmethod
    def forward(ctx, state, h, beta, value, eps, additive):
        out, r, hx = _fused_delta_forward(state, h, beta, value, eps, additive)
        ctx.save_for_backward(state, h, beta, value, r, hx)
        ctx.additive = additive
        return out

    @staticmethod
    def backward(ctx, grad_out):
        state, h, beta, value, r, hx = ctx.saved_tensors
        g, hf = _at_least_float32(grad_out), _at_least_float32(h)
        b = beta.unsqueeze(-1)
        hg = _dot(hf, g)  # h^T g, so k^T g = r hg
        residual = value - r * hx  # v - k^T X
        b_kg = b * r * hg  # beta k^T g = dL/dv
        grad_state = grad_h = None
        if ctx.needs_input_grad[0]:
            grad_state = torch.addcmul(g, *_outer(hf, -r * b_kg, g)).to(state.dtype)
        if ctx.needs_input_grad[1]:
            coef = b * residual
            scale = r * coef + 1.0 if ctx.additive else r * coef
            h_dot_dk = (hg * coef - hx * b_kg).sum(-1, keepdim=True)
            x = _at_least_float32(state)
            grad_h = _mix(g, scale) + _mix(x, -r * b_kg) - hf * (r * r * r * h_dot_dk)
            grad_h = grad_h.to(h.dtype)
        grad_beta = (r * hg * residual).sum(-1) if ctx.needs_input_grad[2] else None
        grad_value = b_kg if ctx.needs_input_grad[3] else None
        return grad_state, grad_h, grad_beta, grad_value, None, None


def fused_delta_update(
    state: torch.Tensor,
    branch_output: torch.Tensor,
    beta: torch.Tensor,
    value: torch.Tensor,
    eps: float,
    additive: bool,
) -> torch.Tensor:
    """`delta_update(state, unit_direction(h, eps), beta, value, h if additive else None)`, fused.

    Under autograd it is one node that saves only X, h and per-token scalars; without autograd it is a plain
    function (no node, fewest ops: what generation runs).
    """
    tensors = (state, branch_output, beta, value)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _FusedDeltaUpdate.apply(*tensors, eps, additive)
    return _fused_delta_forward(*tensors, eps, additive)[0]


class DeltaResidual(nn.Module):
    """The Delta residual around one sublayer; shared by both modes and every number of value channels.

    `read` gives the sublayer its input from the state; `forward` writes the sublayer output back.
    `fused = False` switches to the plain autograd path (`delta_update`), the readable reference.
    """

    fused: bool = True

    def __init__(self, config: DeltaGPTConfig):
        super().__init__()
        hidden_size, value_channels = config.hidden_size, config.delta_value_channels
        self.additive = config.delta_mode == "additive"
        self.eps = config.delta_eps
        self.value_channels = value_channels
        if value_channels > 1:
            self.read_weights = nn.Parameter(torch.empty(value_channels))
        if config.delta_gate == "linear":
            self.beta_proj = nn.Linear(hidden_size, 1)
        else:  # the paper's eq. A.2: w^T tanh(W_in c)
            self.beta_proj = nn.Sequential(
                nn.Linear(hidden_size, config.delta_gate_hidden_size, bias=False),
                nn.Tanh(),
                nn.Linear(config.delta_gate_hidden_size, 1),
            )
        self.beta_open = nn.Parameter(torch.empty(()))
        self.v_proj = nn.Linear(hidden_size, value_channels)

    def read(self, state: torch.Tensor) -> torch.Tensor:
        """The sublayer's input: the state itself (d_v = 1), or `X w_read` over the value channels."""
        if self.value_channels == 1:
            return state
        return state @ self.read_weights.to(state.dtype)

    def forward(
        self, state: torch.Tensor, normed_input: torch.Tensor, branch_output: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the new state and beta `[batch, seq_len]`."""
        with maybe_autocast(state.device.type, enabled=False):  # beta, v and k in float32 under autocast
            dtype = self.v_proj.weight.dtype
            c = normed_input if normed_input.dtype == dtype else normed_input.to(dtype)
            opening = _at_least_float32(self.beta_open)
            # Without autograd the straight-through clamp is a plain clamp (same value, fewer ops for generation).
            rho = (
                straight_through_clamp(opening, 0.0, 1.0)
                if torch.is_grad_enabled() and opening.requires_grad
                else opening.clamp(0.0, 1.0)
            )
            # 2 rho as rho + rho: same bits as 2.0 * rho without wrapping a Python scalar (a dispatch per block).
            beta = torch.sigmoid(_at_least_float32(self.beta_proj(c)).squeeze(-1)) * (rho + rho)
            value = _at_least_float32(self.v_proj(c))
            if self.fused:
                new_state = fused_delta_update(state, branch_output, beta, value, self.eps, self.additive)
            else:
                k = unit_direction(branch_output, self.eps)
                new_state = delta_update(state, k, beta, value, branch_output if self.additive else None)
        return new_state, beta


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
    out_dtype, dtype = v.dtype, _compute_dtype(v.dtype)  # the state accumulates over T
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
    out_dtype, dtype = v.dtype, _compute_dtype(v.dtype)  # the state accumulates over T
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


class DeltaNetCacheLayer(LinearAttentionLayer):
    """transformers' linear-attention cache layer (conv window + recurrent state), plus a count of absorbed tokens.

    The state is `[B, H, d_v, d_k]` whatever the context length: constant memory per generated token. The count
    exists because GPT-2's absolute position embeddings and `generate` ask the cache for its sequence length, which
    transformers' all-linear caches cannot answer.
    """

    def __init__(self, **kwargs):
        super().__init__(number_of_states=1)
        self.seen_tokens = 0
        self.keys = self.values = None  # no key/value tensors: keeps `Cache` helpers that read them working

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, state_idx: int = 0, num_new_tokens: int = 0, **kwargs
    ) -> torch.Tensor:
        self.seen_tokens += num_new_tokens
        # transformers marks "has a previous state" only in update_conv_state; without a conv that never runs.
        self.has_previous_state[state_idx] = True
        return super().update_recurrent_state(recurrent_states, state_idx)

    def reset(self) -> None:
        super().reset()
        self.seen_tokens = 0

    def batch_repeat_interleave(self, repeats: int) -> None:
        for i in range(self.number_of_states):
            if self.is_conv_states_initialized[i]:
                self.conv_states[i] = self.conv_states[i].repeat_interleave(repeats, dim=0)
            if self.is_recurrent_states_initialized[i]:
                self.recurrent_states[i] = self.recurrent_states[i].repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for i in range(self.number_of_states):
            if self.is_conv_states_initialized[i]:
                self.conv_states[i] = self.conv_states[i][indices]
            if self.is_recurrent_states_initialized[i]:
                self.recurrent_states[i] = self.recurrent_states[i][indices]


class DeltaNetCache(Cache):
    """The cache of a `token_mixer="delta_net"` DeltaGPT: one `DeltaNetCacheLayer` per layer, no growing KV tensors.

    `DeltaGPTModel` and `generate` create it; pass one yourself as `past_key_values=DeltaNetCache(config)`.
    """

    def __init__(self, config: DeltaGPTConfig):
        super().__init__(layers=[DeltaNetCacheLayer() for _ in range(config.num_hidden_layers)])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].seen_tokens if layer_idx < len(self.layers) else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.get_seq_length(layer_idx) + query_length, 0

    @property
    def is_compileable(self) -> bool:
        return False  # the token count is a Python int

    def crop(self, tokens_to_remove: int) -> None:
        raise RuntimeError("DeltaNetCache cannot be cropped: the recurrent state cannot forget tokens.")


class DeltaNetAttention(nn.Module):
    """DeltaNet token mixer, a drop-in for `GPT2Attention` in a DeltaGPT block (returns `(output, None)`).

    x -> q, k, v projections -> optional short causal depthwise conv + SiLU -> L2-normalised q, k;
    beta = sigmoid(W_beta x) per head (times 2 with `delta_net_allow_negative_eigval`, so beta in (0, 2) and the
    transition I - beta k k^T can have eigenvalue 1 - beta < 0) -> delta rule over time -> per-head RMSNorm ->
    output projection. Padding (2-D attention mask, 0 = pad): padded tokens get beta = 0 and a zero conv input, so
    they neither write to nor erase from the state; left padding therefore gives the same outputs as no padding.
    """

    def __init__(self, config: DeltaGPTConfig, layer_idx: int | None = None):
        super().__init__()
        hidden_size = config.hidden_size
        self.layer_idx = layer_idx
        self.num_heads = config.delta_net_heads or config.num_attention_heads
        self.head_dim = config.delta_net_head_dim or hidden_size // self.num_heads
        self.inner_dim = self.num_heads * self.head_dim
        self.conv_size = config.delta_net_conv_size
        self.beta_scale = 2.0 if config.delta_net_allow_negative_eigval else 1.0
        self.erase = config.delta_net_rule == "delta"
        self.chunk_size = config.delta_net_chunk_size

        self.q_proj = nn.Linear(hidden_size, self.inner_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.inner_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.inner_dim, bias=False)
        self.b_proj = nn.Linear(hidden_size, self.num_heads)
        if self.conv_size > 0:
            conv_dim = 3 * self.inner_dim  # one depthwise conv over [q | k | v]: one cached window per layer
            self.conv1d = nn.Conv1d(conv_dim, conv_dim, self.conv_size, groups=conv_dim, bias=False)
        self.o_norm = nn.RMSNorm(self.head_dim, eps=config.layer_norm_epsilon)
        self.o_proj = nn.Linear(self.inner_dim, hidden_size)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)

    def forward(
        self,
        hidden_states: torch.Tensor,
        past_key_values: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        batch, seq_len, _ = hidden_states.shape
        cache = past_key_values
        if cache is not None and not isinstance(cache, DeltaNetCache):
            raise TypeError(
                f"A token_mixer='delta_net' model needs a DeltaNetCache, got {type(cache).__name__}; "
                "pass past_key_values=DeltaNetCache(model.config) or let the model create it (use_cache=True)."
            )
        token_mask = None
        if attention_mask is not None:
            token_mask = attention_mask[:, -seq_len:].to(hidden_states.dtype)  # 1 = token, 0 = padding
            hidden_states = hidden_states * token_mask.unsqueeze(-1)

        qkv = torch.cat([self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)], -1)
        initial_state = cache.get_recurrent_state(self.layer_idx) if cache is not None else None
        if self.conv_size > 0:
            qkv = self._short_conv(qkv, cache)
        q, k, v = (
            x.view(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2) for x in qkv.split(self.inner_dim, -1)
        )
        q, k = nn.functional.normalize(q, dim=-1, eps=1e-6), nn.functional.normalize(k, dim=-1, eps=1e-6)
        beta = self.beta_scale * torch.sigmoid(self.b_proj(hidden_states).float()).transpose(1, 2)  # [B, H, T]
        if token_mask is not None:
            beta = beta * token_mask.unsqueeze(1)

        if seq_len == 1:  # decoding: one rank-1 update
            o, state = delta_rule_recurrent(q, k, v, beta, initial_state, erase=self.erase)
        else:
            o, state = delta_rule_chunkwise(q, k, v, beta, self.chunk_size, initial_state, erase=self.erase)
        if cache is not None:
            cache.update_recurrent_state(state.detach(), self.layer_idx, num_new_tokens=seq_len)

        o = self.o_norm(o.transpose(1, 2)).reshape(batch, seq_len, self.inner_dim)
        return self.resid_dropout(self.o_proj(o)), None

    def _short_conv(self, qkv: torch.Tensor, cache: Cache | None) -> torch.Tensor:
        """SiLU(causal depthwise conv) over time; with a cache, the last `conv_size` inputs are carried over."""
        seq_len = qkv.shape[1]
        x = qkv.transpose(1, 2)  # [B, C, T]
        if cache is not None:  # prefill: x (zero-padded to conv_size); decoding: [cached window | x]
            x = cache.update_conv_state(x, self.layer_idx, conv_kernel_size=self.conv_size)
        x = nn.functional.pad(x, (self.conv_size - 1, 0))
        y = nn.functional.conv1d(x, self.conv1d.weight, groups=x.shape[1])[..., -seq_len:]
        return nn.functional.silu(y).transpose(1, 2)


# ----------------------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------------------


class DeltaGPTBlock(GradientCheckpointingLayer):
    """GPT-2 block (pre-norm attention then MLP) whose two residual connections are Delta residuals."""

    def __init__(self, config: DeltaGPTConfig, layer_idx: int | None = None):
        super().__init__()
        hidden_size = config.hidden_size
        inner_dim = config.n_inner if config.n_inner is not None else 4 * hidden_size

        self.ln_1 = nn.LayerNorm(hidden_size, eps=config.layer_norm_epsilon)
        if config.token_mixer == "delta_net":
            self.attn = DeltaNetAttention(config=config, layer_idx=layer_idx)
        else:
            self.attn = GPT2Attention(config=config, layer_idx=layer_idx)
        self.attn_delta = DeltaResidual(config)
        self.ln_2 = nn.LayerNorm(hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(inner_dim, config)
        self.mlp_delta = DeltaResidual(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        past_key_values: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        use_cache: bool | None = False,
        **kwargs,
    ) -> torch.Tensor:
        normed = self.ln_1(self.attn_delta.read(hidden_states))
        attn_output, _ = self.attn(
            normed,
            past_key_values=past_key_values,
            attention_mask=attention_mask,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states, _ = self.attn_delta(hidden_states, normed, attn_output)

        normed = self.ln_2(self.mlp_delta.read(hidden_states))
        hidden_states, _ = self.mlp_delta(hidden_states, normed, self.mlp(normed))
        return hidden_states


@dataclass
class DeltaGPTModelOutput(BaseModelOutputWithPastAndCrossAttentions):
    r"""
    betas (`tuple(torch.FloatTensor)`, returned when `output_betas=True`):
        One `[batch_size, sequence_length]` tensor per Delta block, two per layer (attention, then MLP).
    """

    betas: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class DeltaGPTCausalLMOutput(CausalLMOutputWithCrossAttentions):
    r"""
    betas (`tuple(torch.FloatTensor)`, returned when `output_betas=True`):
        One `[batch_size, sequence_length]` tensor per Delta block, two per layer (attention, then MLP).
    """

    betas: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class DeltaGPTSequenceClassifierOutput(SequenceClassifierOutputWithPast):
    r"""
    betas (`tuple(torch.FloatTensor)`, returned when `output_betas=True`):
        One `[batch_size, sequence_length]` tensor per Delta block, two per layer (attention, then MLP).
    """

    betas: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class DeltaGPTTokenClassifierOutput(TokenClassifierOutput):
    r"""
    betas (`tuple(torch.FloatTensor)`, returned when `output_betas=True`):
        One `[batch_size, sequence_length]` tensor per Delta block, two per layer (attention, then MLP).
    """

    betas: tuple[torch.FloatTensor, ...] | None = None


class DeltaGPTPreTrainedModel(PreTrainedModel):
    config: DeltaGPTConfig
    config_class = DeltaGPTConfig
    base_model_prefix = "transformer"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DeltaGPTBlock"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True
    _can_record_outputs = {
        "hidden_states": DeltaGPTBlock,
        "attentions": OutputRecorder(GPT2Attention, layer_name=".attn", index=1),
        "betas": OutputRecorder(DeltaResidual, index=1),
    }
    _keys_to_ignore_on_load_unexpected = ["attn.bias", "attn.masked_bias"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """GPT-2's initialisation, plus Delta residuals that start at exactly `config.delta_beta_init`."""
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, Conv1D):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        if isinstance(module, (GPT2Attention, GPT2MLP, DeltaNetAttention)):
            # GPT-2's scaled init of the projections that write to the residual: 2 residual paths per layer.
            out_proj = module.o_proj if isinstance(module, DeltaNetAttention) else module.c_proj
            init.normal_(out_proj.weight, mean=0.0, std=std / math.sqrt(2 * self.config.n_layer))
        if isinstance(module, DeltaResidual):
            # beta = 2 sigmoid(w^T c + b) rho. The last gate layer starts at w = 0 so beta is the same for every
            # token; rho (the opening) and b are set so that beta == delta_beta_init exactly.
            beta0 = float(self.config.delta_beta_init)
            gate_out = module.beta_proj if isinstance(module.beta_proj, nn.Linear) else module.beta_proj[-1]
            init.zeros_(gate_out.weight)
            if beta0 <= 1.0:
                init.constant_(module.beta_open, beta0)
                init.zeros_(gate_out.bias)  # 2 sigmoid(0) = 1 exactly
            else:
                half = min(beta0 / 2.0, 1.0 - 1e-9)
                init.constant_(module.beta_open, 1.0)
                init.constant_(gate_out.bias, math.log(half / (1.0 - half)))
            init.normal_(module.v_proj.weight, mean=0.0, std=std)
            init.zeros_(module.v_proj.bias)
            if module.value_channels > 1:
                init.constant_(module.read_weights, 1.0 / module.value_channels)
        if isinstance(module, DeltaGPTModel) and module.config.delta_value_channels > 1:
            init.constant_(module.read_out, 1.0 / module.config.delta_value_channels)


class DeltaGPTModel(DeltaGPTPreTrainedModel):
    def __init__(self, config: DeltaGPTConfig):
        super().__init__(config)
        config.validate_delta()
        self.embed_dim = config.hidden_size
        self.value_channels = config.delta_value_channels

        self.wte = nn.Embedding(config.vocab_size, self.embed_dim)
        self.wpe = nn.Embedding(config.max_position_embeddings, self.embed_dim)
        self.drop = nn.Dropout(config.embd_pdrop)
        self.h = nn.ModuleList([DeltaGPTBlock(config, layer_idx=i) for i in range(config.num_hidden_layers)])
        if self.value_channels > 1:
            # Reads the expanded state [.., D, d_v] out to [.., D] before ln_f.
            self.read_out = nn.Parameter(torch.empty(self.value_channels))
        self.ln_f = nn.LayerNorm(self.embed_dim, eps=config.layer_norm_epsilon)

        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.wte

    def set_input_embeddings(self, new_embeddings: nn.Embedding) -> None:
        self.wte = new_embeddings

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> DeltaGPTModelOutput:
        r"""
        Same inputs as `GPT2Model.forward`. `output_betas=True` returns `betas`: one `[batch, seq_len]` tensor per
        Delta block. With `delta_value_channels > 1`, `hidden_states` holds the expanded states `[.., D, d_v]`.
        """
        for flag in ("output_attentions", "output_hidden_states", "output_betas"):
            kwargs.pop(flag, None)

        if input_ids is not None and inputs_embeds is not None:
            raise ValueError("You cannot specify both input_ids and inputs_embeds at the same time")
        elif input_ids is not None:
            self.warn_if_padding_and_no_attention_mask(input_ids, attention_mask)
            input_shape = input_ids.size()
            input_ids = input_ids.view(-1, input_shape[-1])
            batch_size = input_ids.shape[0]
        elif inputs_embeds is not None:
            input_shape = inputs_embeds.size()[:-1]
            batch_size = inputs_embeds.shape[0]
        else:
            raise ValueError("You have to specify either input_ids or inputs_embeds")

        delta_net = self.config.token_mixer == "delta_net"
        if use_cache and past_key_values is None:
            past_key_values = DeltaNetCache(self.config) if delta_net else DynamicCache(config=self.config)
        past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
        self._check_inputs(input_ids, attention_mask, position_ids, batch_size, input_shape[-1], past_seen_tokens)

        if inputs_embeds is None:
            inputs_embeds = self.wte(input_ids)
        if position_ids is None:
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)
        hidden_states = inputs_embeds + self.wpe(position_ids).to(inputs_embeds.device)
        if token_type_ids is not None:
            hidden_states = hidden_states + self.wte(token_type_ids.view(-1, input_shape[-1]))

        if attention_mask is not None and attention_mask.ndim < 4:
            attention_mask = attention_mask.view(batch_size, -1)
        if delta_net:  # causal by construction: DeltaNet only needs the 2-D padding mask
            if attention_mask is not None and attention_mask.ndim != 2:
                raise ValueError("token_mixer='delta_net' supports only a 2-D [batch, seq_len] padding mask.")
            causal_mask = attention_mask
        else:
            causal_mask = create_causal_mask(
                config=self.config,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                past_key_values=past_key_values,
                position_ids=position_ids,
            )

        hidden_states = self.drop(hidden_states)
        if self.value_channels > 1:
            # X_0 = embedding repeated over the value channels: a view, no copy.
            hidden_states = hidden_states.unsqueeze(-1).expand(*hidden_states.shape, self.value_channels)

        for block in self.h:
            hidden_states = block(
                hidden_states,
                past_key_values if not (self.gradient_checkpointing and self.training) else None,
                causal_mask,
                use_cache=use_cache,
                position_ids=position_ids,
                **kwargs,
            )

        if self.value_channels > 1:
            hidden_states = hidden_states @ self.read_out.to(hidden_states.dtype)
        hidden_states = self.ln_f(hidden_states)
        hidden_states = hidden_states.view(-1, *input_shape[1:], hidden_states.size(-1))

        return DeltaGPTModelOutput(
            last_hidden_state=hidden_states,
            past_key_values=past_key_values if use_cache else None,
        )

    def _check_inputs(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        batch_size: int,
        seq_len: int,
        past_len: int,
    ) -> None:
        """Turn the usual silent or cryptic failures (index errors deep inside an embedding) into clear errors."""
        if torch.compiler.is_compiling():
            return
        n_positions = self.config.n_positions
        if position_ids is None and past_len + seq_len > n_positions:
            raise ValueError(
                f"Sequence too long: {seq_len} new tokens + {past_len} cached tokens > n_positions={n_positions}. "
                f"Truncate the input (e.g. tokenizer(..., truncation=True, max_length={n_positions}))."
            )
        if position_ids is not None and position_ids.numel():
            highest = int(position_ids.max())  # generation passes position_ids: one host transfer per step
            if highest >= n_positions:
                raise ValueError(
                    f"position_ids reach {highest}, but the model has n_positions={n_positions}; "
                    "truncate the input or pass smaller position_ids."
                )
        if input_ids is not None and input_ids.numel():
            low, high = torch.stack(torch.aminmax(input_ids)).tolist()  # one host transfer, not two
            if low < 0 or high >= self.config.vocab_size:
                raise ValueError(
                    f"input_ids contain token ids outside [0, vocab_size={self.config.vocab_size}) "
                    f"(found {low}..{high}). Use the tokenizer the model was trained with, or call "
                    "model.resize_token_embeddings(len(tokenizer)) after adding tokens."
                )
        if attention_mask is not None and attention_mask.ndim == 2:
            expected = (batch_size, past_len + seq_len)
            if tuple(attention_mask.shape) != expected:
                raise ValueError(
                    f"attention_mask has shape {tuple(attention_mask.shape)}, expected {expected} "
                    "(batch_size, past tokens + new tokens). Pass the mask the tokenizer returned with the input_ids."
                )


class DeltaGPTForCausalLM(DeltaGPTPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}

    def __init__(self, config: DeltaGPTConfig):
        super().__init__(config)
        self.transformer = DeltaGPTModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.post_init()

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args, **kwargs) -> None:
        """`generate` builds a DynamicCache from the config; a DeltaNet model needs its recurrent-state cache."""
        wants_new_cache = model_kwargs.get("past_key_values") is None and generation_config.use_cache is not False
        if self.config.token_mixer != "delta_net" or not wants_new_cache:
            return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        if generation_config.cache_implementation not in (None, "dynamic"):
            raise ValueError(
                f"cache_implementation={generation_config.cache_implementation!r} is not supported with "
                "token_mixer='delta_net': its DeltaNetCache is already fixed-size. Leave cache_implementation unset."
            )
        model_kwargs["past_key_values"] = DeltaNetCache(self.config)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> DeltaGPTCausalLMOutput:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Labels for language modeling; shifted inside the model, so `labels = input_ids` works. -100 is ignored.
        """
        outputs: DeltaGPTModelOutput = self.transformer(
            input_ids,
            past_key_values=past_key_values,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        logits = self.lm_head(slice_logits_to_keep(hidden_states, logits_to_keep))

        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, vocab_size=self.config.vocab_size, **kwargs)

        return DeltaGPTCausalLMOutput(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            betas=outputs.betas,
        )


class DeltaGPTForSequenceClassification(DeltaGPTPreTrainedModel):
    """DeltaGPT with a linear head on the last non-padding token, like `GPT2ForSequenceClassification`."""

    def __init__(self, config: DeltaGPTConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.transformer = DeltaGPTModel(config)
        self.score = nn.Linear(config.n_embd, self.num_labels, bias=False)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> DeltaGPTSequenceClassifierOutput:
        outputs: DeltaGPTModelOutput = self.transformer(
            input_ids,
            past_key_values=past_key_values,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        logits = self.score(outputs.last_hidden_state)
        batch_size = input_ids.shape[0] if input_ids is not None else inputs_embeds.shape[0]

        if self.config.pad_token_id is None and batch_size != 1:
            raise ValueError(
                "Cannot classify a batch of more than one sequence without a padding token: "
                "set model.config.pad_token_id (e.g. to tokenizer.pad_token_id)."
            )
        if self.config.pad_token_id is None or input_ids is None:
            last_token = -1
        else:  # rightmost non-padding token: works for left and right padding
            non_pad = (input_ids != self.config.pad_token_id).to(logits.device, torch.int32)
            positions = torch.arange(input_ids.shape[-1], device=logits.device, dtype=torch.int32)
            last_token = (positions * non_pad).argmax(-1)
        pooled_logits = logits[torch.arange(batch_size, device=logits.device), last_token]

        loss = None
        if labels is not None:
            labels = labels.to(pooled_logits.device)
            if self.config.problem_type is None:
                if self.num_labels == 1:
                    self.config.problem_type = "regression"
                elif labels.dtype in (torch.long, torch.int):
                    self.config.problem_type = "single_label_classification"
                else:
                    self.config.problem_type = "multi_label_classification"
            if self.config.problem_type == "regression":
                loss = MSELoss()(pooled_logits.squeeze(), labels.squeeze().to(pooled_logits.dtype))
            elif self.config.problem_type == "single_label_classification":
                loss = CrossEntropyLoss()(pooled_logits.view(-1, self.num_labels), labels.view(-1))
            else:
                loss = BCEWithLogitsLoss()(pooled_logits, labels.to(pooled_logits.dtype))

        return DeltaGPTSequenceClassifierOutput(
            loss=loss,
            logits=pooled_logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            betas=outputs.betas,
        )


class DeltaGPTForTokenClassification(DeltaGPTPreTrainedModel):
    """DeltaGPT with a linear head on every token, like `GPT2ForTokenClassification`."""

    def __init__(self, config: DeltaGPTConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.transformer = DeltaGPTModel(config)
        classifier_dropout = getattr(config, "classifier_dropout", None)
        self.dropout = nn.Dropout(0.1 if classifier_dropout is None else classifier_dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> DeltaGPTTokenClassifierOutput:
        outputs: DeltaGPTModelOutput = self.transformer(
            input_ids,
            past_key_values=past_key_values,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        logits = self.classifier(self.dropout(outputs.last_hidden_state))

        loss = None
        if labels is not None:
            loss = CrossEntropyLoss()(logits.view(-1, self.num_labels), labels.to(logits.device).view(-1))

        return DeltaGPTTokenClassifierOutput(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            betas=outputs.betas,
        )


__all__ = [
    "DeltaGPTForCausalLM",
    "DeltaGPTForSequenceClassification",
    "DeltaGPTForTokenClassification",
    "DeltaGPTModel",
    "DeltaGPTPreTrainedModel",
    "DeltaResidual",
    "delta_update",
]
