"""ddl_hf: Deep Delta Learning for GPT-2 (DeltaGPT) and Llama-family decoders (DeltaLlama) in 🤗 Transformers.

Importing this package registers both with the Auto classes (and peft's default targets), so
`AutoModelForCausalLM.from_pretrained(dir)` works without `trust_remote_code`, and makes `save_pretrained` write the
Hub custom-code files next to the weights, so the saved directory also loads where `ddl_hf` is not installed.
"""

import importlib

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from .configuration_delta_gpt import DeltaGPTConfig
from .configuration_delta_llama import DeltaLlamaConfig
from .conversion import (
    ConversionError,
    EquivalenceReport,
    beta_upper_bounds,
    convert_checkpoint,
    convert_gpt2,
    convert_llama,
    equivalence_report,
    export_to_gpt2,
    export_to_llama,
    push_converted_to_hub,
)
from .delta_layers import DeltaResidual
from .delta_net import DeltaNetAttention, DeltaNetCache
from .delta_net_ops import delta_rule_chunkwise, delta_rule_recurrent
from .delta_ops import delta_update
from .delta_reads import DeltaRead, DeltaStateCache, DeltaStaticStateCache
from .modeling_delta_gpt import (
    DeltaGPTForCausalLM,
    DeltaGPTForQuestionAnswering,
    DeltaGPTForSequenceClassification,
    DeltaGPTForTokenClassification,
    DeltaGPTModel,
    DeltaGPTPreTrainedModel,
)
from .modeling_delta_llama import (
    DeltaLlamaForCausalLM,
    DeltaLlamaForQuestionAnswering,
    DeltaLlamaForSequenceClassification,
    DeltaLlamaForTokenClassification,
    DeltaLlamaModel,
    DeltaLlamaPreTrainedModel,
    init_reference_backbone,
)
from .peft_targets import register_peft_targets_on_import

__version__ = "0.2.0"

# Training helpers import Trainer and datasets (seconds): loaded on first use, not with the model.
_LAZY_EXPORTS = {"DeltaStatsCallback": "callbacks", "DeltaTrainer": "training"}


def __getattr__(name: str):
    if name in _LAZY_EXPORTS:
        return getattr(importlib.import_module(f".{_LAZY_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_AUTO_CLASSES = (
    (AutoModel, DeltaGPTModel),
    (AutoModelForCausalLM, DeltaGPTForCausalLM),
    (AutoModelForSequenceClassification, DeltaGPTForSequenceClassification),
    (AutoModelForTokenClassification, DeltaGPTForTokenClassification),
    (AutoModelForQuestionAnswering, DeltaGPTForQuestionAnswering),
)

AutoConfig.register(DeltaGPTConfig.model_type, DeltaGPTConfig, exist_ok=True)
DeltaGPTConfig.register_for_auto_class("AutoConfig")
for _auto_class, _model_class in _AUTO_CLASSES:
    _auto_class.register(DeltaGPTConfig, _model_class, exist_ok=True)
    _model_class.register_for_auto_class(_auto_class.__name__)
register_peft_targets_on_import(DeltaGPTConfig.model_type)

# DeltaLlama: the Llama-family decoders (Llama, Mistral, Qwen2, Qwen3) with Delta residuals.
AutoConfig.register(DeltaLlamaConfig.model_type, DeltaLlamaConfig, exist_ok=True)
DeltaLlamaConfig.register_for_auto_class("AutoConfig")
_LLAMA_AUTO_CLASSES = (
    (AutoModel, DeltaLlamaModel),
    (AutoModelForCausalLM, DeltaLlamaForCausalLM),
    (AutoModelForSequenceClassification, DeltaLlamaForSequenceClassification),
    (AutoModelForTokenClassification, DeltaLlamaForTokenClassification),
    (AutoModelForQuestionAnswering, DeltaLlamaForQuestionAnswering),
)
for _auto_class, _model_class in _LLAMA_AUTO_CLASSES:
    _auto_class.register(DeltaLlamaConfig, _model_class, exist_ok=True)
    _model_class.register_for_auto_class(_auto_class.__name__)
register_peft_targets_on_import(DeltaLlamaConfig.model_type)


__all__ = [
    "ConversionError",
    "DeltaGPTConfig",
    "DeltaGPTForCausalLM",
    "DeltaGPTForQuestionAnswering",
    "DeltaGPTForSequenceClassification",
    "DeltaGPTForTokenClassification",
    "DeltaGPTModel",
    "DeltaGPTPreTrainedModel",
    "DeltaLlamaConfig",
    "DeltaLlamaForCausalLM",
    "DeltaLlamaForQuestionAnswering",
    "DeltaLlamaForSequenceClassification",
    "DeltaLlamaForTokenClassification",
    "DeltaLlamaModel",
    "DeltaLlamaPreTrainedModel",
    "DeltaNetAttention",
    "DeltaNetCache",
    "DeltaRead",
    "DeltaResidual",
    "DeltaStateCache",
    "DeltaStaticStateCache",
    "DeltaStatsCallback",
    "DeltaTrainer",
    "EquivalenceReport",
    "beta_upper_bounds",
    "convert_checkpoint",
    "convert_gpt2",
    "convert_llama",
    "delta_rule_chunkwise",
    "delta_rule_recurrent",
    "delta_update",
    "equivalence_report",
    "export_to_gpt2",
    "export_to_llama",
    "init_reference_backbone",
    "push_converted_to_hub",
]
