"""DeltaLlama: Delta residuals in Llama-family decoders, checked against transformers' own
`LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM` and `Qwen3ForCausalLM` of tiny random configs."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Qwen2Config,
)

import ddl_hf
from ddl_hf import ConversionError, DeltaLlamaConfig, DeltaLlamaForCausalLM
from ddl_hf.delta_compat import cache_of
from tests.builders import LLAMA_FAMILIES as FAMILIES
from tests.builders import LLAMA_TINY as TINY
from tests.builders import VOCAB, build_source, random_ids, to_delta, train_steps
from tests.builders import open_llama_gates as open_gates
from tests.conversion_runs import DELTA_LLAMA_CODE
from tests.greedy import greedy_reference

PAD = 0


@pytest.mark.parametrize("value_channels", [1, 4])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_additive_beta_zero_is_the_source_bit_for_bit(family, value_channels):
    source = build_source(family)
    model = to_delta(source, delta_value_channels=value_channels)
    ids = random_ids()
    with torch.no_grad():
        expected, got = source(ids).logits, model(ids).logits
    assert torch.equal(got, expected), f"max |diff| {(got - expected).abs().max().item():.3e}"
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=PAD, min_new_tokens=10)
    assert torch.equal(model.generate(ids[:1, :4], **kwargs), source.generate(ids[:1, :4], **kwargs))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_family_features_matter_in_the_comparison(family):
    """The families' differences (sliding window, RoPE scaling) change the source's logits on the test sequences,
    so the equality above covers them; an open Delta gate changes the converted model's logits."""
    source = build_source(family)
    ids = random_ids()
    with torch.no_grad():
        reference = source(ids).logits
        plain_config = type(source.config)(**TINY)
        plain = AutoModelForCausalLM.from_config(plain_config).eval()
        plain.load_state_dict(source.state_dict())
        assert not torch.allclose(plain(ids).logits, reference)
        opened = open_gates(to_delta(source))
        assert (opened(ids).logits - reference).abs().max() > 1e-3


@pytest.mark.parametrize("value_channels", [1, 4])
def test_paper_mode_at_beta_zero_is_the_identity_in_every_block(value_channels):
    """Paper mode: X' = X + beta k (v^T - k^T X); at beta = 0 every block is the identity, so the model is
    embedding -> (read) -> norm -> lm_head."""
    source = build_source("qwen3")
    model = to_delta(source, delta_mode="paper", delta_value_channels=value_channels)
    ids = random_ids()
    with torch.no_grad():
        got = model(ids).logits
        expected = source.lm_head(source.model.norm(source.model.embed_tokens(ids)))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_output_betas_and_hidden_states_contract(family):
    model = to_delta(build_source(family), delta_value_channels=4, delta_beta_init=0.5)
    ids = random_ids(batch=3, length=7)
    with torch.no_grad():
        out = model(ids, output_betas=True, output_hidden_states=True)
    assert len(out.betas) == 2 * TINY["num_hidden_layers"]
    for beta in out.betas:
        assert beta.shape == (3, 7)
        assert torch.equal(beta, torch.full_like(beta, 0.5))  # gate weight 0 at init: exactly delta_beta_init
    assert len(out.hidden_states) == TINY["num_hidden_layers"] + 1
    assert all(h.shape == (3, 7, TINY["hidden_size"]) for h in out.hidden_states)


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("llama", {}),
        ("mistral", dict(delta_value_channels=4)),
        ("qwen2", dict(delta_mode="paper", delta_value_channels=4)),
        ("qwen3", dict(delta_state_read="temporal_conv")),
        ("llama", dict(delta_value_channels=4, delta_state_read="temporal_conv", delta_embed_expand="conv")),
        ("qwen3", dict(delta_value_channels=4, delta_state_read="channel_conv", delta_gate="mlp")),
    ],
)
def test_cached_generation_equals_uncached(family, overrides):
    model = open_gates(to_delta(build_source(family), delta_init="reference", **overrides))
    prompt = random_ids(batch=2, length=6)
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=PAD)
    reference = greedy_reference(model, prompt, use_cache=True, **kwargs)
    reference.assert_matches(model.generate(prompt, use_cache=False, **kwargs)[:, 6:])
    cached = torch.cat([prompt, reference.tokens], dim=1)
    with torch.no_grad():  # the last step's logits, too: cached prefill + one step == one full forward
        full = model(cached[:, :-1]).logits[:, -1]
        step = model(cached[:, :-2], use_cache=True)
        last = model(cached[:, -2:-1], cache=cache_of(step)).logits[:, -1]
    torch.testing.assert_close(last, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("family", "overrides"),
    [("mistral", {}), ("qwen2", dict(delta_value_channels=4, delta_state_read="temporal_conv"))],
)
def test_left_padded_batch_equals_each_prompt_alone(family, overrides):
    # delta_init="reference": TC starts as an average over 4 tokens, so padding would leak in if it were not masked.
    model = open_gates(to_delta(build_source(family), delta_init="reference", **overrides))
    prompts = [random_ids(1, 7, seed=3)[0], random_ids(1, 4, seed=4)[0]]
    width = max(len(p) for p in prompts)
    # Padding positions hold a token with a non-zero embedding: only the mask may keep them out.
    ids = torch.full((2, width), 5)
    mask = torch.zeros(2, width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = prompt, 1
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=PAD)
    batch = greedy_reference(model, ids, attention_mask=mask, **kwargs)
    batch.assert_matches(torch.stack([model.generate(p[None], **kwargs)[0, len(p) :] for p in prompts]))
    # A plain forward with the mask and no position_ids (generate passes position_ids, which restart the temporal
    # windows at the first real token): the mask alone keeps padding out; RoPE makes the offset irrelevant.
    with torch.no_grad():
        padded = model(ids, attention_mask=mask).logits
        for row, prompt in enumerate(prompts):
            alone = model(prompt[None]).logits[0]
            torch.testing.assert_close(padded[row, width - len(prompt) :], alone, rtol=1e-4, atol=1e-4)


