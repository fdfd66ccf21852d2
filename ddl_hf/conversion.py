"""Turn a GPT-2 checkpoint into a DeltaGPT that starts equivalent to it."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from .configuration_delta_gpt import DeltaGPTConfig
from .modeling_delta_gpt import DeltaGPTForCausalLM


def convert_gpt2(source: str | os.PathLike | GPT2LMHeadModel, **config_overrides) -> DeltaGPTForCausalLM:
    """Build a DeltaGPTForCausalLM carrying the weights of a GPT-2 language model.

    Args:
        source: a Hub id (e.g. "gpt2"), a local directory, or an in-memory `GPT2LMHeadModel`.
        **config_overrides: DeltaGPTConfig fields, e.g. `delta_mode="paper"`, `delta_value_channels=4`.

    Every GPT-2 weight is copied under its own name; only the Delta parameters are new, initialised so that
    beta == `delta_beta_init` (default 0.0: in the additive mode the result computes the source's function).
    """
    gpt2 = source if isinstance(source, GPT2LMHeadModel) else GPT2LMHeadModel.from_pretrained(source)
    if not isinstance(gpt2.config, GPT2Config):
        raise ValueError(f"Source must be a GPT-2 model, got a {type(gpt2.config).__name__}.")

    gpt2_fields = gpt2.config.to_dict()
    for key in ("model_type", "architectures", "auto_map", "transformers_version"):
        gpt2_fields.pop(key, None)
    config = DeltaGPTConfig(**{**gpt2_fields, **config_overrides})
    config._attn_implementation = gpt2.config._attn_implementation

    model = DeltaGPTForCausalLM(config).to(gpt2.dtype)
    missing, unexpected = model.load_state_dict(gpt2.state_dict(), strict=False)
    new_params = [name for name in missing if ".attn_delta." in name or ".mlp_delta." in name or "read_out" in name]
    really_missing = sorted(set(missing) - set(new_params))
    if really_missing or unexpected:
        raise ValueError(
            "GPT-2 weights do not match the DeltaGPT layout: "
            f"missing {really_missing}, unexpected {sorted(unexpected)}."
        )
    with torch.no_grad():
        model.tie_weights()
    return model.eval() if not gpt2.training else model


@dataclass
class EquivalenceReport:
    """How closely a converted DeltaGPT reproduces its source GPT-2 on the same tokens."""

    max_abs_logit_diff: float
    source_perplexity: float
    converted_perplexity: float
    greedy_tokens: int
    greedy_identical: bool

    def __str__(self) -> str:
        change = self.converted_perplexity / self.source_perplexity - 1.0
        return (
            "Equivalence report (converted DeltaGPT vs source GPT-2)\n"
            f"  max |logit difference|       : {self.max_abs_logit_diff:.3e}\n"
            f"  perplexity source / converted: {self.source_perplexity:.4f} / {self.converted_perplexity:.4f}"
            f" ({change:+.2%})\n"
            f"  greedy {self.greedy_tokens} tokens identical  : {self.greedy_identical}"
        )


@torch.no_grad()
def equivalence_report(
    source: GPT2LMHeadModel, converted: DeltaGPTForCausalLM, input_ids: torch.Tensor, greedy_tokens: int = 64
) -> EquivalenceReport:
    """Compare logits and perplexity on `input_ids` [batch, seq], and greedy continuations of its first row."""
    source_out = source(input_ids, labels=input_ids)
    converted_out = converted(input_ids, labels=input_ids)
    prompt = input_ids[:1, : max(1, min(8, input_ids.shape[1]))]
    greedy_tokens = min(greedy_tokens, source.config.n_positions - prompt.shape[1])
    kwargs = dict(max_new_tokens=greedy_tokens, min_new_tokens=greedy_tokens, do_sample=False, pad_token_id=0)
    return EquivalenceReport(
        max_abs_logit_diff=(source_out.logits.float() - converted_out.logits.float()).abs().max().item(),
        source_perplexity=math.exp(source_out.loss.item()),
        converted_perplexity=math.exp(converted_out.loss.item()),
        greedy_tokens=greedy_tokens,
        greedy_identical=bool(torch.equal(source.generate(prompt, **kwargs), converted.generate(prompt, **kwargs))),
    )
