"""PyTorch DeltaGPT: GPT-2 whose every attention and MLP residual is a Deep Delta Learning block.

Deep Delta Learning (Zhang, Liu, Wang, Gu; arXiv 2601.00417) replaces the identity shortcut `X + F(X)` with the
Delta Operator `A = I - beta k k^T` and a synchronous rank-1 write: `X' = A X + beta k v^T`.
GPT-2's own attention and MLP (`GPT2Attention`, `GPT2MLP`) are the sublayers, so every attention backend,
the `Conv1D` weights and GPT-2's parameter names carry over; only the Delta parameters are new.

Reads top to bottom like `modeling_gpt2.py`: the Delta residual (the module around a sublayer), the DeltaNet token
mixer and its cache, the block, the pretrained base, the model and its heads. The tensor math itself lives in
`delta_ops.py`.

Self-contained Hub custom-code file: it imports only torch, transformers and its two sibling files
(`configuration_delta_gpt.py`, `delta_ops.py`), which `save_pretrained` copies next to the weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
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
from transformers.utils import can_return_tuple
from transformers.utils.generic import maybe_autocast, merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .configuration_delta_gpt import DeltaGPTConfig
from .delta_ops import (
    at_least_float32,
    delta_rule_chunkwise,
    delta_rule_recurrent,
    delta_update,
    fused_delta_update,
    straight_through_clamp,
    unit_direction,
)


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

    @property
    def gate_output(self) -> nn.Linear:
        """The gate's last linear layer: its output is the logit g of beta = 2 sigmoid(g) rho."""
        return self.beta_proj if isinstance(self.beta_proj, nn.Linear) else self.beta_proj[-1]

    def opening(self) -> float:
        """rho = clamp(beta_open, 0, 1); 0 means beta is exactly 0 for every input (the gate is closed)."""
        return float(self.beta_open.detach().float().clamp(0.0, 1.0))

    @torch.no_grad()
    def beta_upper_bound(self, norm: nn.LayerNorm) -> float:
        """The largest beta this block can produce over every input, given the LayerNorm that feeds its gate.

        beta = 2 sigmoid(g(c)) rho with c = LayerNorm(x) = gamma * n + b_ln, n zero-mean with |n| < sqrt(D).
        0.0 means beta is exactly 0 for every input (rho == 0, or a gate so negative that sigmoid underflows).
        - linear gate g(c) = w.c + b: sup g = w.b_ln + b + sqrt(D) |center(w * gamma)| (the best zero-mean n
          points along the centred w * gamma), so the bound is the least upper bound;
        - mlp gate g(c) = w.tanh(W c) + b: |tanh| <= 1 gives g <= |w|_1 + b, an upper bound that may not be reached.
        """
        rho = self.opening()
        if rho == 0.0:
            return 0.0
        out = self.gate_output
        w, b = out.weight.float()[0], float(out.bias.float()[0])
        if isinstance(self.beta_proj, nn.Linear):
            scaled = w * norm.weight.float()
            centred = scaled - scaled.mean()
            g_max = float(w @ norm.bias.float()) + b + math.sqrt(w.numel()) * float(centred.norm())
        else:
            g_max = float(w.abs().sum()) + b
        # Stable sigmoid in float64; it reaches 0.0 only below g = -745, where the model's float32 beta is 0 too.
        sigmoid = 1.0 / (1.0 + math.exp(-g_max)) if g_max >= 0 else math.exp(g_max) / (1.0 + math.exp(g_max))
        return 2.0 * rho * sigmoid

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
            opening = at_least_float32(self.beta_open)
            # Without autograd the straight-through clamp is a plain clamp (same value, fewer ops for generation).
            rho = (
                straight_through_clamp(opening, 0.0, 1.0)
                if torch.is_grad_enabled() and opening.requires_grad
                else opening.clamp(0.0, 1.0)
            )
            # 2 rho as rho + rho: same bits as 2.0 * rho without wrapping a Python scalar (a dispatch per block).
            beta = torch.sigmoid(at_least_float32(self.beta_proj(c)).squeeze(-1)) * (rho + rho)
            value = at_least_float32(self.v_proj(c))
            if self.fused:
                new_state = fused_delta_update(state, branch_output, beta, value, self.eps, self.additive)
            else:
                k = unit_direction(branch_output, self.eps)
                new_state = delta_update(state, k, beta, value, branch_output if self.additive else None)
        return new_state, beta


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
        document_starts: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        """`document_starts` `[B, T]` bool (packed rows, see `delta_net_document_starts`): the recurrent state and
        the conv window restart there."""
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
        with maybe_autocast(hidden_states.device.type, enabled=False):
            rule = dict(erase=self.erase, document_starts=document_starts)
            if seq_len == 1:  # decoding: one rank-1 update (a shape-only branch: export with T >= 2 never sees it)
                o, state = delta_rule_recurrent(q, k, v, beta, initial_state, **rule)
            else:
                o, state = delta_rule_chunkwise(q, k, v, beta, self.chunk_size, initial_state, **rule)
        if cache is not None:
            cache.update_recurrent_state(state.detach(), self.layer_idx, num_new_tokens=seq_len)

        o = self.o_norm(o.transpose(1, 2)).reshape(batch, seq_len, self.inner_dim)
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
            y = nn.functional.conv1d(x, self.conv1d.weight, groups=x.shape[1])[..., -seq_len:]
        else:
            # The document of every input, inputs before the new tokens (cached window, padding) in the first one.
            document = nn.functional.pad(document_starts.long().cumsum(-1), (x.shape[-1] - seq_len, 0))
            document, x = document[:, -(seq_len + self.conv_size - 1) :], x[..., -(seq_len + self.conv_size - 1) :]
            weight = self.conv1d.weight[:, 0]  # [C, K]: tap j reads input t - (K - 1) + j for output t
            target = document[:, self.conv_size - 1 :]
            y = sum(
                weight[:, j, None] * x[..., j : j + seq_len] * (document[:, j : j + seq_len] == target).unsqueeze(1)
                for j in range(self.conv_size)
            )
        return nn.functional.silu(y).transpose(1, 2)


