"""Default peft target modules for the Delta models, so `LoraConfig()` / `IA3Config()` without `target_modules` work.

peft picks default targets by `config.model_type` from its own tables; `delta_gpt` and `delta_llama` are not in them.
Each Delta model type inherits the entries of the source model type it keeps the module names of:

- `delta_gpt` takes `gpt2`'s entries as they are (`c_attn`, `mlp.c_proj`, ...). A `token_mixer="delta_net"` model
  has no `c_attn`: where GPT-2's entry targets `c_attn`, the DeltaNet projections `attn.q_proj`, `attn.k_proj`,
  `attn.v_proj` are added. peft needs at least one of a list to match, so one list serves both mixers.
- `delta_llama` (one model type for Llama, Mistral, Qwen2 and Qwen3) takes `llama`'s entries, with each projection
  qualified by its sublayer (`self_attn.q_proj`, `self_attn.v_proj`, `mlp.down_proj`). peft's tables give the four
  families the same LoRA entry (`q_proj`, `v_proj`) and mostly the same others; where they differ (IA3: Qwen's
  `q_proj` against Llama's `k_proj`) Llama's is used.

Why qualified names: peft matches a target by name suffix, and every Delta residual has its own `v_proj` (the value
projection), so a bare `v_proj` would put adapters on the Delta residuals too.

Registered by `import ddl_hf` as soon as peft is imported, before or after it (importing the models imports no
peft). Without `ddl_hf` (Hub custom code only), pass the same names yourself, e.g.
`LoraConfig(target_modules=["c_attn"])` (DeltaGPT), `["attn.q_proj", "attn.k_proj", "attn.v_proj"]` (DeltaNet) or
`["self_attn.q_proj", "self_attn.v_proj"]` (DeltaLlama).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import wrapt

DELTA_NET_ATTENTION_TARGETS = ["attn.q_proj", "attn.k_proj", "attn.v_proj"]

#: The Llama family's projections, by the sublayer (attribute of the decoder layer) that owns them.
LLAMA_PROJECTION_SUBLAYERS = {
    **{name: "self_attn" for name in ("q_proj", "k_proj", "v_proj", "o_proj")},
    **{name: "mlp" for name in ("gate_proj", "up_proj", "down_proj")},
}


def delta_gpt_targets(gpt2_targets: list[str]) -> list[str]:
    """GPT-2's default targets for one peft method, plus the DeltaNet projections where GPT-2 targets `c_attn`."""
    targets = list(gpt2_targets)
    if "c_attn" in targets:
        targets += [name for name in DELTA_NET_ATTENTION_TARGETS if name not in targets]
    return targets


def delta_llama_targets(llama_targets: list[str]) -> list[str]:
    """Llama's default targets for one peft method, each projection qualified by its sublayer (`self_attn.v_proj`),
    so that no Delta residual's own `v_proj` matches; other names (the norms) are kept as they are."""
    return [
        f"{LLAMA_PROJECTION_SUBLAYERS[name]}.{name}" if name in LLAMA_PROJECTION_SUBLAYERS else name
        for name in llama_targets
    ]


#: Delta model type -> (the source model type whose peft entries it inherits, how a list entry is adapted).
PEFT_SOURCES: dict[str, tuple[str, Callable[[list[str]], list[str]]]] = {
    "delta_gpt": ("gpt2", delta_gpt_targets),
    "delta_llama": ("llama", delta_llama_targets),
}


def register_peft_targets(model_type: str = "delta_gpt") -> list[str]:
    """Add `model_type` (a key of `PEFT_SOURCES`) to every peft default-target table that has its source model type;
    return the tables' names. Entries peft already has for `model_type` are left alone. Imports peft (and with it
    bitsandbytes, when installed); `import ddl_hf` uses `register_peft_targets_on_import` instead."""
    try:
        from peft.utils import constants
    except ImportError:  # peft is optional at run time
        return []
    return add_targets(constants, model_type)


def register_peft_targets_on_import(model_type: str = "delta_gpt") -> None:
    """Register `model_type`'s default targets as soon as peft's tables are imported, by anyone (at once if they are
    already). `import ddl_hf` uses this, so that importing the models imports no peft: peft imports bitsandbytes,
    which takes seconds and, on some CPUs, logs a warning at import."""
    wrapt.register_post_import_hook(lambda constants: add_targets(constants, model_type), "peft.utils.constants")


def add_targets(constants: ModuleType, model_type: str) -> list[str]:
    """Add `model_type`'s entries to the `TRANSFORMERS_MODELS_TO_*` tables of peft's `constants` module."""
    source, adapt = PEFT_SOURCES[model_type]
    registered = []
    for name in dir(constants):
        table = getattr(constants, name)
        if name.startswith("TRANSFORMERS_MODELS_TO_") and isinstance(table, dict) and source in table:
            entry = table[source]
            table.setdefault(model_type, adapt(entry) if isinstance(entry, list) else entry)
            registered.append(name)
    return registered


__all__ = [
    "DELTA_NET_ATTENTION_TARGETS",
    "LLAMA_PROJECTION_SUBLAYERS",
    "PEFT_SOURCES",
    "add_targets",
    "delta_gpt_targets",
    "delta_llama_targets",
    "register_peft_targets",
    "register_peft_targets_on_import",
]
