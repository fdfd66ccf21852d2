"""DeltaLlama and DeltaGPT as native vLLM models: every variant, TC and EC windows kept as vLLM's per-sequence state.

vLLM's Transformers backend runs the Hub code with no cache, so the variants with state across tokens (a TC read's
last K - 1 states, EC's last K - 1 embeddings) cannot be served through it (docs/serving.md). Here each such window
is a vLLM state layer (`DeltaWindow`, a `MambaBase` of the "short_conv" kind: one `(K - 1, dim)` window per running
sequence, which vLLM allocates, copies for prefix caching and frees), and the models are vLLM's own layers of the
source family (attention with its paged KV cache, MLP, norms, rotary embedding) around the Delta modules of the Hub
files (`DeltaRead`, `DeltaResidual`, `DeltaEmbedExpand`): the Delta math is `delta_ops`, as in transformers.

The block reads as the transformers block does (eq. 2.5 twice); the reads reach their windows through
`ServingWindows`, which stands where transformers passes a `DeltaConvContext`. Registered with vLLM by the
`vllm.general_plugins` entry point of ddl-hf (`register`), so `LLM(dir)` / `vllm serve dir` take this route wherever
ddl-hf is installed; `model_impl="transformers"` still takes the Transformers backend. Needs vLLM (`pip install
"ddl-hf[vllm]"`); nothing else in ddl_hf imports this module.
"""

# No `from __future__ import annotations`: vLLM reads the backbones' forward annotations to mark dynamic dimensions.
import re
from collections.abc import Iterable
from itertools import islice
from typing import NamedTuple

import torch
from torch import nn
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateCopyFuncCalculator,
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
    is_conv_state_dim_first,
)
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.gpt2 import GPT2Block
from vllm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
from vllm.model_executor.models.qwen3 import Qwen3DecoderLayer
from vllm.model_executor.models.utils import (
    AutoWeightsLoader,
    WeightsMapper,
    extract_layer_index,
    make_layers,
    maybe_prefix,
)
from vllm.platforms import current_platform
from vllm.sequence import IntermediateTensors
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from .delta_fused import temporal_conv_read
from .delta_layers import DeltaResidual
from .delta_model import RENAMED_WEIGHTS, DeltaPreTrainedMixin
from .delta_ops import temporal_conv
from .delta_reads import DeltaEmbedExpand, DeltaRead
from .modeling_delta_llama import attention_layer_types
from .vllm_plugin import window_names

logger = init_logger("vllm.ddl_hf")  # under vLLM's logger: the route shows in vLLM's own log

# ----------------------------------------------------------------------------------------------------------------
# The windows: a temporal convolution's last K - 1 inputs per sequence, as vLLM state
# ----------------------------------------------------------------------------------------------------------------


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
        return MambaStateShapeCalculator.short_conv_state_shape(
            tp_world_size=1, intermediate_size=self.dim, conv_kernel=self.size
        )

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return MambaStateDtypeCalculator.short_conv_state_dtype(
            self.model_config.dtype, self.cache_config.mamba_cache_dtype
        )

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
    """Where transformers passes a `DeltaConvContext` to the reads: each read's window, by the name the block gives
    it, is a `DeltaWindow`. The same two methods, one token per row."""

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


def build_windows(config, vllm_config: VllmConfig, prefix: str) -> nn.ModuleDict:
    """The model's `DeltaWindow`s. vLLM files state layers by the one integer in their name (a layer index), so each
    window's name carries its layer's: `{prefix}.windows.{i}.attn` (the read-out under the last layer, EC under 0)."""
    dim = window_dim(config)
    windows = nn.ModuleDict()
    for name, kind, layer in window_names(config):
        key = f"{layer}.{name.split('.')[-1]}"
        windows[name.replace(".", "_")] = DeltaWindow(
            kind, dim, config.delta_conv_size, vllm_config, f"{prefix}.windows.{key}"
        )
    return windows


def window_dim(config) -> int:
    return config.hidden_size * config.delta_value_channels


# ----------------------------------------------------------------------------------------------------------------
# The blocks: the family's vLLM layers between Delta reads and residuals
# ----------------------------------------------------------------------------------------------------------------


class FamilyParts(NamedTuple):
    """The modules a Delta block takes from vLLM's layer of the source family."""

    self_attn: nn.Module
    mlp: nn.Module
    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module


