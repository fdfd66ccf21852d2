"""Does a converted Delta model compute what its source computes? Measure it on held-out tokens.

The same measurement for DeltaGPT against GPT-2 and DeltaLlama against Llama, Mistral, Qwen2 or Qwen3.

`convert_checkpoint` runs this on the files it wrote, before renaming them into place; the report it returns is
also what the model card and the CLI print.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import PreTrainedConfig, PreTrainedModel

from .families import family_name


def equivalence_tolerance(dtype: torch.dtype, depth: int, width: int, logit_scale: float = 1.0) -> float:
    """The largest |logit difference| accepted when a conversion is meant to be exact (additive mode, beta = 0).

    A correct conversion runs the source's operations in the same order, and measures 0 (every test here does).
    What it may meet elsewhere is a kernel that sums in another order: a reordered sum of n terms moves by about
    sqrt(n) unit roundoffs of its size. The logits pass 2 * depth residual additions of width-long sums, so the bound
    is 4 * eps(dtype) * sqrt(2 * depth * width) * max(1, logit_scale), logit_scale the largest |source logit|:
    5.4e-6 for a 2-layer, width-32 float32 model with unit logits (a defect of 1e-5 is refused there), 0.019 for
    gpt2-xl (48 layers, width 1600) at its logits of about 100.
    """
    return 4 * torch.finfo(dtype).eps * math.sqrt(2 * depth * width) * max(1.0, float(logit_scale))


# Held-out text for the verification report (written for this package; not in any training set we use).
SAMPLE_TEXT = (
    "The lighthouse keeper wrote the weather into a ledger every evening: wind from the west, a grey swell, "
    "two fishing boats back before dark. Nobody had asked him to keep the ledger, and nobody read it, but the "
    "habit had outlived three inspectors and one storm that took the roof off the boathouse.\n\n"
    "In spring the council sent a young engineer to install an automatic lamp. She stayed a week, measured the "
    "tower twice, and spent her last evening reading the ledger from the first page. When she left she asked "
    "whether she could come back in the autumn, not to finish the lamp, which already worked, but to see if the "
    "swallows returned to the same beam above the door. He said they always did, and that he had written it down."
)


@dataclass
class EquivalenceReport:
    """How closely a converted Delta model reproduces its source model on the same tokens."""

    max_abs_logit_diff: float
    source_perplexity: float
    converted_perplexity: float
    greedy_tokens: int
    greedy_identical: bool
    eval_tokens: int = 0
    eval_text: str = "given input_ids"
    delta_mode: str = "additive"
    beta_init: float = 0.0
    value_channels: int = 1
    dtype: str = "float32"
    max_beta: float = 0.0  # largest beta any Delta block produced on the evaluation tokens
    delta_name: str = "DeltaGPT"  # the converted model's architecture
    source_family: str = "GPT-2"  # the source's: "GPT-2", "Llama", "Mistral", "Qwen2", "Qwen3"
    tolerance: float = 0.0  # `equivalence_tolerance` of this model's dtype, depth, width and logits

    @property
    def within_tolerance(self) -> bool:
        """An exact conversion's check: logits within `tolerance` and the same greedy continuation."""
        return self.max_abs_logit_diff <= self.tolerance and self.greedy_identical

    @property
    def perplexity_change(self) -> float:
        """Relative perplexity change of the converted model, e.g. 0.0 for an exact conversion."""
        return self.converted_perplexity / self.source_perplexity - 1.0

    @property
    def expected_equivalent(self) -> bool:
        """Additive mode with every beta = 0 is the source model exactly; any other setting changes the function."""
        return self.delta_mode == "additive" and self.max_beta == 0.0

    def perplexity_same_to(self, digits: int = 4) -> bool:
        return f"{self.source_perplexity:.{digits}g}" == f"{self.converted_perplexity:.{digits}g}"

    def __str__(self) -> str:
        lines = [
            f"Equivalence report (converted {self.delta_name} vs source {self.source_family})",
            f"  setting                      : delta_mode={self.delta_mode}, value_channels={self.value_channels}, "
            f"beta_init={self.beta_init:g}, dtype={self.dtype}",
            f"  evaluated on                 : {self.eval_tokens} tokens of {self.eval_text}",
            f"  max |logit difference|       : {self.max_abs_logit_diff:.3e} (bound for an exact conversion "
            f"{self.tolerance:.1e})",
            f"  perplexity source / converted: {self.source_perplexity:.6g} / {self.converted_perplexity:.6g}"
            f" ({self.perplexity_change:+.4%}; same to 4 significant digits: {self.perplexity_same_to(4)})",
            f"  greedy {self.greedy_tokens} tokens identical  : {self.greedy_identical}",
            f"  largest beta on these tokens : {self.max_beta:.3g}",
        ]
        if self.delta_mode == "paper" and self.beta_init == 0.0:
            final_norm = "ln_f" if self.source_family == "GPT-2" else "norm"
            lines.append(
                "  note: paper mode at beta = 0 makes every Delta block the identity map, so the model starts as "
                f"embeddings -> {final_norm} -> lm_head; the perplexity change above "
                f"({self.perplexity_change:+.2%}) is the cost of that choice until fine-tuning opens the gates."
            )
        elif not self.expected_equivalent:
            lines.append(
                "  note: beta != 0 (or paper mode) changes the function at step 0; the perplexity change above is the "
                "cost of that choice. Use the defaults (additive, beta_init=0) for an exact start."
            )
        return "\n".join(lines)


