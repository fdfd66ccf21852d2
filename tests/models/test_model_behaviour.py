"""DeltaGPT behaves like any transformers causal LM: cache, padding, checkpointing, save/load, heads, errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

import ddl_hf
from ddl_hf.delta_compat import cache_of
from tests.builders import VOCAB, delta_config, delta_model, enable_activation_checkpointing, open_gates
from tests.conversion_runs import DELTA_GPT_CODE, DELTA_LLAMA_CODE
from tests.greedy import greedy_reference

MODES = [("additive", 1), ("additive", 4), ("paper", 1), ("paper", 3)]


def gated_model(mode: str, value_channels: int, **overrides) -> ddl_hf.DeltaGPTForCausalLM:
    model = delta_model(delta_mode=mode, delta_value_channels=value_channels, **overrides)
    open_gates(model)  # exercise the Delta path, not only the beta = 0 case
    return model


@pytest.mark.parametrize(("mode", "value_channels"), MODES)
def test_greedy_generation_with_cache_equals_without(mode: str, value_channels: int) -> None:
    model = gated_model(mode, value_channels)
    prompt = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    kwargs = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False)
    cached = greedy_reference(model, prompt, use_cache=True, **kwargs)
    uncached = model.generate(prompt, use_cache=False, **kwargs)
    assert uncached.shape == (1, 38)
    cached.assert_matches(uncached[:, 6:])


def test_cached_forward_matches_full_forward() -> None:
    model = gated_model("additive", 4)
    ids = torch.randint(1, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids).logits
        first = model(ids[:, :7], use_cache=True)
        rest = model(ids[:, 7:], cache=cache_of(first), use_cache=True).logits
    assert torch.allclose(torch.cat([first.logits, rest], dim=1), full, atol=1e-5)


@pytest.mark.parametrize(("mode", "value_channels"), [("additive", 1), ("paper", 4)])
def test_left_padded_batch_equals_each_prompt_alone(mode: str, value_channels: int) -> None:
    model = gated_model(mode, value_channels)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, VOCAB, (n,), generator=generator) for n in (3, 7, 5)]
    width = max(len(p) for p in prompts)
    pad = model.config.pad_token_id
    batch = torch.stack([torch.cat([torch.full((width - len(p),), pad), p]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(width - len(p)), torch.ones(len(p))]) for p in prompts]).long()
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=pad)

    batched = greedy_reference(model, batch, attention_mask=mask, **kwargs)
    ones = [torch.ones(1, len(prompt), dtype=torch.long) for prompt in prompts]
    alone = [model.generate(p[None], attention_mask=m, **kwargs)[0, len(p) :] for p, m in zip(prompts, ones)]
    batched.assert_matches(torch.stack(alone))


@pytest.mark.parametrize(("mode", "value_channels"), [("additive", 1), ("paper", 4)])
def test_gradient_checkpointing_gives_the_same_gradients(mode: str, value_channels: int) -> None:
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))

    def gradients(checkpointing: bool) -> dict[str, torch.Tensor]:
        model = gated_model(mode, value_channels).train()
        if checkpointing:
            enable_activation_checkpointing(model, use_reentrant=False)
        model(ids, labels=ids).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    plain, checkpointed = gradients(False), gradients(True)
    assert plain.keys() == checkpointed.keys()
    assert any("beta_open" in name for name in plain)
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize(("mode", "value_channels"), [("additive", 1), ("paper", 3)])
def test_save_and_auto_load_round_trip_bit_exactly(tmp_path, mode: str, value_channels: int) -> None:
    model = gated_model(mode, value_channels, delta_gate="mlp")
    model.save_pretrained(tmp_path)
    files = set(os.listdir(tmp_path))
    assert "model.safetensors" in files and not any(f.endswith((".bin", ".pt", ".pkl")) for f in files)
    assert {"configuration_delta_gpt.py", "modeling_delta_gpt.py"} <= files  # Hub custom code travels along
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForCausalLM"] == "modeling_delta_gpt.DeltaGPTForCausalLM"

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is ddl_hf.DeltaGPTForCausalLM
    assert loaded.config.delta_mode == mode and loaded.config.delta_value_channels == value_channels
    original, reloaded = model.state_dict(), loaded.state_dict()
    assert original.keys() == reloaded.keys()
    assert all(torch.equal(original[name], reloaded[name]) for name in original)
    ids = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():  # same weights; kernels may take another path for differently aligned tensors
        torch.testing.assert_close(loaded.eval()(ids).logits, model(ids).logits, rtol=0, atol=1e-6)


def test_auto_classes_build_every_head(tmp_path) -> None:
    config = delta_config(num_labels=3)
    assert isinstance(AutoConfig.for_model("delta_gpt"), ddl_hf.DeltaGPTConfig)
    expected = {
        AutoModel: ddl_hf.DeltaGPTModel,
        AutoModelForCausalLM: ddl_hf.DeltaGPTForCausalLM,
        AutoModelForSequenceClassification: ddl_hf.DeltaGPTForSequenceClassification,
        AutoModelForTokenClassification: ddl_hf.DeltaGPTForTokenClassification,
    }
    for auto_class, model_class in expected.items():
        assert type(auto_class.from_config(config)) is model_class
    ddl_hf.DeltaGPTModel(config).save_pretrained(tmp_path)
    assert type(AutoModel.from_pretrained(tmp_path)) is ddl_hf.DeltaGPTModel


def test_sequence_and_token_classification_heads() -> None:
    config = delta_config(num_labels=3, delta_value_channels=2)
    # Row 0 right-padded with pad_token_id 0: its last position is padding, so pooling the last position would
    # give another answer than pooling the last real token.
    ids = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 10, 11, 12]])
    mask = (ids != 0).long()
    lengths = mask.sum(-1).tolist()
    labels = torch.tensor([2, 0])
    seq_model = ddl_hf.DeltaGPTForSequenceClassification(config).eval()
    open_gates(seq_model)  # exercise the Delta path, not only the beta = 0 case
    with torch.no_grad():
        out = seq_model(ids, attention_mask=mask, labels=labels)
        assert out.logits.shape == (2, 3) and out.loss.ndim == 0
        # The pooled logits are those of each sequence run alone, unpadded (batch of one: its last token).
        alone = torch.cat([seq_model(ids[row : row + 1, :n]).logits for row, n in enumerate(lengths)])
        torch.testing.assert_close(out.logits, alone)
        # ... and not the last position's: the test can tell the two poolings apart.
        hidden = seq_model.transformer(ids, attention_mask=mask).last_hidden_state
        assert (seq_model.score(hidden[0, -1]) - alone[0]).abs().max() > 1e-3
    torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(out.logits, labels))

    token_model = ddl_hf.DeltaGPTForTokenClassification(config).eval()
    token_labels = torch.randint(0, 3, ids.shape)
    out = token_model(ids, labels=token_labels, output_betas=True)
    assert out.logits.shape == (2, 5, 3) and len(out.betas) == 2 * config.n_layer
    torch.testing.assert_close(
        out.loss, torch.nn.functional.cross_entropy(out.logits.reshape(-1, 3), token_labels.flatten())
    )


def test_outputs_hidden_states_attentions_and_betas() -> None:
    model = delta_model(delta_value_channels=3, attn_implementation="eager")
    open_gates(model)
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))
    out = model(ids, output_hidden_states=True, output_attentions=True, output_betas=True)
    n_layer, d = model.config.n_layer, model.config.n_embd
    # transformers' contract: n_layer + 1 states of [batch, seq, hidden], the last one post-ln_f as in GPT-2.
    assert len(out.hidden_states) == n_layer + 1
    assert all(h.shape == (2, 6, d) for h in out.hidden_states)
    torch.testing.assert_close(out.hidden_states[-1], model.transformer(ids).last_hidden_state, rtol=0, atol=0)
    assert out.expanded_states is None  # opt-in
    assert len(out.attentions) == n_layer and out.attentions[0].shape == (2, model.config.n_head, 6, 6)
    assert len(out.betas) == 2 * n_layer and all(b.shape == (2, 6) for b in out.betas)
    plain = model(ids)
    assert plain.betas is None and plain.hidden_states is None and plain.expanded_states is None


def test_expanded_states_are_an_opt_in_output_and_hidden_states_their_reads() -> None:
    model = delta_model(delta_value_channels=3)
    open_gates(model)
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))
    out = model(ids, output_expanded_states=True, output_hidden_states=True)
    n_layer, d = model.config.n_layer, model.config.n_embd
    assert len(out.expanded_states) == n_layer + 1 and all(x.shape == (2, 6, d, 3) for x in out.expanded_states)
    # X_0: the embedding repeated over the value channels, computed here from the embedding tables.
    positions = torch.arange(6)
    embedding = model.transformer.wte(ids) + model.transformer.wpe(positions)
    torch.testing.assert_close(out.expanded_states[0], embedding.unsqueeze(-1).expand(2, 6, d, 3), rtol=0, atol=0)
    # Every hidden state but the last is its expanded state read with the final read vector.
    read = model.transformer.read_out.weights
    for hidden, expanded in zip(out.hidden_states[:-1], out.expanded_states[:-1]):
        torch.testing.assert_close(hidden, expanded @ read, rtol=0, atol=0)
    # The final expanded state, read and normed, is what the LM head sees.
    final = model.transformer.ln_f(out.expanded_states[-1] @ read)
    torch.testing.assert_close(final, out.hidden_states[-1], rtol=0, atol=0)
    torch.testing.assert_close(model.lm_head(final), out.logits, rtol=0, atol=0)
    as_tuple = model(ids, output_expanded_states=True, return_dict=False)
    assert len(as_tuple) == 3 and len(as_tuple[2]) == n_layer + 1  # logits, cache, expanded states


@pytest.mark.parametrize("model_kind", ["gpt", "llama"])
def test_expanded_hidden_states_retain_a_gradient_that_is_the_states_along_the_read(model_kind) -> None:
    """transformers' `test_retain_grad_hidden_states_attentions`: every `hidden_states` entry is in the graph, as
    GPT-2's are. Its gradient is dL/dX u with u = w / |w|^2 (the read holding the rest of X fixed), and asking for
    hidden states changes no parameter's gradient beyond float rounding."""
    if model_kind == "gpt":
        model = delta_model(delta_value_channels=3, delta_mode="paper")
    else:
        from tests.builders import build_source

        model = ddl_hf.convert_llama(build_source("qwen3", vocab_size=VOCAB), delta_value_channels=3)
    open_gates(model)
    model.train()
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))
    out = model(ids, output_hidden_states=True, output_expanded_states=True)
    for hidden in out.hidden_states:
        hidden.retain_grad()
    for state in out.expanded_states:
        state.retain_grad()
    out.logits.sum().backward()
    read = model.base_model.read_out.weights.detach()
    u = read / (read @ read)
    assert all(h.grad is not None for h in out.hidden_states)
    for hidden, state in zip(out.hidden_states[:-1], out.expanded_states[:-1]):
        torch.testing.assert_close(hidden.grad, state.grad @ u, rtol=1e-5, atol=1e-7)
    with_hidden = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model(ids).logits.sum().backward()
    for name, param in model.named_parameters():
        if param.grad is not None:
            torch.testing.assert_close(with_hidden[name], param.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_generate_with_hidden_states_and_assisted_decoding_for_expanded_states() -> None:
    model = delta_model(delta_value_channels=4)
    open_gates(model)
    prompt = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(2))
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    greedy = model.generate(prompt, output_hidden_states=True, return_dict_in_generate=True, **kwargs)
    d = model.config.n_embd
    assert all(h.shape[-1] == d and h.dim() == 3 for step in greedy.hidden_states for h in step)
    assistant = delta_model(seed=1, delta_value_channels=4)  # a different model: some drafts are rejected
    assisted = model.generate(prompt, assistant_model=assistant, **kwargs)
    greedy_reference(model, prompt, **kwargs).assert_matches(assisted[:, 5:])  # drafts are checked several at once


