"""What a DeltaGPT declares to transformers' generic code, and what `generate` then does.

A `token_mixer="delta_net"` model is recurrent: its fixed-size state cannot be rolled back, so everything that crops
the cache (assisted / speculative decoding, prompt lookup, being a draft model) is refused up front with a clear
error, and so are transformers' config-built caches (static, dynamic), which cannot count absorbed tokens. The
attention mixer keeps them all; the references are plain greedy decoding and the dynamic cache.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, PreTrainedModel, StaticCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

import ddl_hf
from ddl_hf.delta_compat import CACHE_ARG, cache_of
from tests.builders import CLIENT_VARIANTS, DELTA_NET, delta_config, delta_model, scramble_delta_weights
from tests.greedy import greedy_reference

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(1, 61, (1, 7), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def attention_model() -> ddl_hf.DeltaGPTForCausalLM:
    return delta_model(vocab_size=61, delta_beta_init=0.5)


@pytest.fixture(scope="module")
def delta_net_model() -> ddl_hf.DeltaGPTForCausalLM:
    return delta_model(DELTA_NET)


def test_the_mixer_is_declared_per_model(attention_model, delta_net_model):
    assert delta_net_model.config.layer_types == ["linear_attention"] * 2
    assert attention_model.config.layer_types == ["full_attention"] * 2
    assert delta_net_model._is_stateful and not attention_model._is_stateful
    assert not ddl_hf.DeltaGPTForCausalLM._is_stateful  # per instance: the class serves both mixers
    # transformers' own generic consumer of layer_types (from transformers 5.18, which added context parallelism):
    # no context parallelism across a recurrent state
    if hasattr(PreTrainedModel, "supports_context_parallel"):
        assert not delta_net_model.supports_context_parallel and attention_model.supports_context_parallel
    cache = cache_of(delta_net_model(torch.tensor([[1, 2, 3]]), use_cache=True))
    assert all(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers)
    assert cache.has_previous_state(0) and cache.get_seq_length() == 3 and not cache.is_compileable


def test_layer_types_follow_the_token_mixer(tmp_path):
    config = delta_config(token_mixer="delta_net")
    assert "layer_types" not in config.to_dict()  # derived, never stale in a saved config
    config.save_pretrained(tmp_path)
    assert ddl_hf.DeltaGPTConfig.from_pretrained(tmp_path).layer_types == ["linear_attention"] * 2
    assert delta_config(layer_types=["full_attention"] * 2).layer_types == ["full_attention"] * 2
    with pytest.raises(ValueError, match=r"layer_types=.* follows token_mixer='attention'.*set token_mixer"):
        delta_config(layer_types=["linear_attention"] * 2)


def test_assisted_decoding_works_for_attention(attention_model, prompt):
    assistant = delta_model(vocab_size=61, seed=3)  # a different model: some draft tokens are rejected
    expected = greedy_reference(attention_model, prompt, **GREEDY)
    n = prompt.shape[1]
    with torch.no_grad():  # the drafts are checked several tokens at once: another rounding
        expected.assert_matches(attention_model.generate(prompt, assistant_model=assistant, **GREEDY)[:, n:])
        expected.assert_matches(attention_model.generate(prompt, prompt_lookup_num_tokens=2, **GREEDY)[:, n:])


@pytest.mark.parametrize("mode", ["assistant_model", "prompt_lookup_num_tokens"])
def test_assisted_decoding_of_a_delta_net_model_is_refused(attention_model, delta_net_model, prompt, mode):
    kwargs = {"assistant_model": attention_model} if mode == "assistant_model" else {"prompt_lookup_num_tokens": 2}
    with pytest.raises(ValueError, match=r"token_mixer='delta_net' .* cannot be used with assisted .* cannot forget"):
        delta_net_model.generate(prompt, **kwargs, **GREEDY)


def test_a_delta_net_assistant_is_refused(attention_model, delta_net_model, prompt):
    with pytest.raises(ValueError, match=r"cannot be used as the assistant \(draft model\)"):
        attention_model.generate(prompt, assistant_model=delta_net_model, **GREEDY)


@pytest.mark.parametrize("variant", ["additive-dv1", "paper-dv4", "cc-dv4"])
def test_static_cache_works_for_attention(variant, prompt):
    """generate builds per-layer-type masks for a static cache (config.layer_types); the model takes them."""
    model = delta_model(**CLIENT_VARIANTS[variant])
    scramble_delta_weights(model)
    expected = greedy_reference(model, prompt, **GREEDY)
    with torch.no_grad():
        expected.assert_matches(model.generate(prompt, cache_implementation="static", **GREEDY)[:, prompt.shape[1] :])


@pytest.mark.parametrize("variant", ["tc-dv1", "tc-ec-paper-dv4", "reference-tc-dv4"])
def test_static_cache_works_for_temporal_variants(variant, prompt):
    """TC / EC convolve over the last tokens: a static cache keeps their windows as fixed buffers written in place
    (DeltaStaticStateCache); greedy tokens equal the dynamic cache's, and the buffers keep their addresses."""
    model = delta_model(**CLIENT_VARIANTS[variant])
    scramble_delta_weights(model)
    with torch.no_grad():
        reference = greedy_reference(model, prompt, **GREEDY)
        expected = torch.cat([prompt, reference.tokens], dim=1)
        out = model.generate(prompt, cache_implementation="static", return_dict_in_generate=True, **GREEDY)
        reference.assert_matches(out.sequences[:, prompt.shape[1] :])
        assert isinstance(cache_of(out), ddl_hf.DeltaStaticStateCache)
        cache = ddl_hf.DeltaStaticStateCache(model.config, max_cache_len=16)
        model(prompt, **{CACHE_ARG: cache}, use_cache=True)
        size = model.config.delta_conv_size - 1
        assert cache.delta_windows and all(w.shape[1] == size for w in cache.delta_windows.values())
        addresses = {key: w.data_ptr() for key, w in cache.delta_windows.items()}
        model(expected[:, -1:], **{CACHE_ARG: cache}, use_cache=True)
        cache.reset()
        assert {key: w.data_ptr() for key, w in cache.delta_windows.items()} == addresses
        assert not any(w.any() for w in cache.delta_windows.values())
    with pytest.raises(ValueError, match="a static cache holds only the last K - 1 inputs"):
        cache.crop(-1)