def family_parts(config, vllm_config: VllmConfig, prefix: str) -> FamilyParts:
    """vLLM's attention, MLP and norms of the source family, with each layer's sliding window as transformers decides
    it (`attention_layer_types`). Qwen3: its own layer (QK-norm). Llama, Mistral, Qwen2: vLLM's Llama layer, whose
    attention takes each layer's window from `layer_types` (vLLM's Qwen2 layer applies one window to every layer),
    with Qwen2's biases on q, k and v only."""
    family, index = config.source_model_type, extract_layer_index(prefix)
    sliding = attention_layer_types(config)[index] == "sliding_attention"
    cache_config, quant_config = vllm_config.cache_config, vllm_config.quant_config
    if family == "qwen2":
        attention = LlamaAttention(
            config=config,
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            max_position_embeddings=config.max_position_embeddings,
            quant_config=quant_config,
            bias=True,
            bias_o_proj=False,
            cache_config=cache_config,
            prefix=f"{prefix}.self_attn",
        )
        mlp = LlamaMLP(
            config.hidden_size, config.intermediate_size, config.hidden_act, quant_config, prefix=f"{prefix}.mlp"
        )
        norms = [RMSNorm(config.hidden_size, eps=config.rms_norm_eps) for _ in range(2)]
        return FamilyParts(attention, mlp, *norms)
    if family == "qwen3":
        window = config.sliding_window if sliding else None
        layer = Qwen3DecoderLayer(config, cache_config, quant_config, prefix=prefix, per_layer_sliding_window=window)
    else:
        layer = LlamaDecoderLayer(vllm_config=vllm_config, prefix=prefix, config=config)
    return FamilyParts(layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm)


class DeltaLlamaDecoderLayer(nn.Module):
    """The family's decoder layer whose two residual connections are Delta residuals (as in transformers)."""

    def __init__(self, config, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        layer = family_parts(config, vllm_config, prefix)
        index = extract_layer_index(prefix)
        self.windows = (f"{index}.attn", f"{index}.mlp")
        self.attn_read = DeltaRead(config)
        self.input_layernorm = layer.input_layernorm
        self.self_attn = layer.self_attn
        self.attn_delta = DeltaResidual(config)
        self.mlp_read = None if config.delta_shared_read else DeltaRead(config)
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.mlp = layer.mlp
        self.mlp_delta = DeltaResidual(config)

    def forward(self, positions: torch.Tensor, state: torch.Tensor, windows: ServingWindows) -> torch.Tensor:
        x = self.attn_read(state, windows, self.windows[0])
        c = self.input_layernorm(x)
        state, _ = self.attn_delta(state, x, c, self.self_attn(positions=positions, hidden_states=c))
        x = (self.mlp_read or self.attn_read)(state, windows, self.windows[1])
        c = self.post_attention_layernorm(x)
        state, _ = self.mlp_delta(state, x, c, self.mlp(c))
        return state


class DeltaGPTBlock(nn.Module):
    """vLLM's GPT-2 block whose two residual connections are Delta residuals (as in transformers)."""

    def __init__(self, config, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        block = GPT2Block(config, vllm_config.cache_config, vllm_config.quant_config, prefix=prefix)
        index = extract_layer_index(prefix)
        self.windows = (f"{index}.attn", f"{index}.mlp")
        self.attn_read = DeltaRead(config)
        self.ln_1 = block.ln_1
        self.attn = block.attn
        self.attn_delta = DeltaResidual(config)
        self.mlp_read = None if config.delta_shared_read else DeltaRead(config)
        self.ln_2 = block.ln_2
        self.mlp = block.mlp
        self.mlp_delta = DeltaResidual(config)

    def forward(self, positions: torch.Tensor, state: torch.Tensor, windows: ServingWindows) -> torch.Tensor:
        x = self.attn_read(state, windows, self.windows[0])
        c = self.ln_1(x)
        state, _ = self.attn_delta(state, x, c, self.attn(hidden_states=c))
        x = (self.mlp_read or self.attn_read)(state, windows, self.windows[1])
        c = self.ln_2(x)
        state, _ = self.mlp_delta(state, x, c, self.mlp(c))
        return state


# ----------------------------------------------------------------------------------------------------------------
# The models
# ----------------------------------------------------------------------------------------------------------------


class DeltaStack(nn.Module):
    """What both backbones add around their blocks: the state expansion (EC or a repeat over the value channels),
    the windows, and the read-out before the final norm (transformers' `DeltaStackMixin`)."""

    def delta_init(self, config, vllm_config: VllmConfig, prefix: str) -> None:
        # The tensor ops, which vLLM's compilation fuses: the Triton ops of `delta_implementation="auto"` have not
        # run inside vLLM's compiled graphs and CUDA graphs yet. Set before any Delta module reads it.
        config.delta_implementation = "eager"
        self.value_channels = config.delta_value_channels
        self.embed_expand = (
            DeltaEmbedExpand(config.hidden_size, self.value_channels, config.delta_conv_size)
            if config.delta_embed_expand == "conv"
            else None
        )
        self.read_out = DeltaRead(config)
        self.delta_windows = build_windows(config, vllm_config, prefix)
        self.serving_windows = ServingWindows(
            {n: self.delta_windows[n.replace(".", "_")] for n, _, _ in window_names(config)}
        )

    def expand_state(self, embeddings: torch.Tensor) -> torch.Tensor:
        if self.embed_expand is not None:
            return self.embed_expand(embeddings, self.serving_windows)
        if self.value_channels > 1:
            return embeddings.unsqueeze(-1).expand(*embeddings.shape, self.value_channels)
        return embeddings

    def read_out_state(self, state: torch.Tensor) -> torch.Tensor:
        return self.read_out(state, self.serving_windows, "read_out")


@support_torch_compile
class DeltaLlamaModel(DeltaStack):
    """vLLM's Llama-family backbone (embedding, layers, norm) with Delta residuals."""

    #: vLLM's stacked projections (as its `LlamaModel.hf_to_vllm_mapper`), anchored on their modules: a Delta
    #: residual's `v_proj` is not the attention's.
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_stacked={
            ".self_attn.q_proj": (".self_attn.qkv_proj", "q"),
            ".self_attn.k_proj": (".self_attn.qkv_proj", "k"),
            ".self_attn.v_proj": (".self_attn.qkv_proj", "v"),
            ".mlp.gate_proj": (".mlp.gate_up_proj", 0),
            ".mlp.up_proj": (".mlp.gate_up_proj", 1),
        }
    )

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, prefix=f"{prefix}.embed_tokens"
        )
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: DeltaLlamaDecoderLayer(config, vllm_config, prefix),
            prefix=f"{prefix}.layers",
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.delta_init(config, vllm_config, prefix)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        embeddings = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        state = self.expand_state(embeddings)
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            state = layer(positions, state, self.serving_windows)
        return self.norm(self.read_out_state(state))


