"""Guarantees 1 and 3 of the conversion: a converted GPT-2 starts equivalent (additive) or as the identity (paper).

Every comparison is against transformers' own GPT2LMHeadModel holding the source weights, or a closed form built
from its modules; perplexity is computed here from the logits, not taken from the model's loss.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2Config

import ddl_hf
from ddl_hf.conversion import SAMPLE_TEXT, ConversionError
from tests.builders import GPT2_FAMILY, family_config, gpt2_model
from tests.gpt2_fixtures import (
    byte_tokenizer,
    text_ids,
    trained_gpt2,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HELD_OUT = text_ids(SAMPLE_TEXT)[:, :128]  # byte-level ids of held-out text, n_positions = 128


def perplexity(logits: torch.Tensor, ids: torch.Tensor) -> float:
    return float(F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()).exp())


def greedy(model, prompt: torch.Tensor, tokens: int = 64) -> torch.Tensor:
    return model.generate(
        prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0, use_cache=True
    )


def check_equivalent(source, converted) -> dict:
    """The three equivalence claims against the source GPT-2; returns the measured figures."""
    with torch.no_grad():
        reference = source(HELD_OUT).logits
        logits = converted(HELD_OUT).logits
    max_diff = float((reference - logits).abs().max())
    ppl_source, ppl_converted = perplexity(reference, HELD_OUT), perplexity(logits, HELD_OUT)
    assert max_diff <= 1e-4, max_diff
    assert f"{ppl_source:.4g}" == f"{ppl_converted:.4g}", (ppl_source, ppl_converted)
    prompt = HELD_OUT[:, :8]
    expected, got = greedy(source, prompt), greedy(converted, prompt)
    assert expected.shape == (1, 72)
    assert torch.equal(expected, got)
    return {"max_diff": max_diff, "ppl": ppl_source}


@pytest.mark.parametrize("value_channels", [1, 4])
@pytest.mark.parametrize("family", sorted(GPT2_FAMILY))
def test_family_shapes_convert_equivalently(family, value_channels, tmp_path):
    """Real depth and head count of each family member, reduced width/vocab/context (see family_config)."""
    source = gpt2_model(config=family_config(family), seed=len(family))
    source.save_pretrained(tmp_path)  # through the directory path, like a downloaded checkpoint
    converted = ddl_hf.convert_gpt2(tmp_path, delta_value_channels=value_channels)
    assert isinstance(converted, ddl_hf.DeltaGPTForCausalLM)
    assert converted.config.n_layer == GPT2_FAMILY[family][0]
    assert converted.config.delta_value_channels == value_channels
    figures = check_equivalent(source, converted)
    print(f"{family} d_v={value_channels}: max|dlogit|={figures['max_diff']:.3e} ppl={figures['ppl']:.6g}")


def test_distilgpt2_at_full_size_converts_equivalently():
    """The one family member that fits the CI budget unreduced: distilgpt2's exact config (82M parameters)."""
    source = gpt2_model(config=GPT2Config(n_layer=6))  # n_embd 768, 12 heads, vocab 50257, context 1024
    assert sum(p.numel() for p in source.parameters()) == 81_912_576
    figures = check_equivalent(source, ddl_hf.convert_gpt2(source))
    print(f"distilgpt2 full size d_v=1: max|dlogit|={figures['max_diff']:.3e} ppl={figures['ppl']:.6g}")


@pytest.mark.parametrize("value_channels", [1, 4])
def test_trained_gpt2_converts_equivalently(value_channels):
    source = trained_gpt2()
    converted = ddl_hf.convert_gpt2(source, delta_value_channels=value_channels)
    figures = check_equivalent(source, converted)
    assert figures["ppl"] < 60  # the source learned something: far below the uniform 257
    # The report the CLI prints agrees with the independent figures above.
    report = ddl_hf.equivalence_report(source, converted, HELD_OUT)
    assert report.max_abs_logit_diff == pytest.approx(figures["max_diff"], abs=1e-7)
    assert report.source_perplexity == pytest.approx(figures["ppl"], rel=1e-5)
    assert report.greedy_identical and report.greedy_tokens == 64 and report.perplexity_same_to(4)
    assert report.expected_equivalent and report.max_beta == 0.0
    print(f"trained d_v={value_channels}: max|dlogit|={figures['max_diff']:.3e} ppl={figures['ppl']:.6g}")


