"""Where DeltaGPT's Hub files meet what differs between transformers and torch releases: the one such place.

The Hub files (`modeling_delta_*.py`, `configuration_delta_*.py`, `delta_ops.py`) run under whatever transformers
and torch the *user* has installed, so pinning the package cannot protect them. This file absorbs the differences:

- the supported range: below `MINIMUM_TRANSFORMERS` / `MINIMUM_TORCH`, importing any Hub file raises one ImportError
  that names the installed version, the minimum and the upgrade command (not a traceback from inside transformers);
- the cache argument's name: transformers 5.24 renamed `past_key_values` to `cache` in every forward, mask function
  and model output. `CACHE_ARG` is the installed name, `cache_argument` passes a cache under it, and `takes_cache`
  lets our forwards take either name;
- transformers' internal model-code utilities and override points, imported or checked here, so that a release that
  moves one fails at import with a message instead of changing behaviour; helpers that older releases lack
  (`slice_logits_to_keep`, before 5.21) have their older releases' equivalent here;
- torch internals that no public API replaces (the module-hook registries, `scan`), each probed here: where one has
  moved, the feature that needs it is switched off (with a warning) or refuses, never silently wrong.

Hub custom-code file: it imports only torch and transformers.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import warnings
from collections.abc import Callable

import torch
import transformers
from torch import nn

#: The oldest releases the whole test suite passes on (README, "Supported versions"); below them, one clear error.
MINIMUM_TRANSFORMERS = "5.16.0"
MINIMUM_TORCH = "2.7.0"  # torch.compiler.is_exporting, which the DeltaNet rule asks, is new in 2.7


def release(version: str) -> tuple[int, int, int]:
    """`"5.25.0.dev0"`, `"2.13.0+cpu"`, `"5.1"` -> `(5, 25, 0)`, `(2, 13, 0)`, `(5, 1, 0)`."""
    match = re.match(r"\d+(?:\.\d+)*", str(version))
    numbers = [int(n) for n in match.group().split(".")] if match else [0]
    return tuple([*numbers, 0, 0][:3])


def check_installed_versions() -> None:
    """One ImportError, naming the installed version, the minimum and the fix, below the supported range."""
    for package, installed, minimum in (
        ("transformers", transformers.__version__, MINIMUM_TRANSFORMERS),
        ("torch", torch.__version__, MINIMUM_TORCH),
    ):
        if release(installed) < release(minimum):
            raise ImportError(
                f"DeltaGPT's model code needs {package}>={minimum}, but {package} {installed} is installed. "
                f'Upgrade it: pip install -U "{package}>={minimum}"'
            )


check_installed_versions()  # before anything below touches a name that older releases lack

try:  # transformers' internal model-code utilities (what its own models use); absent or moved: say so here
    from transformers.cache_utils import Cache
    from transformers.generation import GenerationMixin
    from transformers.masking_utils import create_causal_mask
    from transformers.modeling_outputs import BaseModelOutputWithPast
    from transformers.modeling_utils import PreTrainedModel
    from transformers.utils.generic import merge_with_config_defaults
    from transformers.utils.output_capturing import OutputRecorder, capture_outputs
except ImportError as error:
    raise ImportError(
        f"transformers {transformers.__version__} lacks an internal utility that DeltaGPT's model code uses ({error}). "
        f'Install a release this code is tested with: pip install "transformers>={MINIMUM_TRANSFORMERS}"'
    ) from error


def slice_logits_to_keep_before_5_21(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The positions whose logits `generate` asks for: the last `logits_to_keep` (0: all), or those indices; what each
    model's forward did itself before transformers 5.21 added `slice_logits_to_keep` (GPT2LMHeadModel's, 5.20)."""
    indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    return hidden_states[:, indices, :]


try:
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:
    slice_logits_to_keep = slice_logits_to_keep_before_5_21