def test_beta_upper_bounds_hold_for_rmsnorm_gates():
    """Closed gates bound beta by exactly 0; open ones by a bound that the betas on real inputs never exceed and
    that is reached for the input the bound's argument picks (so it is the least upper bound)."""
    model = to_delta(build_source("llama"))
    assert set(model.beta_upper_bounds().values()) == {0.0}
    open_gates(model)
    bounds = model.beta_upper_bounds()
    with torch.no_grad():
        out = model(random_ids(4, 16), output_betas=True)
    for bound, beta in zip(bounds.values(), out.betas):
        assert 0.0 < float(beta.max()) <= bound
    # The RMSNorm output gamma * n with n along w * gamma (|n| = sqrt(D)) reaches it.
    residual, norm = model.model.layers[0].delta_residuals()["attn_delta"]
    direction = residual.gate_output.weight[0] * norm.weight
    with torch.no_grad():
        x = direction[None, None] * 3.0  # any positive scale: RMSNorm removes it
        beta = residual(x, x, norm(x), torch.randn_like(x))[1]
    assert float(beta) == pytest.approx(bounds["model.layers.0.attn_delta"], rel=1e-4)


def test_auto_classes_and_config_round_trip():
    config = AutoConfig.for_model("delta_llama", source_model_type="qwen2", **TINY, delta_mode="paper")
    assert isinstance(config, DeltaLlamaConfig) and config.layer_types == ["full_attention"] * 2
    model = AutoModelForCausalLM.from_config(config)
    assert type(model) is DeltaLlamaForCausalLM
    assert type(model.model.layers[0].self_attn).__name__ == "Qwen2Attention"
    assert config.auto_map["AutoModelForCausalLM"] == "modeling_delta_llama.DeltaLlamaForCausalLM"
    again = DeltaLlamaConfig.from_dict(config.to_diff_dict())
    assert again.to_dict() == config.to_dict()
    family = again.family_config()
    assert type(family) is Qwen2Config and family.hidden_size == TINY["hidden_size"]


def test_bad_configs_name_the_problem():
    with pytest.raises(ValueError, match=r"source_model_type='gpt2' is invalid: expected one of \('llama', 'mistral'"):
        DeltaLlamaConfig(source_model_type="gpt2")
    with pytest.raises(ValueError, match=r"DeltaLlamaConfig\.delta_mode='x' is invalid: expected one of"):
        DeltaLlamaConfig(delta_mode="x")
    with pytest.raises(ValueError, match=r"delta_embed_expand='conv' is invalid: .*delta_value_channels > 1"):
        DeltaLlamaConfig(delta_embed_expand="conv")
    with pytest.raises(ValueError, match="only token_mixer='attention'"):
        DeltaLlamaConfig(token_mixer="delta_net")
    model = to_delta(build_source("llama"))
    with pytest.raises(RuntimeError, match=r"token ids outside \[0, vocab_size=97\)"):  # torch._assert_async
        model(torch.tensor([[5, VOCAB]]))


