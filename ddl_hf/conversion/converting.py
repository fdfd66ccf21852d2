"""GPT-2 in, DeltaGPT out, in memory: load and check the source, then map its state dict onto a DeltaGPT.

Everything here refuses rather than guesses: a conversion that claims to start from the source's function must not
silently initialise, drop or reshape a weight. Which parameters are new (the Delta ones) is asked of the model
(`delta_parameters()`), and which config fields are Delta is read off `DeltaGPTConfig` itself.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import socket
from collections.abc import Iterable, Iterator
from typing import Any
from urllib.parse import urlparse

import torch
from transformers import AutoConfig, GPT2Config, GPT2LMHeadModel, PreTrainedConfig, PreTrainedModel
from transformers.utils import logging as hf_logging

from ..configuration_delta_gpt import DeltaGPTConfig
from ..configuration_delta_llama import DELTA_LLAMA_FAMILIES
from ..modeling_delta_gpt import DeltaGPTForCausalLM
from .errors import ConversionError

logger = hf_logging.get_logger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Config keys that describe a saved checkpoint rather than the architecture: never carried across model types.
CHECKPOINT_KEYS = ("model_type", "architectures", "auto_map", "transformers_version", "_name_or_path")


def config_field_names() -> set[str]:
    """Every field a DeltaGPTConfig accepts (GPT-2's and the Delta ones)."""
    return {f.name for f in dataclasses.fields(DeltaGPTConfig)}


def delta_config_fields() -> list[str]:
    """The fields DeltaGPTConfig adds to GPT2Config (every `delta_*` field and `token_mixer`), in declaration order."""
    gpt2_fields = {f.name for f in dataclasses.fields(GPT2Config)}
    return [f.name for f in dataclasses.fields(DeltaGPTConfig) if f.name not in gpt2_fields]


def _check_gpt2_config(config, source_name: str) -> None:
    """Refuse configs DeltaGPT cannot reproduce, naming the flag and what to do instead."""
    model_type = getattr(config, "model_type", None)
    if model_type == DeltaGPTConfig.model_type:
        raise ConversionError(
            f"{source_name} is already a DeltaGPT (model_type 'delta_gpt'); load it with "
            "AutoModelForCausalLM.from_pretrained instead of converting it again."
        )
    if model_type in DELTA_LLAMA_FAMILIES:
        raise ConversionError(
            f"{source_name} is a {model_type} checkpoint; convert_gpt2 converts GPT-2 only. Convert it with "
            f"ddl_hf.convert_llama({source_name}), or write a verified Hub repository with "
            "ddl_hf.convert_checkpoint / `ddl-hf convert --source`, which pick the family from the config "
            "(docs/llama.md)."
        )
    if model_type != "gpt2":
        raise ConversionError(
            f"{source_name} is not a GPT-2 checkpoint: its config has model_type {model_type!r} "
            f"({type(config).__name__}). Only GPT-2 models (model_type 'gpt2': gpt2, gpt2-medium, gpt2-large, "
            "gpt2-xl, distilgpt2 and fine-tunes of them) can be converted."
        )
    if getattr(config, "add_cross_attention", False):
        raise ConversionError(
            f"{source_name} is a GPT-2 with cross-attention (add_cross_attention=True, the decoder of an "
            "encoder-decoder model). DeltaGPT is decoder-only; convert a decoder-only GPT-2 instead."
        )
    if getattr(config, "quantization_config", None):
        raise ConversionError(
            f"{source_name} is quantized ({type(config.quantization_config).__name__}); the Delta conversion needs "
            "the full-precision weights. Convert the original float checkpoint and quantize the result afterwards."
        )
    if getattr(config, "pruned_heads", None):
        raise ConversionError(
            f"{source_name} has pruned attention heads ({config.pruned_heads}), which DeltaGPT does not support. "
            "Convert the unpruned checkpoint."
        )


def _delta_config(gpt2_config: GPT2Config, overrides: dict) -> DeltaGPTConfig:
    valid = config_field_names()
    unknown = sorted(set(overrides) - valid)
    if unknown:
        raise ConversionError(
            f"Unknown DeltaGPTConfig field(s) {unknown}. Valid Delta fields: {', '.join(delta_config_fields())} "
            "(and any GPT-2 config field)."
        )
    fields = gpt2_config.to_dict()
    for key in CHECKPOINT_KEYS:
        fields.pop(key, None)
    fields = {key: value for key, value in fields.items() if key in valid}
    try:
        config = DeltaGPTConfig(**{**fields, **overrides})
    except ValueError as error:
        raise ConversionError(f"Invalid DeltaGPT setting: {error}") from error
    if config.token_mixer != "attention":
        raise ConversionError(
            f"token_mixer={config.token_mixer!r} replaces GPT-2's attention by a layer a GPT-2 checkpoint has no "
            "weights for, so the converted model could not start from the source's function. Convert with the "
            "default token_mixer='attention', or train a token_mixer='delta_net' model from a DeltaGPTConfig."
        )
    config._attn_implementation = gpt2_config._attn_implementation
    return config


def _resolve_dtype(dtype: str | torch.dtype | None) -> str | torch.dtype:
    if dtype is None or dtype == "auto" or isinstance(dtype, torch.dtype):
        return "auto" if dtype is None else dtype
    if dtype not in DTYPES:
        raise ConversionError(f"Unsupported dtype {dtype!r}: use one of auto, {', '.join(DTYPES)}.")
    return DTYPES[dtype]


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' load report: the Delta parameters are *expected* to be missing from GPT-2."""
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _describe_mismatch(entry) -> str:
    """transformers reports (name, shape in the checkpoint, shape the config asks for)."""
    if isinstance(entry, tuple) and len(entry) == 3:
        name, found, expected = entry
        return f"{name} {list(found)} in the checkpoint, {list(expected)} for config.json"
    return str(entry)


HUB_PROBE_TIMEOUT_S = 2.0


def materialize_meta_parameters(model: torch.nn.Module) -> torch.nn.Module:
    """Give storage and their initialisation to parameters left on the meta device; returns the model.

    Why: under an FSDP launch with cpu-RAM-efficient loading, transformers leaves what the state dict lacks (here
    every Delta parameter) on the meta device on all ranks but the first, for accelerate to broadcast from it. But
    accelerate (1.15) maps an optimizer's parameters to the sharded ones by data pointer, 0 for every meta tensor, so
    the Delta parameters of those ranks all landed on one optimizer slot and trained wrongly, without an error.
    """
    real = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    modules = [m for m in model.modules() if any(p.device.type == "meta" for p in m.parameters(recurse=False))]
    for module in modules:
        module.to_empty(device=real, recurse=False)
    for module in reversed(modules):  # children first: a parent's init of its children's parameters wins
        model._init_weights(module)
    return model


def loading_problems(info: dict[str, Any], may_lack: Iterable[str] = ()) -> list[str]:
    """What transformers' loading report (`output_loading_info=True`) says did not fit, a phrase per kind: the missing
    weights (but those in `may_lack`), the unexpected ones, and the misshaped ones with both shapes."""
    missing = sorted(set(info["missing_keys"]) - set(may_lack))
    shapes = [_describe_mismatch(entry) for entry in sorted(info["mismatched_keys"], key=str)]
    found = {"missing weights": missing, "unexpected weights": sorted(info["unexpected_keys"])}
    found["weights with the wrong shape"] = shapes
    return [f"{kind}: {', '.join(names)}" for kind, names in found.items() if names]


def source_weights(
    source: PreTrainedModel, dtype: str | torch.dtype | None, share_weights: bool
) -> tuple[str | torch.dtype, dict[str, torch.Tensor]]:
    """A source model's dtype (its own, unless `dtype` names another) and weights (cloned unless `share_weights`)."""
    dtype = source.dtype if dtype in (None, "auto") else _resolve_dtype(dtype)
    state_dict = source.state_dict()
    if not share_weights:
        state_dict = {name: tensor.detach().clone() for name, tensor in state_dict.items()}
    return dtype, state_dict


def from_state_dict(
    model_class: type[PreTrainedModel],
    config: PreTrainedConfig,
    state_dict: dict[str, torch.Tensor],
    dtype: str | torch.dtype,
    like: PreTrainedModel,
) -> tuple[PreTrainedModel, list[str]]:
    """`model_class(config)` holding `state_dict`, with `like`'s generation config and train mode, and what did not
    fit (`loading_problems`; [] when everything did).

    Built as `from_pretrained` builds a model from a state dict: on the meta device, initialising only what the state
    dict lacks, so this is fast even for gpt2-xl. A Delta model's Delta parameters are the only keys it may lack.
    """
    with _quiet_transformers():
        model, info = model_class.from_pretrained(
            None,
            config=config,
            state_dict=state_dict,
            dtype=dtype,
            output_loading_info=True,
            ignore_mismatched_sizes=True,  # a misshaped weight: named below, not a bare error
        )
    problems = loading_problems(info, may_lack=model.delta_parameters() if hasattr(model, "delta_parameters") else ())
    model.generation_config = copy.deepcopy(like.generation_config)
    return materialize_meta_parameters(model).train(like.training), problems


def looks_like_path(name: str) -> bool:
    """A filesystem path rather than a Hub id ("gpt2", "org/name"), so a missing one is "no such directory"."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name or os.path.exists(name)


def hub_reachable(timeout: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether the Hub can be reached: False at once under HF_HUB_OFFLINE, else one short TCP connect.

    Without this an offline `from_pretrained("gpt2")` spends ~30 s in retries before failing; with it an offline
    user gets the error in seconds, and an online user pays one connect. Behind a proxy the probe is skipped.
    """
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def hub_kwargs(name: str) -> dict:
    """`from_pretrained` kwargs for `name`: `local_files_only=True` for a Hub id while the Hub is unreachable."""
    return {} if os.path.isdir(name) or hub_reachable() else {"local_files_only": True}


#: What `read_source_config`'s messages call a source of each kind, and the class that writes such a directory.
_SOURCE_KINDS = {
    "GPT-2": ("a Hub id such as 'gpt2'", "GPT2LMHeadModel.save_pretrained"),
    "Llama-family": ("a Hub id such as 'Qwen/Qwen2.5-0.5B'", "LlamaForCausalLM.save_pretrained (Mistral, Qwen2, ...)"),
    "GPT-2 or Llama-family": ("a Hub id such as 'gpt2' or 'Qwen/Qwen2.5-0.5B'", "save_pretrained"),
}


def read_source_config(source: str | os.PathLike, kind: str = "GPT-2") -> PreTrainedConfig:
    """The config of a Hub id or directory, or a ConversionError naming the fix (no such directory, Hub unreachable
    and not cached, no readable config.json). `kind` ("GPT-2", "Llama-family", "GPT-2 or Llama-family") is what the
    messages ask for. The one place every loader and `convert_checkpoint` read a source's config."""
    name = os.fspath(source)
    example_id, writer = _SOURCE_KINDS[kind]
    if not os.path.isdir(name) and looks_like_path(name):
        raise ConversionError(
            f"No such directory: {name!r}. Pass an existing local {kind} directory (holding config.json and the "
            f"weights) or {example_id}."
        )
    hub = hub_kwargs(name)
    try:
        return AutoConfig.from_pretrained(name, **hub)
    except (OSError, ValueError) as error:
        if hub.get("local_files_only"):
            raise ConversionError(
                f"Cannot load {name!r}: the Hugging Face Hub is unreachable (no network, or HF_HUB_OFFLINE=1) and "
                f"{name!r} is not in the local Hugging Face cache. Pass a local {kind} directory instead (for "
                f"example one written by {writer}), or run once online to fill the cache."
            ) from error
        raise ConversionError(
            f"Cannot read a model config from {name!r}: {error}\nPass {example_id} (this needs network "
            "access or a copy in the Hugging Face cache) or a local directory containing config.json."
        ) from error


def load_exactly(
    model_class: type[PreTrainedModel], name: str, dtype: str | torch.dtype | None, what: str
) -> PreTrainedModel:
    """`model_class.from_pretrained(name)` in eval mode, refusing (ConversionError) a checkpoint whose weights do not
    match its config exactly. `what` names the model in the message ("a GPT2LMHeadModel").

    `from_pretrained` on its own would silently initialise missing weights and drop unexpected ones; a conversion
    that claims equivalence must instead refuse and list them.
    """
    dtype = _resolve_dtype(dtype)  # an unknown name is its own error, not a failed load
    try:
        with _quiet_transformers():
            # ignore_mismatched_sizes: report wrongly shaped weights by name below instead of a bare error.
            model, info = model_class.from_pretrained(
                name,
                dtype=dtype,
                output_loading_info=True,
                ignore_mismatched_sizes=True,
                **hub_kwargs(name),
            )
    except (OSError, RuntimeError, ValueError) as error:
        raise ConversionError(
            f"Cannot load the weights of {what} from {name!r}: {error}\n"
            "Check that the directory holds model.safetensors (or pytorch_model.bin) matching its config.json."
        ) from error
    problems = loading_problems(info)
    if problems:
        raise ConversionError(
            f"{name!r} does not hold exactly the weights of {what} for its config: "
            + "; ".join(problems)
            + ". Converting it would not start from the source's function. Re-save the source with "
            "save_pretrained (or fix config.json so it matches the weights)."
        )
    return model.eval()


def load_gpt2(
    source: str | os.PathLike, dtype: str | torch.dtype | None = "auto", config: PreTrainedConfig | None = None
) -> GPT2LMHeadModel:
    """Load a GPT-2 LM from a Hub id or a directory, refusing anything that is not exactly GPT-2 (`load_exactly`)."""
    name = os.fspath(source)
    config = read_source_config(name, "GPT-2") if config is None else config  # given: read once by the caller
    _check_gpt2_config(config, repr(name))
    model = load_exactly(GPT2LMHeadModel, name, dtype, "a GPT2LMHeadModel")
    logger.info(f"Loaded GPT-2 {name!r} ({model.config.n_layer} layers, dtype {model.dtype}).")
    return model


def convert_gpt2(source: str | os.PathLike | GPT2LMHeadModel, **config_overrides) -> DeltaGPTForCausalLM:
    """Build a DeltaGPTForCausalLM carrying the weights of a GPT-2 language model.

    Args:
        source: a Hub id (e.g. "gpt2"), a local directory, or an in-memory `GPT2LMHeadModel`.
        **config_overrides: DeltaGPTConfig fields, e.g. `delta_mode="paper"`, `delta_value_channels=4`;
            `dtype="bfloat16"` loads a Hub id or directory in that precision.

    Every GPT-2 weight is copied under its own name (an in-memory source is cloned, never shared); only the Delta
    parameters are new, initialised so that beta == `delta_beta_init` exactly (default 0.0: in the additive mode the
    result computes the source's function). Raises `ConversionError` for anything that is not exactly GPT-2.
    """
    return _convert(source, config_overrides, share_weights=False)


def _convert(source, config_overrides: dict, share_weights: bool) -> DeltaGPTForCausalLM:
    """convert_gpt2; `share_weights=True` lets the result use the source's tensors (saves a copy of the weights
    when the caller owns the source and will not train either model, as `convert_checkpoint` does)."""
    overrides = dict(config_overrides)
    dtype = overrides.pop("dtype", None)
    if isinstance(source, GPT2LMHeadModel):
        _check_gpt2_config(source.config, f"The {type(source).__name__} passed in")
        gpt2 = source
    elif isinstance(source, (str, os.PathLike)):
        gpt2 = load_gpt2(source, dtype or "auto")
        dtype, share_weights = None, True  # loaded in that dtype for this conversion alone
    else:
        if hasattr(source, "config"):
            _check_gpt2_config(source.config, f"The {type(source).__name__} passed in")
        raise ConversionError(
            f"source must be a Hub id, a directory or a GPT2LMHeadModel, not a {type(source).__name__}. "
            "Load the checkpoint with GPT2LMHeadModel.from_pretrained (or pass its path) instead."
        )
    config = _delta_config(gpt2.config, overrides)
    dtype, state_dict = source_weights(gpt2, dtype, share_weights)
    model, problems = from_state_dict(DeltaGPTForCausalLM, config, state_dict, dtype, like=gpt2)
    if problems:
        raise ConversionError(f"GPT-2 weights do not match the DeltaGPT layout: {'; '.join(problems)}.")
    return model


__all__ = ["DTYPES", "convert_gpt2", "load_gpt2", "read_source_config"]
