"""PyTorch DeltaLlama: a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) whose every residual is a Delta residual.

Each layer is the family's own `input_layernorm -> self_attn -> residual, post_attention_layernorm -> mlp ->
residual`; both residual connections become `DeltaResidual`s (`delta_layers.py`: the same module as DeltaGPT's,
both modes, any d_v, the variants). The attention, MLP, RMSNorm and rotary embedding are the family's own
transformers classes, chosen by `config.source_model_type`, so attention backends, GQA, RoPE scaling, QK-norm
(Qwen3) and sliding windows carry over, and the parameter names are the family's: a converted checkpoint loads under
its own names.

Reads top to bottom like `modeling_llama.py`: the family table, the decoder layer (eq. 2.5 twice), the output
classes, the pretrained base, the model and its heads. The reads live in `delta_reads.py`, the residual in
`delta_layers.py`, what both families add around their layers in `delta_model.py`, the task heads in
`delta_heads.py`.

Self-contained Hub custom-code file: it imports only torch, transformers and its sibling files
(`configuration_delta_llama.py`, `delta_model.py`, `delta_heads.py`, `delta_layers.py`, `delta_reads.py`,
`delta_state.py`, `delta_net.py`, `delta_net_ops.py`, `delta_ops.py`, `delta_fused.py`, `delta_compat.py`), which
`save_pretrained` copies next to the weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

# First: below the supported transformers / torch it stops here with one clear error (delta_compat.py).
from .delta_compat import (
    OutputRecorder,
    cache_argument,
    capture_outputs,
    merge_with_config_defaults,
    slice_logits_to_keep,
    takes_cache,
)

# isort: split
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding
from transformers.models.mistral.modeling_mistral import (
    MistralAttention,
    MistralMLP,
    MistralRMSNorm,
    MistralRotaryEmbedding,
)
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2MLP, Qwen2RMSNorm, Qwen2RotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding
from transformers.utils import can_return_tuple

from .configuration_delta_llama import DELTA_LLAMA_FAMILIES, DeltaLlamaConfig
from .delta_heads import (
    DeltaForQuestionAnswering,
    DeltaForSequenceClassification,
    DeltaForTokenClassification,
    head_output,
)
from .delta_layers import DeltaResidual, spectral_std
from .delta_model import DeltaOutputs, DeltaPreTrainedMixin, DeltaStackMixin, check_token_ids
from .delta_reads import DeltaConvContext, DeltaRead
from .delta_state import READ_OUT_WINDOW, block_windows


class FamilyModules(NamedTuple):
    """The transformers classes a DeltaLlama layer borrows from its source family."""

    attention: type[nn.Module]
    mlp: type[nn.Module]
    norm: type[nn.Module]
    rotary: type[nn.Module]


FAMILY_MODULES: dict[str, FamilyModules] = {
    "llama": FamilyModules(LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding),
    "mistral": FamilyModules(MistralAttention, MistralMLP, MistralRMSNorm, MistralRotaryEmbedding),
    "qwen2": FamilyModules(Qwen2Attention, Qwen2MLP, Qwen2RMSNorm, Qwen2RotaryEmbedding),
    "qwen3": FamilyModules(Qwen3Attention, Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding),
}
assert set(FAMILY_MODULES) == set(DELTA_LLAMA_FAMILIES)


def family_modules(config: DeltaLlamaConfig) -> FamilyModules:
    """The family's classes, or a ValueError listing the supported families."""
    if config.source_model_type not in FAMILY_MODULES:
        raise ValueError(
            f"source_model_type={config.source_model_type!r} is not supported; DeltaLlama supports "
            f"{', '.join(FAMILY_MODULES)}."
        )
    return FAMILY_MODULES[config.source_model_type]


def attention_layer_types(config: DeltaLlamaConfig) -> list[str]:
    """Each layer's attention kind as its family's model decides it: Qwen2/Qwen3 from `layer_types`, Mistral
    sliding everywhere when `sliding_window` is set, Llama always full."""
    layers = config.num_hidden_layers
    if config.source_model_type in ("qwen2", "qwen3"):
        return list(config.layer_types)
    if config.source_model_type == "mistral" and getattr(config, "sliding_window", None) is not None:
        return ["sliding_attention"] * layers
    return ["full_attention"] * layers


# ----------------------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------------------


