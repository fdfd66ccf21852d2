"""Llama-family checkpoints (Llama, Mistral, Qwen2, Qwen3) in, DeltaLlama out, in memory; and the exact way back.

Same rules as the GPT-2 path (`converting`, `exporting`): refuse rather than guess. Every source weight is copied
under its own name (DeltaLlama keeps the family's module names); only the Delta parameters are new, initialised
so that beta == `delta_beta_init` exactly (default 0: the additive model computes the source's function).
"""

from __future__ import annotations

import dataclasses
import os

import torch
from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoModelForCausalLM, PreTrainedConfig, PreTrainedModel

from ..configuration_delta_llama import DELTA_LLAMA_FAMILIES, DeltaLlamaConfig
from ..modeling_delta_llama import DeltaLlamaForCausalLM
from .converting import (
    CHECKPOINT_KEYS,
    from_state_dict,
    load_exactly,
    read_source_config,
    source_weights,
)
from .errors import ConversionError
from .exporting import check_exportable


def _check_family_config(config: PreTrainedConfig, source_name: str) -> None:
    """Refuse what DeltaLlama cannot reproduce, naming the problem and what to do instead."""
    model_type = getattr(config, "model_type", None)
    if model_type == DeltaLlamaConfig.model_type:
        raise ConversionError(
            f"{source_name} is already a DeltaLlama (model_type 'delta_llama'); load it with "
            "AutoModelForCausalLM.from_pretrained instead of converting it again."
        )
    if model_type not in DELTA_LLAMA_FAMILIES:
        raise ConversionError(
            f"{source_name} has model_type {model_type!r}, which convert_llama does not support. Supported "
            f"families: {', '.join(DELTA_LLAMA_FAMILIES)} (convert GPT-2 checkpoints with convert_gpt2)."
        )
    if getattr(config, "quantization_config", None):
        raise ConversionError(
            f"{source_name} is quantized; the Delta conversion needs the full-precision weights. Convert the "
            "original float checkpoint and quantize the result afterwards."
        )


def _delta_llama_config(source_config: PreTrainedConfig, overrides: dict) -> DeltaLlamaConfig:
    """The source's config with the Delta fields; unknown override names are refused, not silently carried."""
    family_class = DELTA_LLAMA_FAMILIES[source_config.model_type]
    valid = {f.name for f in dataclasses.fields(family_class)} | {f.name for f in dataclasses.fields(DeltaLlamaConfig)}
    if overrides.get("token_mixer") == DeltaLlamaConfig.token_mixer:  # the only mixer: nothing to set
        overrides = {k: v for k, v in overrides.items() if k != "token_mixer"}
    unknown = sorted(set(overrides) - valid)
    delta_gpt_only = [name for name in unknown if name == "token_mixer" or name.startswith("delta_net_")]
    if delta_gpt_only:
        raise ConversionError(
            f"DeltaLlama has no DeltaNet token mixer, so {', '.join(f'{n}={overrides[n]!r}' for n in delta_gpt_only)} "
            f"cannot be set: every layer keeps the {family_class.__name__.removesuffix('Config')} attention the "
            "checkpoint has weights for. Drop these settings, or train a token_mixer='delta_net' DeltaGPT from a "
            "DeltaGPTConfig."
        )
    if unknown:
        delta_fields = [name for name in DeltaLlamaConfig.__dataclass_fields__ if name.startswith("delta_")]
        raise ConversionError(
            f"Unknown DeltaLlamaConfig field(s) {unknown}. Valid Delta fields: {', '.join(delta_fields)} (and any "
            f"{family_class.__name__} field)."
        )
    fields = {k: v for k, v in source_config.to_dict().items() if k not in CHECKPOINT_KEYS}
    try:
        config = DeltaLlamaConfig(source_model_type=source_config.model_type, **{**fields, **overrides})
    except ValueError as error:
        raise ConversionError(f"Invalid DeltaLlama setting: {error}") from error
    config._attn_implementation = source_config._attn_implementation
    return config


