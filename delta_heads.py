"""The task heads of both Delta families, written once over the Delta stack: sequence classification (on the last
non-padding token), token classification and extractive question answering.

They are transformers' `GenericForSequenceClassification`, `GenericForTokenClassification` and
`GenericForQuestionAnswering` (modeling_layers.py, what `LlamaFor*` are) with the Delta outputs (betas, expanded
states) carried through, over the family's own stack instead of `AutoModel` (a Hub directory's custom code cannot
count on the Auto classes knowing its config). Each family's file subclasses them with its pretrained base and stack
(`modeling_delta_gpt.py`, `modeling_delta_llama.py`), under its source's names (GPT-2's `transformer` and token head
`classifier`; Llama's `model`, `score`, and `transformer` for question answering, as transformers keeps for Llama),
so a GPT-2 / Llama head checkpoint loads weight for weight.

Self-contained Hub custom-code file: it imports only torch, transformers and its sibling files, which
`save_pretrained` copies next to the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# First: below the supported transformers / torch it stops here with one clear error (delta_compat.py).
from .delta_compat import CACHE_ARG, cache_argument, cache_of, takes_cache

# isort: split
from transformers.cache_utils import Cache
from transformers.modeling_outputs import (
    QuestionAnsweringModelOutput,
    SequenceClassifierOutputWithPast,
    TokenClassifierOutput,
)
from transformers.utils import can_return_tuple

from .delta_model import DeltaOutputs


@dataclass
class DeltaSequenceClassifierOutput(DeltaOutputs, SequenceClassifierOutputWithPast):
    """`SequenceClassifierOutputWithPast` and the Delta outputs (`DeltaOutputs`)."""


@dataclass
class DeltaTokenClassifierOutput(DeltaOutputs, TokenClassifierOutput):
    """`TokenClassifierOutput` and the Delta outputs (`DeltaOutputs`)."""


@dataclass
class DeltaQuestionAnsweringOutput(DeltaOutputs, QuestionAnsweringModelOutput):
    """`QuestionAnsweringModelOutput` and the Delta outputs (`DeltaOutputs`)."""


def head_output(output_class: type, outputs: DeltaOutputs, **head_fields) -> DeltaOutputs:
    """A head's output: its own fields (`loss`, `logits`, ...) and what the Delta stack returned, passed through as
    it came: the cache (where `output_class` keeps one), hidden states, attentions, betas and expanded states."""
    stack = dict(
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
        betas=outputs.betas,
        expanded_states=outputs.expanded_states,
    )
    if CACHE_ARG in output_class.__dataclass_fields__:
        stack.update(cache_argument(cache_of(outputs)))
    return output_class(**head_fields, **stack)


class DeltaForSequenceClassification:
    """A linear head (`score`, no bias) on the last non-padding token: the rightmost position whose token is not
    `config.pad_token_id`, so left and right padding both pool the last real token. The family's class sets
    `stack_class`."""

    stack_class: type[nn.Module]

    def __init__(self, config):
        super().__init__(config)
        self.num_labels = config.num_labels
        setattr(self, self.base_model_prefix, self.stack_class(config))
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
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
        **kwargs,
    ) -> DeltaSequenceClassifierOutput:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size,)`, *optional*):
            Regression (`num_labels == 1`, mean squared error) or classification (cross-entropy) targets; the problem
            type follows `config.problem_type` as in transformers' heads.
        """
        outputs = self.base_model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        logits = self.score(outputs.last_hidden_state)
        batch_size = input_ids.shape[0] if input_ids is not None else inputs_embeds.shape[0]
        pad_token_id = self.config.pad_token_id
        if pad_token_id is None and batch_size != 1:
            raise ValueError(
                "Cannot classify a batch of more than one sequence without a padding token: "
                "set model.config.pad_token_id (e.g. to tokenizer.pad_token_id)."
            )
        if pad_token_id is None or input_ids is None:  # inputs_embeds: padding cannot be told apart, as transformers
            last_token = -1
        else:  # rightmost non-padding token: works for left and right padding
            non_pad = (input_ids != pad_token_id).to(logits.device, torch.int32)
            positions = torch.arange(input_ids.shape[-1], device=logits.device, dtype=torch.int32)
            last_token = (positions * non_pad).argmax(-1)
        pooled_logits = logits[torch.arange(batch_size, device=logits.device), last_token]

        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, pooled_logits=pooled_logits, config=self.config)

        return head_output(DeltaSequenceClassifierOutput, outputs, loss=loss, logits=pooled_logits)


class DeltaForTokenClassification:
    """A linear head on every token after dropout (`classifier_dropout`, else `hidden_dropout`, else 0.1, as
    transformers' heads). The family's class sets `stack_class` and `classifier_name`, the head's attribute (GPT-2:
    `classifier`; Llama: `score`)."""

    stack_class: type[nn.Module]
    classifier_name: str = "score"

    def __init__(self, config):
        super().__init__(config)
        self.num_labels = config.num_labels
        setattr(self, self.base_model_prefix, self.stack_class(config))
        dropout = getattr(config, "classifier_dropout", None)
        if dropout is None:
            dropout = getattr(config, "hidden_dropout", None)
        self.dropout = nn.Dropout(0.1 if dropout is None else dropout)
        bias = getattr(config, "token_classification_bias", True)
        setattr(self, self.classifier_name, nn.Linear(config.hidden_size, config.num_labels, bias=bias))
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
        **kwargs,
    ) -> DeltaTokenClassifierOutput:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            A class index per token (-100 is ignored).
        """
        outputs = self.base_model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        classifier = getattr(self, self.classifier_name)
        logits = classifier(self.dropout(outputs.last_hidden_state))

        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.config)

        return head_output(DeltaTokenClassifierOutput, outputs, loss=loss, logits=logits)


class DeltaForQuestionAnswering:
    """A span head (`qa_outputs`: start and end logits per token) for extractive question answering. The family's
    class sets `stack_class` (and `base_model_prefix` where its source names the stack otherwise)."""

    stack_class: type[nn.Module]

    def __init__(self, config):
        super().__init__(config)
        setattr(self, self.base_model_prefix, self.stack_class(config))
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
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
        start_positions: torch.LongTensor | None = None,
        end_positions: torch.LongTensor | None = None,
        **kwargs,
    ) -> DeltaQuestionAnsweringOutput:
        r"""
        start_positions, end_positions (`torch.LongTensor` of shape `(batch_size,)`, *optional*):
            The answer span's first and last token; positions outside the sequence are clamped and ignored.
        """
        outputs = self.base_model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            **kwargs,
        )
        start_logits, end_logits = self.qa_outputs(outputs.last_hidden_state).split(1, dim=-1)
        start_logits, end_logits = start_logits.squeeze(-1).contiguous(), end_logits.squeeze(-1).contiguous()

        loss = None
        if start_positions is not None and end_positions is not None:
            loss = self.loss_function(start_logits, end_logits, start_positions, end_positions, **kwargs)

        return head_output(
            DeltaQuestionAnsweringOutput, outputs, loss=loss, start_logits=start_logits, end_logits=end_logits
        )


__all__ = [
    "DeltaForQuestionAnswering",
    "DeltaForSequenceClassification",
    "DeltaForTokenClassification",
    "DeltaQuestionAnsweringOutput",
    "DeltaSequenceClassifierOutput",
    "DeltaTokenClassifierOutput",
    "head_output",
]
