"""DeltaGPT with token_mixer="delta_net": config, the layer, cache, generate, padding, Trainer, save/load."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import LinearAttentionLayer

import ddl_hf  # noqa: F401  (registers the Auto classes)
from ddl_hf import DeltaGPTConfig, DeltaGPTForCausalLM
from ddl_hf.delta_compat import cache_of
from ddl_hf.delta_net import DeltaNetAttention, DeltaNetCache
from ddl_hf.delta_net_ops import delta_rule_recurrent
from tests.builders import DELTA_NET, delta_config, delta_model, enable_activation_checkpointing, train_steps
from tests.greedy import greedy_reference

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = DELTA_NET["vocab_size"]


# ---------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("token_mixer", "mamba"),
        ("delta_net_rule", "gated"),
        ("delta_net_heads", 0),
        ("delta_net_heads", True),
        ("delta_net_head_dim", -1),
        ("delta_net_conv_size", -1),
        ("delta_net_allow_negative_eigval", "yes"),
        ("delta_net_chunk_size", 0),
    ],
)
def test_bad_token_mixer_fields_name_field_and_value(field, value):
    with pytest.raises(ValueError, match=rf"DeltaGPTConfig\.{field}={value!r} is invalid"):
        delta_config(DELTA_NET, **{field: value})


def test_heads_that_do_not_divide_the_width_need_an_explicit_head_dim():
    with pytest.raises(ValueError, match="delta_net_head_dim=None is invalid"):
        delta_config(DELTA_NET, delta_net_heads=3)
    layer = DeltaNetAttention(delta_config(DELTA_NET, delta_net_heads=3, delta_net_head_dim=5))
    assert layer.q_proj.out_features == 15 and layer.o_proj.in_features == 15


def test_attention_is_the_default_mixer():
    assert DeltaGPTConfig().token_mixer == "attention"
    assert type(delta_model(DELTA_NET, token_mixer="attention").transformer.h[0].attn).__name__ == "DeltaGPTAttention"
    assert isinstance(delta_model(DELTA_NET).transformer.h[0].attn, DeltaNetAttention)


# ---------------------------------------------------------------------------------------------------------------
# The layer, against a plain re-computation from its weights
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("negative_eigval", [False, True])
def test_layer_matches_a_token_by_token_recomputation(negative_eigval):
    config = delta_config(DELTA_NET, delta_net_allow_negative_eigval=negative_eigval, delta_net_conv_size=3)
    torch.manual_seed(0)
    layer = DeltaNetAttention(config, layer_idx=0).eval()
    with torch.no_grad():  # a visible conv and gate (the HF init would make them tiny)
        layer.conv1d.weight.normal_()
        layer.b_proj.weight.normal_(std=0.5)
    x = torch.randn(2, 11, 32)
    out, _ = layer(x)

    heads, dim = layer.num_heads, layer.head_dim
    qkv = torch.cat([x @ layer.q_proj.weight.T, x @ layer.k_proj.weight.T, x @ layer.v_proj.weight.T], -1)
    weight = layer.conv1d.weight[:, 0]  # [C, 3]: tap j multiplies x_{t-2+j}
    conv = torch.stack(
        [sum(weight[:, j] * qkv[:, t - 2 + j] for j in range(3) if t - 2 + j >= 0) for t in range(11)], dim=1
    )
    q, k, v = (torch.nn.functional.silu(z).view(2, 11, heads, dim).transpose(1, 2) for z in conv.split(32, -1))
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    beta = (2.0 if negative_eigval else 1.0) * torch.sigmoid(layer.b_proj(x)).transpose(1, 2)
    assert (beta.max() > 1.0) == negative_eigval
    o, _ = delta_rule_recurrent(q, k, v, beta)
    o = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + config.layer_norm_epsilon) * layer.o_norm.weight
    expected = layer.o_proj(o.transpose(1, 2).reshape(2, 11, 32))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def core_output(layer: DeltaNetAttention, x: torch.Tensor) -> torch.Tensor:
    """The layer's delta-rule output o `[B, H, T, d_v]`, before o_norm and o_proj (read with a hook on o_norm)."""
    seen = []
    handle = layer.o_norm.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    with torch.no_grad():
        layer(x)
    handle.remove()
    return seen[0].transpose(1, 2)  # o_norm sees [B, T, H, d_v]