def next_token_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> float:
    """Mean next-token cross-entropy, computed here the same way for both models (no model-specific loss
    function, so a source whose config has no `loss_type`, like every Hub GPT-2, is not warned about)."""
    shifted = logits[:, :-1].float().flatten(0, 1)
    return torch.nn.functional.cross_entropy(shifted, input_ids[:, 1:].flatten()).item()


@torch.no_grad()
def equivalence_report(
    source: PreTrainedModel,
    converted: PreTrainedModel,
    input_ids: torch.Tensor,
    greedy_tokens: int = 64,
    eval_text: str = "given input_ids",
) -> EquivalenceReport:
    """Compare logits and perplexity on `input_ids` [batch, seq], and greedy continuations of its first row.

    `source` is a GPT-2 or Llama-family causal LM, `converted` the DeltaGPT or DeltaLlama made from it.

    The prompt for the greedy comparison is the first (up to) 8 tokens; `min_new_tokens` stops EOS from cutting
    the comparison short.
    """
    source_out = source(input_ids)
    converted_out = converted(input_ids, output_betas=True)
    betas = converted_out.betas or ()
    max_beta = max((float(b.max()) for b in betas), default=0.0)
    prompt = input_ids[:1, : max(1, min(8, input_ids.shape[1]))]
    positions = source.config.max_position_embeddings  # GPT-2's n_positions under its common name
    greedy_tokens = max(0, min(greedy_tokens, positions - prompt.shape[1]))
    kwargs = dict(max_new_tokens=greedy_tokens, min_new_tokens=greedy_tokens, do_sample=False, pad_token_id=0)
    if greedy_tokens:
        greedy_identical = bool(torch.equal(source.generate(prompt, **kwargs), converted.generate(prompt, **kwargs)))
    else:
        greedy_identical = True
    config = converted.config
    source_logits = source_out.logits.float()
    return EquivalenceReport(
        max_abs_logit_diff=(source_logits - converted_out.logits.float()).abs().max().item(),
        tolerance=equivalence_tolerance(
            source_out.logits.dtype, config.num_hidden_layers, config.hidden_size, source_logits.abs().max().item()
        ),
        source_perplexity=math.exp(next_token_loss(source_out.logits, input_ids)),
        converted_perplexity=math.exp(next_token_loss(converted_out.logits, input_ids)),
        greedy_tokens=greedy_tokens,
        greedy_identical=greedy_identical,
        eval_tokens=int(input_ids.numel()),
        eval_text=eval_text,
        delta_mode=config.delta_mode,
        beta_init=float(config.delta_beta_init),
        value_channels=int(config.delta_value_channels),
        dtype=str(converted.dtype).removeprefix("torch."),
        max_beta=max_beta,
        delta_name=type(converted).__name__.removesuffix("ForCausalLM"),
        source_family=family_name(source.config),
    )


def sample_input_ids(tokenizer, config: PreTrainedConfig, max_tokens: int = 512) -> tuple[torch.Tensor, str]:
    """Held-out evaluation tokens: `SAMPLE_TEXT` through the tokenizer, or fixed random ids without one."""
    limit = min(max_tokens, config.max_position_embeddings)  # GPT-2's n_positions under its common name
    if tokenizer is not None:
        ids = tokenizer(SAMPLE_TEXT, return_tensors="pt").input_ids[:, :limit]
        if ids.shape[1] >= 2 and int(ids.max()) < config.vocab_size:
            return ids, "held-out sample text (ddl_hf.conversion.SAMPLE_TEXT)"
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (1, min(limit, 128)), generator=generator)
    return ids, "fixed random token ids (no usable tokenizer)"


__all__ = ["SAMPLE_TEXT", "EquivalenceReport", "equivalence_report", "equivalence_tolerance", "sample_input_ids"]
