"""DeltaLlama and DeltaGPT as native vLLM models: every variant, TC and EC windows kept as vLLM's per-sequence state.

vLLM's Transformers backend runs the Hub code with no cache, so the variants with state across tokens (a TC read's
last K - 1 states, EC's last K - 1 embeddings) cannot be served through it (docs/serving.md). Here the models are
vLLM's own layers of the source family (attention with its paged KV cache, MLP, norms, rotary embedding) around the
Delta modules of the Hub files (`DeltaRead`, `DeltaResidual`, `DeltaEmbedExpand`, and `DeltaStackMixin`'s expansion
of the embedding): the Delta math is `delta_ops`, as in transformers. Each window of the config's `StatePlan` is a
vLLM state layer (`vllm_windows.py`), which the reads reach through `ServingWindows`.

The block reads as the transformers block does (eq. 2.5 twice). The classes are named `Vllm*` after the
transformers classes they serve: vLLM registers them under those architectures (`DeltaLlamaForCausalLM`,
`DeltaGPTForCausalLM`, by the `vllm.general_plugins` entry point of ddl-hf, `vllm_plugin.register`), so `LLM(dir)` /
`vllm serve dir` take this route wherever ddl-hf is installed; `model_impl="transformers"` still takes the
Transformers backend. Needs vLLM (`pip install "ddl-hf[vllm]"`); nothing else in ddl_hf imports this module.
"""

# No `from __future__ import annotations`: vLLM reads the backbones' forward annotations to mark dynamic dimensions.
import re
from collections.abc import Iterable
from itertools import islice
from typing import NamedTuple

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
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
from vllm.sequence import IntermediateTensors

from .delta_layers import DeltaResidual
from .delta_model import RENAMED_WEIGHTS, DeltaPreTrainedMixin, DeltaStackMixin
from .delta_reads import DeltaRead
from .delta_state import READ_OUT_WINDOW, block_windows, state_plan
from .modeling_delta_llama import attention_layer_types
from .vllm_windows import DeltaWindowModel, ServingWindows, align_state_blocks, build_windows

logger = init_logger("vllm.ddl_hf")  # under vLLM's logger: the route shows in vLLM's own log

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


class VllmDeltaLlamaDecoderLayer(nn.Module):
    """The family's decoder layer whose two residual connections are Delta residuals (as in transformers)."""

    def __init__(self, config, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        layer = family_parts(config, vllm_config, prefix)
        self.windows = block_windows(extract_layer_index(prefix))
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


class VllmDeltaGPTBlock(nn.Module):
    """vLLM's GPT-2 block whose two residual connections are Delta residuals (as in transformers)."""

    def __init__(self, config, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        block = GPT2Block(config, vllm_config.cache_config, vllm_config.quant_config, prefix=prefix)
        self.windows = block_windows(extract_layer_index(prefix))
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


class VllmDeltaStack(DeltaStackMixin, nn.Module):
    """What both backbones add around their blocks: the state expansion (EC or a repeat over the value channels,
    `DeltaStackMixin.expand_state`), the windows, and the read-out before the final norm."""

    def delta_init(self, config, vllm_config: VllmConfig, prefix: str) -> None:
        # The tensor ops, which vLLM's compilation fuses: the Triton ops of `delta_implementation="auto"` have not
        # run inside vLLM's compiled graphs and CUDA graphs yet. Set before any Delta module reads it.
        config.delta_implementation = "eager"
        self.init_state_modules(config)
        self.delta_windows, self.serving_windows = build_windows(config, vllm_config, prefix)

    def read_out_state(self, state: torch.Tensor) -> torch.Tensor:
        return self.read_out(state, self.serving_windows, READ_OUT_WINDOW)


@support_torch_compile
class VllmDeltaLlamaModel(VllmDeltaStack):
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
            lambda prefix: VllmDeltaLlamaDecoderLayer(config, vllm_config, prefix),
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
        state = self.expand_state(embeddings, self.serving_windows)
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            state = layer(positions, state, self.serving_windows)
        return self.norm(self.read_out_state(state))


@support_torch_compile
class VllmDeltaGPTModel(VllmDeltaStack):
    """vLLM's GPT-2 backbone (token and position embeddings, blocks, final LayerNorm) with Delta residuals."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden_size, prefix=f"{prefix}.wte")
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.start_layer, self.end_layer, self.h = make_layers(
            config.num_hidden_layers,
            lambda prefix: VllmDeltaGPTBlock(config, vllm_config, prefix),
            prefix=f"{prefix}.h",
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
        state = self.expand_state(embeddings + self.wpe(positions), self.serving_windows)
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


class VllmDeltaCausalLM(DeltaWindowModel, nn.Module):
    """The causal LM head over a Delta backbone, vLLM's interface (forward, compute_logits, load_weights; the windows'
    state, `DeltaWindowModel`)."""

    backbone: type[nn.Module]
    backbone_name: str
    embedding_name: str

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
        windows = state_plan(config).windows
        if windows:
            align_state_blocks(vllm_config)
        logger.info(
            "ddl-hf: serving %s natively (ddl-hf's vLLM plugin): vLLM's %s layers with Delta residuals%s. "
            "model_impl='transformers' takes vLLM's Transformers backend instead (variants without state across "
            "tokens only).",
            type(self).__name__.removeprefix("Vllm"),  # the architecture served
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


class VllmDeltaLlamaForCausalLM(VllmDeltaCausalLM):
    """Served for the `DeltaLlamaForCausalLM` architecture."""

    backbone, backbone_name, embedding_name = VllmDeltaLlamaModel, "model", "embed_tokens"

    def weights_mapper(self) -> WeightsMapper:
        return RENAMED | VllmDeltaLlamaModel.hf_to_vllm_mapper


class VllmDeltaGPTForCausalLM(VllmDeltaCausalLM):
    """Served for the `DeltaGPTForCausalLM` architecture."""

    backbone, backbone_name, embedding_name = VllmDeltaGPTModel, "transformer", "wte"

    def prepare_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        return _transposed_gpt2_weights(weights)


# ----------------------------------------------------------------------------------------------------------------
# What this route refuses, up front
# ----------------------------------------------------------------------------------------------------------------


def check_servable(vllm_config: VllmConfig) -> None:
    """One ValueError, before any weight loads, for what this route does not serve exactly."""
    config = vllm_config.model_config.hf_config
    name, plan = type(config).__name__.removesuffix("Config"), state_plan(config)
    problems = []
    if plan.recurrent:
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
    if plan.windows:
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


__all__ = ["VllmDeltaGPTForCausalLM", "VllmDeltaLlamaForCausalLM", "check_servable"]