def load_llama_family(
    source: str | os.PathLike, dtype: str | torch.dtype | None = "auto", config: PreTrainedConfig | None = None
) -> PreTrainedModel:
    """Load a Llama / Mistral / Qwen2 / Qwen3 causal LM from a Hub id or directory, refusing anything else and any
    checkpoint whose weights do not match its config exactly (missing, unexpected or misshaped weights)."""
    name = os.fspath(source)
    config = read_source_config(name, "Llama-family") if config is None else config  # given: read by the caller
    _check_family_config(config, repr(name))
    return load_exactly(AutoModelForCausalLM, name, dtype, f"a {config.model_type} causal LM")


def convert_llama(source: str | os.PathLike | PreTrainedModel, **config_overrides) -> DeltaLlamaForCausalLM:
    """Build a DeltaLlamaForCausalLM carrying the weights of a Llama, Mistral, Qwen2 or Qwen3 causal LM.

    Args:
        source: a Hub id, a local directory, or an in-memory `LlamaForCausalLM` (`MistralForCausalLM`, ...).
        **config_overrides: DeltaLlamaConfig fields, e.g. `delta_mode="paper"`, `delta_value_channels=4`;
            `dtype="bfloat16"` loads a Hub id or directory in that precision.

    Raises `ConversionError` for an unsupported family, unknown or invalid fields, or mismatched weights.
    """
    return _convert_llama(source, config_overrides, share_weights=False)


def _convert_llama(source, config_overrides: dict, share_weights: bool) -> DeltaLlamaForCausalLM:
    """convert_llama; `share_weights=True` lets the result use an in-memory source's tensors (saves a copy of the
    weights when the caller owns the source and will not train either model, as `convert_checkpoint` does)."""
    overrides = dict(config_overrides)
    dtype = overrides.pop("dtype", None)
    if isinstance(source, PreTrainedModel):
        _check_family_config(source.config, f"The {type(source).__name__} passed in")
        model_in = source
    elif isinstance(source, (str, os.PathLike)):
        model_in = load_llama_family(source, dtype or "auto")
        dtype, share_weights = None, True  # loaded in that dtype for this conversion alone
    else:
        raise ConversionError(
            f"source must be a Hub id, a directory or a Llama-family causal LM, not a {type(source).__name__}."
        )
    config = _delta_llama_config(model_in.config, overrides)
    dtype, state_dict = source_weights(model_in, dtype, share_weights)
    model, problems = from_state_dict(DeltaLlamaForCausalLM, config, state_dict, dtype, like=model_in)
    if problems:
        raise ConversionError(
            f"{config.source_model_type} weights do not match the DeltaLlama layout: {'; '.join(problems)}."
        )
    return model


def export_to_llama(model: DeltaLlamaForCausalLM) -> PreTrainedModel:
    """Return the source family's causal LM (`LlamaForCausalLM`, ...) computing exactly `model`'s function, or
    refuse (ValueError) unless the model is additive with every gate closed (see `check_exportable`)."""
    if getattr(model.config, "model_type", None) != DeltaLlamaConfig.model_type or not hasattr(model, "lm_head"):
        raise ValueError(f"export_to_llama needs a DeltaLlamaForCausalLM, got {type(model).__name__}.")
    family_config = model.config.family_config()
    check_exportable(model, type(family_config).__name__.removesuffix("Config"))
    delta_parameters = set(model.delta_parameters())
    state_dict = {n: t.detach().clone() for n, t in model.state_dict().items() if n not in delta_parameters}
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(family_config)]
    exported, problems = from_state_dict(model_class, family_config, state_dict, model.dtype, like=model)
    if problems:  # a DeltaLlama layout bug
        raise ValueError(f"DeltaLlama weights do not map onto {model_class.__name__}: {'; '.join(problems)}.")
    return exported


__all__ = ["convert_llama", "export_to_llama", "load_llama_family"]