@support_torch_compile
class DeltaGPTModel(DeltaStack):
    """vLLM's GPT-2 backbone (token and position embeddings, blocks, final LayerNorm) with Delta residuals."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden_size, prefix=f"{prefix}.wte")
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.start_layer, self.end_layer, self.h = make_layers(
            config.num_hidden_layers, lambda prefix: DeltaGPTBlock(config, vllm_config, prefix), prefix=f"{prefix}.h"
        )
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.delta_init(config, vllm_config, prefix)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.wte(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        embeddings = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        state = self.expand_state(embeddings + self.wpe(positions))
        for block in islice(self.h, self.start_layer, self.end_layer):
            state = block(positions, state, self.serving_windows)
        return self.ln_f(self.read_out_state(state))


#: Checkpoint names -> this module's: the read parameters' old names (transformers' conversion mapping, which vLLM
#: does not apply to a native model) and, for the Llama families, vLLM's stacked projections.
RENAMED = WeightsMapper(orig_to_new_regex={re.compile(old): new for old, new in RENAMED_WEIGHTS})


def _transposed_gpt2_weights(weights: Iterable[tuple[str, torch.Tensor]]):
    """GPT-2's Conv1D weights are stored transposed to a Linear's (as vLLM's GPT-2 loads them); its old causal-mask
    buffers are dropped."""
    for name, tensor in weights:
        if re.search(r"(^|\.)attn\.(masked_)?bias$", name):
            continue
        if name.endswith(".weight") and re.search(r"\.(c_attn|c_proj|c_fc)\.", name):
            tensor = tensor.t()
        yield name, tensor


class DeltaCausalLM(nn.Module):
    """The causal LM head over a Delta backbone, vLLM's interface (forward, compute_logits, load_weights)."""

    backbone: type[nn.Module]
    backbone_name: str
    embedding_name: str

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> tuple[tuple[int, int]]:
        config = vllm_config.model_config.hf_config
        return MambaStateShapeCalculator.short_conv_state_shape(
            tp_world_size=1, intermediate_size=window_dim(config), conv_kernel=config.delta_conv_size
        )

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, ...]:
        return MambaStateDtypeCalculator.short_conv_state_dtype(
            vllm_config.model_config.dtype, vllm_config.cache_config.mamba_cache_dtype
        )

    @classmethod
    def get_mamba_state_copy_func(cls):
        return MambaStateCopyFuncCalculator.short_conv_state_copy_func()

    @classmethod
    def get_mamba_state_copy_funcs(cls, mamba_types: set) -> dict:
        """How vLLM copies a window between state blocks (prefix caching), per state kind: as its short convolutions."""
        return {mamba_type: cls.get_mamba_state_copy_func() for mamba_type in mamba_types}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        check_servable(vllm_config)
        self.config = config
        backbone = self.backbone(vllm_config=vllm_config, prefix=maybe_prefix(prefix, self.backbone_name))
        setattr(self, self.backbone_name, backbone)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(getattr(backbone, self.embedding_name))
        self.logits_processor = LogitsProcessor(config.vocab_size)
        if vllm_config.model_config.dtype == torch.float16:
            keep_delta_parameters_in_float32(self)
        windows = window_names(config)
        if windows:
            align_state_blocks(vllm_config)
        logger.info(
            "ddl-hf: serving %s natively (ddl-hf's vLLM plugin): vLLM's %s layers with Delta residuals%s. "
            "model_impl='transformers' takes vLLM's Transformers backend instead (variants without state across "
            "tokens only).",
            type(self).__name__,
            getattr(config, "source_model_type", "gpt2"),
            f", {len(windows)} convolution windows kept as vLLM state per sequence" if windows else "",
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.backbone_name).embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        return getattr(self, self.backbone_name)(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    def weights_mapper(self) -> WeightsMapper:
        return RENAMED

    def prepare_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        return weights

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        tied = self.config.tie_word_embeddings  # the head is the embedding: a saved copy of it is not loaded twice
        loader = AutoWeightsLoader(self, ignore_unexpected_prefixes=["lm_head."] if tied else None)
        return loader.load_weights(self.prepare_weights(weights), mapper=self.weights_mapper())


def keep_delta_parameters_in_float32(model: nn.Module) -> None:
    """As transformers keeps them on a float16 load (`_keep_in_fp32_modules`): the gates, values, reads and
    convolutions in float32, the rest in float16. The Delta modules cast at their inputs, as in transformers."""
    keep = [re.compile(pattern) for pattern in DeltaPreTrainedMixin._keep_in_fp32_modules]
    for name, parameter in model.named_parameters():
        if any(pattern.search(name) for pattern in keep):
            parameter.data = parameter.data.float()


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


class DeltaLlamaForCausalLM(DeltaCausalLM):
    backbone, backbone_name, embedding_name = DeltaLlamaModel, "model", "embed_tokens"

    def weights_mapper(self) -> WeightsMapper:
        return RENAMED | DeltaLlamaModel.hf_to_vllm_mapper


class DeltaGPTForCausalLM(DeltaCausalLM):
    backbone, backbone_name, embedding_name = DeltaGPTModel, "transformer", "wte"

    def prepare_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        return _transposed_gpt2_weights(weights)


# ----------------------------------------------------------------------------------------------------------------
# What this route refuses, up front
# ----------------------------------------------------------------------------------------------------------------


def check_servable(vllm_config: VllmConfig) -> None:
    """One ValueError, before any weight loads, for what this route does not serve exactly."""
    config = vllm_config.model_config.hf_config
    name = type(config).__name__.removesuffix("Config")
    problems = []
    if getattr(config, "token_mixer", "attention") != "attention":
        problems.append(
            "the DeltaNet mixer (token_mixer='delta_net') keeps a matrix state per layer that this route does not "
            "serve; generate with transformers (generate, pipeline)"
        )
    for field in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        if getattr(config, field, False):
            problems.append(f"{field}=True is not in vLLM's GPT-2 attention")
    if getattr(config, "scale_attn_weights", True) is False:
        problems.append("scale_attn_weights=False is not in vLLM's GPT-2 attention (it always scales)")
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
        problems.append("tensor and pipeline parallelism are not tested on this route: serve on one device")
    if window_names(config):
        if vllm_config.speculative_config is not None:
            problems.append("speculative decoding would need a window per draft token: serve without it")
        if getattr(vllm_config, "use_v2_model_runner", False):
            problems.append(
                "vLLM's V2 model runner keeps per-sequence state only for the models it marks hybrid, and this one "
                "keeps its convolution windows as such state: set VLLM_USE_V2_MODEL_RUNNER=0 (the V1 runner)"
            )
        if vllm_config.cache_config.mamba_cache_mode == "all":
            problems.append("mamba_cache_mode='all' is not supported: use the default ('align' with prefix caching)")
    if problems:
        raise ValueError(
            f"ddl-hf cannot serve this {name} in vLLM: {'; '.join(problems)}. See ddl-hf's docs/serving.md."
        )


__all__ = ["DeltaGPTForCausalLM", "DeltaLlamaForCausalLM", "DeltaWindow"]