def delta_net_document_starts(
    position_ids: torch.Tensor | None,
    cu_seq_lens: torch.Tensor | None,
    shape: tuple[int, int],
    past_seen_tokens: int,
) -> torch.Tensor | None:
    """Where documents start in packed rows, `[B, T]` bool, for a DeltaNet mixer; None when nothing is packed.

    Packed / padding-free batches (trl `packing=True`, `DataCollatorWithFlattening`) put several documents in one
    row: a document starts where the caller's `position_ids` restart at 0, and at every `cu_seq_lens` boundary
    (cumulative lengths over the flattened batch, as flash-attention kwargs). A cache that already holds tokens
    cannot be continued by a new document (its state belongs to the previous one): refused.
    """
    if position_ids is None and cu_seq_lens is None:
        return None
    if past_seen_tokens and cu_seq_lens is None and not bool((position_ids == 0).any()):
        return None  # decoding (generate passes position_ids every step): one check, nothing starts
    starts = torch.zeros(shape, dtype=torch.bool, device=(position_ids if cu_seq_lens is None else cu_seq_lens).device)
    if position_ids is not None:
        starts = starts | (position_ids == 0)
    if cu_seq_lens is not None:
        boundaries = cu_seq_lens[:-1].long()
        starts = starts.flatten().index_fill(0, boundaries[boundaries < starts.numel()], True).view(shape)
    if past_seen_tokens:
        if cu_seq_lens is not None or bool(starts.any()):
            raise ValueError(
                "token_mixer='delta_net': packed input (position_ids restarting at 0 or cu_seq_lens) cannot "
                f"continue a cache that already holds {past_seen_tokens} tokens, whose recurrent state belongs to "
                "the previous document. Run packed rows without past_key_values (or with an empty cache)."
            )
        return None  # nothing starts: the usual decoding path
    return starts


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

    def delta_residuals(self) -> dict[str, tuple[nn.Module, nn.LayerNorm]]:
        """{attribute name: (Delta residual, the LayerNorm that produces its sublayer and gate input)}."""
        return {"attn_delta": (self.attn_delta, self.ln_1), "mlp_delta": (self.mlp_delta, self.ln_2)}

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