class DeltaLlamaDecoderLayer(GradientCheckpointingLayer):
    """The family's decoder layer (pre-norm attention then MLP) whose two residual connections are Delta residuals."""

    def __init__(self, config: DeltaLlamaConfig, layer_idx: int):
        super().__init__()
        family = family_modules(config)
        self.hidden_size = config.hidden_size
        self.layer_idx = layer_idx
        self.windows = block_windows(layer_idx)  # the cache entries of TC reads

        self.attn_read = DeltaRead(config)
        self.input_layernorm = family.norm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = family.attention(config=config, layer_idx=layer_idx)
        self.attn_delta = DeltaResidual(config)
        self.mlp_read = None if config.delta_shared_read else DeltaRead(config)  # shared: attn_read reads again
        self.post_attention_layernorm = family.norm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = family.mlp(config)
        self.mlp_delta = DeltaResidual(config)

    def delta_residuals(self) -> dict[str, tuple[DeltaResidual, nn.Module]]:
        """{attribute name: (Delta residual, the RMSNorm that produces its sublayer and gate input)}."""
        return {
            "attn_delta": (self.attn_delta, self.input_layernorm),
            "mlp_delta": (self.mlp_delta, self.post_attention_layernorm),
        }

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: Cache | None = None,
        delta_context: DeltaConvContext | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Eq. 2.5 twice: x = read(X), c = norm(x), h = F(c), X = delta(X, x, c, h). Returns the new state and the
        betas of the attention and MLP Delta residuals (recorded for `output_betas`)."""
        x = self.attn_read(hidden_states, delta_context, self.windows[0])
        c = self.input_layernorm(x)
        h, _ = self.self_attn(
            hidden_states=c,
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
            **cache_argument(cache),
            **kwargs,
        )
        hidden_states, attn_beta = self.attn_delta(hidden_states, x, c, h)

        x = (self.mlp_read or self.attn_read)(hidden_states, delta_context, self.windows[1])
        c = self.post_attention_layernorm(x)
        hidden_states, mlp_beta = self.mlp_delta(hidden_states, x, c, self.mlp(c))
        return hidden_states, attn_beta, mlp_beta


@dataclass
class DeltaLlamaModelOutput(DeltaOutputs, BaseModelOutputWithPast):
    """`BaseModelOutputWithPast` and the Delta outputs (`DeltaOutputs`)."""


@dataclass
class DeltaLlamaCausalLMOutput(DeltaOutputs, CausalLMOutputWithPast):
    """`CausalLMOutputWithPast` and the Delta outputs (`DeltaOutputs`)."""


class DeltaLlamaPreTrainedModel(DeltaPreTrainedMixin, PreTrainedModel):
    """The family's pretrained base (transformers' default init) plus the Delta init, `delta_residuals()`,
    `delta_parameters()` and the exact init of the Delta parameters a source checkpoint lacks."""

    config: DeltaLlamaConfig
    config_class = DeltaLlamaConfig
    base_model_prefix = "model"
    layers_attribute = "layers"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DeltaLlamaDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values", "cache"]  # the cache, under either name
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True
    # `hidden_states` and `expanded_states` are values of the stack (`DeltaStackMixin.record_state`).
    _can_record_outputs = {
        # The family's attention class differs per config: matched by its module name instead.
        "attentions": OutputRecorder(None, index=1, class_name="self_attn"),
        "betas": [OutputRecorder(DeltaLlamaDecoderLayer, index=1), OutputRecorder(DeltaLlamaDecoderLayer, index=2)],
    }

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """The family's initialisation (transformers' default) plus the Delta parameters (`init_delta_weights`)."""
        super()._init_weights(module)
        self.init_delta_weights(module)


class DeltaLlamaModel(DeltaStackMixin, DeltaLlamaPreTrainedModel):
    def __init__(self, config: DeltaLlamaConfig):
        super().__init__(config)
        config.validate_delta_residual()
        family = family_modules(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.layer_types = attention_layer_types(config)

        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([DeltaLlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.init_state_modules(config)  # EC's expansion of the embedding, the read-out for the norm
        self.norm = family.norm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = family.rotary(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, new_embeddings: nn.Embedding) -> None:
        self.embed_tokens = new_embeddings

    @takes_cache
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> DeltaLlamaModelOutput:
        r"""
        Same inputs as the family's `XxxModel.forward`. `output_betas=True` returns `betas`: one `[batch, seq_len]`
        tensor per Delta residual. With `delta_value_channels > 1`, `hidden_states` are `[.., hidden_size]` reads of
        the expanded states, and `output_expanded_states=True` returns the states `[.., hidden_size, d_v]`.

        The family's forward (embeddings, masks, rotary, layers, norm) plus the Delta steps (`DeltaStackMixin`): the
        state expansion over the value channels, the convolution windows of the temporal variants, and the read-out
        before `norm`.
        """
        records = self.state_records(kwargs)
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        check_token_ids(input_ids, self.config.vocab_size)

        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        cache = self.delta_cache(cache, use_cache)
        past_seen_tokens = cache.get_seq_length() if cache is not None else 0
        delta_context = self.delta_context(  # the caller's position_ids: where packed documents restart
            attention_mask, cache, position_ids, inputs_embeds.shape[:2], past_seen_tokens, kwargs
        )
        if position_ids is None:
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        # It may already have been prepared by e.g. `generate`
        if not isinstance(causal_mask_mapping := attention_mask, dict):
            mask_kwargs = {
                "config": self.config,
                "inputs_embeds": inputs_embeds,
                "attention_mask": attention_mask,
                **cache_argument(cache),
                "position_ids": position_ids,
            }
            causal_mask_mapping = {"full_attention": create_causal_mask(**mask_kwargs)}
            if "sliding_attention" in self.layer_types:
                causal_mask_mapping["sliding_attention"] = create_sliding_window_causal_mask(**mask_kwargs)

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        hidden_states = self.expand_state(hidden_states, delta_context)
        checkpointing = self.gradient_checkpointing and self.training
        for i, decoder_layer in enumerate(self.layers[: self.config.num_hidden_layers]):
            hidden_states = self.record_state(hidden_states, records)
            hidden_states, *_ = decoder_layer(
                hidden_states,
                attention_mask=causal_mask_mapping[self.layer_types[i]],
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                cache=cache if not checkpointing else None,  # recomputed layers must not write to it twice
                use_cache=use_cache,
                delta_context=delta_context,
                **kwargs,
            )

        final_state = hidden_states
        hidden_states = self.norm(self.read_out(hidden_states, delta_context, READ_OUT_WINDOW))
        return DeltaLlamaModelOutput(
            last_hidden_state=hidden_states,
            **cache_argument(cache if use_cache else None),
            **self.state_outputs(records, final_state, hidden_states),
        )


class DeltaLlamaForCausalLM(DeltaLlamaPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: DeltaLlamaConfig):
        super().__init__(config)
        self.model = DeltaLlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @takes_cache
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> DeltaLlamaCausalLMOutput:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Labels for language modeling; shifted inside the model, so `labels = input_ids` works. -100 is ignored.
        """
        outputs: DeltaLlamaModelOutput = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        logits = self.lm_head(slice_logits_to_keep(hidden_states, logits_to_keep))

        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)

        return head_output(DeltaLlamaCausalLMOutput, outputs, loss=loss, logits=logits)


