"""ddl-hf's vLLM plugin (the `vllm.general_plugins` entry point): DeltaLlama and DeltaGPT as native vLLM models.

vLLM calls `register` in each of its processes before it reads a model's config. It names the models lazily (vLLM
imports `ddl_hf.vllm_models` only when it builds one) and gives them the config hook below. docs/serving.md.
"""

from __future__ import annotations

from vllm.config import VllmConfig
from vllm.model_executor.models.config import MambaModelConfig, VerifyAndUpdateConfig

from .delta_state import state_plan

#: The architectures ddl-hf serves natively, as `config.architectures` names them, and the class of
#: `ddl_hf.vllm_models` that serves each (named after it: the transformers class keeps its own name).
ARCHITECTURES = {
    "DeltaLlamaForCausalLM": "VllmDeltaLlamaForCausalLM",
    "DeltaGPTForCausalLM": "VllmDeltaGPTForCausalLM",
}


class DeltaServingConfig(VerifyAndUpdateConfig):
    """vLLM's per-architecture config hook: a model with windows (its `StatePlan`'s) gets the state settings vLLM
    gives its hybrid models (a state block size; the 'align' prefix-cache mode when prefix caching is on). vLLM applies
    them itself only where `config.layer_types` names a layer other than attention, and a Delta model's layers are
    all attention."""

    @classmethod
    def verify_and_update_config(cls, vllm_config: VllmConfig) -> None:
        if state_plan(vllm_config.model_config.hf_config).windows:
            MambaModelConfig.verify_and_update_config(vllm_config)


#: The custom op through which a window runs (`ddl_hf.vllm_windows.DeltaWindow`).
WINDOW_OP = "vllm::ddl_delta_window"


def register() -> None:
    """Register DeltaLlama and DeltaGPT with vLLM (imported lazily by vLLM) and their config hook, and make the window
    op one where vLLM splits its compiled graphs, as its own short convolution is: a piecewise CUDA graph must not
    capture a window, whose metadata changes every step."""
    from vllm import ModelRegistry
    from vllm.config import CompilationConfig
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    for architecture, served_by in ARCHITECTURES.items():
        ModelRegistry.register_model(architecture, f"ddl_hf.vllm_models:{served_by}")
        MODELS_CONFIG_MAP[architecture] = DeltaServingConfig
    splitting = getattr(CompilationConfig, "_attention_ops", None)  # vLLM's default splitting ops (0.32)
    if isinstance(splitting, list) and WINDOW_OP not in splitting:
        splitting.append(WINDOW_OP)


__all__ = ["ARCHITECTURES", "WINDOW_OP", "DeltaServingConfig", "register"]
