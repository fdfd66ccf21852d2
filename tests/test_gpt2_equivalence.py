"""Additive mode with beta = 0 computes GPT-2's function: compared with transformers' own GPT2LMHeadModel."""

from __future__ import annotations

import pytest
import torch
from builders import delta_config, gpt2_model

import ddl_hf


def delta_from_gpt2(gpt2: torch.nn.Module, **overrides) -> ddl_hf.DeltaGPTForCausalLM:
    """Load the GPT-2 state dict into a fresh DeltaGPT; only Delta parameters may be missing."""
    config = delta_config(**{**gpt2.config.to_diff_dict(), **overrides})
    config._attn_implementation = gpt2.config._attn_implementation
    model = ddl_hf.DeltaGPTForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(gpt2.state_dict(), strict=False)
    assert unexpected == []
    assert missing and all("_delta." in name or name == "transformer.read_out" for name in missing), missing
    return model


@pytest.mark.parametrize("value_channels", [1, 4])
@pytest.mark.parametrize("padding", [None, "left", "right"])
def test_additive_beta_zero_matches_gpt2(value_channels: int, padding: str | None, token_batch: torch.Tensor) -> None:
    gpt2 = gpt2_model(random_constants=True)
    delta = delta_from_gpt2(gpt2, delta_value_channels=value_channels)
    kwargs = {}
    if padding is not None:
        mask = torch.ones_like(token_batch)
        if padding == "left":
            mask[0, :5] = 0
            mask[1, :2] = 0
        else:
            mask[0, -5:] = 0
            mask[1, -2:] = 0
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        kwargs = dict(attention_mask=mask, position_ids=position_ids)

    with torch.no_grad():
        expected = gpt2(token_batch, **kwargs).logits
        out = delta(token_batch, output_betas=True, **kwargs)

    assert all(torch.equal(beta, torch.zeros_like(beta)) for beta in out.betas)
    assert (out.logits - expected).abs().max().item() <= 1e-5


def test_additive_equivalence_holds_for_every_attention_backend(token_batch: torch.Tensor) -> None:
    for implementation in ("eager", "sdpa"):
        gpt2 = gpt2_model(random_constants=True, attn_implementation=implementation)
        delta = delta_from_gpt2(gpt2, delta_value_channels=4)
        assert delta.config._attn_implementation == implementation
        with torch.no_grad():
            assert (delta(token_batch).logits - gpt2(token_batch).logits).abs().max().item() <= 1e-5


def test_opened_gates_change_the_function(token_batch: torch.Tensor) -> None:
    """The equivalence above is not vacuous: once beta != 0 the model departs from GPT-2."""
    gpt2 = gpt2_model(random_constants=True)
    delta = delta_from_gpt2(gpt2)
    with torch.no_grad():
        for module in delta.modules():
            if isinstance(module, ddl_hf.DeltaResidual):
                module.beta_open.fill_(0.5)
        assert (delta(token_batch).logits - gpt2(token_batch).logits).abs().max().item() > 1e-3


def test_paper_mode_beta_zero_is_identity_per_block(token_batch: torch.Tensor) -> None:
    """Paper eq. 3.5: with beta = 0 every block is skipped, so the output is ln_f(embeddings) -> lm_head."""
    gpt2 = gpt2_model(random_constants=True)
    delta = delta_from_gpt2(gpt2, delta_mode="paper")
    with torch.no_grad():
        positions = torch.arange(token_batch.shape[1])
        embeddings = gpt2.transformer.wte(token_batch) + gpt2.transformer.wpe(positions)
        expected = gpt2.lm_head(gpt2.transformer.ln_f(embeddings))
        assert (delta(token_batch).logits - expected).abs().max().item() <= 1e-5