def _with_betas(name: str, output_class: type) -> type:
    """transformers' `output_class` plus one field, `betas`: with `output_betas=True`, one `[batch_size, seq_len]`
    tensor per Delta block, two per layer (attention, then MLP). One definition for the four heads' outputs."""
    namespace = {"__annotations__": {"betas": "tuple[torch.FloatTensor, ...] | None"}, "betas": None}
    namespace.update(__module__=__name__, __qualname__=name, __doc__=_with_betas.__doc__)
    return dataclass(type(name, (output_class,), namespace))


DeltaGPTModelOutput = _with_betas("DeltaGPTModelOutput", BaseModelOutputWithPastAndCrossAttentions)
DeltaGPTCausalLMOutput = _with_betas("DeltaGPTCausalLMOutput", CausalLMOutputWithCrossAttentions)
DeltaGPTSequenceClassifierOutput = _with_betas("DeltaGPTSequenceClassifierOutput", SequenceClassifierOutputWithPast)
DeltaGPTTokenClassifierOutput = _with_betas("DeltaGPTTokenClassifierOutput", TokenClassifierOutput)


class DeltaSite(NamedTuple):
    """Where a Delta residual sits: its module name, its short label, the module, and the LayerNorm feeding it."""

    name: str
    short_name: str
    residual: nn.Module
    norm: nn.LayerNorm


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

    # The one place that says which modules and parameters are Delta (not in a GPT-2 checkpoint); conversion, export,
    # DeltaTrainer, DeltaStatsCallback and `ddl-hf inspect` all ask these methods.

    def delta_residuals(self, short_names: bool = False) -> dict[str, nn.Module]:
        """Every Delta residual in forward order (per layer: attention, then MLP), by module name.

        Names are relative to this model (`transformer.h.0.attn_delta` on a head model), or `L0.attn`, `L0.mlp`, ...
        with `short_names=True`. A wrapper that a tool put in a residual's place (peft's `modules_to_save`) is
        returned as it is: it runs, and forwards attribute access to, the active copy.
        """
        return {site.short_name if short_names else site.name: site.residual for site in self._delta_sites()}

    def delta_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters that a GPT-2 checkpoint does not have (gates, values, read vectors), by name."""
        owners = tuple(f"{site.name}." for site in self._delta_sites())
        read_out = f"{self._base_prefix()}read_out"
        return {n: p for n, p in self.named_parameters() if n.startswith(owners) or n == read_out}

    @torch.no_grad()
    def beta_upper_bounds(self) -> dict[str, float]:
        """The largest beta each Delta residual can produce over every input (see `DeltaResidual.beta_upper_bound`)."""
        return {site.name: site.residual.beta_upper_bound(site.norm) for site in self._delta_sites()}

    def _base_prefix(self) -> str:
        return "" if self.base_model is self else f"{self.base_model_prefix}."

    def _delta_sites(self) -> list[DeltaSite]:
        prefix = self._base_prefix()
        return [
            DeltaSite(f"{prefix}h.{i}.{attr}", f"L{i}.{attr.removesuffix('_delta')}", residual, norm)
            for i, block in enumerate(self.base_model.h)
            for attr, (residual, norm) in block.delta_residuals().items()
        ]

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
            gate_out = module.gate_output
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

        A copy of `GPT2Model.forward` (embeddings, mask, blocks, `ln_f`) except for three Delta steps: the cache
        of a DeltaNet mixer, the expansion of the embedding over the value channels, and the read-out before `ln_f`.
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

        document_starts = None
        if delta_net:  # packed rows: the recurrent state and conv window restart at each document
            cu_seq_lens = kwargs.get("cu_seq_lens_q", kwargs.get("cu_seq_lens_k"))
            shape = (batch_size, input_shape[-1])
            document_starts = delta_net_document_starts(position_ids, cu_seq_lens, shape, past_seen_tokens)

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
                **({"document_starts": document_starts} if document_starts is not None else {}),
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
    """DeltaGPT with a linear head on the last non-padding token; its forward is `GPT2ForSequenceClassification`'s
    (pooling and loss) on DeltaGPT's hidden states."""

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
            loss = self.loss_function(logits=logits, labels=labels, pooled_logits=pooled_logits, config=self.config)

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
            loss = self.loss_function(logits, labels, self.config, **kwargs)

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