def test_a_static_cache_decoding_step_of_a_tc_model_compiles_with_fullgraph(prompt):
    """transformers' compiled generation runs the decoding step fullgraph over a static cache: the TC windows too
    (the "aot_eager" backend checks the capture and the in-place window writes; same logits as eager)."""
    model = delta_model(**CLIENT_VARIANTS["reference-tc-dv4"])
    scramble_delta_weights(model)
    assert model._can_compile_fullgraph
    positions = torch.arange(prompt.shape[1] + 1)[None]
    logits = []
    for compiled in (False, True):
        cache = ddl_hf.DeltaStaticStateCache(model.config, max_cache_len=16)
        with torch.no_grad():
            model(prompt, **{CACHE_ARG: cache}, use_cache=True)  # the prefill allocates the buffers, eagerly
            torch._dynamo.reset()
            step = torch.compile(model, fullgraph=True, backend="aot_eager") if compiled else model
            for token in (5, 9):
                ids = torch.tensor([[token]])
                logits.append(step(ids, **{CACHE_ARG: cache}, use_cache=True, position_ids=positions[:, -1:]).logits)
                positions = positions + 1
        positions = positions - 2
    torch.testing.assert_close(torch.cat(logits[2:]), torch.cat(logits[:2]), rtol=0, atol=1e-5)


def test_static_and_config_built_caches_are_refused_for_delta_net(delta_net_model, prompt):
    with pytest.raises(ValueError, match="cache_implementation='static' is not supported with token_mixer='delta_net'"):
        delta_net_model.generate(prompt, cache_implementation="static", **GREEDY)
    config = delta_net_model.config
    for cache in (StaticCache(config=config, max_cache_len=16), DynamicCache(config=config)):
        with pytest.raises(TypeError, match=f"needs a DeltaNetCache, got {type(cache).__name__}"):
            delta_net_model.generate(prompt, **{CACHE_ARG: cache}, **GREEDY)
        with pytest.raises(TypeError, match="needs a DeltaNetCache"):
            delta_net_model(prompt, cache=cache, use_cache=True)


def test_delta_net_decoding_compiles_with_fullgraph(delta_net_model, prompt):
    """A decoding step with the cache compiles without graph break (the "eager" backend checks the capture; inductor
    was checked by hand, within 1.5e-7; the cache-free forward is exported in test_delta_net_clients). The model
    still says `_can_compile_fullgraph = False`, as transformers' Falcon-H1 does for its recurrent state: there is no
    static cache, so transformers' compiled generation cannot run. generate does not auto-compile it (DeltaNetCache
    is not `is_compileable`) and gives the eager tokens with a compile_config."""
    from transformers import CompileConfig

    assert not delta_net_model._can_compile_fullgraph
    torch._dynamo.reset()
    step = torch.compile(lambda ids, cache: delta_net_model(ids, cache=cache, use_cache=True).logits,
                         fullgraph=True, backend="eager")  # fmt: skip
    with torch.no_grad():
        compiled_cache = cache_of(delta_net_model(prompt, use_cache=True))
        eager_cache = cache_of(delta_net_model(prompt, use_cache=True))
        for token in (prompt[:, :1], prompt[:, 1:2]):
            eager = delta_net_model(token, cache=eager_cache, use_cache=True).logits
            assert (step(token, compiled_cache) - eager).abs().max() <= 1e-5
        config = CompileConfig(fullgraph=True)
        config._compile_all_devices = True  # let generate consider compiling on CPU
        expected = greedy_reference(delta_net_model, prompt, **GREEDY)
        expected.assert_matches(delta_net_model.generate(prompt, compile_config=config, **GREEDY)[:, prompt.shape[1] :])
