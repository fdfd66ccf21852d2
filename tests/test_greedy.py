"""tests/greedy.py: a divergence from the reference's greedy tokens fails, unless the reference nearly tied there."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from tests.builders import delta_model, open_gates
from tests.greedy import assert_generations_match, assert_greedy_matches, tie_margin_float32

#: Two rows of four steps over a vocabulary of 5; row 0's step 2 nearly ties (tokens 1 and 3, gap 0.01), every other
#: step leads by at least 0.5.
SCORES = torch.tensor(
    [
        [[0.0, 2.0, 0.0, 1.0, 0.0], [3.0, 0.0, 0.0, 0.0, 1.0], [0.0, 1.50, 0.0, 1.49, 0.0], [0.0, 0.0, 1.0, 0.0, 0.5]],
        [[1.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 2.0, 0.0], [0.0, 0.0, 4.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0, 0.0]],
    ]
)
REFERENCE = SCORES.argmax(-1)  # [[1, 0, 1, 2], [0, 3, 2, 1]]


def test_equal_tokens_pass_with_scores_stacked_or_per_step():
    assert_greedy_matches(REFERENCE, SCORES, REFERENCE.clone(), tie_margin=0.0)
    assert_greedy_matches(REFERENCE, SCORES.unbind(1), REFERENCE.tolist(), tie_margin=0.0)


def test_a_divergence_at_a_near_tie_passes_and_ends_that_rows_comparison():
    tokens = REFERENCE.clone()
    tokens[0, 2:] = torch.tensor([3, 4])  # the runner-up at the near-tie, then another text
    assert_greedy_matches(REFERENCE, SCORES, tokens, tie_margin=0.02)


def test_a_divergence_beyond_the_margin_fails_naming_row_step_tokens_and_gap():
    tokens = REFERENCE.clone()
    tokens[0, 2] = 3
    with pytest.raises(
        AssertionError, match=r"row 0, step 2: token 3 where the reference chose 1, .* 0\.01 > .* 0\.005"
    ):
        assert_greedy_matches(REFERENCE, SCORES, tokens, tie_margin=0.005)
    tokens = REFERENCE.clone()
    tokens[0, 2:] = torch.tensor([3, 4])  # row 0 accepted at its near-tie ...
    tokens[1, 1] = 0  # ... but row 1 is compared on its own: 2.0 leads by 2
    with pytest.raises(AssertionError, match=r"row 1, step 1: token 0 where the reference chose 3, .* 2 > "):
        assert_greedy_matches(REFERENCE, SCORES, tokens, tie_margin=0.02)


def test_a_reference_token_that_is_not_its_argmax_fails():
    wrong = REFERENCE.clone()
    wrong[1, 3] = 0
    with pytest.raises(AssertionError, match=r"not its scores' argmax at \(row, step\) \[\[1, 3\]\]"):
        assert_greedy_matches(wrong, SCORES, wrong, tie_margin=1.0)


def test_a_shorter_or_longer_row_fails_unless_it_diverged_at_a_near_tie():
    with pytest.raises(AssertionError, match="row 0: 3 tokens where the reference has 4"):
        assert_greedy_matches(REFERENCE, SCORES, REFERENCE[:, :3], tie_margin=0.02)
    shorter = REFERENCE[:, :3].clone()
    shorter[0, 2] = 3
    shorter[1] = REFERENCE[1, :3]
    with pytest.raises(AssertionError, match="row 1: 3 tokens"):
        assert_greedy_matches(REFERENCE, SCORES, shorter, tie_margin=0.02)


def test_the_float32_margin_is_a_few_roundings_far_below_the_gaps_of_a_generation():
    """On a tiny DeltaGPT with open gates: the margin from the float64 logits is small against the gaps greedy
    decoding meets (so the helper still compares nearly every step), and cached vs uncached decoding, two paths that
    round differently, match within it."""
    model = delta_model(delta_value_channels=4, delta_mode="paper")
    open_gates(model)
    ids = torch.randint(3, model.config.vocab_size, (3, 7), generator=torch.Generator().manual_seed(0))
    kwargs = dict(max_new_tokens=12, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        cached = model.generate(ids, **kwargs)
        uncached = model.generate(ids, use_cache=False, max_new_tokens=12, do_sample=False)
    margin = tie_margin_float32(model, cached.sequences)
    gaps = torch.stack(cached.scores, 1).topk(2, dim=-1).values.diff(dim=-1).abs()
    assert 0 < margin < 1e-2 * float(gaps.median()), (margin, gaps.median())  # measured: 7.9e-6 vs 0.023
    new = cached.sequences[:, ids.shape[1] :]
    assert_greedy_matches(new, cached.scores, uncached[:, ids.shape[1] :], tie_margin=margin)


def generation(tokens: torch.Tensor, scores: torch.Tensor) -> GenerateDecoderOnlyOutput:
    """What `generate(output_scores=True, return_dict_in_generate=True)` returns, for a prompt of two zeros."""
    return GenerateDecoderOnlyOutput(sequences=torch.cat([torch.zeros(2, 2, dtype=torch.long), tokens], 1),
                                     scores=scores.unbind(1))  # fmt: skip


def test_two_generations_match_by_scores_within_the_tolerance_and_by_tokens_up_to_a_near_tie():
    reference = generation(REFERENCE, SCORES)
    assert_generations_match(reference, generation(REFERENCE, SCORES + 0.004), rtol=0, atol=0.005)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        assert_generations_match(reference, generation(REFERENCE, SCORES + 0.006), rtol=0, atol=0.005)
    # Row 0 takes the runner-up at its near-tie (gap 0.01 <= 2 * 0.005): the steps after it are not compared.
    tokens, scores = REFERENCE.clone(), SCORES.clone()
    tokens[0, 2:], scores[:, 3] = torch.tensor([3, 4]), 0.0
    assert_generations_match(reference, generation(tokens, scores), rtol=0, atol=0.005)
    with pytest.raises(AssertionError, match="row 0, step 2"):  # 0.01 > 2 * 0.004
        assert_generations_match(reference, generation(tokens, scores), rtol=0, atol=0.004)