def test_the_equivalence_bound_follows_rounding_depth_and_width():
    """4 eps sqrt(2 L D) max(1, |logit|): tight where a small model's exact conversion measures 0 (a defect of 1e-5
    in its logits is refused), loose enough for sum-reordering kernels at gpt2-xl's depth, width and logit size."""
    from ddl_hf.conversion import equivalence_tolerance

    assert equivalence_tolerance(torch.float32, 2, 32) == pytest.approx(4 * 2**-23 * 128**0.5)
    assert equivalence_tolerance(torch.float32, 2, 32) < 1e-5
    xl = equivalence_tolerance(torch.float32, 48, 1600, logit_scale=100.0)
    assert 1e-2 < xl < 0.05
    assert equivalence_tolerance(torch.bfloat16, 2, 32) == pytest.approx(
        2**16 * equivalence_tolerance(torch.float32, 2, 32)
    )
    source = trained_gpt2()
    converted = ddl_hf.convert_gpt2(source)
    report = ddl_hf.equivalence_report(source, converted, HELD_OUT)
    assert report.max_abs_logit_diff == 0.0 and report.within_tolerance
    depth, width = source.config.n_layer, source.config.n_embd
    assert report.tolerance == equivalence_tolerance(torch.float32, depth, width, report_logit_scale(source))
    with torch.no_grad():  # a defect of 1e-5: the logits move by about that much
        converted.lm_head.weight.add_(1e-5 * torch.sign(converted.lm_head.weight))
    defective = ddl_hf.equivalence_report(source, converted, HELD_OUT)
    assert defective.tolerance < defective.max_abs_logit_diff < 1e-3 and not defective.within_tolerance


def report_logit_scale(model) -> float:
    with torch.no_grad():
        return float(model(HELD_OUT).logits.abs().max())


@pytest.mark.parametrize("read", ["temporal_conv", "channel_conv"])
def test_conv_read_variants_convert_equivalently(read):
    """TC / CC reads start as identity convolutions when converted (delta_init resolves to "exact" when loading)."""
    source = trained_gpt2()
    converted = ddl_hf.convert_gpt2(source, delta_value_channels=4, delta_state_read=read)
    assert converted.config.delta_init == "exact" and converted.config.delta_beta_init == 0.0
    check_equivalent(source, converted)


def test_conversion_does_not_share_or_change_the_source():
    source = trained_gpt2()
    before = {k: v.clone() for k, v in source.state_dict().items()}
    converted = ddl_hf.convert_gpt2(source)
    with torch.no_grad():
        converted.transformer.h[0].attn.c_attn.weight.add_(1.0)
    assert all(torch.equal(before[k], v) for k, v in source.state_dict().items())


@pytest.mark.parametrize("value_channels", [1, 4])
def test_paper_mode_starts_as_identity(value_channels):
    """delta_mode='paper', beta = 0: every block is the identity, so logits = lm_head(ln_f(wte + wpe))."""
    source = trained_gpt2()
    converted = ddl_hf.convert_gpt2(source, delta_mode="paper", delta_value_channels=value_channels)
    positions = torch.arange(HELD_OUT.shape[1])
    with torch.no_grad():
        gpt2 = source.transformer
        closed_form = source.lm_head(gpt2.ln_f(gpt2.wte(HELD_OUT) + gpt2.wpe(positions)))
        out = converted(HELD_OUT, output_betas=True)
        source_logits = source(HELD_OUT).logits
    assert float((out.logits - closed_form).abs().max()) <= 1e-5
    assert all(float(b.abs().max()) == 0.0 for b in out.betas)
    report = ddl_hf.equivalence_report(source, converted, HELD_OUT)
    assert report.converted_perplexity == pytest.approx(perplexity(closed_form, HELD_OUT), rel=1e-5)
    assert report.source_perplexity == pytest.approx(perplexity(source_logits, HELD_OUT), rel=1e-5)
    assert report.perplexity_change > 0.5  # skipping every sublayer costs a trained model a lot
    text = str(report)
    assert "paper mode" in text and "identity" in text and f"{report.perplexity_change:+.2%}" in text
    print(
        f"paper d_v={value_channels}: perplexity {report.source_perplexity:.6g} -> "
        f"{report.converted_perplexity:.6g} ({report.perplexity_change:+.2%})"
    )


def test_nonzero_beta_init_is_reported_as_a_change():
    source = trained_gpt2()
    converted = ddl_hf.convert_gpt2(source, delta_beta_init=0.5)
    report = ddl_hf.equivalence_report(source, converted, HELD_OUT)
    assert report.max_beta == pytest.approx(0.5) and not report.expected_equivalent
    assert report.max_abs_logit_diff > 1e-3
    assert "cost of that choice" in str(report)


