"""PyTorch DeltaGPT: GPT-2 whose every attention and MLP residual is a Deep Delta Learning block.

Deep Delta Learning (Zhang, Liu, Wang, Gu; arXiv 2601.00417) replaces the identity shortcut `X + F(X)` with the
Delta Operator `A = I - beta k k^T` and a synchronous rank-1 write: `X' = A X + beta k v^T` (`DeltaResidual`, in
`delta_layers.py`). GPT-2's own attention and MLP are the sublayers (`GPT2MLP`, and `DeltaGPTAttention`: `GPT2Attention`
with its output reshaped as Llama's, for vLLM), so every attention backend, the `Conv1D` weights and GPT-2's
parameter names carry over; only the Delta parameters are new.

Reads top to bottom like `modeling_gpt2.py`: the block (eq. 2.5 twice: read, norm, sublayer, Delta update), the
output classes, the pretrained base, the model and its heads. The reads live in `delta_reads.py`, the residual in
`delta_layers.py`, what both families add around their layers in `delta_model.py`, the task heads of both families in
`delta_heads.py`, the DeltaNet token mixer in `delta_net.py`, the state carried across tokens in `delta_state.py`,
the math in `delta_ops.py`.

Self-contained Hub custom-code file: it imports only torch, transformers and its sibling files, which
`save_pretrained` copies next to the weights. Whatever differs between transformers / torch releases is absorbed in
`delta_compat.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions, CausalLMOutputWithCrossAttentions
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP, GPT2Attention, eager_attention_forward
from transformers.pytorch_utils import Conv1D
from transformers.utils import can_return_tuple

from .configuration_delta_gpt import DeltaGPTConfig
from .delta_heads import (
    DeltaForQuestionAnswering,
    DeltaForSequenceClassification,
    DeltaForTokenClassification,
    head_output,
)
from .delta_layers import DeltaResidual
from .delta_model import DeltaOutputs, DeltaPreTrainedMixin, DeltaStackMixin, check_token_ids
from .delta_net import DeltaNetAttention
from .delta_reads import DeltaConvContext, DeltaRead
from .delta_state import READ_OUT_WINDOW, block_windows


class DeltaGPTAttention(GPT2Attention):
    """GPT-2's self-attention: `GPT2Attention`'s parameters, initialisation and math, bit for bit (its own eager
    `reorder_and_upcast_attn` path included). One line differs: the attention output is reshaped by the input's
    shape, `reshape(*input_shape, -1)`, as the Llama-family attentions do, instead of by the output's own leading
    dimensions. An attention backend that returns `[tokens, heads * head_dim]` (vLLM's Transformers backend does)
    then works too; `GPT2Attention` flattens such an output to one dimension (docs/serving.md). DeltaGPT is
    decoder-only (no cross-attention), so only the self-attention path is here."""

    @takes_cache
    def forward(
        self,
        hidden_states: torch.Tensor,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        kwargs.pop("output_attentions", None)  # GPT2Attention's flag: the weights are always returned
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query, key, value = self.c_attn(hidden_states).split(self.split_size, dim=2)
        query, key, value = (x.view(hidden_shape).transpose(1, 2) for x in (query, key, value))
        if cache is not None:  # as GPT2Attention up to 5.23; 5.24's also passes `kwargs=`, which no cache layer reads
            key, value = cache.update(key, value, self.layer_idx)

        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        if self.config._attn_implementation == "eager" and self.reorder_and_upcast_attn:
            attn_output, attn_weights = self._upcast_and_reordered_attn(query, key, value, attention_mask)
        else:
            attn_output, attn_weights = attention_interface(
                self,
                query,
                key,
                value,
                attention_mask,
                dropout=self.attn_dropout.p if self.training else 0.0,
                scaling=self.scaling,
                **kwargs,
            )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.resid_dropout(self.c_proj(attn_output)), attn_weights


class DeltaGPTBlock(GradientCheckpointingLayer):
    """GPT-2 block (pre-norm attention then MLP) whose two residual connections are Delta residuals."""

    def __init__(self, config: DeltaGPTConfig, layer_idx: int | None = None):
        super().__init__()
        hidden_size = config.hidden_size
        inner_dim = config.n_inner if config.n_inner is not None else 4 * hidden_size
        self.layer_idx = layer_idx
        self.windows = block_windows(layer_idx)  # where the cache keeps TC reads' last inputs

        self.attn_read = DeltaRead(config)
        self.ln_1 = nn.LayerNorm(hidden_size, eps=config.layer_norm_epsilon)
        if config.token_mixer == "delta_net":
            self.attn = DeltaNetAttention(config=config, layer_idx=layer_idx)
        else:
            self.attn = DeltaGPTAttention(config=config, layer_idx=layer_idx)
        self.attn_delta = DeltaResidual(config)
        self.mlp_read = None if config.delta_shared_read else DeltaRead(config)  # shared: attn_read reads again
        self.ln_2 = nn.LayerNorm(hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(inner_dim, config)
        self.mlp_delta = DeltaResidual(config)

    def delta_residuals(self) -> dict[str, tuple[DeltaResidual, nn.LayerNorm]]:
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
        """Eq. 2.5 twice: x = read(X), c = norm(x), h = F(c), X = delta(X, x, c, h). Returns the new state and the
        betas of the attention and MLP Delta residuals (recorded for `output_betas`)."""
        x = self.attn_read(hidden_states, delta_context, self.windows[0])
        c = self.ln_1(x)
        h, _ = self.attn(c, attention_mask=attention_mask, use_cache=use_cache, **cache_argument(cache), **kwargs)
        hidden_states, attn_beta = self.attn_delta(hidden_states, x, c, h)

        x = (self.mlp_read or self.attn_read)(hidden_states, delta_context, self.windows[1])
        c = self.ln_2(x)
        hidden_states, mlp_beta = self.mlp_delta(hidden_states, x, c, self.mlp(c))
        return hidden_states, attn_beta, mlp_beta


@dataclass
class DeltaGPTModelOutput(DeltaOutputs, BaseModelOutputWithPastAndCrossAttentions):
    """`BaseModelOutputWithPastAndCrossAttentions` and the Delta outputs (`DeltaOutputs`)."""


@dataclass
class DeltaGPTCausalLMOutput(DeltaOutputs, CausalLMOutputWithCrossAttentions):
    """`CausalLMOutputWithCrossAttentions` and the Delta outputs (`DeltaOutputs`)."""


class DeltaGPTPreTrainedModel(DeltaPreTrainedMixin, PreTrainedModel):
    config: DeltaGPTConfig
    config_class = DeltaGPTConfig
    base_model_prefix = "transformer"
    layers_attribute = "h"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DeltaGPTBlock"]
    _skip_keys_device_placement = ["past_key_values", "cache"]  # the cache, under either name
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True
    # `hidden_states` and `expanded_states` are values of the stack (`DeltaStackMixin.record_state`): at d_v > 1 an
    # entry is a read of the state, not a layer's output.
    _can_record_outputs = {
        "attentions": OutputRecorder(GPT2Attention, layer_name=".attn", index=1),
        "betas": [OutputRecorder(DeltaGPTBlock, index=1), OutputRecorder(DeltaGPTBlock, index=2)],
    }
    # Old GPT-2 checkpoints' causal-mask buffers (`h.0.attn.bias`, `h.0.attn.masked_bias`), anchored: vLLM's
    # Transformers backend drops every weight these patterns `search`, and "attn.bias" also finds `c_attn.bias`.
    _keys_to_ignore_on_load_unexpected = [r"(^|\.)attn\.bias$", r"(^|\.)attn\.masked_bias$"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """GPT-2's initialisation, plus the Delta parameters (`init_delta_weights`)."""
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
        self.init_delta_weights(module)


def check_inputs(
    config: DeltaGPTConfig,
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    batch_size: int,
    seq_len: int,
    past_len: int,
) -> None:
    """Clear errors for the usual silent or cryptic failures (index errors deep inside an embedding): from shapes
    on the host, from data on the device (`torch._assert_async`: the host never waits for it)."""
    n_positions = config.n_positions
    if position_ids is None and past_len + seq_len > n_positions:
        raise ValueError(
            f"Sequence too long: {seq_len} new tokens + {past_len} cached tokens > n_positions={n_positions}. "
            f"Truncate the input (e.g. tokenizer(..., truncation=True, max_length={n_positions}))."
        )
    if position_ids is not None and position_ids.numel():
        torch._assert_async(
            (position_ids < n_positions).all(),
            f"position_ids reach n_positions={n_positions} or more: truncate the input or pass smaller ones.",
        )
    check_token_ids(input_ids, config.vocab_size)
    if attention_mask is not None and attention_mask.ndim == 2:
        expected = (batch_size, past_len + seq_len)
        if tuple(attention_mask.shape) != expected:
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)}, expected {expected} "
                "(batch_size, past tokens + new tokens). Pass the mask the tokenizer returned with the input_ids."
            )