def test_save_and_load_in_a_fresh_process_without_ddl_hf(tmp_path):
    """save_pretrained writes the custom code (modeling_delta_llama.py and the files it imports relatively); a
    fresh process that cannot import ddl_hf loads it with trust_remote_code=True and computes the same logits."""
    model = open_gates(to_delta(build_source("qwen3"), delta_value_channels=4, delta_state_read="temporal_conv"))
    model.save_pretrained(tmp_path)
    files = {p.name for p in tmp_path.iterdir()}
    assert set(DELTA_LLAMA_CODE) <= files
    ids = random_ids(2, 9)
    with torch.no_grad():
        expected = model(ids).logits
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is DeltaLlamaForCausalLM
    # Not bit for bit: safetensors' mmap can leave a weight at another 64-byte alignment than the original, and the
    # BLAS kernels then sum in another order (~1e-7 here); a wrong load would differ by far more.
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, expected, rtol=1e-5, atol=1e-6)
    torch.save({"ids": ids, "logits": expected}, tmp_path / "expected.pt")
    script = (
        "import sys, torch\n"
        "sys.modules['ddl_hf'] = None  # the editable install would make it importable\n"
        "from transformers import AutoModelForCausalLM\n"
        "model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()\n"
        "assert 'ddl_hf' not in type(model).__module__, type(model).__module__\n"
        "data = torch.load(sys.argv[1] + '/expected.pt')\n"
        "with torch.no_grad():\n"
        "    torch.testing.assert_close(model(data['ids']).logits, data['logits'], rtol=1e-5, atol=1e-6)\n"
        "print('OK', type(model).__name__)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OK DeltaLlamaForCausalLM" in result.stdout


@pytest.mark.parametrize("family", list(FAMILIES))
def test_convert_from_a_directory_and_export_back_while_gates_are_closed(family, tmp_path):
    source = build_source(family)
    source.save_pretrained(tmp_path / "source")
    model = ddl_hf.convert_llama(tmp_path / "source", delta_value_channels=4).eval()
    ids = random_ids()
    with torch.no_grad():
        expected = source(ids).logits
        assert torch.equal(model(ids).logits, expected)
        exported = ddl_hf.export_to_llama(model).eval()
        assert type(exported) is type(source)
        assert torch.equal(exported(ids).logits, expected)

    def fields(config):  # dtype and architectures are written by loading and saving, not the architecture
        return {k: v for k, v in config.to_diff_dict().items() if k not in ("dtype", "architectures")}

    assert fields(exported.config) == fields(source.config)
    source_weights = source.state_dict()
    assert all(torch.equal(tensor, source_weights[name]) for name, tensor in exported.state_dict().items())


def test_export_refuses_open_gates_paper_mode_and_moved_reads():
    source = build_source("qwen2")
    opened = r"4 of 4 Delta blocks have an open gate\. Largest beta found: 1\.6 in model\.layers\."
    with pytest.raises(ValueError, match=opened):
        ddl_hf.export_to_llama(open_gates(to_delta(source)))
    with pytest.raises(ValueError, match="Cannot export a paper-mode Delta model to Qwen2"):
        ddl_hf.export_to_llama(to_delta(source, delta_mode="paper"))
    model = to_delta(source, delta_value_channels=4)
    with torch.no_grad():
        model.model.read_out.weights.add_(0.1)
    with pytest.raises(ValueError, match=r"read vector must sum to 1.*'model.read_out.weights'"):
        ddl_hf.export_to_llama(model)


def test_convert_refuses_bad_input_with_the_fix(tmp_path):
    gpt2_dir = tmp_path / "gpt2"
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)).save_pretrained(gpt2_dir)
    with pytest.raises(ConversionError, match=r"model_type 'gpt2'.*Supported families: llama, mistral, qwen2, qwen3"):
        ddl_hf.convert_llama(gpt2_dir)
    with pytest.raises(ConversionError, match="No such directory"):
        ddl_hf.convert_llama(tmp_path / "missing")
    source = build_source("llama")
    with pytest.raises(ConversionError, match=r"Unknown DeltaLlamaConfig field\(s\) \['delta_moed'\]"):
        ddl_hf.convert_llama(source, delta_moed="paper")
    with pytest.raises(ConversionError, match=r"Invalid DeltaLlama setting: .*delta_value_channels=0"):
        ddl_hf.convert_llama(source, delta_value_channels=0)
    with pytest.raises(ConversionError, match="already a DeltaLlama"):
        ddl_hf.convert_llama(to_delta(source))
    # The conversion copies: training the result leaves the source untouched.
    model = to_delta(source)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.add_(1.0)
    assert not torch.equal(model.model.layers[0].mlp.down_proj.weight, source.model.layers[0].mlp.down_proj.weight)


def test_trainer_step_moves_delta_parameters(tmp_path):
    """One optimizer step through the model's loss (`self.loss_function`) with transformers' Trainer."""
    model = to_delta(build_source("mistral"), delta_beta_init=0.5).train()
    before = {name: p.detach().clone() for name, p in model.delta_parameters().items()}
    train_steps(model, random_ids(8, 10), tmp_path, max_steps=1, per_device_train_batch_size=4, learning_rate=1e-2)
    moved = [name for name, p in model.delta_parameters().items() if not torch.equal(p.detach(), before[name])]
    assert any(".beta_proj." in name for name in moved) and any(".v_proj." in name for name in moved)


def test_package_exports():
    exported = {"DeltaLlamaConfig", "DeltaLlamaForCausalLM", "DeltaLlamaModel", "convert_llama", "export_to_llama"}
    assert exported <= set(ddl_hf.__all__)


def test_convert_gpt2_points_a_llama_family_checkpoint_to_convert_llama_and_the_cli(tmp_path):
    """convert_gpt2 stays GPT-2 only and names both ways that take the family; `ddl-hf convert` of Llama-family
    checkpoints is tested in test_delta_llama_conversion.py."""
    build_source("mistral").save_pretrained(tmp_path / "source")
    pointer = r"mistral checkpoint.*ddl_hf\.convert_llama\(.*`ddl-hf convert --source`"
    with pytest.raises(ConversionError, match=pointer):
        ddl_hf.convert_gpt2(tmp_path / "source")