def test_tied_embeddings_and_resize_token_embeddings() -> None:
    model = delta_model()
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    model.resize_token_embeddings(VOCAB + 11)
    assert model.config.vocab_size == VOCAB + 11
    assert model.lm_head.weight.shape[0] == VOCAB + 11
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    logits = model(torch.tensor([[VOCAB + 10, 3]])).logits
    assert logits.shape == (1, 2, VOCAB + 11)


def test_loss_accepts_num_items_in_batch_like_trainer() -> None:
    """Trainer passes num_items_in_batch for gradient accumulation: the loss becomes sum / num_items."""
    model = gated_model("additive", 1)
    ids = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(5))
    labels = ids.clone()
    labels[0, :3] = -100
    logits = model(ids).logits
    token_losses = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
    )
    mean = model(ids, labels=labels).loss
    summed = model(ids, labels=labels, num_items_in_batch=torch.tensor(40)).loss
    torch.testing.assert_close(mean, token_losses / (labels[:, 1:] != -100).sum())
    torch.testing.assert_close(summed, token_losses / 40)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("delta_mode", "gated", "delta_mode='gated'"),
        ("delta_value_channels", 0, "delta_value_channels=0"),
        ("delta_value_channels", 2.5, "delta_value_channels=2.5"),
        ("delta_beta_init", 2.5, r"delta_beta_init=2.5 is invalid: expected a number in \[0, 2\]"),
        ("delta_beta_init", -0.1, "delta_beta_init=-0.1"),
        ("delta_gate", "conv", "delta_gate='conv'"),
        ("delta_gate_hidden_size", 0, "delta_gate_hidden_size=0"),
        ("delta_eps", 0.0, "delta_eps=0.0"),
        ("add_cross_attention", True, "cross-attention is not supported"),
    ],
)
def test_bad_config_values_raise_value_error(field: str, value, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        delta_config(**{field: value})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"delta_state_read": "conv"}, r"delta_state_read='conv' is invalid: expected one of \('linear', "),
        ({"delta_state_read": "channel_conv"}, "delta_state_read='channel_conv' is invalid: .*value_channels > 1"),
        (
            {"delta_state_read": "channel_conv", "delta_value_channels": 4, "delta_conv_size": 5},
            "delta_conv_size=5 is invalid: expected <= delta_value_channels=4",
        ),
        ({"delta_conv_size": 0}, "delta_conv_size=0 is invalid: expected an integer >= 1"),
        ({"delta_embed_expand": "conv"}, "delta_embed_expand='conv' is invalid: .*delta_value_channels > 1"),
        ({"delta_embed_expand": "tile"}, "delta_embed_expand='tile'"),
        ({"delta_value": "tanh"}, "delta_value='tanh' is invalid: expected one of"),
        ({"delta_value_scale": 0.0}, "delta_value_scale=0.0 is invalid: expected a finite number > 0"),
        ({"delta_shared_read": 1}, "delta_shared_read=1 is invalid"),
        ({"delta_value_constant": float("nan")}, "delta_value_constant=nan is invalid: expected a finite number"),
        ({"delta_erase": "no"}, "delta_erase='no' is invalid"),
        ({"delta_init": "zero"}, r"delta_init='zero' is invalid: expected None \(auto\) or one of \('exact', "),
    ],
)
def test_bad_variant_values_raise_value_error(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        delta_config(**overrides)


def test_from_scratch_follows_the_reference_code_and_loading_a_gpt2_stays_exact(tmp_path) -> None:
    """Built from a config: the authors' from-scratch init (beta = 2 sigmoid(w.c) around 1, averaging read
    convolutions), recorded in the config; a paper-mode model is then not a stack of identity blocks. Loading a
    checkpoint without the Delta parameters (a GPT-2) gives them the exact init instead; explicit choices win."""
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(6))
    model = delta_model(delta_mode="paper", delta_value_channels=4, delta_state_read="temporal_conv")
    assert model.config.delta_init == "reference" and model.config.delta_beta_init == 1.0
    betas = torch.stack(model(ids, output_betas=True).betas)
    # the gate reads c: logit w.c with w ~ N(0, (0.5 / D)^2) and |c| ~ sqrt(D), so beta = 1 +- ~0.25 / sqrt(D)
    assert 0 < (betas - 1).abs().max() < 0.5 / model.config.n_embd**0.5 * 3
    conv = model.transformer.h[0].attn_read.conv.weight
    assert torch.equal(conv, torch.full_like(conv, 0.25))
    base = model.transformer
    identity_logits = model.lm_head(base.ln_f(base.wte(ids) + base.wpe.weight[:6]))
    assert (model(ids).logits - identity_logits).abs().max() > 1e-2  # the blocks act from the first step

    explicit = delta_model(delta_init="exact", delta_state_read="channel_conv", delta_value_channels=4)
    assert explicit.config.delta_beta_init == 0.0
    weight = explicit.transformer.read_out.conv.weight
    assert torch.equal(weight, torch.eye(4)[1].expand_as(weight))  # centred tap p = (4 - 1) // 2 = 1
    assert delta_model(delta_beta_init=0.5).config.delta_init == "reference"
    with torch.no_grad():  # exact: the same beta for every token, the one asked for
        exact = delta_model(delta_beta_init=0.5, delta_init="exact")(ids, output_betas=True).betas
        assert all(torch.equal(b, torch.full_like(b, 0.5)) for b in exact)

    model.save_pretrained(tmp_path)  # the resolved scheme travels with the config
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reloaded.config.delta_init == "reference" and reloaded.config.delta_beta_init == 1.0
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=1e-6)


