"""Contracts that transformers' own models keep on the installed release, checked side by side with GPT2LMHeadModel:
the old cache argument's name warns as GPT-2's does (or, before transformers 5.24, is the installed name and does
not), and chosen-layer hidden states come back in GPT-2's layout at every number of value channels."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from ddl_hf.delta_compat import CACHE_ARG, LEGACY_CACHE_ARG
from tests.builders import CLIENT_VARIANTS, build_source, delta_model, gpt2_model, to_delta


def caught(model, **kwargs) -> list[str]:
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        cache = getattr(model(ids, use_cache=True), CACHE_ARG)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            model(torch.tensor([[4]]), **{LEGACY_CACHE_ARG: cache}, use_cache=True, **kwargs)
    name = type(model).__name__  # the message names the model's class
    return sorted(
        {
            f"{w.category.__name__}: {w.message}".replace(name, "MODEL")
            for w in seen
            if "past_key_values" in str(w.message)
        }
    )


@pytest.mark.compat
@pytest.mark.parametrize("variant", [{}, {"delta_value_channels": 4, "delta_state_read": "temporal_conv"}])
def test_the_old_cache_name_warns_exactly_as_gpt2s(variant):
    expected = caught(gpt2_model())
    assert caught(delta_model(**variant)) == expected
    assert bool(expected) == (CACHE_ARG == "cache")  # a deprecation only where the name changed


@pytest.mark.parametrize("d_v", [1, 4])
@pytest.mark.parametrize("chosen", [[0, -1], [1], 2], ids=str)
def test_chosen_layer_hidden_states_have_gpt2s_layout(d_v, chosen):
    gpt2, delta, ids = gpt2_model(), delta_model(delta_value_channels=d_v), torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        reference = gpt2(ids, output_hidden_states=chosen).hidden_states
        full = delta(ids, output_hidden_states=True).hidden_states
        got = delta(ids, output_hidden_states=chosen).hidden_states
    assert [h is None for h in got] == [h is None for h in reference]  # the same positions chosen, the same length
    for entry, whole in zip(got, full):
        assert entry is None or torch.equal(entry, whole)
    assert all(entry is None or entry.shape == (1, 4, delta.config.hidden_size) for entry in got)


#: Entries kept out of quantization only: they end at a module name (`$`), so no state-dict or parameter name matches.
QUANTIZATION_ONLY = {r".+\.attn\.b_proj$"}


def keep_in_fp32_problems(model: torch.nn.Module) -> list[str]:
    """transformers' `test_keep_in_fp32_modules_exist`, as it reads (test_modeling_common.py): every entry matches a
    state-dict name at module boundaries; a quantization-only entry must name one of the model's modules instead."""
    names = set(model.state_dict())
    modules = [name for name, _ in model.named_modules()]
    problems = []
    for entry in model._keep_in_fp32_modules:
        if entry in QUANTIZATION_ONLY:
            found = any(re.fullmatch(rf"(?:.*\.)?(?:{entry})", name) for name in modules)
        else:
            found = any(re.search(rf"(?:^|\.){entry}(?:\.|$)", name) for name in names)
        if not found:
            problems.append(entry)
    return problems


LLAMA_VARIANTS = {
    "llama-dv1": {},
    "llama-dv4-tc-ec": dict(delta_value_channels=4, delta_state_read="temporal_conv", delta_embed_expand="conv"),
    "llama-dv4-cc": dict(delta_value_channels=4, delta_state_read="channel_conv"),
}


@pytest.mark.parametrize("name", [*CLIENT_VARIANTS, *LLAMA_VARIANTS])
def test_keep_in_fp32_modules_names_only_modules_the_model_has(name):
    if name in LLAMA_VARIANTS:
        model = to_delta(build_source("llama"), **LLAMA_VARIANTS[name])
    else:
        model = delta_model(**CLIENT_VARIANTS[name])
    assert keep_in_fp32_problems(model) == []
    # and every module the class may keep, that this model has, is still declared
    has = {
        entry
        for entry in type(model)._keep_in_fp32_modules
        if any(re.fullmatch(rf"(?:.*\.)?(?:{entry})", n) for n, _ in model.named_modules())
    }
    assert set(model._keep_in_fp32_modules) == has
    assert r".+\.(?:attn|mlp)_(?:delta|read)" in has
    assert ("embed_expand" in has) == (model.config.delta_embed_expand == "conv")
    assert (r".+\.attn\.b_proj$" in has) == (getattr(model.config, "token_mixer", "attention") == "delta_net")