def test_bfloat16_conversion_matches_bfloat16_source(tmp_path):
    source = trained_gpt2()
    source.save_pretrained(tmp_path)
    converted = ddl_hf.convert_gpt2(tmp_path, dtype="bfloat16")
    assert converted.dtype == torch.bfloat16
    reference = type(source).from_pretrained(tmp_path, dtype=torch.bfloat16)
    with torch.no_grad():
        diff = (reference(HELD_OUT).logits.float() - converted(HELD_OUT).logits.float()).abs().max()
    assert float(diff) <= 5e-2


def test_untied_head_is_copied(tmp_path):
    """A fine-tune with untied input/output embeddings keeps its own lm_head."""
    config = family_config("distilgpt2")
    config.tie_word_embeddings = False
    source = gpt2_model(config=config)
    with torch.no_grad():
        source.lm_head.weight.normal_()
    assert source.lm_head.weight.data_ptr() != source.transformer.wte.weight.data_ptr()
    converted = ddl_hf.convert_gpt2(source)
    assert torch.equal(converted.lm_head.weight, source.lm_head.weight)
    check_equivalent(source, converted)


@pytest.mark.parametrize(
    "flags", [{"scale_attn_by_inverse_layer_idx": True}, {"reorder_and_upcast_attn": True}, {"n_inner": 40}]
)
def test_other_gpt2_flags_convert_equivalently(flags):
    config = family_config("distilgpt2")
    for key, value in flags.items():
        setattr(config, key, value)
    source = gpt2_model(config=config)
    check_equivalent(source, ddl_hf.convert_gpt2(source))


def test_bad_sources_and_overrides_raise_clear_errors():
    from transformers import BertConfig, BertModel

    with pytest.raises(ConversionError, match="not a GPT-2 checkpoint: its config has model_type 'bert'"):
        ddl_hf.convert_gpt2(
            BertModel(
                BertConfig(
                    hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, vocab_size=50
                )
            )
        )
    source = trained_gpt2()
    with pytest.raises(ConversionError, match=r"not a GPT2Model.*GPT2LMHeadModel\.from_pretrained"):
        ddl_hf.convert_gpt2(source.transformer)
    with pytest.raises(ConversionError, match="delta_modes"):
        ddl_hf.convert_gpt2(source, delta_modes="paper")
    with pytest.raises(ConversionError, match="delta_value_channels=0"):
        ddl_hf.convert_gpt2(source, delta_value_channels=0)
    with pytest.raises(ConversionError, match="delta_beta_init=3"):
        ddl_hf.convert_gpt2(source, delta_beta_init=3.0)


def test_an_in_memory_source_whose_weights_miss_its_config_is_refused_by_name():
    """A GPT2LMHeadModel whose config no longer matches its weights (here a shorter context): the conversion names
    the misshaped weight with both shapes instead of failing inside transformers' loader."""
    source = gpt2_model(n_positions=16)
    source.config.n_positions = 12
    named = r"wrong shape: transformer\.wpe\.weight \[16, 32\] in the checkpoint, \[12, 32\]"
    with pytest.raises(ConversionError, match=named):
        ddl_hf.convert_gpt2(source)


def test_unknown_field_error_lists_every_delta_field():
    """The list of valid fields is read off DeltaGPTConfig, so new Delta fields (token mixer, DeltaNet) appear."""
    with pytest.raises(ConversionError, match="Unknown DeltaGPTConfig field") as error:
        ddl_hf.convert_gpt2(trained_gpt2(), delta_bogus=1)
    message = str(error.value)
    assert "'delta_bogus'" in message
    for field in ("token_mixer", "delta_net_rule", "delta_net_chunk_size", "delta_mode", "delta_eps"):
        assert field in message


def test_tokenizer_fixture_is_byte_level():
    """The test texts are turned into ids by their UTF-8 bytes; the GPT-2 tokenizer the CLI copies agrees."""
    assert byte_tokenizer()(SAMPLE_TEXT).input_ids[:128] == HELD_OUT[0].tolist()


def test_converting_to_the_delta_net_mixer_is_refused_with_the_reason():
    with pytest.raises(ConversionError, match=r"token_mixer='delta_net'.*no weights"):
        ddl_hf.convert_gpt2(gpt2_model(), token_mixer="delta_net")
