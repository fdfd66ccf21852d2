"""Which conversion a source takes: GPT-2 -> DeltaGPT, or Llama / Mistral / Qwen2 / Qwen3 -> DeltaLlama.

`convert_checkpoint` (and through it `ddl-hf convert`) reads the source's config and asks `conversion_path` how to
load, check and convert it, which Delta class reloads the written files, and how the report and the model card name
things. Everything else in the job (atomic writing, tokenizer, verification, card) is one code path for every family.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from transformers import PreTrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ..configuration_delta_gpt import DeltaGPTConfig
from ..configuration_delta_llama import DELTA_LLAMA_FAMILIES, DeltaLlamaConfig
from ..modeling_delta_gpt import DeltaGPTForCausalLM
from ..modeling_delta_llama import DeltaLlamaForCausalLM
from .converting import _check_gpt2_config, _convert, load_gpt2, read_source_config
from .errors import ConversionError
from .llama import _check_family_config, _convert_llama, load_llama_family

#: How the report, the model card and the messages name each source family (its `model_type`).
FAMILY_NAMES = {"gpt2": "GPT-2", "llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}


@dataclass(frozen=True)
class ConversionPath:
    """One kind of conversion: the source families it takes and what `convert_checkpoint` calls for them."""

    delta_name: str  # "DeltaGPT"
    delta_model_type: str  # "delta_gpt"
    delta_class: type[PreTrainedModel]  # reloads the written files
    load: Callable  # (Hub id or directory, dtype, its config) -> the checked source causal LM
    check: Callable  # (config, name shown in messages) -> None, or ConversionError naming the fix
    convert: Callable  # (source causal LM, config overrides, share_weights) -> the Delta causal LM
    export: str  # the function of `ddl_hf` that goes back while every gate is closed
    tag: str  # the model card's tag for the Delta model


GPT2_PATH = ConversionPath(
    delta_name="DeltaGPT",
    delta_model_type=DeltaGPTConfig.model_type,
    delta_class=DeltaGPTForCausalLM,
    load=load_gpt2,
    check=_check_gpt2_config,
    convert=_convert,
    export="export_to_gpt2",
    tag="delta-gpt",
)
LLAMA_PATH = ConversionPath(
    delta_name="DeltaLlama",
    delta_model_type=DeltaLlamaConfig.model_type,
    delta_class=DeltaLlamaForCausalLM,
    load=load_llama_family,
    check=_check_family_config,
    convert=_convert_llama,
    export="export_to_llama",
    tag="delta-llama",
)
#: Source model_type -> its path. A Delta model_type maps to its own path, whose check refuses it by name.
PATHS: dict[str, ConversionPath] = {
    "gpt2": GPT2_PATH,
    GPT2_PATH.delta_model_type: GPT2_PATH,
    **dict.fromkeys(DELTA_LLAMA_FAMILIES, LLAMA_PATH),
    LLAMA_PATH.delta_model_type: LLAMA_PATH,
}


def conversion_path(config: PreTrainedConfig, source_name: str) -> ConversionPath:
    """The path for a source (or Delta) config, or a ConversionError listing the model types that convert."""
    model_type = getattr(config, "model_type", None)
    if model_type not in PATHS:
        raise ConversionError(
            f"{source_name} is not a GPT-2 checkpoint or a Llama-family one: its config has model_type "
            f"{model_type!r} ({type(config).__name__}). convert_checkpoint and `ddl-hf convert` take model_type "
            "'gpt2' (gpt2, gpt2-medium, gpt2-large, gpt2-xl, distilgpt2 and fine-tunes of them) and "
            f"{', '.join(repr(t) for t in DELTA_LLAMA_FAMILIES)} (Llama, Mistral, Qwen2, Qwen3 and fine-tunes)."
        )
    return PATHS[model_type]


@dataclass(frozen=True)
class ResolvedSource:
    """A conversion source resolved once per run: what the rest of the run (the recorded command, loading, the
    model card) takes instead of reading the source's config again, which for a Hub id includes a connectivity
    probe each time."""

    source: str | os.PathLike | PreTrainedModel  # a Hub id or directory, or an in-memory causal LM
    name: str | None  # the Hub id or directory, None for an in-memory model
    config: PreTrainedConfig
    path: ConversionPath


def resolve_source(source: str | os.PathLike | PreTrainedModel | ResolvedSource) -> ResolvedSource:
    """Read the source's config (once) and find its conversion path, or a ConversionError naming the problem."""
    if isinstance(source, ResolvedSource):
        return source
    if isinstance(source, (str, os.PathLike)):
        name = os.fspath(source)
        config = read_source_config(name, "GPT-2 or Llama-family")
        return ResolvedSource(source, name, config, conversion_path(config, repr(name)))
    if isinstance(getattr(source, "config", None), PreTrainedConfig):
        return ResolvedSource(
            source, None, source.config, conversion_path(source.config, f"The {type(source).__name__} passed in")
        )
    raise ConversionError(
        f"source must be a Hub id, a directory or a causal LM of a supported family (GPT2LMHeadModel, "
        f"LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM), not a {type(source).__name__}."
    )


def source_model_type(config: PreTrainedConfig) -> str:
    """The source family's model_type of a source config ("qwen2") or of a Delta config converted from one."""
    model_type = getattr(config, "model_type", None)
    if model_type == DeltaGPTConfig.model_type:
        return "gpt2"
    if model_type == DeltaLlamaConfig.model_type:
        return config.source_model_type
    return model_type


def family_name(config: PreTrainedConfig) -> str:
    """ "GPT-2", "Llama", "Mistral", "Qwen2", "Qwen3": the source family of a source or Delta config."""
    model_type = source_model_type(config)
    return FAMILY_NAMES.get(model_type, str(model_type))


def source_class_name(config: PreTrainedConfig) -> str:
    """The source family's causal LM class ("GPT2LMHeadModel", "Qwen2ForCausalLM"): what the export returns."""
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[source_model_type(config)]


__all__ = [
    "FAMILY_NAMES",
    "ConversionPath",
    "ResolvedSource",
    "conversion_path",
    "family_name",
    "resolve_source",
    "source_class_name",
    "source_model_type",
]