def test_config_mutated_after_creation_is_checked_when_building_or_saving(tmp_path) -> None:
    config = delta_config()
    config.delta_mode = "typo"
    with pytest.raises(ValueError, match="delta_mode='typo'"):
        ddl_hf.DeltaGPTForCausalLM(config)
    with pytest.raises(ValueError, match="delta_mode='typo'"):
        config.save_pretrained(tmp_path)


def test_bad_inputs_raise_clear_errors() -> None:
    model = delta_model()
    # Checks on tensor data run on the device (torch._assert_async): a RuntimeError, and the host never waits for it.
    with pytest.raises(RuntimeError, match=r"outside \[0, vocab_size=97\).*resize_token_embeddings"):
        model(torch.tensor([[1, 2, VOCAB]]))
    with pytest.raises(RuntimeError, match="outside"):
        model(torch.tensor([[1, -1, 2]]))
    too_long = torch.ones(1, model.config.n_positions + 1, dtype=torch.long)
    with pytest.raises(ValueError, match=r"Sequence too long: 65 new tokens \+ 0 cached tokens > n_positions=64"):
        model(too_long)
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 5\), expected \(2, 6\)"):
        model(torch.ones(2, 6, dtype=torch.long), attention_mask=torch.ones(2, 5, dtype=torch.long))
    with pytest.raises(RuntimeError, match=r"position_ids reach n_positions=64"):
        model(torch.ones(1, 2, dtype=torch.long), position_ids=torch.tensor([[63, 64]]))
    with pytest.raises(ValueError, match="either input_ids or inputs_embeds"):
        model()