def _require_override_points() -> None:
    """transformers methods that DeltaGPT overrides to change what they do. A release that renamed one would skip the
    override in silence (a converted model would then start from the reference init, not the source model's
    function), so a missing one stops the import instead."""
    points = {
        PreTrainedModel: ("_init_weights", "initialize_weights", "_initialize_missing_keys"),
        GenerationMixin: ("_prepare_cache_for_generation", "_validate_generation_mode"),
    }
    missing = [f"{cls.__name__}.{name}" for cls, names in points.items() for name in names if not hasattr(cls, name)]
    if missing:
        raise ImportError(
            f"transformers {transformers.__version__} no longer has {', '.join(missing)}, which DeltaGPT's model code "
            f'overrides. Install a release this code is tested with: pip install "transformers>={MINIMUM_TRANSFORMERS}"'
        )


_require_override_points()


# ----------------------------------------------------------------------------------------------------------------
# The cache argument: `past_key_values` up to transformers 5.23, `cache` from 5.24 on.
# ----------------------------------------------------------------------------------------------------------------

LEGACY_CACHE_ARG = "past_key_values"


def _installed_cache_name() -> str:
    """The name the installed transformers gives the cache, read from its model outputs and checked against the mask
    functions and `generate`, which must agree: a release that renamed only some would need a new adapter here."""
    fields = {field.name for field in dataclasses.fields(BaseModelOutputWithPast)}
    name = "cache" if "cache" in fields else LEGACY_CACHE_ARG
    for function in (create_causal_mask, GenerationMixin.prepare_inputs_for_generation):
        if name not in inspect.signature(function).parameters:
            raise ImportError(
                f"transformers {transformers.__version__} names the cache {name!r} in its model outputs but not in "
                f"{function.__qualname__}; DeltaGPT's model code does not support this release. Install a tested one: "
                f'pip install "transformers>={MINIMUM_TRANSFORMERS}"'
            )
    return name


#: The cache's name in the installed transformers' forwards, mask functions, model outputs and `generate` kwargs.
CACHE_ARG = _installed_cache_name()


def cache_argument(cache: Cache | None) -> dict[str, Cache | None]:
    """`{CACHE_ARG: cache}`: a cache passed to transformers (attention modules, mask functions, model outputs) under
    the installed name. The old name would warn on 5.24 and be ignored by nothing but luck later on."""
    return {CACHE_ARG: cache}


def cache_of(outputs: object) -> Cache | None:
    """The cache a transformers model output holds, read under the installed name (the old one warns on 5.24)."""
    return getattr(outputs, CACHE_ARG, None)


def takes_cache(forward: Callable) -> Callable:
    """Let a forward whose cache parameter is named `cache` be called with `past_key_values=` as well: `generate` and
    users' code up to transformers 5.23 pass that name, from 5.24 `cache`. Both at once must be the same object."""

    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        if LEGACY_CACHE_ARG in kwargs:
            legacy = kwargs.pop(LEGACY_CACHE_ARG)
            cache = kwargs.get("cache")
            if cache is not None and legacy is not None and cache is not legacy:
                raise ValueError(
                    "Both cache= and past_key_values= were passed, with different caches: pass one (they are two "
                    "names of the same argument; transformers 5.24 renamed past_key_values to cache)."
                )
            if cache is None:
                kwargs["cache"] = legacy
        return forward(*args, **kwargs)

    return wrapper


# ----------------------------------------------------------------------------------------------------------------
# Loading: which weights a checkpoint supplied, and checkpoints of an earlier release.
# ----------------------------------------------------------------------------------------------------------------


def was_loaded(tensor: torch.Tensor) -> bool:
    """Whether transformers' loader set this parameter from a checkpoint: its `_is_hf_initialized` mark, the one that
    transformers' own `initialization` functions read to leave loaded weights alone."""
    return bool(getattr(tensor, "_is_hf_initialized", False))