def test_write_only_rule_is_purely_additive_linear_attention():
    """delta_net_rule="write_only" is the same layer without the erase term: o_t = sum_{s<=t} beta_s v_s (k_s . q_t)."""
    config = delta_config(DELTA_NET, delta_net_rule="write_only", delta_net_conv_size=3)
    torch.manual_seed(0)
    write_only = DeltaNetAttention(config, layer_idx=0).eval()
    with torch.no_grad():  # a visible conv and gate (the HF init would make them tiny)
        write_only.conv1d.weight.normal_()
        write_only.b_proj.weight.normal_(std=0.5)
    erase = DeltaNetAttention(delta_config(DELTA_NET, delta_net_conv_size=3), layer_idx=0).eval()
    assert erase.state_dict().keys() == write_only.state_dict().keys()
    erase.load_state_dict(write_only.state_dict())
    x = torch.randn(2, 21, 32)  # 3 chunks of 8

    # q, k, v and beta the way DeltaNetAttention.forward makes them.
    with torch.no_grad():
        heads, dim = write_only.num_heads, write_only.head_dim
        qkv = torch.cat([write_only.q_proj(x), write_only.k_proj(x), write_only.v_proj(x)], -1)
        q, k, v = (z.view(2, 21, heads, dim).transpose(1, 2) for z in write_only._short_conv(qkv, None).split(32, -1))
        q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
        beta = torch.sigmoid(write_only.b_proj(x)).transpose(1, 2)  # [B, H, T]
    # Closed form of purely additive linear attention: causal (q_t . k_s) weights times beta_s v_s.
    scores = (q @ k.transpose(-1, -2)).tril()  # [B, H, t, s], s <= t
    expected = scores @ (beta.unsqueeze(-1) * v)

    torch.testing.assert_close(core_output(write_only, x), expected, rtol=1e-5, atol=1e-5)
    assert (core_output(erase, x) - expected).abs().max() > 1e-2  # the delta rule does erase


def test_old_additive_rule_spelling_still_works_with_a_future_warning():
    with pytest.warns(FutureWarning, match="delta_net_rule='additive' is deprecated"):
        config = delta_config(DELTA_NET, delta_net_rule="additive")
    assert config.delta_net_rule == "write_only" and config.to_dict()["delta_net_rule"] == "write_only"
    old, new = delta_model(config=config, seed=3), delta_model(DELTA_NET, seed=3, delta_net_rule="write_only")
    assert not old.transformer.h[0].attn.erase
    ids = torch.randint(0, VOCAB, (1, 20))
    with torch.no_grad():
        assert torch.equal(old(ids).logits, new(ids).logits)


# ---------------------------------------------------------------------------------------------------------------
# Cache and generate
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [{}, {"delta_net_conv_size": 0}, {"delta_net_allow_negative_eigval": True}, {"delta_net_rule": "write_only"}],
    ids=["conv4", "no_conv", "negative_eigval", "additive"],
)
def test_cached_forward_equals_full_forward(overrides):
    model = delta_model(DELTA_NET, **overrides)
    ids = torch.randint(0, VOCAB, (2, 30))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :13], use_cache=True)  # prefill (chunked, padded), then a 2-token step, then 1 at a time
        cache, pieces = cache_of(out), [out.logits]
        assert isinstance(cache, DeltaNetCache) and cache.get_seq_length() == 13
        for start, stop in [(13, 15), *((t, t + 1) for t in range(15, 30))]:
            out = model(ids[:, start:stop], cache=cache, use_cache=True)
            pieces.append(out.logits)
    assert (torch.cat(pieces, dim=1) - full).abs().max() <= 1e-5
    assert cache.get_seq_length() == 30


def test_cache_memory_is_constant_in_context_length():
    model = delta_model(DELTA_NET)

    def cache_bytes(length):
        with torch.no_grad():
            cache = model(torch.randint(0, VOCAB, (1, length)), use_cache=True).past_key_values
        assert all(type(layer).__mro__[1] is LinearAttentionLayer for layer in cache.layers)
        states = [t for layer in cache.layers for t in (*layer.conv_states.values(), *layer.recurrent_states.values())]
        assert states[1].shape == (1, 4, 8, 8)  # [B, H, d_v, d_k] per layer
        return sum(t.numel() * t.element_size() for t in states)

    assert cache_bytes(5) == cache_bytes(80)


