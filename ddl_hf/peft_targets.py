"""Default peft target modules for DeltaGPT, so `LoraConfig()` / `IA3Config()` without `target_modules` work.

peft picks default targets by `config.model_type` from its own tables; `delta_gpt` is not in them. DeltaGPT keeps
GPT-2's module names, so every table entry of `gpt2` applies as it is (`c_attn`, `mlp.c_proj`, ...). A
`token_mixer="delta_net"` model has no `c_attn`: where GPT-2's entry targets `c_attn`, the DeltaNet projections
`attn.q_proj`, `attn.k_proj`, `attn.v_proj` are added (qualified with `attn.` so that the Delta residuals' own
`v_proj` is never picked). peft needs at least one of a list to match, so one list serves both mixers.

Registered on `import ddl_hf`. Without `ddl_hf` (Hub custom code only), pass the same names yourself:
`LoraConfig(target_modules=["c_attn"])` (attention) or `["attn.q_proj", "attn.k_proj", "attn.v_proj"]` (DeltaNet).
"""

from __future__ import annotations

DELTA_NET_ATTENTION_TARGETS = ["attn.q_proj", "attn.k_proj", "attn.v_proj"]


def delta_gpt_targets(gpt2_targets: list[str]) -> list[str]:
    """GPT-2's default targets for one peft method, plus the DeltaNet projections where GPT-2 targets `c_attn`."""
    targets = list(gpt2_targets)
    if "c_attn" in targets:
        targets += [name for name in DELTA_NET_ATTENTION_TARGETS if name not in targets]
    return targets


def register_peft_targets(model_type: str = "delta_gpt") -> list[str]:
    """Add `model_type` to every peft default-target table that has GPT-2; return the tables' names."""
    try:
        from peft.utils import constants
    except ImportError:  # peft is optional at run time
        return []
    registered = []
    for name in dir(constants):
        table = getattr(constants, name)
        if name.startswith("TRANSFORMERS_MODELS_TO_") and isinstance(table, dict) and "gpt2" in table:
            gpt2_entry = table["gpt2"]
            table.setdefault(model_type, delta_gpt_targets(gpt2_entry) if isinstance(gpt2_entry, list) else gpt2_entry)
            registered.append(name)
    return registered


__all__ = ["DELTA_NET_ATTENTION_TARGETS", "delta_gpt_targets", "register_peft_targets"]
