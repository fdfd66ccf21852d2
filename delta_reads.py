"""The reads of the residual state and its expansion (Deep Delta Learning's variants; docs/variants.md).

A Delta model's residual state X is `[B, T, D]` (d_v = 1) or `[B, T, D, d_v]`. Every sublayer reads its input out
of it (`DeltaRead`: a read vector, after a temporal (TC) or channel (CC) convolution for those variants), and EC lifts
the embedding into it (`DeltaEmbedExpand`). The temporal convolutions keep their last `delta_conv_size - 1` inputs
per sequence in the cache when generating (`DeltaStateCache`). The math is in `delta_ops.py`.

Self-contained Hub custom-code file: it imports only torch, transformers and its sibling files, which
`save_pretrained` copies next to the weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

# First: below the supported transformers / torch it stops here with one clear error (delta_compat.py).
from .delta_compat import check_installed_versions  # noqa: F401

# isort: split
from transformers.cache_utils import DynamicCache, StaticCache
from transformers.configuration_utils import PreTrainedConfig

from .delta_fused import channel_conv_read, temporal_conv_read
from .delta_ops import (
    TENSOR_OPS,
    DeltaKernels,
    delta_kernels,
    same_document_taps,
    temporal_conv,
)
from .delta_state import EMBED_WINDOW


class WindowSource(Protocol):
    """Where the temporal convolutions (TC reads, EC) find the inputs before each token, by the window's key in the
    model's `StatePlan`: transformers' `DeltaConvContext` (the cache's windows; rows of tokens) or ddl-hf's vLLM route
    (`ddl_hf.vllm_windows.ServingWindows`: vLLM's per-sequence state; one token per row)."""

    def convolve(self, x: torch.Tensor, key: str, weight: torch.Tensor) -> torch.Tensor:
        """`temporal_conv` of x `[.., T, D, 1]` over its window at `key`: EC's expansion `[.., T, D, d_v]`."""
        ...

    def convolve_read(
        self,
        x: torch.Tensor,
        key: str,
        weight: torch.Tensor,
        read: torch.Tensor | None = None,
        kernels: DeltaKernels = TENSOR_OPS,
    ) -> torch.Tensor:
        """The TC read of x `[.., T, D, d_v]` (or `[.., T, D]`) over its window at `key`, with the read vector `read`
        folded into the kernels: `[.., T, D]`."""
        ...


@dataclass
class DeltaConvContext:
    """What a temporal convolution needs besides its input: the padding mask, the cache holding its windows, and
    where packed documents start (transformers' `WindowSource`).

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

    def window(self, key: str, size: int) -> torch.Tensor | None:
        """The last `size - 1` inputs cached at `key` (a view), or None (none cached: zeros)."""
        past = None if self.cache is None else self.cache.delta_windows.get(key)
        return None if past is None else past[:, past.shape[1] - (size - 1) :]

    def past(self, x: torch.Tensor, key: str, size: int) -> torch.Tensor | None:
        """The `size - 1` inputs before x at `key` (cached), or None (zeros); keeps x's last `size - 1` as the next
        window (`DeltaWindowsMixin`)."""
        if self.cache is None:
            return None
        past = self.window(key, size)
        past = x.new_zeros(x.shape[0], size - 1, *x.shape[2:]) if past is None else past.to(x.dtype)
        # In a forward that records gradients only the last size - 1 inputs are kept, as a copy: the whole history
        # would hold a second copy of the input alive as long as the cache.
        history = torch.cat([past, x.detach()], dim=1)
        if self.keeps_history(x):
            self.cache.keep_window(key, history)
        else:
            last = history[:, history.shape[1] - (size - 1) :]
            self.cache.keep_window(key, last.clone() if x.requires_grad else last)
        # A static cache has just overwritten the window `past` may view: its rows as they were live on in `history`.
        return past if self.cache.delta_keeps_history else history[:, : size - 1]

    def keeps_history(self, x: torch.Tensor) -> bool:
        """Whether the next window is the last forward's whole input, `[past, x]` (what assisted decoding crops), or
        its last `size - 1` inputs: in a forward that records gradients and in a static cache."""
        return self.cache is not None and self.cache.delta_keeps_history and not x.requires_grad

    def convolve(self, x: torch.Tensor, key: str, weight: torch.Tensor) -> torch.Tensor:
        """`temporal_conv` of x `[B, T, ...]` over its window at `key`; in packed rows each token reads only its own
        document."""
        size = weight.shape[-1]
        x = self.masked(x)
        past = self.past(x, key, size)
        if past is None:
            past = x.new_zeros(x.shape[0], size - 1, *x.shape[2:])
        return temporal_conv(torch.cat([past, x], dim=1), weight, self.same_document(size))

    def convolve_read(
        self,
        x: torch.Tensor,
        key: str,
        weight: torch.Tensor,
        read: torch.Tensor | None = None,
        kernels: DeltaKernels = TENSOR_OPS,
    ) -> torch.Tensor:
        """`convolve(x, key, weight * read[:, None]).sum(-1)` as one op (`temporal_conv_read`, or the model's
        `temporal_read`): x `[B, T, D, d_v]` (or `[B, T, D]`, one value channel, weight `[D, 1, K]`, no read vector)
        -> `[B, T, D]`."""
        size = weight.shape[-1]
        x = self.masked(x)
        if kernels.temporal_read is not None:  # the read vector folded into the op, which writes the next window
            past = self.window(key, size)
            one_channel = x.dim() == 3
            if one_channel:
                x, past = x.unsqueeze(-1), None if past is None else past.unsqueeze(-1)
            history = self.keeps_history(x)
            y, window = kernels.temporal_read(x, weight, read, past, self.same_document(size), history)
            if self.cache is not None:
                self.cache.keep_window(key, window.squeeze(-1) if one_channel else window)
            return y
        past = self.past(x, key, size)
        if x.dim() == 3:
            x, past = x.unsqueeze(-1), None if past is None else past.unsqueeze(-1)
        same_document = self.same_document(size)
        weight = weight if read is None else weight * read[:, None]
        return temporal_conv_read(x, weight, past, same_document, kernels.tc_read)


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
        self,
        state: torch.Tensor,
        read: torch.Tensor | None = None,
        context: WindowSource | None = None,
        window: str = "",
        kernels: DeltaKernels = TENSOR_OPS,
    ) -> torch.Tensor:
        """The convolution, then the read vector `read` `[d_v]`: `[..., D, d_v]` -> `[..., D]`; without one (d_v = 1,
        state `[..., D]`) the convolution alone. `window`: where the cache keeps a TC read's last inputs; `kernels`:
        the model's (`channel_read` for CC; `temporal_read` or `tc_read` for TC)."""
        if self.kind == "channel_conv":
            return channel_conv_read(state, self.weight, read, kernels.channel_read)
        # TC: the read vector scales the kernels (W r), and one pass reads the state.
        return (context or DeltaConvContext()).convolve_read(state, window, self.weight, read, kernels)


class DeltaRead(nn.Module):
    """x = read(X): what a sublayer (or the final norm) receives from the residual state.

    The state itself at d_v = 1; `X w` with the read vector `weights` `[d_v]` at d_v > 1; after the TC / CC
    convolution `conv` where the config asks for one (docs/variants.md). A block calls its `attn_read` before the
    attention and its `mlp_read` before the MLP (with `delta_shared_read`, `attn_read` again); the model's `read_out`
    reads the last state for the final norm. `window` names the cache entry of a TC read's last inputs, one per call
    site. Everything runs in `forward`, so that tools which load a module's weights around its forward (accelerate's
    offload hooks) see these weights used.
    """

    def __init__(self, config: PreTrainedConfig):
        super().__init__()
        self.config = config  # its `delta_implementation` names the read's kernels
        value_channels = config.delta_value_channels
        self.weights = nn.Parameter(torch.empty(value_channels)) if value_channels > 1 else None
        self.conv = (
            DeltaStateConv(config.delta_state_read, config.hidden_size, value_channels, config.delta_conv_size)
            if config.delta_state_read != "linear"
            else None
        )

    def forward(self, state: torch.Tensor, context: WindowSource | None = None, window: str = "") -> torch.Tensor:
        if self.conv is None and self.weights is None:
            return state
        kernels = delta_kernels(self.config.delta_implementation, state)
        if self.conv is not None:
            return self.conv(state, self.weights, context, window, kernels)
        if kernels.read is not None:
            return kernels.read(state, self.weights)
        return state @ self.weights.to(state.dtype)


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

    def forward(self, embeddings: torch.Tensor, context: WindowSource | None) -> torch.Tensor:
        return (context or DeltaConvContext()).convolve(embeddings.unsqueeze(-1), EMBED_WINDOW, self.weight)


class DeltaWindowsMixin:
    """Cache mixin: per temporal convolution, its last inputs, for each sequence in the batch (`delta_windows`).

    A window holds the inputs of the last forward too (K - 1 + T entries), so that assisted decoding can crop the
    tokens it rejects; the next forward keeps only the last K - 1. Memory does not grow with the context. A forward
    that records gradients (training with `use_cache`) keeps only the last K - 1, not a copy of its whole input.
    """

    delta_history: int = 0
    delta_windows: dict[str, torch.Tensor]
    #: Whether a window holds the last forward's inputs too (False: only the last K - 1, `DeltaStaticStateCache`).
    delta_keeps_history: bool = True
    #: What `generate` asks of the cache class that keeps a model's state across tokens (`state_cache_class`):
    #: whether its state rolls back over rejected draft tokens (assisted decoding, `crop`), and its static form
    #: (compiled generation; None: there is none).
    rolls_back: bool = True
    static_form: type | None = None

    @classmethod
    def refuse_rollback(cls, role: str) -> None:
        """A ValueError where this state cannot roll back for `role` (assisted decoding); the windows can."""

    def keep_window(self, key: str, window: torch.Tensor) -> None:
        """Keep `window` `[B, L, ...]` (L >= K - 1) as the inputs before the next forward's at `key`."""
        self.delta_windows[key] = window

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
        for key, window in self.delta_windows.items():  # first: a refused crop leaves the keys and values whole
            if window.shape[1] + min(tokens_to_remove, 0) < self.delta_history:
                held = "a static cache holds only the last K - 1 inputs (use the dynamic cache to crop)"
                if self.delta_keeps_history:
                    held = f"it holds only the last forward's {window.shape[1] - self.delta_history} tokens"
                raise ValueError(
                    f"Cannot crop {-tokens_to_remove} tokens from the Delta convolution window {key!r}: {held}."
                )
        super().crop(tokens_to_remove)
        if self.delta_keeps_history:
            for key, window in self.delta_windows.items():
                keep = window.shape[1] + min(tokens_to_remove, 0)  # crop(0): just shrink back to K - 1 entries
                self.delta_windows[key] = window[:, keep - self.delta_history : keep]


class DeltaStaticStateCache(DeltaWindowsMixin, StaticCache):
    """`DeltaStateCache`'s static form, what `generate(..., cache_implementation="static")` builds for a temporal
    variant (compiled decoding, CUDA graphs): transformers' StaticCache plus each convolution window as a buffer of
    fixed shape and address `[B, K - 1, ...]`, allocated by the first forward (the prefill) and written in place after.
    It keeps no history beyond the last K - 1 inputs, so it cannot crop decoded tokens (as DeltaNetCache)."""

    delta_keeps_history = False

    def __init__(self, config, max_cache_len: int, **kwargs):
        super().__init__(config=config, max_cache_len=max_cache_len, **kwargs)
        self.delta_history = config.delta_conv_size - 1
        self.delta_windows = {}

    def keep_window(self, key: str, window: torch.Tensor) -> None:
        last = window[:, window.shape[1] - self.delta_history :]
        buffer = self.delta_windows.get(key)
        if buffer is None or buffer.shape != last.shape or buffer.dtype != last.dtype:
            buffer = torch.zeros_like(last, memory_format=torch.contiguous_format)
            if not torch.compiler.is_compiling():  # as StaticCache's keys and values: no recompilation, CUDA graphs
                torch._dynamo.mark_static_address(buffer)
            self.delta_windows[key] = buffer
        buffer.copy_(last)

    def reset(self) -> None:
        StaticCache.reset(self)  # the windows keep their buffers (and addresses), zeroed
        for buffer in self.delta_windows.values():
            buffer.zero_()


class DeltaStateCache(DeltaWindowsMixin, DynamicCache):
    """The cache of a Delta model with a temporal variant (`delta_state_read="temporal_conv"` or
    `delta_embed_expand="conv"`): transformers' DynamicCache (keys and values) plus the convolution windows."""

    static_form = DeltaStaticStateCache

    def __init__(self, config, **kwargs):
        super().__init__(config=config, **kwargs)
        self.delta_history = config.delta_conv_size - 1
        self.delta_windows = {}

    @classmethod
    def require(cls, cache) -> None:
        """A TypeError for a cache given to a temporal variant that cannot keep its windows."""
        if cache is not None and not isinstance(cache, DeltaWindowsMixin):
            raise TypeError(
                "A temporal variant (delta_state_read='temporal_conv' or delta_embed_expand='conv') convolves over "
                f"tokens and needs a cache that keeps its windows, got {type(cache).__name__}; pass "
                "cache=DeltaStateCache(model.config) (static: DeltaStaticStateCache(model.config, max_cache_len=...)) "
                "or let the model create it (use_cache=True)."
            )


__all__ = [
    "DeltaConvContext",
    "DeltaEmbedExpand",
    "DeltaRead",
    "DeltaStateCache",
    "DeltaStateConv",
    "DeltaStaticStateCache",
    "DeltaWindowsMixin",
    "WindowSource",
]
