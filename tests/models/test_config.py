"""The configs' field tables (every row rejects what it should and accepts what it allows) and DeltaLlamaConfig's
`use_cache`, against the family's own config."""

from __future__ import annotations

import math
import re

import pytest

from ddl_hf.configuration_delta_gpt import (
    DELTA_FIELD_RULES,
    TOKEN_MIXER_FIELD_RULES,
    DeltaGPTConfig,
    DeltaResidualConfigMixin,
    FieldRule,
)
from ddl_hf.configuration_delta_llama import DELTA_LLAMA_FAMILIES, SOURCE_MODEL_TYPE_RULE, DeltaLlamaConfig
from ddl_hf.conversion.llama import _delta_llama_config

#: Valid for every variant value of the rows, so that each row is the only check a value can fail: d_v = 4 (channel
#: convolution and EC allowed), attention (no DeltaNet head-size check).
GPT_BASE = dict(n_embd=32, n_head=4, n_layer=1, n_positions=16, vocab_size=97, delta_value_channels=4)
LLAMA_BASE = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, vocab_size=97, delta_value_channels=4)
CASES = [(DeltaGPTConfig, GPT_BASE, rule) for rule in (*DELTA_FIELD_RULES, *TOKEN_MIXER_FIELD_RULES)] + [
    (DeltaLlamaConfig, LLAMA_BASE, rule) for rule in (*DELTA_FIELD_RULES, SOURCE_MODEL_TYPE_RULE)
]


def allowed_values(rule: FieldRule) -> list:
    if rule.kind == "choice":
        values = list(rule.allowed)
    elif rule.kind == "bool":
        values = [True, False]
    elif rule.kind == "int":
        values = [rule.allowed, rule.allowed + 3]
    elif rule.kind == "positive":
        values = [1e-9, 3]
    else:
        low, high = rule.allowed
        values = [low, (low + high) / 2, high] if math.isfinite(low) and math.isfinite(high) else [-1.5, 0, 2.0]
    return values + [None] * rule.optional


def bad_values(rule: FieldRule) -> list:
    values = [None] * (not rule.optional) + [[1]]  # a list is no kind's value
    if rule.kind == "choice":
        values += ["not-a-choice", rule.allowed[-1].upper()]
    elif rule.kind == "bool":
        values += [1, 0, "yes"]
    elif rule.kind == "int":
        values += [rule.allowed - 1, float(rule.allowed + 1), True]
    else:
        low, high = rule.allowed or (0, math.inf)
        values += [v for v in (low - 0.5, high + 0.5) if math.isfinite(v)]
        values += [0] * (rule.kind == "positive") + [math.nan, math.inf, -math.inf, True, "1"]
    return values


def rule_id(case) -> str:
    return f"{case[0].__name__}.{case[2].field}"


@pytest.mark.parametrize(("config_class", "base", "rule"), CASES, ids=map(rule_id, CASES))
def test_each_field_rule_accepts_what_it_allows_and_rejects_the_rest(config_class, base, rule) -> None:
    for value in allowed_values(rule):
        assert getattr(config_class(**{**base, rule.field: value}), rule.field) == value
    for value in bad_values(rule):
        message = f"{config_class.__name__}.{rule.field}={value!r} is invalid: {rule.message()}."
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            config_class(**{**base, rule.field: value})


def test_the_tables_cover_every_field() -> None:
    assert sorted(rule.field for rule in DELTA_FIELD_RULES) == sorted(DeltaResidualConfigMixin.__dataclass_fields__)
    mixer_fields = ["token_mixer"] + [f for f in DeltaGPTConfig.__dataclass_fields__ if f.startswith("delta_net_")]
    assert sorted(rule.field for rule in TOKEN_MIXER_FIELD_RULES) == sorted(mixer_fields)


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        (FieldRule("f", "choice", ("a", "b")), "expected one of ('a', 'b')"),
        (FieldRule("f", "int", 2), "expected an integer >= 2"),
        (FieldRule("f", "number", (0.5, 2.0)), "expected a number in [0.5, 2.0]"),
        (FieldRule("f", "number", (-math.inf, math.inf)), "expected a finite number"),
        (FieldRule("f", "positive"), "expected a finite number > 0"),
        (FieldRule("f", "bool"), "expected True or False"),
        (FieldRule("f", "bool", expected="expected yes"), "expected yes"),
    ],
)
def test_a_rule_without_its_own_wording_says_what_its_kind_allows(rule: FieldRule, message: str) -> None:
    assert rule.message() == message


def use_cache_of(make) -> object:
    """The config's use_cache, or the type of the error that building it raised."""
    try:
        return make().use_cache
    except Exception as error:  # the family's strict-dataclass error is no ValueError
        return type(error)


@pytest.mark.parametrize("family", DELTA_LLAMA_FAMILIES)
@pytest.mark.parametrize("use_cache", ["unset", None, True, False])
def test_use_cache_is_the_family_configs(family: str, use_cache, tmp_path) -> None:
    """Default True, kept when given, None refused, as by LlamaConfig & co.; carried by to_dict, save / load, the
    family config that export writes and the config that conversion builds from the source's."""
    family_class = DELTA_LLAMA_FAMILIES[family]
    given = {} if use_cache == "unset" else {"use_cache": use_cache}
    expected = use_cache_of(lambda: family_class(**given))
    assert use_cache_of(lambda: DeltaLlamaConfig(source_model_type=family, **given)) == expected
    if not isinstance(expected, bool):
        return
    config = DeltaLlamaConfig(source_model_type=family, **given)
    assert config.to_dict()["use_cache"] is expected
    assert config.family_config().use_cache is expected
    assert DeltaLlamaConfig.from_dict(config.to_diff_dict()).use_cache is expected
    config.save_pretrained(tmp_path)
    again = DeltaLlamaConfig.from_pretrained(tmp_path)
    assert again.use_cache is expected and again.to_dict() == config.to_dict()
    assert _delta_llama_config(family_class(**given), {}).use_cache is expected
