"""Additive mode with beta = 0 computes GPT-2's function: compared with transformers' own GPT2LMHeadModel."""

from __future__ import annotations

import pytest
import torch

import ddl_hf
from tests.builders import delta_config, gpt2_model


def delta_from_gpt2(gpt2: torch.nn.Module, **overrides) -> ddl_hf.DeltaGPTForCausalLM:
    """Load the GPT-2 state dict into DeltaGPT with `from_pretrained`, as conversion does: the Delta parameters the
    checkpoint lacks get the exact init (`delta_init=None` resolves to "exact" when loading); only they may be
    missing."""
    config = delta_config(**{**gpt2.config.to_diff_dict(), **overrides})
    config._attn_implementation = gpt2.config._attn_implementation
    model, info = ddl_hf.DeltaGPTForCausalLM.from_pretrained(
        None, config=config, state_dict=gpt2.state_dict(), output_loading_info=True
    )
    delta_names = set(model.delta_parameters())
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    assert info["missing_keys"] and set(info["missing_keys"]) <= delta_names, info["missing_keys"]
    assert model.config.delta_init == "exact" and model.config.delta_beta_init == 0.0
    return model.eval()


# Every (d_v, state read, embedding expansion) the config accepts (docs/variants.md); the value and erase choices
# cycle through their four combinations (each appears twice) to keep the suite fast: at beta = 0 they change which
# modules exist, not the function.
_SHAPES = [
    (d_v, read, expand)
    for d_v in (1, 4)
    for read in ("linear", "temporal_conv", "channel_conv")
    for expand in ("repeat", "conv")
    if d_v > 1 or (read != "channel_conv" and expand != "conv")
]
_VALUE_ERASE = [("linear", True), ("constant", False), ("constant", True), ("linear", False)]
VARIANTS = [(*shape, *_VALUE_ERASE[i % 4]) for i, shape in enumerate(_SHAPES)]


@pytest.mark.parametrize(("value_channels", "read", "expand", "value", "erase"), VARIANTS)
def test_every_variant_starts_as_gpt2_bit_for_bit(
    value_channels: int, read: str, expand: str, value: str, erase: bool, token_batch: torch.Tensor
) -> None:
    """Additive mode, beta = 0, identity convolutions: transformers' GPT-2 exactly, also for a left-padded batch
    (padding enters the temporal convolutions as zeros)."""
    gpt2 = gpt2_model(random_constants=True)
    delta = delta_from_gpt2(
        gpt2,
        delta_value_channels=value_channels,
        delta_state_read=read,
        delta_embed_expand=expand,
        delta_value=value,
        delta_erase=erase,
    )
    assert (delta.transformer.read_out.conv is not None) == (read != "linear")
    assert (delta.transformer.embed_expand is not None) == (expand == "conv")
    mask = torch.ones_like(token_batch)
    mask[0, :5] = 0
    mask[1, :2] = 0
    kwargs = dict(attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    with torch.no_grad():
        for inputs in ({}, kwargs):
            out = delta(token_batch, output_betas=True, **inputs)
            assert all(torch.count_nonzero(beta) == 0 for beta in out.betas)
            expected = gpt2(token_batch, **inputs).logits
            real = mask.bool() if inputs else torch.ones_like(mask, dtype=torch.bool)
            assert torch.equal(out.logits[real], expected[real])


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