try:  # transformers' checkpoint conversions (what its own models use for checkpoints in older layouts)
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping
    from transformers.core_model_loading import ConversionOps, WeightConverter
except ImportError:  # moved: old-layout checkpoints then fail with transformers' own size-mismatch error, and so
    register_checkpoint_conversion_mapping = None  # does tests/test_fsdp.py's legacy-checkpoint test, in CI
    ConversionOps = object


class _ToParameterShape(ConversionOps):
    """A checkpoint tensor with its parameter's number of elements in another shape (the 0-dim `beta_open` of ddl-hf
    0.1, today `[1]`), reshaped to the parameter's. Anything else passes unchanged, for transformers to report.
    Saving runs the same op, which leaves a tensor of the parameter's own shape as it is."""

    def convert(self, input_dict: dict, source_patterns: list[str], target_patterns: list[str], **kwargs) -> dict:
        (tensor,) = input_dict.values()
        tensor = tensor[0] if isinstance(tensor, list) else tensor
        try:
            shape = kwargs["model"].get_parameter(kwargs["full_layer_name"]).shape
        except (AttributeError, KeyError, TypeError):
            shape = tensor.shape
        if tensor.shape != shape and tensor.numel() == shape.numel():
            tensor = tensor.reshape(shape)
        return {target_patterns[0]: tensor}

    @property
    def reverse_op(self) -> _ToParameterShape:
        return self


def load_legacy_shapes(model_type: str, *parameter_names: str) -> None:
    """Let `from_pretrained` load checkpoints in which these parameters had another shape with the same elements,
    through transformers' checkpoint-conversion registry (custom-code models are only converted when registered)."""
    if register_checkpoint_conversion_mapping is not None:
        converters = [WeightConverter(name, name, [_ToParameterShape()]) for name in parameter_names]
        register_checkpoint_conversion_mapping(model_type, converters, overwrite=True)


# ----------------------------------------------------------------------------------------------------------------
# torch internals with no public replacement, probed once at import.
# ----------------------------------------------------------------------------------------------------------------

_MODULE_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOK_DICTS = tuple(f"_global{name}" for name in _MODULE_HOOK_DICTS)


def _probe_hook_registries() -> tuple[dict, ...] | None:
    """torch's four registries of global module hooks, or None if they no longer behave as `is_unhooked` reads them.

    No public API says whether a module call would run a hook, so `is_unhooked` reads the registries themselves; this
    probe registers hooks through the public functions (global forward and forward-pre; each kind on a module) and
    checks that they appear where it reads. Only checked to exist: the global backward registries (registering a global
    full backward hook would change torch's global state) and `nn.Module._compiled_call_impl`, which `module.compile()`
    sets (compiling a probe would import inductor, a second per import)."""
    try:
        return _read_hook_registries()
    except Exception:  # a registration function that moved or changed its signature: the registries cannot be read
        return None


def _read_hook_registries() -> tuple[dict, ...] | None:
    from torch.nn.modules import module as torch_module

    registries = tuple(getattr(torch_module, name, None) for name in _GLOBAL_HOOK_DICTS)
    if not all(isinstance(registry, dict) for registry in registries):
        return None

    def no_op(*args):
        return None

    probe = nn.Identity()
    handles = []
    try:  # registered one by one, so that a registration that fails leaves no probe hook behind
        handles.append((registries[0], torch_module.register_module_forward_hook(no_op)))
        handles.append((registries[1], torch_module.register_module_forward_pre_hook(no_op)))
        seen = all(handle.id in registry for registry, handle in handles)
    finally:
        for _, handle in handles:
            handle.remove()
    seen = seen and not any(handle.id in registry for registry, handle in handles)
    local = (
        probe.register_forward_hook(no_op),
        probe.register_forward_pre_hook(no_op),
        probe.register_full_backward_hook(no_op),
        probe.register_full_backward_pre_hook(no_op),
    )
    attributes = probe.__dict__
    seen = seen and all(handle.id in attributes.get(name, ()) for name, handle in zip(_MODULE_HOOK_DICTS, local))
    compiled_call = "_compiled_call_impl" in vars(nn.Module) and nn.Module._compiled_call_impl is None
    return registries if seen and compiled_call else None


