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
- torch internals that no public API replaces (`scan`, for exporting DeltaNet with a dynamic length): where one has
  moved, the feature that needs it refuses with a clear error, never silently wrong.

Hub custom-code file: it imports only torch and transformers.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections.abc import Callable

import torch
import transformers

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


def hidden_states_indices(model: PreTrainedModel, output_hidden_states: object, count: int) -> list[int]:
    """Which of the `count` hidden states `output_hidden_states` asks for: all of them for a flag; the chosen ones
    where transformers takes indices (`output_hidden_states=[0, -1]`, newer releases' `selected_hidden_states`)."""
    try:
        from transformers.utils.output_capturing import resolve_hidden_states_indices, selected_hidden_states
    except ImportError:  # this release takes a flag only
        return list(range(count))
    selected = selected_hidden_states(output_hidden_states)
    return list(range(count)) if selected is None else sorted(resolve_hidden_states_indices(model, selected))


def _require_override_points() -> None:
    """transformers methods that DeltaGPT overrides to change what they do. A release that renamed one would skip the
    override in silence (a converted model would then start from the reference init, not the source model's
    function), so a missing one stops the import instead."""
    points = {
        PreTrainedModel: (
            "_init_weights",
            "initialize_weights",
            "_initialize_missing_keys",
            "_adjust_missing_and_unexpected_keys",
        ),
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


def _takes_installed_cache_name(forward: Callable) -> Callable:
    """Before transformers 5.24: the installed name is `past_key_values`, which `generate` and users pass, and which
    our forwards' `cache` parameter takes as it is (no warning: it is not deprecated there)."""

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


if CACHE_ARG == "cache":
    from transformers.utils.deprecation import deprecate_kwarg

    #: Let a forward whose cache parameter is named `cache` take `past_key_values=` too. From transformers 5.24 on, the
    #: old name warns exactly as transformers' own models warn (their decorator, their deprecation release).
    takes_cache = deprecate_kwarg(LEGACY_CACHE_ARG, "5.40.0", new_name="cache")
else:
    takes_cache = _takes_installed_cache_name


# ----------------------------------------------------------------------------------------------------------------
# Loading: which weights a checkpoint supplied, and checkpoints of an earlier release.
# ----------------------------------------------------------------------------------------------------------------


def was_loaded(tensor: torch.Tensor) -> bool:
    """Whether transformers' loader set this parameter from a checkpoint: its `_is_hf_initialized` mark, the one that
    transformers' own `initialization` functions read to leave loaded weights alone."""
    return bool(getattr(tensor, "_is_hf_initialized", False))


#: Parameters that ddl-hf 0.1 saved 0-dim and later releases save as `[1]` (FSDP2 shards along dim 0).
PARAMETERS_0_DIM_IN_0_1 = ("beta_open",)


def is_0_1_tensor(name: str, shape: tuple[int, ...]) -> bool:
    """Whether a checkpoint tensor is one that ddl-hf 0.1 saved 0-dim where today's parameter is `[1]`."""
    return len(shape) == 0 and name.rsplit(".", 1)[-1] in PARAMETERS_0_DIM_IN_0_1


def check_checkpoint_format(model: PreTrainedModel, loading_info) -> None:
    """Refuse a checkpoint of ddl-hf 0.1 with one line that names `ddl-hf upgrade`, instead of transformers'
    size-mismatch report (or, with `ignore_mismatched_sizes=True`, gates silently re-initialised).

    Called from the model's `_adjust_missing_and_unexpected_keys`, the one override point that `from_pretrained`
    hands its `loading_info` (transformers 5.16 to 5.24). The 0.1 entries leave `mismatched_keys` first: the load
    report that transformers runs next would otherwise raise its own error in place of this one."""
    legacy = {entry for entry in loading_info.mismatched_keys if is_0_1_tensor(entry[0], entry[1])}
    if legacy:
        loading_info.mismatched_keys.difference_update(legacy)
        source = model.name_or_path
        raise ValueError(
            f"{source or 'This checkpoint'} was saved by ddl-hf 0.1, whose beta_open parameters are 0-dim (now [1]); "
            f"upgrade it once with `ddl-hf upgrade {source or 'CHECKPOINT_DIR'} --output UPGRADED_DIR` "
            "(pip install ddl-hf) and load UPGRADED_DIR."
        )


# ----------------------------------------------------------------------------------------------------------------
# torch internals with no public replacement.
# ----------------------------------------------------------------------------------------------------------------

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
    "MINIMUM_TORCH",
    "MINIMUM_TRANSFORMERS",
    "OutputRecorder",
    "cache_argument",
    "cache_of",
    "capture_outputs",
    "check_checkpoint_format",
    "check_installed_versions",
    "hidden_states_indices",
    "is_0_1_tensor",
    "merge_with_config_defaults",
    "release",
    "scan",
    "slice_logits_to_keep",
    "takes_cache",
    "was_loaded",
]
