"""DeltaNet: the delta rule over time as a token mixer (paper §4.2), a drop-in for GPT-2's attention in DeltaGPT.

    S_t = S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T,   o_t = S_t q_t,   S_t in R^{d_v x d_k} per head.

DDL applies this rank-1 Delta Operator over depth; DeltaNet applies it over the sequence. The mixer and its cache
live here; the rule itself (chunkwise for training and prefill, recurrent for decoding) in `delta_net_ops.py`.

Self-contained Hub custom-code file: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

import torch
from torch import nn

# First: below the supported transformers / torch it stops here with one clear error (delta_compat.py).
from .delta_compat import takes_cache

# isort: split
from transformers.cache_utils import Cache, LinearAttentionLayer

from .delta_layers import autocast_off
from .delta_net_ops import delta_rule
from .delta_ops import delta_kernels
from .delta_reads import DeltaWindowsMixin


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


NO_CACHE_ROLLBACK = (
    "A token_mixer='delta_net' DeltaGPT cannot be used {role}: that rolls the cache back over rejected draft tokens, "
    "and DeltaNet's recurrent state cannot forget tokens (its fixed-size state is the point of the mixer). Use plain "
    "generate (greedy, sampling, beam search), or a token_mixer='attention' model for assisted decoding."
)


class DeltaNetCache(DeltaWindowsMixin, Cache):
    """The cache of a `token_mixer="delta_net"` DeltaGPT: one `DeltaNetCacheLayer` per layer, no growing KV tensors
    (and the windows of a TC / EC variant's convolutions, `DeltaWindowsMixin`).

    `DeltaGPTModel` and `generate` create it; pass one yourself as `cache=DeltaNetCache(config)`. The rules `generate`
    follows for the mixer's state are here too: it cannot roll back (no assisted decoding: `_is_stateful`) and has no
    static form (no compiled generation: `_can_compile_fullgraph`).
    """

    rolls_back = False

    def __init__(self, config):
        super().__init__(layers=[DeltaNetCacheLayer() for _ in range(config.num_hidden_layers)])
        self.delta_history = config.delta_conv_size - 1
        self.delta_windows = {}

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].seen_tokens if layer_idx < len(self.layers) else 0

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """The layer's recurrent state, None before its first token: transformers' accessor (Cache, from 5.21),
        defined here too so that this cache reads the same on the releases before it."""
        layer = self.layers[layer_idx]
        return layer.recurrent_states[state_idx] if layer.has_previous_state[state_idx] else None

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.get_seq_length(layer_idx) + query_length, 0

    @property
    def is_compileable(self) -> bool:
        return False  # the token count is a Python int

    def crop(self, tokens_to_remove: int) -> None:
        raise RuntimeError(
            "DeltaNetCache cannot be cropped: the recurrent state cannot forget tokens (assisted / speculative "
            "decoding, prompt lookup and anything else that rolls the cache back need a token_mixer='attention' model)."
        )

    @classmethod
    def refuse_rollback(cls, role: str) -> None:
        raise ValueError(NO_CACHE_ROLLBACK.format(role=role))

    @classmethod
    def require(cls, cache: Cache | None) -> None:
        """A DeltaNet model needs its own cache: transformers' caches built from the config (`DynamicCache`,
        `StaticCache`) hold `LinearAttentionLayer`s that cannot say how many tokens they absorbed, which GPT-2's
        position embeddings need."""
        if cache is not None and not isinstance(cache, DeltaNetCache):
            raise TypeError(
                f"A token_mixer='delta_net' model needs a DeltaNetCache, got {type(cache).__name__}; "
                "pass cache=DeltaNetCache(model.config) or let the model create it (use_cache=True)."
            )


class DeltaNetShortConv(nn.Conv1d):
    """DeltaNet's short causal depthwise convolution over `[q | k | v]` (`weight` `[C, 1, K]`, no bias).

    `forward(x)` is `nn.Conv1d`'s; `forward(x, document)` also takes the document of every input, so that in packed
    rows a tap that would read a token of an earlier document reads 0 instead (as if each document were alone).
    Every use of the weight is in `forward`, so tools that load weights around it (accelerate offload) see it.
    """

    def __init__(self, channels: int, size: int):
        super().__init__(channels, channels, size, groups=channels, bias=False)

    def forward(self, x: torch.Tensor, document: torch.Tensor | None = None) -> torch.Tensor:
        """x `[B, C, K - 1 + T]` (the K - 1 inputs before the first output included), document `[B, K - 1 + T]`;
        returns the `[B, C, T]` outputs."""
        if document is None:
            return super().forward(x)
        size = self.kernel_size[0]
        seq_len = x.shape[-1] - (size - 1)
        weight = self.weight[:, 0]  # [C, K]: tap j reads input t - (K - 1) + j for output t
        target = document[:, size - 1 :]
        return sum(
            weight[:, j, None] * x[..., j : j + seq_len] * (document[:, j : j + seq_len] == target).unsqueeze(1)
            for j in range(size)
        )


class DeltaNetAttention(nn.Module):
    """DeltaNet token mixer, a drop-in for `GPT2Attention` in a DeltaGPT block (returns `(output, None)`).

    x -> q, k, v projections -> optional short causal depthwise conv + SiLU -> L2-normalised q, k;
    beta = sigmoid(W_beta x) per head (times 2 with `delta_net_allow_negative_eigval`, so beta in (0, 2) and the
    transition I - beta k k^T can have eigenvalue 1 - beta < 0) -> delta rule over time -> per-head RMSNorm ->
    output projection. Padding (2-D attention mask, 0 = pad): padded tokens get beta = 0 and a zero conv input, so
    they neither write to nor erase from the state; left padding therefore gives the same outputs as no padding.
    """

    def __init__(self, config, layer_idx: int | None = None):
        super().__init__()
        self.config = config  # its `delta_implementation` names the delta rule's kernel (fla's on CUDA)
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
            self.conv1d = DeltaNetShortConv(conv_dim, self.conv_size)
        self.o_norm = nn.RMSNorm(self.head_dim, eps=config.layer_norm_epsilon)
        self.o_proj = nn.Linear(self.inner_dim, hidden_size)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)

    @takes_cache
    def forward(
        self,
        hidden_states: torch.Tensor,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        document_starts: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        """`document_starts` `[B, T]` bool (packed rows, see `packed_document_starts`): the recurrent state and
        the conv window restart there. The cache comes under GPT2Attention's name (`takes_cache`)."""
        batch, seq_len, _ = hidden_states.shape
        DeltaNetCache.require(cache)
        token_mask = None
        if attention_mask is not None:
            token_mask = attention_mask[:, -seq_len:].to(hidden_states.dtype)  # 1 = token, 0 = padding
            hidden_states = hidden_states * token_mask.unsqueeze(-1)

        qkv = torch.cat([self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)], -1)
        initial_state = cache.get_recurrent_state(self.layer_idx) if cache is not None else None
        if self.conv_size > 0:
            qkv = self._short_conv(qkv, cache, document_starts)
        q, k, v = (
            x.view(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2) for x in qkv.split(self.inner_dim, -1)
        )
        q, k = nn.functional.normalize(q, dim=-1, eps=1e-6), nn.functional.normalize(k, dim=-1, eps=1e-6)
        beta = self.beta_scale * torch.sigmoid(self.b_proj(hidden_states).float()).transpose(1, 2)  # [B, H, T]
        if token_mask is not None:
            beta = beta * token_mask.unsqueeze(1)

        # The delta rule in float32 with autocast off (as the Delta residual): under bf16/fp16 autocast its matmuls
        # would otherwise round the state every token. It returns v's dtype.
        with autocast_off(hidden_states.device.type):
            o, state = delta_rule(
                q,
                k,
                v,
                beta,
                self.chunk_size,
                initial_state,
                erase=self.erase,
                document_starts=document_starts,
                cu_seqlens=kwargs.get("cu_seq_lens_q") if document_starts is not None else None,
                kernel=delta_kernels(self.config.delta_implementation, v).delta_rule,
            )
        if cache is not None:
            cache.update_recurrent_state(state.detach(), self.layer_idx, num_new_tokens=seq_len)

        # In the norm's dtype: under autocast o is bf16 / fp16 beside a float32 weight, which rms_norm cannot fuse.
        o = self.o_norm(o.transpose(1, 2).to(self.o_norm.weight.dtype)).reshape(batch, seq_len, self.inner_dim)
        return self.resid_dropout(self.o_proj(o)), None

    def _short_conv(
        self, qkv: torch.Tensor, cache: Cache | None, document_starts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """SiLU(causal depthwise conv) over time; with a cache, the last `conv_size` inputs are carried over.

        With `document_starts`, a tap that would read a token of an earlier document reads 0 instead, as if each
        document were alone (there, the left zero padding).
        """
        seq_len = qkv.shape[1]
        x = qkv.transpose(1, 2)  # [B, C, T]
        if cache is not None:  # prefill: x (zero-padded to conv_size); decoding: [cached window | x]
            x = cache.update_conv_state(x, self.layer_idx, conv_kernel_size=self.conv_size)
        x = nn.functional.pad(x, (self.conv_size - 1, 0))
        if document_starts is None:
            y = self.conv1d(x)[..., -seq_len:]
        else:
            # The document of every input, inputs before the new tokens (cached window, padding) in the first one.
            document = nn.functional.pad(document_starts.long().cumsum(-1), (x.shape[-1] - seq_len, 0))
            span = seq_len + self.conv_size - 1
            y = self.conv1d(x[..., -span:], document[:, -span:])
        return nn.functional.silu(y).transpose(1, 2)


__all__ = [
    "NO_CACHE_ROLLBACK",
    "DeltaNetAttention",
    "DeltaNetCache",
    "DeltaNetCacheLayer",
    "DeltaNetShortConv",
]