class DeltaGPTModel(DeltaStackMixin, DeltaGPTPreTrainedModel):
    def __init__(self, config: DeltaGPTConfig):
        super().__init__(config)
        config.validate_delta()
        self.embed_dim = config.hidden_size

        self.wte = nn.Embedding(config.vocab_size, self.embed_dim)
        self.wpe = nn.Embedding(config.max_position_embeddings, self.embed_dim)
        self.drop = nn.Dropout(config.embd_pdrop)
        self.h = nn.ModuleList([DeltaGPTBlock(config, layer_idx=i) for i in range(config.num_hidden_layers)])
        self.init_state_modules(config)  # EC's expansion of the embedding, the read-out for ln_f
        self.ln_f = nn.LayerNorm(self.embed_dim, eps=config.layer_norm_epsilon)

        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.wte

    def set_input_embeddings(self, new_embeddings: nn.Embedding) -> None:
        self.wte = new_embeddings

    @takes_cache
    @merge_with_config_defaults
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
        Same inputs as `GPT2Model.forward`. `output_betas=True` returns `betas`: one `[batch, seq_len]` tensor per
        Delta residual. With `delta_value_channels > 1`, `hidden_states` are `[.., hidden_size]` reads of the
        expanded states, and `output_expanded_states=True` returns the states `[.., hidden_size, d_v]` themselves.

        `GPT2Model.forward` (embeddings, mask, blocks, `ln_f`) plus the Delta steps (`DeltaStackMixin`): the cache of
        a DeltaNet mixer or of the convolution windows, the expansion of the embedding over the value channels, the
        read-out before `ln_f`.
        """
        records = self.state_records(kwargs)
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

        if isinstance(attention_mask, dict):  # generate with a static cache: masks by layer type (config.layer_types)
            attention_mask = attention_mask.get(self.config.layer_types[0])
        cache = self.delta_cache(cache, use_cache)
        past_seen_tokens = cache.get_seq_length() if cache is not None else 0
        check_inputs(
            self.config, input_ids, attention_mask, position_ids, batch_size, input_shape[-1], past_seen_tokens
        )
        if attention_mask is not None and attention_mask.ndim < 4:
            attention_mask = attention_mask.view(batch_size, -1)

        delta_context = self.delta_context(  # the caller's position_ids: where packed documents restart
            attention_mask, cache, position_ids, (batch_size, input_shape[-1]), past_seen_tokens, kwargs
        )
        if inputs_embeds is None:
            inputs_embeds = self.wte(input_ids)
        if position_ids is None:
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)
        hidden_states = inputs_embeds + self.wpe(position_ids).to(inputs_embeds.device)
        if token_type_ids is not None:
            hidden_states = hidden_states + self.wte(token_type_ids.view(-1, input_shape[-1]))

        # The mask by layer type (config.layer_types): GPT-2's causal mask, or DeltaNet's 2-D padding mask and
        # where packed documents start (causal by construction).
        if self.config.layer_types[0] == "linear_attention":
            if attention_mask is not None and attention_mask.ndim != 2:
                raise ValueError("token_mixer='delta_net' supports only a 2-D [batch, seq_len] padding mask.")
            kwargs["document_starts"] = delta_context.document_starts
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
        checkpointing = self.gradient_checkpointing and self.training
        for block in self.h:
            hidden_states = self.record_state(hidden_states, records)
            hidden_states, *_ = block(
                hidden_states,
                cache if not checkpointing else None,  # recomputed layers must not write to it twice
                causal_mask,
                use_cache=use_cache,
                position_ids=position_ids,
                delta_context=delta_context,
                **kwargs,
            )

        final_state = hidden_states
        hidden_states = self.ln_f(self.read_out(hidden_states, delta_context, READ_OUT_WINDOW))
        hidden_states = hidden_states.view(-1, *input_shape[1:], hidden_states.size(-1))

        return DeltaGPTModelOutput(
            last_hidden_state=hidden_states,
            **cache_argument(cache if use_cache else None),
            **self.state_outputs(records, final_state, hidden_states),
        )


class DeltaGPTForCausalLM(DeltaGPTPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}

    def __init__(self, config: DeltaGPTConfig):
        super().__init__(config)
        self.transformer = DeltaGPTModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
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

        return head_output(DeltaGPTCausalLMOutput, outputs, loss=loss, logits=logits)


class DeltaGPTForSequenceClassification(DeltaForSequenceClassification, DeltaGPTPreTrainedModel):
    """DeltaGPT with a linear head on the last non-padding token, as `GPT2ForSequenceClassification`
    (`delta_heads.py`)."""

    stack_class = DeltaGPTModel


class DeltaGPTForTokenClassification(DeltaForTokenClassification, DeltaGPTPreTrainedModel):
    """DeltaGPT with a linear head on every token, as `GPT2ForTokenClassification` (`delta_heads.py`)."""

    stack_class = DeltaGPTModel
    classifier_name = "classifier"


class DeltaGPTForQuestionAnswering(DeltaForQuestionAnswering, DeltaGPTPreTrainedModel):
    """DeltaGPT with a span head for extractive question answering, as `GPT2ForQuestionAnswering`
    (`delta_heads.py`)."""

    stack_class = DeltaGPTModel


__all__ = [
    "DeltaGPTForCausalLM",
    "DeltaGPTForQuestionAnswering",
    "DeltaGPTForSequenceClassification",
    "DeltaGPTForTokenClassification",
    "DeltaGPTModel",
    "DeltaGPTPreTrainedModel",
]
