"""Deep Delta Learning layers shared by every Delta model family (DeltaGPT, DeltaLlama).

Deep Delta Learning (Zhang, Liu, Wang, Gu; arXiv 2601.00417) replaces the identity shortcut `X + F(X)` of a residual
block with the Delta Operator `A = I - beta k k^T` and a synchronous rank-1 write (eq. 2.5):

    X' = A X + beta k v^T = X + beta k (v^T - k^T X),    k = F(x) / |F(x)|,  beta = 2 sigmoid(g(x)) in [0, 2]

`DeltaResidual.forward` is that line: read the state, run the sublayer, gate, value, one call of the update op
(`delta_ops.fused_delta_update`). This file holds the modules around the ops (layers over ops, as fla's
`layers/delta_net.py` over `ops/delta_rule/`): the residual, the reads and expansion of the expanded state (TC, CC,
EC; docs/variants.md), the cache that keeps their windows, the Delta initialisations, and the steps every Delta base
model adds around its stack of layers. The math itself lives in `delta_ops.py`.

Self-contained Hub custom-code file: it imports only torch, transformers and its sibling files (`delta_ops.py`,
`delta_compat.py`), which `save_pretrained` copies next to the weights.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

# First: below the supported transformers / torch it stops here with one clear error (delta_compat.py).
from .delta_compat import check_checkpoint_format, hidden_states_indices, was_loaded

# isort: split
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.configuration_utils import PreTrainedConfig

from .delta_ops import (
    at_least_float32,
    channel_conv_read,
    delta_gate,
    fused_delta_update,
    residual_step,
    same_document_taps,
    straight_through_clamp,
    temporal_conv,
    temporal_conv_read,
)

# ----------------------------------------------------------------------------------------------------------------
# The reads and the expansion of the expanded state (TC, CC, EC). The temporal ones keep their last
# `delta_conv_size - 1` inputs in the cache when generating.
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class DeltaConvContext:
    """What a temporal convolution needs besides its input: the padding mask, the cache holding its windows, and
    where packed documents start.

    `token_mask` `[B, T]` (1 = token, 0 = padding): padded positions enter the convolution as zeros, the same as the
    zeros before the start of a sequence, so a left-padded prompt reads what it reads alone.
    """

    token_mask: torch.Tensor | None = None
    cache: DeltaWindowsMixin | None = None
    document_starts: torch.Tensor | None = None

    def same_document(self, size: int) -> torch.Tensor | None:
        starts = self.document_starts
        return None if starts is None else same_document_taps(starts, size)

    def masked(self, x: torch.Tensor) -> torch.Tensor:
        """x `[B, T, ...]` with padded positions zeroed (as the zeros before the start of a sequence)."""
        if self.token_mask is None:
            return x
        mask = self.token_mask[:, -x.shape[1] :].to(x.dtype)
        return x * mask.view(*mask.shape, *([1] * (x.dim() - 2)))

    def past(self, x: torch.Tensor, key: str, size: int) -> torch.Tensor | None:
        """The `size - 1` inputs before x at `key` (cached), or None (zeros); keeps x's last `size - 1` as the next
        window (`DeltaWindowsMixin`)."""
        if self.cache is None:
            return None
        past = self.cache.delta_windows.get(key)
        if past is None:
            past = x.new_zeros(x.shape[0], size - 1, *x.shape[2:])
        else:
            past = past[:, past.shape[1] - (size - 1) :].to(x.dtype)
        # In a forward that records gradients only the last size - 1 inputs are kept, as a copy: the whole history
        # would hold a second copy of the input alive as long as the cache.
        history = torch.cat([past, x.detach()], dim=1)
        last = history[:, history.shape[1] - (size - 1) :]
        self.cache.delta_windows[key] = last.clone() if x.requires_grad else history
        return past

    def convolve(self, x: torch.Tensor, key: str, weight: torch.Tensor) -> torch.Tensor:
        """`temporal_conv` of x `[B, T, ...]` over its window at `key`; in packed rows each token reads only its own
        document."""
        size = weight.shape[-1]
        x = self.masked(x)
        past = self.past(x, key, size)
        if past is None:
            past = x.new_zeros(x.shape[0], size - 1, *x.shape[2:])
        return temporal_conv(torch.cat([past, x], dim=1), weight, self.same_document(size))

    def convolve_read(self, x: torch.Tensor, key: str, weight: torch.Tensor) -> torch.Tensor:
        """`convolve(x, key, weight).sum(-1)` as one op (`temporal_conv_read`): x `[B, T, D, d_v]` (or `[B, T, D]`, one
        value channel, weight `[D, 1, K]`) -> `[B, T, D]`."""
        size = weight.shape[-1]
        x = self.masked(x)
        past = self.past(x, key, size)
        if x.dim() == 3:
            x, past = x.unsqueeze(-1), None if past is None else past.unsqueeze(-1)
        return temporal_conv_read(x, weight, past, self.same_document(size))


class DeltaStateConv(nn.Module):
    """The convolution of a TC (`"temporal_conv"`) or CC (`"channel_conv"`) read, before the read vector.

    temporal: `weight` `[D, d_v, K]`, a causal depthwise convolution over the last K tokens of each state entry;
    channel: `weight` `[D, K]`, a convolution across the d_v value channels of each hidden unit.
    Initialised by the model: the identity (conversion) or an average (the reference code's from-scratch choice).
    """

    def __init__(self, kind: str, hidden_size: int, value_channels: int, size: int):
        super().__init__()
        self.kind, self.size = kind, size
        shape = (hidden_size, value_channels, size) if kind == "temporal_conv" else (hidden_size, size)
        self.weight = nn.Parameter(torch.empty(shape))

    def identity(self) -> torch.Tensor:
        """The weight that makes this convolution the identity: the current token's / own channel's tap is 1."""
        weight = torch.zeros(self.weight.shape, dtype=self.weight.dtype, device=self.weight.device)
        weight[..., self.size - 1 if self.kind == "temporal_conv" else (self.size - 1) // 2] = 1.0
        return weight

    def forward(
        self, state: torch.Tensor, read: torch.Tensor | None = None, context: DeltaConvContext | None = None, key=""
    ) -> torch.Tensor:
        """The convolution, then the read vector `read` `[d_v]`: `[..., D, d_v]` -> `[..., D]`; without one (d_v = 1,
        state `[..., D]`) the convolution alone. All of it in `forward`, so that tools which load a module's weights
        around its forward (accelerate's offload hooks) see this weight used."""
        if self.kind == "channel_conv":
            return channel_conv_read(state, self.weight, read)
        # TC: the read vector scales the kernels (W r), and one pass reads the state.
        weight = self.weight if read is None else self.weight * read[:, None]
        return (context or DeltaConvContext()).convolve_read(state, key, weight)


class DeltaEmbedExpand(nn.Module):
    """EC: the embedding `[B, T, D]` lifted to the state `[B, T, D, d_v]` by a causal depthwise convolution over
    tokens with one kernel per value channel (`weight` `[D, d_v, K]`); the identity init repeats the embedding."""

    def __init__(self, hidden_size: int, value_channels: int, size: int):
        super().__init__()
        self.size, self.value_channels = size, value_channels
        self.weight = nn.Parameter(torch.empty(hidden_size, value_channels, size))

    def identity(self) -> torch.Tensor:
        weight = torch.zeros(self.weight.shape, dtype=self.weight.dtype, device=self.weight.device)
        weight[..., -1] = 1.0
        return weight

    def forward(self, embeddings: torch.Tensor, context: DeltaConvContext | None) -> torch.Tensor:
        return (context or DeltaConvContext()).convolve(embeddings.unsqueeze(-1), "embed", self.weight)


class DeltaWindowsMixin:
    """Cache mixin: per temporal convolution, its last inputs, for each sequence in the batch (`delta_windows`).

    A window holds the inputs of the last forward too (K - 1 + T entries), so that assisted decoding can crop the
    tokens it rejects; the next forward keeps only the last K - 1. Memory does not grow with the context. A forward
    that records gradients (training with `use_cache`) keeps only the last K - 1, not a copy of its whole input.
    """

    delta_history: int = 0
    delta_windows: dict[str, torch.Tensor]

    def delta_window_bytes(self) -> int:
        """Bytes held by the windows now: K entries each between decoding steps, whatever the context length."""
        return sum(w.numel() * w.element_size() for w in self.delta_windows.values())

    def _map_windows(self, fn) -> None:
        self.delta_windows = {key: fn(window) for key, window in self.delta_windows.items()}

    def reset(self) -> None:
        super().reset()
        self.delta_windows = {}

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._map_windows(lambda w: w.index_select(0, beam_idx.to(w.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._map_windows(lambda w: w.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._map_windows(lambda w: w[indices])

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        for key, window in self.delta_windows.items():
            keep = window.shape[1] + min(tokens_to_remove, 0)  # crop(0): just shrink back to K - 1 entries
            if keep < self.delta_history:
                raise ValueError(
                    f"Cannot crop {-tokens_to_remove} tokens from the Delta convolution window {key!r}: it holds only "
                    f"the last forward's {window.shape[1] - self.delta_history} tokens."
                )
            self.delta_windows[key] = window[:, keep - self.delta_history : keep]


class DeltaStateCache(DeltaWindowsMixin, DynamicCache):
    """The cache of a Delta model with a temporal variant (`delta_state_read="temporal_conv"` or
    `delta_embed_expand="conv"`): transformers' DynamicCache (keys and values) plus the convolution windows."""

    def __init__(self, config, **kwargs):
        super().__init__(config=config, **kwargs)
        self.delta_history = config.delta_conv_size - 1
        self.delta_windows = {}


# ----------------------------------------------------------------------------------------------------------------
# The Delta residual
# ----------------------------------------------------------------------------------------------------------------


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast switched off, so that beta, k, v and the delta rule run in float32 under fp16 / bf16 autocast."""
    if device_type != "meta" and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


class DeltaResidual(nn.Module):
    """The Delta residual around one sublayer F: `X' = X + beta k (v^T - k^T X)` (+ `F(x) 1^T` in additive mode).

    Holds the read of the state (the read vector `read_weights` and the TC / CC convolution `read_conv`, for d_v > 1),
    the gate `beta = 2 sigmoid(beta_proj(c)) rho` with its opening `rho = clamp(beta_open, 0, 1)`, and the value
    `v_proj`. `owns_read=False` (`delta_shared_read`): the block's other residual reads the state for this one.
    """

    def __init__(self, config, owns_read: bool = True):
        super().__init__()
        hidden_size, value_channels = config.hidden_size, config.delta_value_channels
        self.additive = config.delta_mode == "additive"
        self.eps = config.delta_eps
        self.value_channels = value_channels
        self.erase = config.delta_erase
        self.owns_read = owns_read
        self.read_weights = nn.Parameter(torch.empty(value_channels)) if value_channels > 1 and owns_read else None
        self.read_conv = (
            DeltaStateConv(config.delta_state_read, hidden_size, value_channels, config.delta_conv_size)
            if config.delta_state_read != "linear" and owns_read
            else None
        )
        if config.delta_gate == "linear":
            self.beta_proj = nn.Linear(hidden_size, 1)
        else:  # the paper's eq. A.2: w^T tanh(W_in c)
            self.beta_proj = nn.Sequential(
                nn.Linear(hidden_size, config.delta_gate_hidden_size, bias=False),
                nn.Tanh(),
                nn.Linear(config.delta_gate_hidden_size, 1),
            )
        # [1], not a 0-dim scalar: FSDP2's fully_shard shards along dim 0 and refuses 0-dim parameters.
        self.beta_open = nn.Parameter(torch.empty(1))
        # v = W_v c ("linear"), scale * sigmoid(W_v x + b) from the un-normalised read x ("sigmoid", the authors'
        # default), or a constant in every channel ("constant", no parameters).
        self.value_scale = float(config.delta_value_scale) if config.delta_value == "sigmoid" else None
        self.value_constant = float(config.delta_value_constant)
        self.v_proj = nn.Linear(hidden_size, value_channels) if config.delta_value != "constant" else None

    def read(self, state: torch.Tensor, context: DeltaConvContext | None = None, key: str = "") -> torch.Tensor:
        """The sublayer's input x: the state itself (d_v = 1), or `X w_read` over the value channels, after the TC / CC
        convolution if any (`context` and `key` locate its cached window when generating)."""
        if self.read_conv is not None:
            return self.read_conv(state, self.read_weights, context, key)
        if self.read_weights is not None:
            return state @ self.read_weights.to(state.dtype)
        return state

    def forward(
        self,
        state: torch.Tensor,
        branch: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        context: DeltaConvContext | None = None,
        key: str = "",
        read: torch.Tensor | None = None,
        read_next: str | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """One Delta block: x = read(X), (c, h) = branch(x) with c = norm(x) and h = F(c), then eq. 2.5. Returns the
        new state and beta `[...]`.

        `branch` is a plain function of the block (not a module argument: accelerate's hooks move module arguments
        between devices). `read`: x given by the block (`delta_shared_read`: its other residual read it).
        `read_next=key`: also return, third, this residual's read of the new state at that key, for the residual that
        shares this read. The read happens here, in this module's call, so that offload hooks load its weights.
        """
        x = self.read(state, context, key) if read is None else read
        c, h = branch(x)
        # A registered inference kernel (`ddl_hf.native`) does the update in one call where it applies; else None.
        state, beta = residual_step(self, state, x, c, h) or self.update(state, x, c, h)
        return (state, beta) if read_next is None else (state, beta, self.read(state, context, read_next))

    def update(
        self, state: torch.Tensor, x: torch.Tensor, c: torch.Tensor, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Eq. 2.5 after the branch: the gate beta, the value v and the write `X + beta k (v^T - k^T X)`. Returns the
        new state and beta `[...]`."""
        with autocast_off(state.device.type):
            dtype = self.beta_open.dtype  # the model's float dtype, also when a quantizer replaced the Linears
            opening = at_least_float32(self.beta_open)
            rho = straight_through_clamp(opening, 0.0, 1.0) if opening.requires_grad else opening.clamp(0.0, 1.0)
            beta = delta_gate(at_least_float32(self.beta_proj(c.to(dtype))), rho)  # [..., 1]
            if self.v_proj is None:
                value = beta.new_full((*beta.shape[:-1], self.value_channels), self.value_constant)
            elif self.value_scale is None:
                value = at_least_float32(self.v_proj(c.to(dtype)))
            else:
                value = torch.sigmoid(at_least_float32(self.v_proj(x.to(dtype)))) * self.value_scale
            state = fused_delta_update(state, h, beta, value, self.eps, self.additive, self.erase)
        # beta `[...]` as a tensor of its own, not a view of `[..., 1]` (a sum over one element: exact): FSDP2 warns
        # about views among a sharded block's outputs.
        return state, beta.sum(-1)

    @property
    def gate_output(self) -> nn.Linear:
        """The gate's last linear layer: its output is the logit g of beta = 2 sigmoid(g) rho."""
        return self.beta_proj if isinstance(self.beta_proj, nn.Linear) else self.beta_proj[-1]

    def opening(self) -> float:
        """rho = clamp(beta_open, 0, 1); 0 means beta is exactly 0 for every input (the gate is closed)."""
        return float(self.beta_open.detach().float().clamp(0.0, 1.0))


def _sigmoid(x: float) -> float:
    """The logistic function of a Python float, without overflow for any input (`math.exp` raises above ~709)."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)


@torch.no_grad()
def beta_upper_bound(residual: DeltaResidual, norm: nn.Module) -> float:
    """The largest beta `residual` can produce over every input, given the norm that feeds its gate; 0.0 means beta
    is exactly 0 for every input (rho == 0, or a gate so negative that sigmoid underflows).

    beta = 2 sigmoid(g(c)) rho with c = norm(x) = gamma * n (+ b):
    - LayerNorm: n is zero-mean with |n| < sqrt(D); a linear gate g = w.c + b is at most
      w.b_ln + b + sqrt(D) |center(w * gamma)| (the least upper bound: the best n points along the centred w * gamma);
    - RMSNorm: |n| < sqrt(D), not zero-mean; a linear gate is at most b + sqrt(D) |w * gamma| (the least upper bound);
    - an mlp gate g = w.tanh(W c) + b is at most |w|_1 + b (an upper bound that may not be reached).
    """
    rho = residual.opening()
    if rho == 0.0:
        return 0.0
    out = residual.gate_output
    w, b = out.weight.float()[0], float(out.bias.float()[0])
    if not isinstance(residual.beta_proj, nn.Linear):
        g_max = float(w.abs().sum()) + b
    elif isinstance(norm, nn.LayerNorm):
        scaled = w * norm.weight.float()
        centred = scaled - scaled.mean()
        g_max = float(w @ norm.bias.float()) + b + math.sqrt(w.numel()) * float(centred.norm())
    else:
        g_max = b + math.sqrt(w.numel()) * float((w * norm.weight.float()).norm())
    return 2.0 * rho * _sigmoid(g_max)  # float64 sigmoid is 0.0 only below g = -745, where float32 beta is 0 too


# ----------------------------------------------------------------------------------------------------------------
# Outputs and the steps every Delta base model adds around its layers
# ----------------------------------------------------------------------------------------------------------------


def with_delta_outputs(name: str, output_class: type) -> type:
    """transformers' `output_class` plus the Delta models' two outputs.

    betas (with `output_betas=True`): one `[batch_size, seq_len]` tensor per Delta residual, two per layer (attention,
        then MLP).
    expanded_states (with `output_expanded_states=True`, `delta_value_channels > 1` only): the residual state
        `[batch_size, seq_len, hidden_size, d_v]` entering the first layer and leaving every layer
        (`num_hidden_layers + 1` tensors). `hidden_states` keeps transformers' `[batch_size, seq_len, hidden_size]`.
    """
    fields = ("betas", "expanded_states")
    namespace = {"__annotations__": dict.fromkeys(fields, "tuple[torch.FloatTensor, ...] | None")}
    namespace.update(dict.fromkeys(fields), __module__=__name__, __qualname__=name, __doc__=with_delta_outputs.__doc__)
    return dataclass(type(name, (output_class,), namespace))


def hidden_states_contract(forward):
    """Keep transformers' `hidden_states` contract (`[batch, seq_len, hidden_size]`) when the state is expanded.

    With `delta_value_channels > 1` the layers pass `[.., hidden_size, d_v]` states, which transformers' output
    recorder would return as they are. Each expanded state X is returned as its read `X w_out` with the model's final
    read vector (the last entry stays the final `last_hidden_state`, as for GPT-2); the states themselves are an
    opt-in output of their own, `output_expanded_states=True`.
    """

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        want_expanded = bool(kwargs.pop("output_expanded_states", False))
        if self.value_channels == 1:
            return forward(self, *args, **kwargs)
        want_hidden = kwargs.get("output_hidden_states", self.config.output_hidden_states)
        if want_hidden is None or want_hidden is False:
            want_hidden = None
        if not (want_expanded or want_hidden is not None):
            return forward(self, *args, **kwargs)
        return_dict = kwargs.pop("return_dict", getattr(self.config, "return_dict", True))
        kwargs["output_hidden_states"] = True  # every state recorded; the selection is made below
        outputs = forward(self, *args, return_dict=True, _hand_over_final_state=True, **kwargs)
        # The forward hands over the last state, and the read of every layer's input state (`record_read`).
        final_state, *reads = outputs.expanded_states
        states = outputs.hidden_states  # the expanded states, the last one tied to `last_hidden_state`
        fields = {key: value for key, value in outputs.items() if key not in ("hidden_states", "expanded_states")}
        if want_expanded:
            fields["expanded_states"] = (*states[:-1], final_state)
        if want_hidden is not None:
            entries = (*reads, states[-1])  # as GPT-2's: every position, None where a chosen-layer request skips it
            chosen = set(hidden_states_indices(self, want_hidden, len(entries)))
            fields["hidden_states"] = tuple(entry if i in chosen else None for i, entry in enumerate(entries))
        outputs = type(outputs)(**fields)
        return outputs if return_dict else outputs.to_tuple()

    return wrapper


class _ReadInGraph(torch.autograd.Function):
    """The expanded state X unchanged, with its read h = X w made one of its parents, so that a `hidden_states` entry
    is in the graph as GPT-2's are (`h.retain_grad()` works). The gradient reaching X passes on whole: its component
    along u = w / |w|^2 goes through h (dL/dh holding X - h u^T fixed), the rest straight to X."""

    @staticmethod
    def forward(ctx, read: torch.Tensor, state: torch.Tensor, u: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(u, w)
        return state.view_as(state)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        u, w = ctx.saved_tensors
        grad_read = grad @ u
        return grad_read, grad - grad_read.unsqueeze(-1) * w, None, None


class DeltaStateMixin:
    """The Delta steps around a stack of layers, shared by every Delta base model (DeltaGPT, DeltaLlama).

    Needs `value_channels`, `embed_expand`, `read_out` and `read_out_conv` on the model."""

    def check_window_cache(self, cache: Cache | None) -> None:
        """TC / EC variants convolve over tokens: refuse a cache that cannot keep their windows."""
        config = self.config
        if config.delta_temporal and cache is not None and not isinstance(cache, DeltaWindowsMixin):
            raise TypeError(
                f"delta_state_read={config.delta_state_read!r} / delta_embed_expand="
                f"{config.delta_embed_expand!r} convolve over tokens and need a cache that keeps their windows, "
                f"got {type(cache).__name__}; pass cache=DeltaStateCache(model.config) or let the "
                "model create it (use_cache=True)."
            )

    def expand_state(self, embeddings: torch.Tensor, context: DeltaConvContext) -> torch.Tensor:
        """X_0: the embedding itself (d_v = 1), convolved into the channels (EC), or repeated over them (a view)."""
        if self.embed_expand is not None:
            return self.embed_expand(embeddings, context)
        if self.value_channels > 1:
            return embeddings.unsqueeze(-1).expand(*embeddings.shape, self.value_channels)
        return embeddings

    def record_read(self, state: torch.Tensor, reads: list[torch.Tensor]) -> torch.Tensor:
        """Append to `reads` the `hidden_states` entry of an expanded state (its read with the final read vector) and
        return the state, with that read in its graph when autograd is on (`_ReadInGraph`; same values)."""
        w = self.read_out.detach().to(state.dtype)
        read = state @ w
        reads.append(read)
        if not torch.is_grad_enabled():
            return state
        norm = w @ w
        u = torch.where(norm > 0, w / norm, torch.zeros_like(w))  # w = 0: the read carries no gradient
        return _ReadInGraph.apply(read, state, u, w)

    def read_state_out(self, state: torch.Tensor, context: DeltaConvContext) -> torch.Tensor:
        """What the final norm receives: the last state read with `read_out` (after the TC / CC convolution)."""
        if self.read_out_conv is not None:
            return self.read_out_conv(state, self.read_out if self.value_channels > 1 else None, context, "read_out")
        if self.value_channels > 1:
            return state @ self.read_out.to(state.dtype)
        return state

    def check_read_out_placement(self, inputs: torch.Tensor) -> None:
        """`read_out` is a bare parameter of the whole model: accelerate, which loads an offloaded weight only around
        the forward of the module that owns it, cannot load it when a device map offloads it on its own entry."""
        if self.value_channels > 1 and self.read_out.is_meta and not inputs.is_meta:
            prefix = "" if self.base_model is self else f"{type(self).__name__}."
            raise RuntimeError(
                f"{prefix}read_out (the final read vector, delta_value_channels floats) is still on the meta "
                "device: a device_map gave this bare parameter an offloaded device of its own ('disk', or 'cpu' when "
                "the model runs on a GPU), and accelerate loads offloaded weights only around the forward of the "
                "module that owns them. Map 'transformer.read_out' ('model.read_out' for DeltaLlama, 'read_out' for a "
                "base model) to the execution device, as device_map='auto' does, or offload the base model as a whole."
            )


def check_token_ids(input_ids: torch.Tensor | None, vocab_size: int) -> None:
    """A clear error for token ids outside the vocabulary (not an index error deep inside the embedding), checked on
    the device without making the host wait (`torch._assert_async`)."""
    if input_ids is None or not input_ids.numel():
        return
    inside = ((input_ids >= 0) & (input_ids < vocab_size)).all()
    torch._assert_async(
        inside,
        f"input_ids contain token ids outside [0, vocab_size={vocab_size}). Use the tokenizer the model was trained "
        "with, or call model.resize_token_embeddings(len(tokenizer)) after adding tokens.",
    )


def packed_document_starts(
    position_ids: torch.Tensor | None,
    cu_seq_lens: torch.Tensor | None,
    shape: tuple[int, int],
    past_seen_tokens: int,
) -> torch.Tensor | None:
    """Where documents start in packed rows, `[B, T]` bool, for what runs over tokens (the DeltaNet mixer's state and
    short convolution, the TC / EC convolutions of the residual state); None when nothing can start.

    Packed / padding-free batches (trl `packing=True`, `DataCollatorWithFlattening`) put several documents in one
    row: a document starts where the caller's `position_ids` restart at 0, and at every `cu_seq_lens` boundary
    (cumulative lengths over the flattened batch, as flash-attention kwargs). A cache that already holds tokens
    cannot be continued by a new document (its state belongs to the previous one): refused, on the device.
    """
    if position_ids is None and cu_seq_lens is None:
        return None
    if past_seen_tokens and cu_seq_lens is not None:
        raise ValueError(
            f"Packed input (cu_seq_lens) cannot continue a cache that already holds {past_seen_tokens} tokens, whose "
            "recurrent state / convolution windows belong to the previous document. Run packed rows without a cache."
        )
    device = (position_ids if cu_seq_lens is None else cu_seq_lens).device
    starts = torch.zeros(shape, dtype=torch.bool, device=device)
    if position_ids is not None:
        starts = starts | (position_ids == 0)
    if cu_seq_lens is not None:
        # Every boundary but the last marks a start; one slot past the end takes those beyond the tokens.
        numel = starts.numel()
        boundaries = cu_seq_lens[:-1].long().clamp(0, numel)
        marks = torch.zeros(numel + 1, dtype=torch.int32, device=device).index_add_(
            0, boundaries, torch.ones_like(boundaries, dtype=torch.int32)
        )
        starts = starts | (marks[:numel] > 0).view(shape)
    if past_seen_tokens:
        torch._assert_async(
            ~starts.any(),
            "Packed input (position_ids restarting at 0) cannot continue a cache that already holds "
            f"{past_seen_tokens} tokens, whose recurrent state / convolution windows belong to the previous "
            "document. Run packed rows without a cache (or with an empty one).",
        )
        return None  # nothing starts: the usual decoding path
    return starts


# ----------------------------------------------------------------------------------------------------------------
# Initialisation: the exact start of a conversion and the authors' from-scratch start
# ----------------------------------------------------------------------------------------------------------------


def init_delta_residual_exactly(module: DeltaResidual, beta0: float, std: float) -> None:
    """beta = 2 sigmoid(w^T c + b) rho. The last gate layer starts at w = 0, so beta is the same for every token;
    rho (the opening) and b are set so that beta == beta0 exactly. v_proj: GPT-2's N(0, std)."""
    gate_out = module.gate_output
    init.zeros_(gate_out.weight)
    if beta0 <= 1.0:
        init.constant_(module.beta_open, beta0)
        init.zeros_(gate_out.bias)  # 2 sigmoid(0) = 1 exactly
    else:
        half = min(beta0 / 2.0, 1.0 - 1e-9)
        init.constant_(module.beta_open, 1.0)
        init.constant_(gate_out.bias, math.log(half / (1.0 - half)))
    if module.v_proj is not None:
        init.normal_(module.v_proj.weight, mean=0.0, std=std)
        init.zeros_(module.v_proj.bias)


# The authors' initialisation at commit d1f7621 of github.com/yifanzhang-pro/deep-delta-learning
# (`model/init_utils.py::init_gpt_weights`, `model/modules/initialization.py::spectral_std`): every matrix
# N(0, spectral_std) with their `hidden_init_std_factor` 0.5; biases other than the gate's keep nn.Linear's default.
REFERENCE_COMMIT = "d1f76215c999be3089fe3132fe30e7a63dc8bbcb"
REFERENCE_STD_FACTOR = 0.5


def spectral_std(fan_in: int, fan_out: int, factor: float = REFERENCE_STD_FACTOR) -> float:
    """The reference's std of an `[fan_out, fan_in]` matrix: factor / sqrt(fan_in) * min(1, sqrt(fan_out / fan_in))."""
    return factor / math.sqrt(fan_in) * min(1.0, math.sqrt(fan_out / fan_in))


def init_delta_residual_as_reference(module: DeltaResidual, beta0: float) -> None:
    """The reference's Delta residual at `REFERENCE_COMMIT`: gate matrices N(0, spectral_std), the gate's bias
    logit(beta0 / 2) (p clamped to [1e-6, 1 - 1e-6]) with the opening rho = 1 (they have none), v_proj's weight
    N(0, spectral_std) and its bias nn.Linear's U(-1/sqrt(D), 1/sqrt(D)).

    beta0 == 0 (their gate cannot be shut): rho = 0 and the bias 0, so that beta is exactly 0 for every input, as the
    config's `delta_beta_init=0.0` says, and rho still receives a gradient (`straight_through_clamp`)."""
    for layer in module.beta_proj.modules() if isinstance(module.beta_proj, nn.Sequential) else [module.beta_proj]:
        if isinstance(layer, nn.Linear):
            init.normal_(layer.weight, mean=0.0, std=spectral_std(layer.in_features, layer.out_features))
    shut = beta0 <= 0.0
    p = 0.5 if shut else min(max(min(beta0, 2.0) / 2.0, 1e-6), 1.0 - 1e-6)
    init.constant_(module.gate_output.bias, math.log(p / (1.0 - p)))
    init.constant_(module.beta_open, 0.0 if shut else 1.0)
    v_proj = module.v_proj
    if v_proj is not None:
        init.normal_(v_proj.weight, mean=0.0, std=spectral_std(v_proj.in_features, v_proj.out_features))
        bound = 1.0 / math.sqrt(v_proj.in_features)
        init.uniform_(v_proj.bias, -bound, bound)


def resolve_delta_init(config, loading: bool) -> None:
    """Fill `delta_init=None` (auto) and `delta_beta_init=None` in the config with what the model uses.

    auto = "exact" for Delta parameters a loaded checkpoint lacks (conversion), "reference" for a model built from
    its config; `delta_beta_init=None` = 0.0 under "exact", 1.0 (the reference code's value) under "reference".
    Written back so that a saved config says how the model started.
    """
    if config.delta_init is None:
        config.delta_init = "exact" if loading else "reference"
    if config.delta_beta_init is None:
        config.delta_beta_init = 0.0 if config.delta_init == "exact" else 1.0


class DeltaSite(NamedTuple):
    """Where a Delta residual sits: its module name, its short label, the module, and the norm feeding it."""

    name: str
    short_name: str
    residual: nn.Module
    norm: nn.Module


#: `config._attn_implementation` under the serving engines' Transformers backends, which run the model with every
#: scheduled sequence packed into one row and no cache, so nothing carries over from one decoding step to the next
#: (vLLM: "vllm", "vllm_mla"; SGLang: "sglang", the same contract, not tested here). docs/serving.md.
SERVING_ENGINES = {"vllm": "vLLM", "vllm_mla": "vLLM", "sglang": "SGLang"}


def state_across_tokens(config: PreTrainedConfig) -> list[str]:
    """The settings of `config` that carry state from one token to the next (TC, EC, the DeltaNet mixer): what a
    cache must keep between decoding steps. Empty for every other variant."""
    settings = []
    if config.delta_state_read == "temporal_conv":
        settings.append("delta_state_read='temporal_conv' (TC)")
    if config.delta_embed_expand == "conv":
        settings.append("delta_embed_expand='conv' (EC)")
    if getattr(config, "token_mixer", "attention") == "delta_net":
        settings.append("token_mixer='delta_net' (DeltaNet)")
    return settings


def refuse_state_across_tokens_in_serving_engines(config: PreTrainedConfig) -> None:
    """One ValueError, while the engine builds the model, for a variant with state across tokens under a serving
    engine's Transformers backend: its tokens would differ from `generate`'s without an error. Nothing elsewhere."""
    engine = SERVING_ENGINES.get(getattr(config, "_attn_implementation", None))
    settings = state_across_tokens(config)
    if engine is None or not settings:
        return
    name = type(config).__name__.removesuffix("Config")
    raise ValueError(
        f"{name} with {' and '.join(settings)} carries state across tokens, which {engine}'s Transformers backend "
        "does not keep between decoding steps (it runs the model without a cache), so its tokens would differ from "
        "generate's: refused. Serve this model with transformers (generate, pipeline), or serve a variant without "
        "state across tokens (delta_state_read='linear' or 'channel_conv', delta_embed_expand='repeat', "
        "token_mixer='attention'); see ddl-hf's docs/serving.md."
    )


class DeltaPreTrainedMixin:
    """What every Delta model's `PreTrainedModel` base adds: the one place that says which modules and parameters are
    Delta (conversion, export, DeltaTrainer, DeltaStatsCallback and `ddl-hf inspect` all ask these methods), and the
    Delta initialisation. The family's base sets `layers_attribute` (its base model's list of layers)."""

    layers_attribute: str = "layers"
    # transformers' `_keep_in_fp32_modules`: every quantizer (bitsandbytes 4 / 8 bit, ...) leaves these modules
    # unquantized, and a float16 load keeps their checkpoint tensors in float32 (bf16 loads are unchanged). They are the
    # precision-critical Delta parts: each residual (the gate `beta_proj` and its MLP form, `beta_open`, `v_proj`, the
    # read `read_weights` / `read_conv`), the TC / CC read-out and EC convolutions. transformers matches each entry by
    # `re.match` from the start of a module name (quantizers; or a suffix) and by `re.search` in a parameter name (the
    # float16 plan): `.+\.` ties the names to a layer, so the sublayers' own `self_attn.v_proj`, `c_attn` still
    # quantize. DeltaNet's beta projection (`attn.b_proj`, num_heads outputs) is kept out of quantization only: `$` ends
    # at the module name, so no parameter name matches and it keeps the model's dtype, as the mixer computes it.
    # Not `read_out`: a bare parameter, cast to the state's dtype where it is used, and the model's first parameter
    # (`model.dtype`) when d_v > 1. Each instance declares only the entries it has a module for (`post_init`), as
    # transformers' `test_keep_in_fp32_modules_exist` asks; that test matches state-dict names, which the
    # quantization-only `$` entry never does by design.
    _keep_in_fp32_modules = [r".+\.(?:attn|mlp)_delta", r".+\.attn\.b_proj$", "read_out_conv", "embed_expand"]

    def __init__(self, config, *inputs, **kwargs):
        super().__init__(config, *inputs, **kwargs)
        refuse_state_across_tokens_in_serving_engines(self.config)
        if state_across_tokens(config):
            # transformers' capability flag, per instance (it depends on the variant): the convolution windows and the
            # DeltaNet state have no static cache, so transformers' compiled generation cannot run; tools and tests
            # that read the flag skip it up front (the refusal in `_prepare_cache_for_generation` stays).
            self._can_compile_fullgraph = False

    def post_init(self) -> None:
        names = [name for name, _ in self.named_modules()]
        self._keep_in_fp32_modules = [
            entry
            for entry in type(self)._keep_in_fp32_modules
            if any(re.fullmatch(rf"(?:.*\.)?(?:{entry})", name) for name in names)
        ]
        super().post_init()

    def delta_residuals(self, short_names: bool = False) -> dict[str, nn.Module]:
        """Every Delta residual in forward order (per layer: attention, then MLP), by module name.

        Names are relative to this model (`transformer.h.0.attn_delta` on a head model), or `L0.attn`, `L0.mlp`, ...
        with `short_names=True`. A wrapper that a tool put in a residual's place (peft's `modules_to_save`) is
        returned as it is: it runs, and forwards attribute access to, the active copy.
        """
        return {site.short_name if short_names else site.name: site.residual for site in self.delta_sites()}

    def delta_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters that the source checkpoint does not have (gates, values, reads), by name."""
        prefix = self._base_prefix()
        owners = tuple(f"{site.name}." for site in self.delta_sites())
        owners += (f"{prefix}read_out_conv.", f"{prefix}embed_expand.")
        read_out = f"{prefix}read_out"
        return {n: p for n, p in self.named_parameters() if n.startswith(owners) or n == read_out}

    @torch.no_grad()
    def beta_upper_bounds(self) -> dict[str, float]:
        """The largest beta each Delta residual can produce over every input (see `beta_upper_bound`)."""
        return {site.name: beta_upper_bound(site.residual, site.norm) for site in self.delta_sites()}

    def _base_prefix(self) -> str:
        return "" if self.base_model is self else f"{self.base_model_prefix}."

    def delta_sites(self) -> list[DeltaSite]:
        """Every Delta residual with its name, short name and the norm that feeds its sublayer and gate."""
        prefix = f"{self._base_prefix()}{self.layers_attribute}"
        return [
            DeltaSite(f"{prefix}.{i}.{attr}", f"L{i}.{attr.removesuffix('_delta')}", residual, norm)
            for i, layer in enumerate(getattr(self.base_model, self.layers_attribute))
            for attr, (residual, norm) in layer.delta_residuals().items()
        ]

    def _initialize_missing_keys(self, is_quantized: bool) -> None:
        """Loading a checkpoint: Delta parameters it lacks (a source checkpoint: conversion) get the exact init
        unless the config asks otherwise, so `delta_init=None` never changes a converted model's function. A load
        that supplied no weight at all (`from_pretrained(None, config=..., state_dict={})`, as sharded loading and
        transformers' own init tests do) builds the model from its config, as `XxxForCausalLM(config)` does."""
        tied = set(self._tied_weights_keys or ())  # marked as loaded even when the checkpoint lacks both ends
        supplied = any(was_loaded(p) for name, p in self.named_parameters() if name not in tied)
        resolve_delta_init(self.config, loading=supplied)
        super()._initialize_missing_keys(is_quantized)

    def _adjust_missing_and_unexpected_keys(self, loading_info) -> None:
        """A ddl-hf 0.1 checkpoint (0-dim `beta_open`) is refused with one line naming `ddl-hf upgrade`."""
        check_checkpoint_format(self, loading_info)
        super()._adjust_missing_and_unexpected_keys(loading_info)

    def initialize_weights(self) -> None:
        """Built from its config (from scratch): `delta_init=None` becomes the reference code's init."""
        resolve_delta_init(self.config, loading=False)
        super().initialize_weights()

    def init_delta_weights(self, module: nn.Module) -> None:
        """The Delta part of `_init_weights`: residuals that start at exactly `config.delta_beta_init` (or the
        reference's start), read vectors at 1 / d_v, identity (exact) or averaging (reference) convolutions."""
        config = self.config
        resolve_delta_init(config, loading=False)  # no-op once resolved
        if isinstance(module, DeltaResidual):
            if config.delta_init == "reference":
                init_delta_residual_as_reference(module, float(config.delta_beta_init))
            else:
                init_delta_residual_exactly(module, float(config.delta_beta_init), config.initializer_range)
            if module.read_weights is not None:
                init.constant_(module.read_weights, 1.0 / module.value_channels)
        elif isinstance(module, DeltaStateConv):
            if config.delta_init == "exact":
                init.copy_(module.weight, module.identity())
            else:
                init.constant_(module.weight, 1.0 / module.size)
        elif isinstance(module, DeltaEmbedExpand):
            init.copy_(module.weight, module.identity())  # the reference code starts EC as the repeat, too
        elif isinstance(module, DeltaStateMixin) and module.value_channels > 1:
            init.constant_(module.read_out, 1.0 / module.value_channels)


__all__ = [
    "REFERENCE_COMMIT",
    "DeltaConvContext",
    "DeltaEmbedExpand",
    "DeltaPreTrainedMixin",
    "DeltaResidual",
    "DeltaSite",
    "DeltaStateCache",
    "DeltaStateConv",
    "DeltaStateMixin",
    "DeltaWindowsMixin",
    "autocast_off",
    "beta_upper_bound",
    "check_token_ids",
    "hidden_states_contract",
    "init_delta_residual_as_reference",
    "init_delta_residual_exactly",
    "packed_document_starts",
    "resolve_delta_init",
    "spectral_std",
    "with_delta_outputs",
]
