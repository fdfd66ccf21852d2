"""Guarantee 5: `export_to_gpt2` is an exact way back while every gate is closed, and refuses otherwise.

"Largest beta" is the supremum of beta over every possible input of the block (see `beta_upper_bounds`); the tests
check it against the block's own forward pass on inputs built to approach it.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GPT2LMHeadModel

import ddl_hf
from ddl_hf.conversion import SAMPLE_TEXT
from tests.gpt2_fixtures import (
    text_ids,
    trained_gpt2,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HELD_OUT = text_ids(SAMPLE_TEXT)[:, :128]


@pytest.mark.parametrize("value_channels", [1, 4])
def test_round_trip_is_exact(value_channels):
    source = trained_gpt2()
    converted = ddl_hf.convert_gpt2(source, delta_value_channels=value_channels)
    with torch.no_grad():  # a gate that training closed (beta_open < 0) is still beta = 0 exactly
        converted.transformer.h[1].mlp_delta.beta_open.fill_(-0.25)
    exported = ddl_hf.export_to_gpt2(converted)
    assert type(exported) is GPT2LMHeadModel
    expected = source.state_dict()
    assert set(exported.state_dict()) == set(expected)
    assert all(torch.equal(exported.state_dict()[k], v) for k, v in expected.items())
    assert exported.lm_head.weight.data_ptr() == exported.transformer.wte.weight.data_ptr()  # still tied
    with torch.no_grad():
        assert torch.equal(exported(HELD_OUT).logits, source(HELD_OUT).logits)
        assert float((converted(HELD_OUT).logits - exported(HELD_OUT).logits).abs().max()) == 0.0


def test_open_gate_is_refused_naming_the_largest_beta():
    converted = ddl_hf.convert_gpt2(trained_gpt2())
    with torch.no_grad():
        converted.transformer.h[0].mlp_delta.beta_open.fill_(0.1)
        converted.transformer.h[1].attn_delta.beta_open.fill_(0.3)
    # The gate weights are still 0, so beta = 2 sigmoid(0) rho = rho exactly for every token.
    with torch.no_grad():
        betas = converted(HELD_OUT, output_betas=True).betas
    assert max(float(b.max()) for b in betas) == pytest.approx(0.3)
    with pytest.raises(
        ValueError, match=r"2 of 4 Delta blocks.*Largest beta found: 0\.3 in transformer\.h\.1\.attn_delta"
    ):
        ddl_hf.export_to_gpt2(converted)


def test_paper_mode_is_refused():
    converted = ddl_hf.convert_gpt2(trained_gpt2(), delta_mode="paper")
    with pytest.raises(ValueError, match="paper"):
        ddl_hf.export_to_gpt2(converted)


def test_read_vectors_must_sum_to_one():
    converted = ddl_hf.convert_gpt2(trained_gpt2(), delta_value_channels=4)
    with torch.no_grad():
        converted.transformer.h[0].attn_read.weights[0] += 0.5
    with pytest.raises(ValueError, match=r"transformer\.h\.0\.attn_read\.weights"):
        ddl_hf.export_to_gpt2(converted)


@pytest.mark.parametrize(
    ("variant", "module"),
    [
        (dict(delta_state_read="temporal_conv"), "transformer.h.1.mlp_read.conv"),
        (dict(delta_state_read="channel_conv"), "transformer.read_out.conv"),
        (dict(delta_embed_expand="conv"), "transformer.embed_expand"),
    ],
)
def test_variants_round_trip_while_their_convolutions_are_the_identity(variant, module):
    """TC/CC reads and the EC expansion convert exactly (identity weights) and so export exactly; once a convolution
    moves, no GPT-2 computes the same function and the export names the module."""
    source = trained_gpt2()
    converted = ddl_hf.convert_gpt2(source, delta_value_channels=4, **variant)
    exported = ddl_hf.export_to_gpt2(converted)
    with torch.no_grad():
        assert torch.equal(exported(HELD_OUT).logits, source(HELD_OUT).logits)
        assert torch.equal(converted(HELD_OUT).logits, source(HELD_OUT).logits)
        converted.get_submodule(module).weight.mul_(0.5)
    with pytest.raises(ValueError, match=rf"state convolution.*{module.replace('.', '[.]')}"):
        ddl_hf.export_to_gpt2(converted)


def _block_beta(block_delta, norm, x: torch.Tensor) -> torch.Tensor:
    """beta from the block's own forward pass for residual inputs x [n, D]."""
    _, beta = block_delta(x, x, norm(x), torch.randn_like(x))
    return beta


@pytest.mark.parametrize("gate", ["linear", "mlp"])
def test_beta_bound_is_an_upper_bound_and_tight_for_linear_gates(gate):
    torch.manual_seed(0)
    converted = ddl_hf.convert_gpt2(trained_gpt2(), delta_gate=gate)
    block = converted.transformer.h[1]
    with torch.no_grad():
        for module in block.mlp_delta.beta_proj.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(std=0.3)
                if module.bias is not None:
                    module.bias.normal_()
        block.mlp_delta.beta_open.fill_(0.7)
        block.ln_2.weight.uniform_(0.5, 1.5)
        block.ln_2.bias.normal_(std=0.2)
        bound = ddl_hf.beta_upper_bounds(converted)["transformer.h.1.mlp_delta"]
        sampled = _block_beta(block.mlp_delta, block.ln_2, 5 * torch.randn(4096, converted.config.n_embd))
        assert float(sampled.max()) <= bound + 1e-6
        assert bound <= 1.4 + 1e-9  # 2 rho
        if gate == "linear":  # the supremum is approached by inputs along the centred w * gamma
            direction = block.mlp_delta.beta_proj.weight[0] * block.ln_2.weight
            direction = direction - direction.mean()
            best = _block_beta(block.mlp_delta, block.ln_2, 1e3 * direction[None])
            assert float(best) == pytest.approx(bound, rel=1e-5)
            assert float(best) > float(sampled.max())
    assert ddl_hf.beta_upper_bounds(converted)["transformer.h.0.mlp_delta"] == 0.0
    with pytest.raises(ValueError, match=f"Largest beta found: {bound:.6g} in transformer.h.1.mlp_delta"):
        ddl_hf.export_to_gpt2(converted)
    assert math.isfinite(bound)


def test_export_rejects_non_delta_models():
    with pytest.raises(ValueError, match="DeltaGPTForCausalLM"):
        ddl_hf.export_to_gpt2(trained_gpt2())
