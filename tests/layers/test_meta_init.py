"""Initialisation from the meta device, as sharded loading and transformers' own `test_can_init_all_missing_weights`
do it: `from_pretrained(None, config=config, state_dict={})` builds every module on meta, moves it to the CPU and
initialises each weight with `_init_weights`. The reference is the model built directly from the same config."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.utils import logging as hf_logging

import ddl_hf
from tests.builders import CLIENT_VARIANTS, delta_config
from tests.builders import LLAMA_FAMILIES as FAMILIES
from tests.builders import LLAMA_TINY as TINY_LLAMA


def llama_config(family: str, **overrides) -> ddl_hf.DeltaLlamaConfig:
    """builders' tiny Llama-family model of `family` (its sliding windows, biases, QK-norm) as a DeltaLlamaConfig."""
    _, extra = FAMILIES[family]
    return ddl_hf.DeltaLlamaConfig(source_model_type=family, **TINY_LLAMA, **extra, **overrides)


CONFIGS = {
    **{
        f"gpt-{name}": (ddl_hf.DeltaGPTForCausalLM, lambda v=variant: delta_config(v))
        for name, variant in CLIENT_VARIANTS.items()
    },
    "gpt-mlp-gate-beta-1.5": (ddl_hf.DeltaGPTForCausalLM, lambda: delta_config(delta_gate="mlp", delta_beta_init=1.5)),
    "llama-qwen3-tc-dv4": (
        ddl_hf.DeltaLlamaForCausalLM,
        lambda: llama_config("qwen3", delta_value_channels=4, delta_state_read="temporal_conv"),
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_weight_is_initialised_from_the_meta_device_as_when_built(name):
    """Deterministic weights (beta_open, the gate, read vectors, convolutions, norms) equal the built model's bit for
    bit; random ones (a second build with another seed tells which) have its mean and spread. Nothing stays on meta."""
    model_class, make_config = CONFIGS[name]
    torch.manual_seed(0)
    built = dict(model_class(copy.deepcopy(make_config())).named_parameters())
    torch.manual_seed(1)
    rebuilt = dict(model_class(copy.deepcopy(make_config())).named_parameters())
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the load report lists every weight as missing, which is the point here
    try:
        from_meta = dict(
            model_class.from_pretrained(None, config=copy.deepcopy(make_config()), state_dict={}).named_parameters()
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    assert from_meta.keys() == built.keys()
    assert not [n for n, p in from_meta.items() if p.is_meta]
    for param_name, value in built.items():
        loaded = from_meta[param_name].detach()
        assert loaded.shape == value.shape, param_name
        if torch.equal(value, rebuilt[param_name]):
            assert torch.equal(loaded, value), param_name
        elif value.numel() < 8:  # random and too few to have a spread (v_proj's bias at d_v = 1): its scale
            largest = float(torch.cat([value.flatten(), rebuilt[param_name].flatten()]).detach().abs().max())
            assert 0 < float(loaded.abs().max()) <= 10 * largest, param_name
        else:  # random: a zero-mean draw of the built model's scale (not zeros, not the meta device's garbage)
            spread = float(torch.cat([value.flatten(), rebuilt[param_name].flatten()]).detach().std())
            assert abs(float(loaded.mean())) <= 4 * spread / value.numel() ** 0.5, param_name
            # a sample std of n draws is off by ~1/sqrt(2n): 6 of those, and never tighter than a factor of 2
            slack = 6 / (2 * value.numel()) ** 0.5
            assert min(0.5, max(0.25, 1 - slack)) <= float(loaded.std()) / spread <= max(2.0, 1 + slack), param_name
