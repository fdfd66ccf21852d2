"""Greedy tokens compared across two code paths that may round differently (another kernel, dtype, cache, batch
padding, engine): equal, except where the reference itself nearly tied.

Greedy decoding takes the argmax of each step's logits. Where the reference's best two logits are closer than the
two paths' rounding can move them, the other path may legitimately take the second one, and every later token then
continues another text. So a divergence is accepted only at a step where the reference's top-two gap is at most
`tie_margin`, and nothing after it in that row is compared; anywhere else it is a failure. Where both paths must give
the same tokens by construction (the same path twice), compare exactly instead.

`tie_margin_float32` derives the margin for two float32 paths from the model's float64 logits (tests/rounding.py);
`greedy_reference` runs a reference's `generate` and returns its tokens, scores and that margin;
`assert_generations_match` compares two paths' generations, scores and tokens, where the tie margin follows from the
tolerance on the scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput

from tests.rounding import float64_logits_and_bound


def assert_greedy_matches(
    reference_tokens: torch.Tensor | Sequence[Sequence[int]],
    reference_scores: torch.Tensor | Sequence[torch.Tensor],
    tokens: torch.Tensor | Sequence[Sequence[int]],
    *,
    tie_margin: float,
) -> None:
    """`tokens` `[batch, steps]` (the generated part) are the reference's greedy tokens, but for a divergence at a
    step where the reference's best two scores are within `tie_margin` (then the rest of that row is not compared).

    `reference_scores` are the scores the reference chose its tokens by, one `[batch, vocab]` tensor per step as
    `generate(output_scores=True, return_dict_in_generate=True).scores` gives them, or stacked `[batch, steps,
    vocab]`; each reference token must be its step's argmax. The error names the row, the step, both tokens and the
    gap."""
    reference_tokens = torch.as_tensor(reference_tokens).cpu()
    tokens = torch.as_tensor(tokens).cpu()
    if not isinstance(reference_scores, torch.Tensor):
        reference_scores = torch.stack(tuple(reference_scores), dim=1)
    scores = reference_scores.detach().cpu().double()
    batch, steps = reference_tokens.shape
    assert scores.shape[:2] == (batch, steps), f"scores {tuple(scores.shape)} for reference tokens {(batch, steps)}"
    assert tokens.dim() == 2 and tokens.shape[0] == batch, f"tokens {tuple(tokens.shape)} for a batch of {batch}"
    chosen = scores.gather(-1, reference_tokens.unsqueeze(-1)).squeeze(-1)
    not_argmax = (chosen < scores.amax(-1)).nonzero().tolist()
    assert not not_argmax, f"the reference's tokens are not its scores' argmax at (row, step) {not_argmax}"
    best_two = scores.topk(2, dim=-1).values
    gaps = best_two[..., 0] - best_two[..., 1]
    common = min(steps, tokens.shape[1])
    for row in range(batch):
        differ = (tokens[row, :common] != reference_tokens[row, :common]).nonzero()
        if len(differ) == 0:
            assert tokens.shape[1] == steps, f"row {row}: {tokens.shape[1]} tokens where the reference has {steps}"
            continue
        step = int(differ[0])
        gap = float(gaps[row, step])
        assert gap <= tie_margin, (
            f"row {row}, step {step}: token {int(tokens[row, step])} where the reference chose "
            f"{int(reference_tokens[row, step])}, whose score leads the next best by {gap:.3g} > the tie margin "
            f"{tie_margin:.3g}"
        )


def _steps_in_common(reference_tokens: torch.Tensor, tokens: torch.Tensor) -> int:
    """How many steps the two paths' per-step outputs (scores, hidden states) can be compared over: up to and
    including the first step at which any row's tokens differ (every step's inputs are then still the same)."""
    common = min(reference_tokens.shape[1], tokens.shape[1])
    differ = (reference_tokens[:, :common] != tokens[:, :common]).any(0).nonzero()
    return int(differ[0]) + 1 if len(differ) else common


def tie_margin_float32(model: torch.nn.Module, input_ids: torch.Tensor, **kwargs) -> float:
    """The tie margin for two float32 paths through `model`: each path's logits lie within the float64 bound of the
    exact (float64) ones (`float64_logits_and_bound`, measured on `input_ids`: the prompts and the tokens generated),
    so their best two can swap only where the exact gap is under twice the bound."""
    return 2 * float64_logits_and_bound(model, input_ids, **kwargs)[1]


@dataclass
class GreedyReference:
    """A reference's greedy tokens `[batch, steps]` (the generated part), the scores it chose them by (one `[batch,
    vocab]` per step) and the tie margin for a float32 path compared with it."""

    tokens: torch.Tensor
    scores: tuple[torch.Tensor, ...]
    tie_margin: float

    def assert_matches(self, tokens: torch.Tensor | Sequence[Sequence[int]]) -> None:
        """`assert_greedy_matches` of `tokens` (the generated part) against this reference."""
        assert_greedy_matches(self.tokens, self.scores, tokens, tie_margin=self.tie_margin)


def greedy_reference(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **generate_kwargs
) -> GreedyReference:
    """`model.generate(input_ids, ...)`'s greedy tokens with their scores, and `tie_margin_float32` on the prompts
    with those tokens. Pass `min_new_tokens` = `max_new_tokens`: a row that ends early has no argmax to check."""
    masks = {} if attention_mask is None else {"attention_mask": attention_mask}
    generate_kwargs = {"do_sample": False, **generate_kwargs, "output_scores": True, "return_dict_in_generate": True}
    with torch.no_grad():
        out = model.generate(input_ids, **masks, **generate_kwargs)
    tokens = out.sequences[:, input_ids.shape[1] :]
    if attention_mask is not None:
        masks["attention_mask"] = torch.cat([attention_mask, torch.ones_like(tokens)], dim=1)
    return GreedyReference(tokens, out.scores, tie_margin_float32(model, out.sequences, **masks))


def assert_generations_match(reference: ModelOutput, other: ModelOutput, *, rtol: float, atol: float) -> None:
    """Two `generate(..., output_scores=True, return_dict_in_generate=True)` outputs for the same prompts, by paths
    that round differently: the scores within `rtol` / `atol` over the steps whose inputs are still the same, and the
    greedy tokens equal, but where the reference's best two scores are within twice that tolerance (each path's
    scores may be off by it in opposite directions)."""
    prompt_length = reference.sequences.shape[1] - len(reference.scores)
    reference_tokens, tokens = reference.sequences[:, prompt_length:], other.sequences[:, prompt_length:]
    steps = _steps_in_common(reference_tokens, tokens)
    reference_scores, scores = torch.stack(reference.scores, dim=1), torch.stack(other.scores, dim=1)
    torch.testing.assert_close(scores[:, :steps], reference_scores[:, :steps], rtol=rtol, atol=atol)
    largest = float(reference_scores[reference_scores.isfinite()].abs().max())
    assert_greedy_matches(reference_tokens, reference_scores, tokens, tie_margin=2 * (atol + rtol * largest))
