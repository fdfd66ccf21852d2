"""The TC / EC windows of ddl-hf's native vLLM models (`vllm_models.py`) as vLLM's per-sequence state.

A temporal convolution (a TC read, EC) needs its last K - 1 inputs before each token. vLLM's Transformers backend
runs the Hub code without a cache, so they cannot be kept there (docs/serving.md); here each window of the model's
`StatePlan` (`delta_state.py`) is a vLLM state layer (`DeltaWindow`, a `MambaBase` of the "short_conv" kind: one
`(K - 1, dim)` window per running sequence, which vLLM allocates, copies for prefix caching and frees), and the reads
reach them through `ServingWindows`, the `WindowSource` that stands where transformers passes a `DeltaConvContext`.
`DeltaWindowModel` answers vLLM's questions about that state (shape, dtype, copy) for the model class. The
convolutions themselves are `delta_ops`' and `delta_fused`'s, as in transformers. Needs vLLM; imported by
`vllm_models.py` only.
"""

import torch
from torch import nn
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateCopyFuncCalculator,
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
    is_conv_state_dim_first,
)
from vllm.platforms import current_platform
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from .delta_fused import temporal_conv_read
from .delta_ops import temporal_conv
from .delta_state import state_plan


class DeltaWindow(MambaBase, nn.Module):
    """One temporal convolution's window (a TC read's or EC's): its last K - 1 inputs for each running sequence.

    vLLM's "short_conv" state (the layout of its short-convolution layers): a `(K - 1, dim)` block per sequence,
    allocated, copied for prefix caching and freed by vLLM, read and updated in `forward` from vLLM's metadata
    (decode rows first, then prefill chunks with `query_start_loc_p`, `has_initial_states_p` for a continued chunk or
    a prefix-cache hit). Every window of a model has the same `dim` (`window_dim`): vLLM pages all state layers alike;
    EC's window, which holds embeddings (`hidden_size` of them), uses its first `hidden_size` columns.

    `kind` says which op reads the window: "read" (a TC read, `temporal_conv_read`: state `[N, D(, d_v)]` -> `[N,
    D]`) or "expand" (EC, `temporal_conv`: embedding `[N, D, 1]` -> `[N, D, d_v]`).
    """

    def __init__(self, kind: str, dim: int, size: int, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        self.kind, self.dim, self.size, self.prefix = kind, dim, size, prefix
        self.model_config, self.cache_config = vllm_config.model_config, vllm_config.cache_config
        context = vllm_config.compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        context[prefix] = self
        self.kv_cache = (torch.tensor([]),)

    def get_state_shape(self) -> tuple[tuple[int, int]]:
        return MambaStateShapeCalculator.short_conv_state_shape(1, self.dim, self.size)

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return state_dtype(self.model_config, self.cache_config)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.SHORT_CONV

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The convolution of x `[N, D, ...]` (N scheduled tokens) over this window, through a custom op (vLLM's
        metadata changes every step: compiled graphs must not see it)."""
        shape = (x.shape[0], x.shape[1]) if self.kind == "read" else (*x.shape[:2], weight.shape[1])
        output = x.new_empty(shape)
        torch.ops.vllm.ddl_delta_window(x, weight, output, self.prefix)
        return output

    def windows(self) -> torch.Tensor:
        """The state as `[blocks, K - 1, dim]` (a view, whichever layout vLLM stores)."""
        state = self.kv_cache[0]
        return state.transpose(-1, -2) if is_conv_state_dim_first() else state

    def convolve(self, x: torch.Tensor, weight: torch.Tensor, output: torch.Tensor) -> None:
        """The op's body: the K - 1 inputs before each token (`exchange`), then `delta_ops`' convolution."""
        metadata = get_forward_context().attn_metadata
        if metadata is not None:
            if not isinstance(metadata, dict) or self.prefix not in metadata:
                raise RuntimeError(f"vLLM gave no state metadata for the Delta window {self.prefix!r} in this step")
            metadata = metadata[self.prefix]
        if metadata is None:  # vLLM's profiling run: no state yet, zeros before every token
            tokens, past = x.shape[0], None
        else:
            tokens = metadata.num_decode_tokens + metadata.num_prefill_tokens
            flat = x[:tokens].reshape(tokens, -1)
            past = self.exchange(flat, metadata).view(tokens, self.size - 1, *x.shape[1:])
        x = x[:tokens]
        if self.kind == "read":  # `DeltaConvContext.convolve_read`, one token per row
            x4 = x.reshape(tokens, 1, x.shape[1], -1)
            past4 = None if past is None else past.reshape(tokens, self.size - 1, *x4.shape[2:])
            output[:tokens] = temporal_conv_read(x4, weight, past4).squeeze(1)
        else:  # `DeltaConvContext.convolve`
            if past is None:
                past = x.new_zeros(tokens, self.size - 1, *x.shape[1:])
            output[:tokens] = temporal_conv(torch.cat([past, x.unsqueeze(1)], dim=1), weight).squeeze(1)

    def exchange(self, x: torch.Tensor, metadata) -> torch.Tensor:
        """The K - 1 inputs before each token of x `[tokens, width]` (from its sequence's window or from x itself),
        `[tokens, K - 1, width]`; stores each sequence's last K - 1 inputs as its window. Tensor ops only: no host
        read of tensor data (the counts are host integers of vLLM's metadata)."""
        states = self.windows()[..., : x.shape[1]]
        lags = torch.arange(self.size - 1, 0, -1, device=x.device)  # tap j of K - 1 reads the token `lags[j]` back
        decodes, pasts = metadata.num_decode_tokens, []
        if decodes:  # one token per sequence: its window, then the window shifted by that token
            slots = _slots(metadata.state_indices_tensor_d, decodes)
            past = states[slots]
            states[slots] = torch.cat([past[:, 1:], x[:decodes, None].to(states.dtype)], dim=1)
            pasts.append(past)
        if metadata.num_prefill_tokens:
            starts = metadata.query_start_loc_p.to(torch.long)  # [P + 1], from the first prefill token
            slots = _slots(metadata.state_indices_tensor_p, starts.shape[0] - 1)
            x_p = x[decodes:]
            # A continued chunk or a prefix-cache hit starts from its window; a new sequence from zeros (selected, not
            # multiplied: a reused block may hold any bytes, NaN included).
            first = torch.where(metadata.has_initial_states_p.view(-1, 1, 1), states[slots], 0)
            token = torch.arange(x_p.shape[0], device=x.device)
            sequence = torch.searchsorted(starts[1:], token, right=True)
            back = (token - starts[sequence])[:, None] - lags  # position of each tap in its chunk; < 0: the window
            pasts.append(_history(x_p, first, token[:, None] - lags, sequence[:, None], back))
            lengths = starts[1:] - starts[:-1]
            back = lengths[:, None] - lags  # the last K - 1 positions of each chunk's history, in order
            rows = torch.arange(slots.shape[0], device=x.device)[:, None]
            states[slots] = _history(x_p, first, starts[:-1, None] + back, rows, back).to(states.dtype)
        past = torch.cat(pasts) if len(pasts) > 1 else pasts[0]
        return past.to(x.dtype)  # the state's dtype is vLLM's `mamba_cache_dtype`, which may differ from the model's


def _slots(indices: torch.Tensor, count: int) -> torch.Tensor:
    """The state block of each of `count` sequences (the first column where vLLM gives one per speculative token).
    Padding rows name the null block 0, which holds no sequence (a -1 is sent there too)."""
    if indices.dim() == 2:
        indices = indices[:, 0]
    return indices[:count].to(torch.long).clamp(min=0)


def _history(x: torch.Tensor, first: torch.Tensor, at: torch.Tensor, sequence: torch.Tensor, back: torch.Tensor):
    """Entries of each sequence's history `cat(first[s], its chunk of x)`: x's row `at` where `back >= 0`, else the
    window's entry `K - 1 + back`."""
    size = first.shape[1]
    from_x = x[at.clamp(min=0, max=x.shape[0] - 1)]
    from_window = first[sequence, (size + back).clamp(min=0, max=size - 1)].to(x.dtype)
    return torch.where((back >= 0)[..., None], from_x, from_window)


@eager_break_during_capture
def ddl_delta_window(x: torch.Tensor, weight: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    get_forward_context().no_compile_layers[layer_name].convolve(x, weight, output)


def _ddl_delta_window_fake(x: torch.Tensor, weight: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    return None


direct_register_custom_op(
    op_name="ddl_delta_window", op_func=ddl_delta_window, mutates_args=["output"], fake_impl=_ddl_delta_window_fake
)


class ServingWindows:
    """The reads' `WindowSource` on this route, where transformers passes a `DeltaConvContext`: each window of the
    model's `StatePlan`, by its key, is a `DeltaWindow` (one token per row)."""

    def __init__(self, windows: dict[str, DeltaWindow]):
        self.windows = windows

    def convolve_read(
        self, x: torch.Tensor, key: str, weight: torch.Tensor, read: torch.Tensor | None = None, kernels=None
    ) -> torch.Tensor:
        """The TC read with the read vector folded into the kernels (`DeltaConvContext.convolve_read`); the window's
        own op reads the state (`kernels`, the model's, is for the transformers route)."""
        return self.windows[key](x, weight if read is None else weight * read[:, None])

    def convolve(self, x: torch.Tensor, key: str, weight: torch.Tensor) -> torch.Tensor:
        return self.windows[key](x, weight)


def build_windows(config, vllm_config: VllmConfig, prefix: str) -> tuple[nn.ModuleList, ServingWindows]:
    """A `DeltaWindow` for each window of the config's `StatePlan`, and the `ServingWindows` the reads take. vLLM
    files state layers by the one integer in their name (a layer index), so each window's name carries its layer's:
    `{prefix}.windows.{i}.attn` (the read-out under the last layer, EC under 0)."""
    plan, dim = state_plan(config), window_dim(config)
    windows = [
        DeltaWindow(kind, dim, config.delta_conv_size, vllm_config, f"{prefix}.windows.{layer}.{key.split('.')[-1]}")
        for key, kind, layer in plan.windows
    ]
    return nn.ModuleList(windows), ServingWindows({w.key: window for w, window in zip(plan.windows, windows)})


def state_dtype(model_config, cache_config) -> tuple[torch.dtype, ...]:
    """A window's dtype: vLLM's `mamba_cache_dtype`, else the model's."""
    return MambaStateDtypeCalculator.short_conv_state_dtype(model_config.dtype, cache_config.mamba_cache_dtype)


def window_dim(config) -> int:
    """Every window's width: vLLM pages all state layers alike, so EC's (`hidden_size` embeddings) takes a TC read's
    (`hidden_size * d_v` state entries)."""
    return config.hidden_size * config.delta_value_channels


class DeltaWindowModel:
    """vLLM's interface of a model with state layers, for the windows (vLLM asks the model class)."""

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> tuple[tuple[int, int]]:
        config = vllm_config.model_config.hf_config
        return MambaStateShapeCalculator.short_conv_state_shape(1, window_dim(config), config.delta_conv_size)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, ...]:
        return state_dtype(vllm_config.model_config, vllm_config.cache_config)

    @classmethod
    def get_mamba_state_copy_func(cls):
        return MambaStateCopyFuncCalculator.short_conv_state_copy_func()

    @classmethod
    def get_mamba_state_copy_funcs(cls, mamba_types: set) -> dict:
        """How vLLM copies a window between state blocks (prefix caching), per state kind: as its short convolutions."""
        return {mamba_type: cls.get_mamba_state_copy_func() for mamba_type in mamba_types}


def align_state_blocks(vllm_config: VllmConfig) -> None:
    """What vLLM does for its hybrid models once their layers exist (`Platform.update_block_size_for_backend`, which
    passes over a model that its `layer_types` do not mark hybrid, as a Delta model's are not): an attention block at
    least as large as a window's page, the windows' pages padded to it, and in the "align" prefix-cache mode a state
    block per attention block (else prefix-cache states would be kept at other boundaries than the KV blocks')."""
    align = getattr(current_platform, "_align_hybrid_block_size", None)
    find_backends = getattr(current_platform, "_find_non_ssm_backends", None)
    backends = find_backends(vllm_config) if find_backends is not None else []
    if align is not None and backends:
        align(vllm_config, backends[0])
    cache_config = vllm_config.cache_config
    if cache_config.mamba_cache_mode == "align":
        cache_config.mamba_block_size = cache_config.block_size


__all__ = ["DeltaWindow", "DeltaWindowModel", "ServingWindows", "align_state_blocks", "build_windows", "window_dim"]