class DeltaLlamaForSequenceClassification(DeltaForSequenceClassification, DeltaLlamaPreTrainedModel):
    """DeltaLlama with a linear head on the last non-padding token, as `LlamaForSequenceClassification`
    (`delta_heads.py`)."""

    stack_class = DeltaLlamaModel


class DeltaLlamaForTokenClassification(DeltaForTokenClassification, DeltaLlamaPreTrainedModel):
    """DeltaLlama with a linear head on every token, as `LlamaForTokenClassification` (`delta_heads.py`)."""

    stack_class = DeltaLlamaModel


class DeltaLlamaForQuestionAnswering(DeltaForQuestionAnswering, DeltaLlamaPreTrainedModel):
    """DeltaLlama with a span head for extractive question answering, as `LlamaForQuestionAnswering`
    (`delta_heads.py`), whose stack transformers keeps under `transformer` for older checkpoints."""

    base_model_prefix = "transformer"
    stack_class = DeltaLlamaModel


# The authors' residual output projections (their `attn.o_proj` and `mlp.o_proj`), under the Llama family's names.
REFERENCE_OUTPUT_PROJECTIONS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


@torch.no_grad()
def init_reference_backbone(model: nn.Module, embedding_std: float = 0.02) -> nn.Module:
    """Initialise a Llama-style backbone (a DeltaLlama, or the family's own model) as the authors' code does at
    `delta_layers.REFERENCE_COMMIT` (`init_utils.init_gpt_weights`); returns the model.

    The (tied) embedding N(0, `embedding_std`); every other backbone matrix N(0, spectral_std(fan_in, fan_out)) with
    their factor 0.5, divided by the number of layers for the projections that write to the residual (attention and
    MLP output); norms at one. Delta parameters are left to `delta_init` (call this after building the model)."""
    layers = model.config.num_hidden_layers
    delta = {id(p) for p in model.delta_parameters().values()} if hasattr(model, "delta_parameters") else set()
    embedding = model.get_input_embeddings().weight
    for name, parameter in model.named_parameters():
        if id(parameter) in delta:
            continue
        if parameter is embedding:
            init.normal_(parameter, mean=0.0, std=embedding_std)
        elif parameter.dim() >= 2:
            fan_out = parameter.shape[0]
            std = spectral_std(parameter.numel() // fan_out, fan_out)
            init.normal_(parameter, mean=0.0, std=std / layers if name.endswith(REFERENCE_OUTPUT_PROJECTIONS) else std)
        elif name.endswith("norm.weight"):
            init.ones_(parameter)
        else:
            raise ValueError(f"init_reference_backbone: no rule for {name} {tuple(parameter.shape)} (a bias?)")
    return model


__all__ = [
    "DeltaLlamaDecoderLayer",
    "DeltaLlamaForCausalLM",
    "DeltaLlamaForQuestionAnswering",
    "DeltaLlamaForSequenceClassification",
    "DeltaLlamaForTokenClassification",
    "DeltaLlamaModel",
    "DeltaLlamaPreTrainedModel",
    "init_reference_backbone",
]
