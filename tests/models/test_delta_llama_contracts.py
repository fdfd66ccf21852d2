"""DeltaLlama keeps the contracts its family's own model keeps, checked beside it (transformers' LlamaForCausalLM,
MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM as the reference): the cache comes back exactly when the
family's model returns one, and the capability flags that transformers and its tests read say what the loaded
variant supports."""

from __future__ import annotations

import pytest
import torch

from ddl_hf.delta_compat import CACHE_ARG
from tests.builders import LLAMA_FAMILIES as FAMILIES
from tests.builders import build_source, delta_model, random_ids, to_delta


def returned_cache(model, use_cache) -> bool:
    kwargs = {} if use_cache == "unset" else {"use_cache": use_cache}
    with torch.no_grad():
        return getattr(model(random_ids(1, 5), **kwargs), CACHE_ARG) is not None


@pytest.mark.parametrize("config_value", ["unset", True, False], ids=lambda v: f"config-{v}")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_cache_comes_back_exactly_when_the_familys_model_returns_one(family, config_value):
    overrides = {} if config_value == "unset" else {"use_cache": config_value}
    source = build_source(family, **overrides)
    model = to_delta(source)
    assert model.config.use_cache == source.config.use_cache
    for use_cache in ("unset", None, True, False):
        assert returned_cache(model, use_cache) == returned_cache(source, use_cache), (use_cache, config_value)


@pytest.mark.parametrize(
    "variant, compilable",
    [
        ({}, True),
        ({"delta_value_channels": 4}, True),
        ({"delta_value_channels": 4, "delta_state_read": "channel_conv"}, True),
        ({"delta_state_read": "temporal_conv"}, True),
        ({"delta_value_channels": 4, "delta_embed_expand": "conv"}, True),
        ({"token_mixer": "delta_net"}, False),
    ],
    ids=["dv1", "dv4", "cc", "tc", "ec", "delta_net"],
)
def test_the_compile_flag_says_what_the_variant_supports(variant, compilable):
    """`_can_compile_fullgraph` is what transformers' compiled generation with a static cache asks of a model; the
    DeltaNet variant has no static cache, and says so up front (the class keeps the flag True); the windowed variants
    have one (DeltaStaticStateCache)."""
    model = delta_model(**variant)
    assert model._can_compile_fullgraph is compilable
    assert type(model)._can_compile_fullgraph is True
    if not compilable:  # the refusal stays as the last line of defence
        with pytest.raises(ValueError, match="cache_implementation"):
            model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=1, cache_implementation="static", pad_token_id=0)


@pytest.mark.parametrize("read", ["linear", "temporal_conv"])
def test_delta_llama_flags_follow_the_variant(read):
    model = to_delta(build_source("llama"), delta_value_channels=4, delta_state_read=read)
    assert model._can_compile_fullgraph