_GLOBAL_HOOKS = _probe_hook_registries()
#: Whether `is_unhooked` can answer on this torch. False: the fast paths that skip nn.Module's call machinery (and the
#: one-token host path and native kernel, which read projection weights directly) are off; results are unchanged.
HOOKS_READABLE = _GLOBAL_HOOKS is not None
if not HOOKS_READABLE:
    warnings.warn(
        f"torch {torch.__version__} keeps module hooks where DeltaGPT cannot see them, so DeltaGPT's one-token "
        "decoding fast path is off (outputs are unchanged; decoding is slower). Please report this torch version.",
        RuntimeWarning,
        stacklevel=2,
    )


def is_unhooked(module: nn.Module) -> bool:
    """Whether `module(...)` is exactly its class's `forward`: no hook of the module or a global one (DeepSpeed,
    pruning, offload), no patched `forward` (accelerate offload) and no `module.compile()`. False while compiling
    (dynamo traces module calls itself, and these lookups would only add guards) and where `HOOKS_READABLE` is False.
    """
    if _GLOBAL_HOOKS is None or torch.compiler.is_compiling():
        return False
    attributes = module.__dict__  # dict lookups: a miss on the module itself costs an AttributeError
    return not (
        attributes["_forward_hooks"]
        or attributes["_forward_pre_hooks"]
        or attributes["_backward_hooks"]
        or attributes["_backward_pre_hooks"]
        or any(_GLOBAL_HOOKS)
        or "forward" in attributes
        or attributes.get("_compiled_call_impl") is not None
    )


#: torch.export traces DeltaNet's chunk loop over a symbolic sequence length (`scan`) from this torch on (measured:
#: 2.7, 2.8, 2.10 and 2.12 fail inside torch.export, on guards over the number of chunks or on `scan` itself).
DELTA_NET_DYNAMIC_EXPORT_TORCH = "2.13.0"
#: Whether this torch exports DeltaNet with a dynamic length. Where not, an export traces the eager chunk loop: a
#: program for the traced length, and torch.export's own error if a dynamic length is asked for (decided here, at
#: import: a version parse cannot run while torch.export traces).
DELTA_NET_DYNAMIC_EXPORT = release(torch.__version__) >= release(DELTA_NET_DYNAMIC_EXPORT_TORCH)


def scan(combine: Callable, init: torch.Tensor, xs: tuple, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's `scan` higher-order op (no public name yet): a loop over a symbolic number of steps, which exporting
    DeltaNet with a dynamic length needs. Refuses clearly where a release moved the op."""
    try:
        from torch._higher_order_ops.scan import scan as torch_scan
    except ImportError as error:
        raise RuntimeError(
            f"Exporting a DeltaNet model with a dynamic sequence length needs torch's scan operator, which torch "
            f"{torch.__version__} no longer has at torch._higher_order_ops.scan ({error}). Export with a static "
            "length, or use a torch release this code is tested with (README, Supported versions)."
        ) from error
    return torch_scan(combine, init, xs, dim=dim)


__all__ = [
    "CACHE_ARG",
    "DELTA_NET_DYNAMIC_EXPORT",
    "DELTA_NET_DYNAMIC_EXPORT_TORCH",
    "HOOKS_READABLE",
    "MINIMUM_TORCH",
    "MINIMUM_TRANSFORMERS",
    "OutputRecorder",
    "cache_argument",
    "cache_of",
    "capture_outputs",
    "check_installed_versions",
    "is_unhooked",
    "load_legacy_shapes",
    "merge_with_config_defaults",
    "release",
    "scan",
    "slice_logits_to_keep",
    "takes_cache",
    "was_loaded",
]
