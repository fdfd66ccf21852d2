"""PyTorch DeltaGPT: GPT-2 whose every attention and MLP residual is a Deep Delta Learning block.

Deep Delta Learning (Zhang, Liu, Wang, Gu; arXiv 2601.00417) replaces the identity shortcut `X + F(X)` with the
Delta Operator `A = I - beta k k^T` and a synchronous rank-1 write: `X' = A X + beta k v^T`.
GPT-2's own attention and MLP (`GPT2Attention`, `GPT2MLP`) are the sublayers, so every attention backend,
the `Conv1D` weights and GPT-2's parameter names carry over; only the Delta parameters are new.

Reads top to bottom like `modeling_gpt2.py`: the Delta residual (the module around a sublayer), the DeltaNet token
mixer and its cache, the block, the pretrained base, the model and its heads. The tensor math itself lives in
`delta_ops.py`.

Self-contained Hub custom-code file: it imports only torch, transformers and its sibling files
(`configuration_delta_gpt.py`, `delta_ops.py`, `delta_compat.py`), which `save_pretrained` copies next to the
weights. Whatever differs between transformers / torch releases is absorbed in `delta_compat.py`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

# First: below the supported transformers / torch it stops here with one clear error (delta_compat.py).
from .delta_compat import (
    CACHE_ARG,
    OutputRecorder,
    cache_argument,
    cache_of,
    capture_outputs,
    is_unhooked,
    load_legacy_shapes,
    merge_with_config_defaults,
    slice_logits_to_keep,
    takes_cache,
    was_loaded,
)

# isort: split
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache, LinearAttentionLayer
from transformers.generation import GenerationMixin, GenerationMode
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPastAndCrossAttentions,
    CausalLMOutputWithCrossAttentions,
    SequenceClassifierOutputWithPast,
    TokenClassifierOutput,
)
from transformers.modeling_utils import PreTrainedModel
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP, GPT2Attention
from transformers.pytorch_utils import Conv1D
from transformers.utils import can_return_tuple

from .configuration_delta_gpt import DeltaGPTConfig
from .delta_ops import (
    _WIDE_FLOATS,
    _native_applies,
    at_least_float32,
    channel_conv,
    channel_conv_read_weight,
    delta_gate,
    delta_rule_chunkwise,
    delta_rule_recurrent,
    delta_update,
    fused_delta_update,
    one_token_delta_update,
    same_document_taps,
    sigmoid,
    straight_through_clamp,
    temporal_conv,
    temporal_conv_read,
    temporal_conv_read_window,
    unit_direction,
)

# ----------------------------------------------------------------------------------------------------------------
# The paper's variants of reading and expanding the state (docs/variants.md): small modules around delta_ops'
# convolutions. The temporal ones keep their last `delta_conv_size - 1` inputs in the cache when generating.
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class DeltaConvContext:
    """What a temporal convolution needs besides its input: the padding mask and the cache holding its windows.

    `token_mask` `[B, T]` (1 = token, 0 = padding): padded positions enter the convolution as zeros, the same as
    the zeros before the start of a sequence, so a left-padded prompt reads what it reads alone.
    """

    token_mask: torch.Tensor | None = None
    cache: DeltaWindowsMixin | None = None
    document_starts: torch.Tensor | None = None

    def convolve(self, x: torch.Tensor, key: str, weight: torch.Tensor) -> torch.Tensor:
        """`temporal_conv` of x with its window at `key`; in packed rows each token reads only its own document."""
        size = weight.shape[-1]
        starts = self.document_starts
        return temporal_conv(
            self.history(x, key, size), weight, None if starts is None else same_document_taps(starts, size)
        )

    def convolve_read(self, x: torch.Tensor, key: str, weight: torch.Tensor, kernel: Any = None) -> torch.Tensor:
        """`convolve(x, key, weight).sum(-1)` as one pass (`temporal_conv_read`, with the native `kernel` if given):
        neither the zero-padded history nor the `[B, T, D, d_v]` convolution is made, except the history that a cache
        keeps as the window. x `[B, T, D]` is one value channel (d_v = 1, weight `[D, 1, K]`): the read is
        `convolve(x, key, weight[:, 0])`, and the window keeps x's shape."""
        size = weight.shape[-1]
        starts = self.document_starts
        if self.cache is None:
            x, past = self.masked(x), None
        else:  # the window the cache keeps is the history: its first size - 1 rows are the past
            history = self.history(x, key, size)
            if history.dim() == 3:
                history = history.unsqueeze(-1)
            if history.shape[1] == size and starts is None:  # one token: its window is the whole history
                return temporal_conv_read_window(history, weight).unsqueeze(1)
            if history.requires_grad:  # save the state itself and a copy of the past, not slices of a second copy
                x, past = self.masked(x), history[:, : size - 1].clone()
            else:
                x, past = history[:, size - 1 :], history[:, : size - 1]
        document = None if starts is None else same_document_taps(starts, size)
        return temporal_conv_read(x.unsqueeze(-1) if x.dim() == 3 else x, weight, past, document, kernel)

    def read_cached(
        self, kernel: Callable, x: torch.Tensor, key: str, weight: torch.Tensor, read: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The TC read of a forward with a cache and without autograd (a prompt, then each decoded token) with the
        native `kernel` (`ddl_hf.native.enable_native_decoding`): the new window and `convolve_read(x, key,
        weight * read[:, None])` (d_v = 1: `weight`) in one call. None without a cache or where the kernel declines,
        and the tensor path reads."""
        if self.cache is None:
            return None
        starts = self.document_starts
        document = None if starts is None else same_document_taps(starts, weight.shape[-1])
        windows = self.cache.delta_windows
        result = kernel(x, windows.get(key), weight, read, self.token_mask, document)
        if result is None:
            return None
        windows[key] = result[1]
        return result[0]

    def masked(self, x: torch.Tensor) -> torch.Tensor:
        """x `[B, T, ...]` with padded positions zeroed (as the zeros before the start of a sequence)."""
        if self.token_mask is None:
            return x
        mask = self.token_mask[:, -x.shape[1] :].to(x.dtype)
        return x * mask.view(*mask.shape, *([1] * (x.dim() - 2)))

    def history(self, x: torch.Tensor, key: str, size: int) -> torch.Tensor:
        """`[B, size - 1 + T, ...]`: the previous `size - 1` inputs at `key` (cached, or zeros), then x."""
        x = self.masked(x)
        past = self.cache.delta_window(key) if self.cache is not None else None
        if past is None:
            past = x.new_zeros(x.shape[0], size - 1, *x.shape[2:])
        else:
            past = past[:, past.shape[1] - (size - 1) :].to(x.dtype)
        history = torch.cat([past, x], dim=1)
        if self.cache is not None:
            # In a forward that records gradients (training) only the last size - 1 inputs are kept, as a copy: the
            # whole history would hold a second copy of the input alive as long as the cache.
            window = history[:, history.shape[1] - (size - 1) :].clone() if history.requires_grad else history
            self.cache.set_delta_window(key, window.detach())
        return history


class DeltaStateConv(nn.Module):
    """The read of a TC (`"temporal_conv"`) or CC (`"channel_conv"`) variant: a convolution, then the read vector.

    temporal: `weight` `[D, d_v, K]`, a causal depthwise convolution over the last K tokens of each state entry;
    channel: `weight` `[D, K]`, a convolution across the d_v value channels of each hidden unit.
    Initialised by the model: the identity (conversion) or an average (the reference code's from-scratch choice).
    """

    # The native training kernels (`ddl_hf.native.enable_native_training`): the TC read in one pass over the state,
    # forward and backward. Optional: None (the default) keeps `temporal_conv_read`'s tensor ops.
    native_read: Any = None
    # The native read of a forward without autograd (`ddl_hf.native.enable_native_decoding`) in one call: TC's with a
    # cache (the read and the new window, for the prompt and each decoded token), CC's folded read. Optional: None
    # keeps the tensor ops.
    inference_read: Callable | None = None

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
        context: DeltaConvContext | None = None,
        key: str = "",
    ) -> torch.Tensor:
        """The convolution, then the read vector `read` `[d_v]` if given: `[..., D, d_v]` -> `[..., D]`; without one
        (d_v = 1, state `[..., D]`) the convolution alone. CC folds both into one `[D, d_v]` weight
        (`channel_conv_read_weight`): one pass over the state instead of 2K + 1.

        All of it happens in `forward`, so that tools which load a module's weights around its forward (accelerate's
        offload hooks) see this weight used."""
        weight = self._parameters["weight"]  # from the dict: decoding is all per-call overhead
        if (
            self.inference_read is not None
            and (read is None) == (state.dim() == 3)  # the read, not every channel's convolution
            and not torch.is_grad_enabled()
            and _native_applies(state)
        ):
            out = self._read_natively(state, weight, read, context, key)
            if out is not None:
                return out
        if self.kind == "channel_conv":
            if read is None:
                return channel_conv(state, weight)
            return (state * channel_conv_read_weight(weight, read).to(state.dtype)).sum(-1)
        context = context or DeltaConvContext()
        if state.dim() == 3:  # d_v = 1: the state is [B, T, D], its read the convolution itself, in one pass
            return context.convolve_read(state, key, weight, self.native_read)
        if read is None:
            return context.convolve(state, key, weight)
        # TC: the read vector scales the kernels (W r), and one pass reads the state (`temporal_conv_read`).
        return context.convolve_read(state, key, weight * read[:, None], self.native_read)

    def _read_natively(
        self,
        state: torch.Tensor,
        weight: torch.Tensor,
        read: torch.Tensor | None,
        context: DeltaConvContext | None,
        key: str,
    ) -> torch.Tensor | None:
        """The read with `inference_read`: CC's folded read; TC's with its cached window (`read_cached`). None where
        the kernel declines (or TC runs without a cache), and the tensor ops read."""
        if self.kind == "channel_conv":
            return self.inference_read(state, weight, read)
        return None if context is None else context.read_cached(self.inference_read, state, key, weight, read)

    def __getstate__(self) -> dict:
        """Pickling (`torch.save(model)`, `copy.deepcopy`) leaves out the native reads, compiled extensions that cannot
        be pickled: the copy reads with tensor ops (the same values) until `enable_native_training` /
        `enable_native_decoding` is called on it."""
        state = super().__getstate__().copy()
        state.pop("native_read", None)
        state.pop("inference_read", None)
        return state


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
    """Cache mixin: per temporal convolution, its last `delta_conv_size - 1` inputs, for each sequence in the batch.

    A window holds the inputs of the last forward too (K - 1 + T entries), so that assisted decoding can crop the
    tokens it rejects; the next forward keeps only the last K - 1. Memory does not grow with the context. A forward
    that records gradients (training with `use_cache`) keeps only the last K - 1, not a copy of its whole input.
    """

    delta_history: int = 0

    @property
    def delta_windows(self) -> dict[str, torch.Tensor]:
        if "_delta_windows" not in self.__dict__:
            self._delta_windows = {}
        return self._delta_windows

    def delta_window(self, key: str) -> torch.Tensor | None:
        return self.delta_windows.get(key)

    def set_delta_window(self, key: str, window: torch.Tensor) -> None:
        self.delta_windows[key] = window

    def delta_window_bytes(self) -> int:
        """Bytes held by the windows now: K entries each between decoding steps (the K - 1 kept and the last token),
        whatever the context length."""
        return sum(w.numel() * w.element_size() for w in self.delta_windows.values())

    def reset(self) -> None:
        super().reset()
        self.delta_windows.clear()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        for key, window in self.delta_windows.items():
            self.delta_windows[key] = window.index_select(0, beam_idx.to(window.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        for key, window in self.delta_windows.items():
            self.delta_windows[key] = window.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        for key, window in self.delta_windows.items():
            self.delta_windows[key] = window[indices]

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
    """The cache of an attention DeltaGPT with a temporal variant (`delta_state_read="temporal_conv"` or
    `delta_embed_expand="conv"`): transformers' DynamicCache (keys and values) plus the convolution windows."""

    def __init__(self, config: DeltaGPTConfig, **kwargs):
        super().__init__(config=config, **kwargs)
        self.delta_history = config.delta_conv_size - 1


class DeltaResidual(nn.Module):
    """The Delta residual around one sublayer; shared by both modes and every number of value channels.

    `read` gives the sublayer its input from the state; `forward` writes the sublayer output back.
    `fused = False` switches to the plain autograd path (`delta_update`), the readable reference.
    """

    fused: bool = True
    # A native one-token update (`ddl_hf.native.enable_native_decoding`): one call instead of `_update_one_token`'s
    # ~14 tensor calls. Optional: None (the default) keeps the Python host path.
    one_token_kernel: Callable | None = None
    # The native training kernels (`ddl_hf.native.enable_native_training`): the fused update in one pass over the
    # state, forward and backward. Optional: None keeps `fused_delta_update`'s tensor ops.
    native_update: Any = None

    def __init__(self, config: DeltaGPTConfig, owns_read: bool = True):
        super().__init__()
        hidden_size, value_channels = config.hidden_size, config.delta_value_channels
        self.additive = config.delta_mode == "additive"
        self.eps = config.delta_eps
        self.value_channels = value_channels
        self.erase = config.delta_erase
        # owns_read=False (`delta_shared_read`): the block reads for this residual with its other residual's read.
        self.owns_read = owns_read
        if value_channels > 1 and owns_read:
            self.read_weights = nn.Parameter(torch.empty(value_channels))
        # TC / CC: a convolution before the read vector (docs/variants.md).
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
        # [1], not a 0-dim scalar: FSDP2's fully_shard shards along dim 0 and refuses 0-dim parameters. Checkpoints
        # of ddl-hf 0.1 hold it 0-dim: `_load_from_state_dict` and delta_compat's loading conversion reshape them.
        self.beta_open = nn.Parameter(torch.empty(1))
        # v = W_v c ("linear"), scale * sigmoid(W_v r + b) from the un-normalised read r ("sigmoid", the authors'
        # default), or a constant in every channel ("constant", no parameters).
        self.value_scale = float(config.delta_value_scale) if config.delta_value == "sigmoid" else None
        if config.delta_value == "constant":
            self.v_proj = None
            self.value_constant = float(config.delta_value_constant)
        else:
            self.v_proj = nn.Linear(hidden_size, value_channels)

    def __getstate__(self) -> dict:
        """Pickling (`torch.save(model)`, `copy.deepcopy`) leaves out the native kernels, compiled extensions that
        cannot be pickled: the copy decodes on the Python host path and trains with tensor ops (the same tokens and
        values) until `ddl_hf.native.enable_native_decoding` / `enable_native_training` is called on it."""
        state = super().__getstate__().copy()
        state.pop("one_token_kernel", None)
        state.pop("native_update", None)
        return state

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args, **kwargs) -> None:
        """`load_state_dict` (Trainer resume, peft adapters, DCP) of a checkpoint with the 0-dim `beta_open` of
        ddl-hf 0.1: the same number as `[1]`, and so is an optimizer state saved with it (`_reshape_0_dim_state`)."""
        key = f"{prefix}beta_open"
        if key in state_dict and state_dict[key].dim() == 0:
            state_dict[key] = state_dict[key].reshape(1)
            self.beta_open._ddl_hf_0_dim_state = True
            _reshape_0_dim_state.arm()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

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
        # sigmoid in float64 reaches 0.0 only below g = -745, where the model's float32 beta is 0 too.
        return 2.0 * rho * sigmoid(g_max)

    def read(self, state: torch.Tensor, context: DeltaConvContext | None = None, key: str = "") -> torch.Tensor:
        """The sublayer's input: the state itself (d_v = 1), or `X w_read` over the value channels, after the
        TC / CC convolution if any (`context` and `key` locate its cached window when generating).

        Runs through this module's call (see `forward`'s `read_from`) whenever it uses a parameter, so that hooks
        which load its weights around its forward (accelerate offload) fire for the read too."""
        if self.read_conv is None and self.value_channels == 1:
            return state
        if not self.owns_read:
            raise RuntimeError("This residual shares its block's read (delta_shared_read): read with attn_delta.")
        return self(state, read_from=(context, key))[0]

    def _read(self, state: torch.Tensor, context: DeltaConvContext | None, key: str) -> torch.Tensor:
        read_weights = self._parameters.get("read_weights")  # from the dicts, as in `_update`
        read_conv = self._modules.get("read_conv")
        if read_conv is not None:
            return read_conv(state, read_weights, context, key)
        return _read_channels(state, read_weights)

    def forward(
        self,
        state: torch.Tensor,
        normed_input: torch.Tensor | None = None,
        branch_output: torch.Tensor | None = None,
        read_from: tuple | None = None,
        read: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return the new state and beta `[batch, seq_len]`.

        `read` is the un-normalised read of the state that `normed_input` normalises (`self.read(state)`): the
        input of `delta_value="sigmoid"`, which needs it.

        `read_from=(context, key)` does the residual's read instead and returns `(read, None)`: the read uses this
        module's `read_weights`, and tools that load a module's weights only around its forward (accelerate's disk /
        CPU offload hooks replace `forward`) would otherwise leave them on the meta device. transformers' output
        recorder and `DeltaStatsCallback` skip the `None` in place of beta.
        """
        if read_from is not None:
            return self._read(state, *read_from), None
        if self.value_scale is None:
            value_input = normed_input
        elif read is None:
            raise ValueError(
                "delta_value='sigmoid' computes v from the un-normalised read of the state: call the residual as "
                "residual(state, normed_input, branch_output, read=residual.read(state))."
            )
        else:
            value_input = read
        if not torch.is_grad_enabled() and self._takes_one_token_path():  # decoding: checked first, cheaply
            if self.one_token_kernel is not None:
                update = self._update_one_token_natively(state, normed_input, branch_output, value_input)
                if update is not None:  # None: the kernel found these inputs outside the one-token path
                    return update
            elif self._updates_one_token_on_host(state, normed_input, branch_output, value_input):
                return self._update_one_token(state, normed_input, branch_output, value_input)
        with autocast_off("cpu" if state.is_cpu else state.device.type):  # `device` builds an object per call
            return self._update(state, normed_input, branch_output, value_input)

    def _update(
        self, state: torch.Tensor, normed_input: torch.Tensor, branch_output: torch.Tensor, value_input: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Parameters and submodules straight from their dicts: `self.beta_open` misses the instance dict first,
        # and CPython formats an AttributeError before nn.Module.__getattr__ finds it (~1 µs per lookup, and
        # decoding is all such overhead). The same objects either way.
        parameters, modules = self._parameters, self._modules
        opening = parameters["beta_open"]
        dtype = opening.dtype  # the model's float dtype, also when a quantizer replaced the Linears
        c = normed_input if normed_input.dtype == dtype else normed_input.to(dtype)
        opening = at_least_float32(opening)
        # Without autograd the straight-through clamp is a plain clamp (same value, fewer ops for generation).
        rho = (
            straight_through_clamp(opening, 0.0, 1.0)
            if torch.is_grad_enabled() and opening.requires_grad
            else opening.clamp(0.0, 1.0)
        )
        beta = delta_gate(at_least_float32(_linear(modules["beta_proj"], c)), rho)  # [..., 1]
        v_proj = modules.get("v_proj")  # None for the constant value (then an instance attribute)
        if v_proj is not None:
            x = value_input if value_input.dtype == dtype else value_input.to(dtype)
            value = at_least_float32(_linear(v_proj, x))
            if self.value_scale is not None:
                value = torch.sigmoid(value) * self.value_scale
        else:
            value = beta.new_full((*beta.shape[:-1], self.value_channels), self.value_constant)
        if self.fused:
            new_state = fused_delta_update(
                state, branch_output, beta, value, self.eps, self.additive, self.erase, self.native_update
            )
        else:
            k = unit_direction(branch_output, self.eps)
            branch = branch_output if self.additive else None
            new_state = delta_update(state, k, beta.squeeze(-1), value, branch, self.erase)
        # The returned beta `[...]` is a tensor of its own, not a view of `[..., 1]` (a sum over one element: exact):
        # FSDP2 warns about views among a sharded block's outputs, as an in-place op on one would skip its all-gather.
        return new_state, beta.sum(-1)

    def _takes_one_token_path(self) -> bool:
        """The half of the one-token check that does not depend on the inputs: outside compile / export / jit
        tracing (a host read-back would break the graph; checked first, so that compiling adds no guards for the
        rest), on the fused path, with plain unhooked projections and the linear gate."""
        modules = self._modules
        v_proj = modules.get("v_proj")
        return (
            not torch.compiler.is_compiling()
            and not torch.jit.is_tracing()
            and self.fused
            and _is_plain_linear(modules["beta_proj"])
            and (v_proj is None or _is_plain_linear(v_proj))
        )

    def _updates_one_token_on_host(
        self, state: torch.Tensor, c: torch.Tensor, branch_output: torch.Tensor, value_input: torch.Tensor
    ) -> bool:
        """Given autograd off and `_takes_one_token_path`, whether `_update_one_token` applies to these inputs: one
        token at batch 1 (decoding), on the CPU, without autocast, in float32 / float64 throughout (the parameters
        too). Everything else takes the tensor path. The native kernel checks the same conditions itself."""
        dtype = state.dtype
        return (
            state.is_cpu
            and branch_output.numel() == branch_output.shape[-1]
            and dtype in _WIDE_FLOATS
            and branch_output.dtype == dtype
            and c.dtype == dtype
            and value_input.dtype == dtype
            and self._parameters["beta_open"].dtype == dtype
            and not torch.is_autocast_enabled("cpu")
        )

    def _update_one_token(
        self, state: torch.Tensor, c: torch.Tensor, branch_output: torch.Tensor, value_input: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`_update` for one decoded token on the CPU: beta as a Python float (the gate logit read back), v from one
        `addmv`, then `one_token_delta_update`: the same math in 28 aten operator calls instead of 42 at d_v = 1, and
        60% of the instructions (docs/performance.md)."""
        modules = self._modules
        v_proj = modules.get("v_proj")
        c = c.reshape(-1)
        rho = min(max(self._parameters["beta_open"].item(), 0.0), 1.0)
        beta = 2.0 * sigmoid(_matvec(modules["beta_proj"], c).item()) * rho
        if v_proj is not None:
            value = _matvec(v_proj, value_input.reshape(-1))
            if self.value_scale is not None:
                value = torch.sigmoid(value) * self.value_scale
        else:
            value = torch.full((self.value_channels,), self.value_constant, dtype=state.dtype)
        new_state = one_token_delta_update(state, branch_output, beta, value, self.eps, self.additive, self.erase)
        return new_state, torch.full(branch_output.shape[:-1], beta, dtype=state.dtype)

    def _update_one_token_natively(
        self, state: torch.Tensor, c: torch.Tensor, branch_output: torch.Tensor, value_input: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`_update_one_token` as one call of `one_token_kernel` (`ddl_hf.native`), which returns None for inputs
        that `_updates_one_token_on_host` would refuse."""
        modules = self._modules
        v_proj = modules.get("v_proj")
        gate, value = modules["beta_proj"]._parameters, v_proj._parameters if v_proj is not None else {}
        return self.one_token_kernel(
            state,
            c,
            branch_output,
            gate["weight"],
            gate["bias"],
            value.get("weight"),
            value.get("bias"),
            self._parameters["beta_open"],
            self.__dict__.get("value_constant", 0.0),
            self.eps,
            self.additive,
            self.erase,
            value_input,
            self.value_scale or 0.0,
        )


class _Reshape0DimState:
    """An optimizer state saved with a 0-dim `beta_open` (a ddl-hf 0.1 Trainer checkpoint: AdamW's `exp_avg` and
    `exp_avg_sq`) reshaped to the parameter's `[1]` before the first step after such a checkpoint was loaded (the
    fused AdamW would not mind, the other optimizers broadcast into it and fail). One global step pre-hook, armed by
    the load and gone after its first step: every later state of the parameter is `[1]` already."""

    handle = None

    def arm(self) -> None:
        if self.handle is None:
            self.handle = register_optimizer_step_pre_hook(self)

    def __call__(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        self.handle.remove()
        self.handle = None
        for group in optimizer.param_groups:
            for param in group["params"]:
                if getattr(param, "_ddl_hf_0_dim_state", False):
                    state = optimizer.state.get(param, {})
                    for key, value in state.items():  # `step` is 0-dim by design
                        if key != "step" and torch.is_tensor(value) and value.dim() == 0:
                            state[key] = value.reshape(param.shape)


_reshape_0_dim_state = _Reshape0DimState()


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast switched off, so that beta, k, v and the delta rule run in float32 under fp16 / bf16 autocast; no
    context at all where autocast is not on (nothing to enter and leave, no autocast node in a compiled graph)."""
    if device_type != "meta" and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _is_plain_linear(module: nn.Module) -> bool:
    """Whether calling `module(x)` is exactly `F.linear(x, weight, bias)`: an unhooked `nn.Linear` itself, not a
    subclass or replacement (dynamic quantization, LoRA)."""
    return type(module) is nn.Linear and is_unhooked(module)


def _read_channels(state: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`X w`: the expanded state `[..., D, d_v]` read over its value channels. w is cast only when its dtype differs
    (a no-op cast still costs a dispatch when decoding)."""
    return state @ (weights if weights.dtype == state.dtype else weights.to(state.dtype))


def _matvec(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`F.linear` of a plain `nn.Linear` on one vector `x` `[D]`, as `addmv` (half the dispatch cost of `F.linear`)."""
    parameters = linear._parameters
    weight, bias = parameters["weight"], parameters["bias"]
    return torch.mv(weight, x) if bias is None else torch.addmv(bias, weight, x)


def _linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)`, calling `F.linear` directly where that is exactly what the call would do (`_is_plain_linear`).

    nn.Module's call machinery costs about as much as the D -> 1 matvec itself when decoding one token (~5 µs on
    CPU), and every Delta residual makes two such calls.
    """
    if _is_plain_linear(module):
        parameters = module._parameters
        return nn.functional.linear(x, parameters["weight"], parameters["bias"])
    return module(x)


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


_NO_CACHE_ROLLBACK = (
    "A token_mixer='delta_net' DeltaGPT cannot be used {role}: that rolls the cache back over rejected draft tokens, "
    "and DeltaNet's recurrent state cannot forget tokens (its fixed-size state is the point of the mixer). Use plain "
    "generate (greedy, sampling, beam search), or a token_mixer='attention' model for assisted decoding."
)


class DeltaNetCache(DeltaWindowsMixin, Cache):
    """The cache of a `token_mixer="delta_net"` DeltaGPT: one `DeltaNetCacheLayer` per layer, no growing KV tensors.

    `DeltaGPTModel` and `generate` create it; pass one yourself as `cache=DeltaNetCache(config)`.
    """

    def __init__(self, config: DeltaGPTConfig):
        super().__init__(layers=[DeltaNetCacheLayer() for _ in range(config.num_hidden_layers)])
        self.delta_history = config.delta_conv_size - 1

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


def require_delta_net_cache(cache: Cache | None) -> None:
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
        require_delta_net_cache(cache)
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
            y = self.conv1d(x)[..., -seq_len:]
        else:
            # The document of every input, inputs before the new tokens (cached window, padding) in the first one.
            document = nn.functional.pad(document_starts.long().cumsum(-1), (x.shape[-1] - seq_len, 0))
            span = seq_len + self.conv_size - 1
            y = self.conv1d(x[..., -span:], document[:, -span:])
        return nn.functional.silu(y).transpose(1, 2)


def packed_document_starts(
    position_ids: torch.Tensor | None,
    cu_seq_lens: torch.Tensor | None,
    shape: tuple[int, int],
    past_seen_tokens: int,
) -> torch.Tensor | None:
    """Where documents start in packed rows, `[B, T]` bool, for what runs over tokens (the DeltaNet mixer's state and
    short convolution, the TC/EC convolutions of the residual state); None when nothing is packed.

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
                "Packed input (position_ids restarting at 0 or cu_seq_lens) cannot continue a cache that already "
                f"holds {past_seen_tokens} tokens, whose recurrent state / convolution windows belong to "
                "the previous document. Run packed rows without a cache (or with an empty one)."
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
        self.layer_idx = layer_idx

        self.ln_1 = nn.LayerNorm(hidden_size, eps=config.layer_norm_epsilon)
        if config.token_mixer == "delta_net":
            self.attn = DeltaNetAttention(config=config, layer_idx=layer_idx)
        else:
            self.attn = GPT2Attention(config=config, layer_idx=layer_idx)
        self.attn_delta = DeltaResidual(config)
        self.ln_2 = nn.LayerNorm(hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(inner_dim, config)
        self.mlp_delta = DeltaResidual(config, owns_read=not config.delta_shared_read)

    def delta_residuals(self) -> dict[str, tuple[nn.Module, nn.LayerNorm]]:
        """{attribute name: (Delta residual, the LayerNorm that produces its sublayer and gate input)}."""
        return {"attn_delta": (self.attn_delta, self.ln_1), "mlp_delta": (self.mlp_delta, self.ln_2)}

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        use_cache: bool | None = False,
        delta_context: DeltaConvContext | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The new state and the betas of the attention and MLP Delta residuals (recorded for `output_betas`)."""
        attn_delta, mlp_delta = self.attn_delta, self.mlp_delta
        read = attn_delta.read(hidden_states, delta_context, f"h.{self.layer_idx}.attn")
        normed = self.ln_1(read)
        if isinstance(self.attn, DeltaNetAttention) and delta_context is not None:
            kwargs["document_starts"] = delta_context.document_starts  # attention reads documents from its mask
        attn_output, _ = self.attn(
            normed,
            attention_mask=attention_mask,
            use_cache=use_cache,
            **cache_argument(cache),
            **kwargs,
        )
        hidden_states, attn_beta = attn_delta(hidden_states, normed, attn_output, read=read)

        reader = mlp_delta if mlp_delta.owns_read else attn_delta  # delta_shared_read: one read per block
        read = reader.read(hidden_states, delta_context, f"h.{self.layer_idx}.mlp")
        normed = self.ln_2(read)
        hidden_states, mlp_beta = mlp_delta(hidden_states, normed, self.mlp(normed), read=read)
        return hidden_states, attn_beta, mlp_beta


def _with_delta_outputs(name: str, output_class: type) -> type:
    """transformers' `output_class` plus DeltaGPT's two outputs. One definition for the four heads' outputs.

    betas (with `output_betas=True`): one `[batch_size, seq_len]` tensor per Delta block, two per layer (attention,
        then MLP).
    expanded_states (with `output_expanded_states=True`, `delta_value_channels > 1` only): the residual state
        `[batch_size, seq_len, hidden_size, d_v]` entering the first layer and leaving every layer
        (`num_hidden_layers + 1` tensors). `hidden_states` keeps transformers' `[batch_size, seq_len, hidden_size]`.
    """
    fields = ("betas", "expanded_states")
    namespace = {"__annotations__": dict.fromkeys(fields, "tuple[torch.FloatTensor, ...] | None")}
    namespace.update(dict.fromkeys(fields), __module__=__name__, __qualname__=name, __doc__=_with_delta_outputs.__doc__)
    return dataclass(type(name, (output_class,), namespace))


DeltaGPTModelOutput = _with_delta_outputs("DeltaGPTModelOutput", BaseModelOutputWithPastAndCrossAttentions)
DeltaGPTCausalLMOutput = _with_delta_outputs("DeltaGPTCausalLMOutput", CausalLMOutputWithCrossAttentions)
DeltaGPTSequenceClassifierOutput = _with_delta_outputs(
    "DeltaGPTSequenceClassifierOutput", SequenceClassifierOutputWithPast
)
DeltaGPTTokenClassifierOutput = _with_delta_outputs("DeltaGPTTokenClassifierOutput", TokenClassifierOutput)


def _signature_computed_once(forward):
    """Store `inspect.signature(forward)` on it: `generate` asks for the signature of a custom-code model's `forward`
    on every decoding step (a compatibility check for remote code), which costs ~35 µs per token when the
    decorated function has to be unwrapped and inspected again; a stored `__signature__` answers at once."""
    forward.__signature__ = inspect.signature(forward)
    return forward


def _hidden_states_contract(forward):
    """Keep transformers' `hidden_states` contract (`[batch, seq_len, hidden_size]`) when the state is expanded.

    With `delta_value_channels > 1` the blocks pass `[.., hidden_size, d_v]` states, which transformers' output
    recorder would return as they are; generation, assisted decoding and every tool built on `hidden_states` expect
    `[.., hidden_size]`. Each expanded state X is returned as its read `X w_out` with the model's final read vector
    (what `ln_f` would receive if the model ended there; the last entry stays the final `last_hidden_state`, as for
    GPT-2), and the states themselves are an opt-in output of their own, `output_expanded_states=True`.
    """

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        want_expanded = bool(kwargs.pop("output_expanded_states", False))
        if self.value_channels == 1:
            return forward(self, *args, **kwargs)
        want_hidden = kwargs.get("output_hidden_states", self.config.output_hidden_states)
        if not (want_expanded or want_hidden):
            return forward(self, *args, **kwargs)  # nothing to replace (generation: no output rebuilt per token)
        return_dict = kwargs.pop("return_dict", getattr(self.config, "return_dict", True))
        if want_expanded:
            kwargs["output_hidden_states"] = True
        outputs = forward(self, *args, return_dict=True, _hand_over_final_state=True, **kwargs)
        # The forward hands over the last state, and the read of every block's input state (`record_read`).
        final_state, *reads = outputs.expanded_states
        states = outputs.hidden_states  # the expanded states, the last one tied to `last_hidden_state`
        fields = {key: value for key, value in outputs.items() if key not in ("hidden_states", "expanded_states")}
        if want_expanded:
            fields["expanded_states"] = (*states[:-1], final_state)
        if want_hidden and states is not None:
            fields["hidden_states"] = (*reads, states[-1])
        outputs = type(outputs)(**fields)
        return outputs if return_dict else outputs.to_tuple()

    return wrapper


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
    _skip_keys_device_placement = ["past_key_values", "cache"]  # the cache, under either name
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True
    _can_record_outputs = {
        "hidden_states": DeltaGPTBlock,
        "attentions": OutputRecorder(GPT2Attention, layer_name=".attn", index=1),
        # From the block, which is hooked for hidden states anyway: a hook on every Delta residual would put each
        # of their calls on nn.Module's slow path (about as costly as the call itself when decoding).
        "betas": [OutputRecorder(DeltaGPTBlock, index=1), OutputRecorder(DeltaGPTBlock, index=2)],
    }
    _keys_to_ignore_on_load_unexpected = ["attn.bias", "attn.masked_bias"]

    def __init__(self, config: DeltaGPTConfig, *inputs, **kwargs):
        super().__init__(config, *inputs, **kwargs)
        if config.token_mixer == "delta_net":
            # transformers reads these class flags from the instance; they depend on the mixer, so per instance.
            # Stateful: the recurrent state cannot be rolled back, so generate refuses assisted decoding up front.
            # `_can_compile_fullgraph` stays True: prefill and decoding steps compile with fullgraph=True (tested);
            # generate never auto-compiles it, as DeltaNetCache is not `is_compileable` (no static cache).
            self._is_stateful = True

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
        prefix = self._base_prefix()
        owners = tuple(f"{site.name}." for site in self._delta_sites())
        owners += (f"{prefix}read_out_conv.", f"{prefix}embed_expand.")
        read_out = f"{prefix}read_out"
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

    def _initialize_missing_keys(self, is_quantized: bool) -> None:
        """Loading a checkpoint: Delta parameters it lacks (a GPT-2 checkpoint: conversion) get the exact init
        unless the config asks otherwise, so `delta_init=None` never changes a converted model's function. A load
        that supplied no weight at all (`from_pretrained(None, config=..., state_dict={})`, as sharded loading and
        transformers' own init tests do) builds the model from its config, as `DeltaGPTForCausalLM(config)` does."""
        tied = set(self._tied_weights_keys or ())  # marked as loaded even when the checkpoint lacks both ends
        supplied = any(was_loaded(p) for name, p in self.named_parameters() if name not in tied)
        resolve_delta_init(self.config, loading=supplied)
        super()._initialize_missing_keys(is_quantized)

    def initialize_weights(self) -> None:
        """Built from its config (from scratch): `delta_init=None` becomes the reference code's init."""
        resolve_delta_init(self.config, loading=False)
        super().initialize_weights()

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
            resolve_delta_init(self.config, loading=False)  # no-op once resolved
            if self.config.delta_init == "reference":
                init_delta_residual_as_reference(module, float(self.config.delta_beta_init))
            else:
                init_delta_residual_exactly(module, float(self.config.delta_beta_init), std)
            if "read_weights" in module._parameters:  # both schemes; none where the block's read is shared
                init.constant_(module.read_weights, 1.0 / module.value_channels)
        if isinstance(module, DeltaStateConv):
            # exact: the identity (a converted model computes GPT-2); reference: an average over the K taps.
            if self.config.delta_init == "exact":
                init.copy_(module.weight, module.identity())
            else:
                init.constant_(module.weight, 1.0 / module.size)
        if isinstance(module, DeltaEmbedExpand):
            init.copy_(module.weight, module.identity())  # the reference code starts EC as the repeat, too
        if isinstance(module, DeltaGPTModel) and module.config.delta_value_channels > 1:
            init.constant_(module.read_out, 1.0 / module.config.delta_value_channels)


# Checkpoints of ddl-hf 0.1 hold `beta_open` 0-dim (today `[1]`): `from_pretrained` reshapes them on load.
load_legacy_shapes(DeltaGPTConfig.model_type, "beta_open")


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
    N(0, spectral_std) and its bias nn.Linear's U(-1/sqrt(D), 1/sqrt(D)). (The read vector, 1 / d_v in both
    schemes, is set by `_init_weights`.)"""
    for layer in module.beta_proj.modules() if isinstance(module.beta_proj, nn.Sequential) else [module.beta_proj]:
        if isinstance(layer, nn.Linear):
            init.normal_(layer.weight, mean=0.0, std=spectral_std(layer.in_features, layer.out_features))
    p = min(max(min(max(beta0, 0.0), 2.0) / 2.0, 1e-6), 1.0 - 1e-6)
    init.constant_(module.gate_output.bias, math.log(p / (1.0 - p)))
    init.constant_(module.beta_open, 1.0)
    v_proj = module.v_proj
    if v_proj is not None:
        init.normal_(v_proj.weight, mean=0.0, std=spectral_std(v_proj.in_features, v_proj.out_features))
        bound = 1.0 / math.sqrt(v_proj.in_features)
        init.uniform_(v_proj.bias, -bound, bound)


def resolve_delta_init(config: DeltaGPTConfig, loading: bool) -> None:
    """Fill `delta_init=None` (auto) and `delta_beta_init=None` in the config with what the model uses.

    auto = "exact" for Delta parameters a loaded checkpoint lacks (conversion), "reference" for a model built from
    its config; `delta_beta_init=None` = 0.0 under "exact", 1.0 (the reference code's value) under "reference".
    Written back so that a saved config says how the model started.
    """
    if config.delta_init is None:
        config.delta_init = "exact" if loading else "reference"
    if config.delta_beta_init is None:
        config.delta_beta_init = 0.0 if config.delta_init == "exact" else 1.0


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
    """The Delta steps around a stack of blocks, shared by every Delta base model (DeltaGPT, DeltaLlama).

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
        norm = w @ w
        if not torch.is_grad_enabled() or not bool(norm > 0):
            return state
        return _ReadInGraph.apply(read, state, w / norm, w)

    def read_state_out(self, state: torch.Tensor, context: DeltaConvContext) -> torch.Tensor:
        """What the final norm receives: the last state read with `read_out` (after the TC read-out convolution)."""
        if self.read_out_conv is not None:
            return self.read_out_conv(state, self.read_out if self.value_channels > 1 else None, context, "read_out")
        if self.value_channels > 1:
            return _read_channels(state, self._parameters["read_out"])
        return state


def check_token_ids(input_ids: torch.Tensor | None, vocab_size: int) -> None:
    """A clear error for token ids outside the vocabulary (not an index error deep inside the embedding)."""
    if input_ids is None or not input_ids.numel():
        return
    if input_ids.numel() == 1:  # decoding one sequence: one host read, no reduction
        low = high = int(input_ids)
    else:
        low, high = torch.stack(torch.aminmax(input_ids)).tolist()  # one host transfer, not two
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"input_ids contain token ids outside [0, vocab_size={vocab_size}) (found {low}..{high}). Use the "
            "tokenizer the model was trained with, or call model.resize_token_embeddings(len(tokenizer)) after "
            "adding tokens."
        )


class DeltaGPTModel(DeltaStateMixin, DeltaGPTPreTrainedModel):
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
        # TC / CC read the final state like every sublayer's input; EC expands the embedding (docs/variants.md).
        size = config.delta_conv_size
        self.read_out_conv = (
            DeltaStateConv(config.delta_state_read, self.embed_dim, self.value_channels, size)
            if config.delta_state_read != "linear"
            else None
        )
        self.embed_expand = (
            DeltaEmbedExpand(self.embed_dim, self.value_channels, size) if config.delta_embed_expand == "conv" else None
        )
        self.ln_f = nn.LayerNorm(self.embed_dim, eps=config.layer_norm_epsilon)

        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.wte

    def set_input_embeddings(self, new_embeddings: nn.Embedding) -> None:
        self.wte = new_embeddings

    @takes_cache
    @merge_with_config_defaults
    @_hidden_states_contract
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> DeltaGPTModelOutput:
        r"""
        Same inputs as `GPT2Model.forward`; the cache is `cache` or, as before transformers 5.24, `past_key_values`.
        `output_betas=True` returns `betas`: one `[batch, seq_len]` tensor per Delta block. With
        `delta_value_channels > 1`, `hidden_states` are `[.., hidden_size]` reads of the expanded states, and
        `output_expanded_states=True` returns the states `[.., hidden_size, d_v]` themselves.

        A copy of `GPT2Model.forward` (embeddings, mask, blocks, `ln_f`) except for three Delta steps: the cache
        of a DeltaNet mixer, the expansion of the embedding over the value channels, and the read-out before `ln_f`.
        """
        for flag in ("output_attentions", "output_hidden_states", "output_betas", "output_expanded_states"):
            kwargs.pop(flag, None)
        hand_over_final_state = kwargs.pop("_hand_over_final_state", False)  # set by `_hidden_states_contract`

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

        self._check_read_out_placement(input_ids if inputs_embeds is None else inputs_embeds)
        if isinstance(attention_mask, dict):  # generate with a static cache: masks by layer type (config.layer_types)
            attention_mask = attention_mask.get(self.config.layer_types[0])
        delta_net = self.config.token_mixer == "delta_net"
        temporal = self.config.delta_temporal
        if use_cache and cache is None:
            if delta_net:
                cache = DeltaNetCache(self.config)
            else:
                cache = DeltaStateCache(self.config) if temporal else DynamicCache(config=self.config)
        if delta_net:
            require_delta_net_cache(cache)
        else:
            self.check_window_cache(cache)
        past_seen_tokens = cache.get_seq_length() if cache is not None else 0
        self._check_inputs(input_ids, attention_mask, position_ids, batch_size, input_shape[-1], past_seen_tokens)

        document_starts = None
        if delta_net or temporal:  # packed rows: states and windows that run over tokens restart at each document
            cu_seq_lens = kwargs.get("cu_seq_lens_q", kwargs.get("cu_seq_lens_k"))
            shape = (batch_size, input_shape[-1])
            document_starts = packed_document_starts(position_ids, cu_seq_lens, shape, past_seen_tokens)

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
        checkpointing = self.gradient_checkpointing and self.training
        delta_context = DeltaConvContext(
            token_mask=attention_mask if attention_mask is not None and attention_mask.ndim == 2 else None,
            cache=cache if temporal and not checkpointing else None,
            document_starts=document_starts,
        )
        if delta_net:  # causal by construction: DeltaNet only needs the 2-D padding mask
            if attention_mask is not None and attention_mask.ndim != 2:
                raise ValueError("token_mixer='delta_net' supports only a 2-D [batch, seq_len] padding mask.")
            causal_mask = attention_mask
        else:
            causal_mask = create_causal_mask(
                config=self.config,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                position_ids=position_ids,
                **cache_argument(cache),
            )

        hidden_states = self.expand_state(self.drop(hidden_states), delta_context)

        reads = []  # d_v > 1 with hidden states: their entries, in the graph (`record_read`)
        for block in self.h:
            if hand_over_final_state:
                hidden_states = self.record_read(hidden_states, reads)
            hidden_states, *_ = block(
                hidden_states,
                cache if not checkpointing else None,
                causal_mask,
                use_cache=use_cache,
                position_ids=position_ids,
                delta_context=delta_context,
                **kwargs,
            )

        final_state = hidden_states
        hidden_states = self.ln_f(self.read_state_out(hidden_states, delta_context))
        hidden_states = hidden_states.view(-1, *input_shape[1:], hidden_states.size(-1))

        return DeltaGPTModelOutput(
            last_hidden_state=hidden_states,
            **cache_argument(cache if use_cache else None),
            # d_v > 1: the final expanded state and the reads, for `_hidden_states_contract`, which replaces them.
            expanded_states=(final_state, *reads) if hand_over_final_state else None,
        )

    def _check_read_out_placement(self, inputs: torch.Tensor) -> None:
        """`read_out` is a bare parameter of the whole model: accelerate, which loads an offloaded weight only around
        the forward of the module that owns it, cannot load it when a device map offloads it on its own entry."""
        if self.value_channels > 1 and self.read_out.is_meta and not inputs.is_meta:
            raise RuntimeError(
                "DeltaGPTModel.read_out (the final read vector, delta_value_channels floats) is still on the meta "
                "device: a device_map gave this bare parameter an offloaded device of its own ('disk', or 'cpu' when "
                "the model runs on a GPU), and accelerate loads offloaded weights only around the forward of the "
                "module that owns them. Map 'transformer.read_out' ('read_out' for a DeltaGPTModel) to the execution "
                "device, as device_map='auto' does, or offload 'transformer' as a whole."
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
            # generation passes position_ids: one host transfer per step (no reduction for a single token)
            highest = int(position_ids) if position_ids.numel() == 1 else int(position_ids.max())
            if highest >= n_positions:
                raise ValueError(
                    f"position_ids reach {highest}, but the model has n_positions={n_positions}; "
                    "truncate the input or pass smaller position_ids."
                )
        check_token_ids(input_ids, self.config.vocab_size)
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

    def _validate_generation_mode(self, generation_mode: GenerationMode, *args, **kwargs) -> None:
        """Refuse assisted decoding up front for a DeltaNet model, naming why (transformers' own check says only
        "stateful model"): it needs to roll the cache back over the rejected draft tokens."""
        if self._is_stateful and generation_mode == GenerationMode.ASSISTED_GENERATION:
            raise ValueError(_NO_CACHE_ROLLBACK.format(role="with assisted / speculative decoding or prompt lookup"))
        return super()._validate_generation_mode(generation_mode, *args, **kwargs)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args, **kwargs) -> None:
        """`generate` builds a DynamicCache from the config; a DeltaNet model needs its recurrent-state cache."""
        wants_new_cache = model_kwargs.get(CACHE_ARG) is None and generation_config.use_cache is not False
        delta_net = self.config.token_mixer == "delta_net"
        if delta_net:
            require_delta_net_cache(model_kwargs.get(CACHE_ARG))  # before generate asks it for its length
            if getattr(generation_config, "is_assistant", False):
                raise ValueError(_NO_CACHE_ROLLBACK.format(role="as the assistant (draft model) of assisted decoding"))
        if not (delta_net or self.config.delta_temporal) or not wants_new_cache:
            return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        if generation_config.cache_implementation not in (None, "dynamic"):
            raise ValueError(
                f"cache_implementation={generation_config.cache_implementation!r} is not supported with "
                "token_mixer='delta_net' or a temporal Delta variant (their caches keep recurrent states or "
                "convolution windows). Leave cache_implementation unset."
            )
        model_kwargs[CACHE_ARG] = DeltaNetCache(self.config) if delta_net else DeltaStateCache(self.config)

    @_signature_computed_once
    @takes_cache
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
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
            cache=cache,
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
            **cache_argument(cache_of(outputs)),
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            betas=outputs.betas,
            expanded_states=outputs.expanded_states,
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

    @takes_cache
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
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
            cache=cache,
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
            **cache_argument(cache_of(outputs)),
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            betas=outputs.betas,
            expanded_states=outputs.expanded_states,
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

    @takes_cache
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
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
            cache=cache,
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
            expanded_states=outputs.expanded_states,
        )


__all__ = [
    "DeltaEmbedExpand",
    "DeltaGPTForCausalLM",
    "DeltaGPTForSequenceClassification",
    "DeltaGPTForTokenClassification",
    "DeltaGPTModel",
    "DeltaGPTPreTrainedModel",
    "DeltaResidual",
    "DeltaStateCache",
    "DeltaStateConv",
    "delta_update",
]