@pytest.mark.parametrize("rule", ["delta", "write_only"])
def test_greedy_generate_with_cache_equals_without(rule):
    model = delta_model(DELTA_NET, delta_net_rule=rule)
    prompt = torch.randint(0, VOCAB, (2, 9))
    kwargs = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
    cached = greedy_reference(model, prompt, use_cache=True, **kwargs)
    uncached = model.generate(prompt, use_cache=False, **kwargs)
    assert uncached.shape == (2, 41)
    cached.assert_matches(uncached[:, 9:])


def test_beam_search_with_cache_equals_without():
    model = delta_model(DELTA_NET)
    prompt = torch.randint(0, VOCAB, (2, 7))
    kwargs = dict(max_new_tokens=8, num_beams=3, do_sample=False, pad_token_id=0)
    cached, uncached = (model.generate(prompt, use_cache=use_cache, **kwargs) for use_cache in (True, False))
    assert torch.equal(cached, uncached)


def test_left_padded_batch_equals_each_prompt_alone():
    model = delta_model(DELTA_NET)
    prompts = [torch.randint(1, VOCAB, (n,)) for n in (5, 12)]
    batch = torch.zeros(2, 12, dtype=torch.long)
    mask = torch.zeros(2, 12, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        batch[row, 12 - len(prompt) :], mask[row, 12 - len(prompt) :] = prompt, 1
    kwargs = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    together = greedy_reference(model, batch, attention_mask=mask, **kwargs)
    together.assert_matches(torch.stack([model.generate(p[None], **kwargs)[0, len(p) :] for p in prompts]))


def test_wrong_cache_or_mask_raise_clear_errors():
    model = delta_model(DELTA_NET)
    ids = torch.randint(0, VOCAB, (1, 6))
    with pytest.raises(TypeError, match="needs a DeltaNetCache"):
        model(ids, cache=DynamicCache(), use_cache=True)
    with pytest.raises(ValueError, match="2-D"):
        model(ids, attention_mask=torch.ones(1, 1, 6, 6))
    with pytest.raises(ValueError, match="cache_implementation='static' is not supported"):
        model.generate(ids, max_new_tokens=2, cache_implementation="static", pad_token_id=0)


# ---------------------------------------------------------------------------------------------------------------
# Training and serialisation
# ---------------------------------------------------------------------------------------------------------------


def test_gradient_checkpointing_gives_the_same_gradients():
    ids = torch.randint(0, VOCAB, (2, 20))
    grads = []
    for checkpointing in (False, True):
        model = delta_model(DELTA_NET, seed=1).train()
        if checkpointing:
            enable_activation_checkpointing(model)
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any(".attn.conv1d." in n for n in grads[0])
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-5, atol=1e-6, msg=name)


def test_trainer_steps_update_the_delta_net_weights(tmp_path):
    model = delta_model(DELTA_NET, seed=2).train()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if ".attn." in n}
    ids = torch.randint(0, VOCAB, (16, 24))
    result = train_steps(
        model, ids, tmp_path, max_steps=3, per_device_train_batch_size=8, learning_rate=1e-2, logging_steps=1
    )
    assert torch.isfinite(torch.tensor(result.training_loss))
    changed = [n for n, p in model.named_parameters() if n in before and not torch.equal(before[n], p.detach())]
    for part in ("q_proj", "k_proj", "v_proj", "b_proj", "conv1d", "o_norm", "o_proj"):
        assert any(f".attn.{part}." in n for n in changed), part


def test_save_and_load_round_trip(tmp_path):
    model = delta_model(
        DELTA_NET, delta_net_allow_negative_eigval=True, delta_net_conv_size=2, delta_net_rule="write_only"
    )
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, DeltaGPTForCausalLM)
    for field in ("token_mixer", "delta_net_allow_negative_eigval", "delta_net_conv_size", "delta_net_rule"):
        assert getattr(loaded.config, field) == getattr(model.config, field)
    state, loaded_state = model.state_dict(), loaded.state_dict()
    assert state.keys() == loaded_state.keys()
    assert all(torch.equal(state[name], loaded_state[name]) for name in state)
    ids = torch.randint(0, VOCAB, (1, 15))
    # Loaded tensors sit at other memory alignments, so SIMD reductions may round differently (also for attention).
    torch.testing.assert_close(model(ids).logits, loaded(ids).logits, rtol=0, atol=1e-6)