def test_generation_past_n_positions_is_refused() -> None:
    model = delta_model()
    prompt = torch.ones(1, 60, dtype=torch.long)
    with pytest.raises(RuntimeError, match="n_positions=64"):
        model.generate(prompt, max_new_tokens=10, min_new_tokens=10, do_sample=False)


@pytest.mark.parametrize(("value_channels", "budget"), [(1, 1.001), (4, 1.002)])
def test_parameter_overhead_at_gpt2_small_shape(value_channels: int, budget: float) -> None:
    """Built on the meta device: GPT-2 small's shape without allocating its weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        gpt2 = GPT2LMHeadModel(GPT2Config())
        delta = ddl_hf.DeltaGPTForCausalLM(ddl_hf.DeltaGPTConfig(delta_value_channels=value_channels))
    gpt2_params = sum(p.numel() for p in gpt2.parameters())
    delta_params = sum(p.numel() for p in delta.parameters())
    read = value_channels if value_channels > 1 else 0
    per_block = (768 + 1) + 1 + value_channels * (768 + 1) + read  # beta_proj, beta_open, v_proj, the read vector
    extra = 24 * per_block + read  # + read_out
    assert delta_params - gpt2_params == extra
    assert delta_params / gpt2_params <= budget


@pytest.mark.parametrize("name", sorted({*DELTA_GPT_CODE, *DELTA_LLAMA_CODE}))
def test_the_package_modules_are_the_root_hub_files(name: str) -> None:
    """`ddl_hf/` links to the self-contained Hub files at the repository root, so that what the package runs is what
    `save_pretrained` ships; an editor that replaces a link by a copy would let the two drift apart."""
    root = Path(__file__).resolve().parents[2]
    assert (root / "ddl_hf" / name).is_symlink()
    assert (root / "ddl_hf" / name).resolve() == (root / name).resolve()
