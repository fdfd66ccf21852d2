"""DeltaLlama configuration: a Llama-family decoder's config (Llama, Mistral, Qwen2, Qwen3) plus the Delta residual.

One config class for the four families: `source_model_type` names the family, and every field of that family's own
config (`LlamaConfig`, `MistralConfig`, `Qwen2Config`, `Qwen3Config`) is carried under its own name, with the family's
defaults and derived values (`head_dim`, `layer_types`, `sliding_window`, standardised `rope_parameters`). The family's
attention, MLP, norm and rotary classes, which the model reuses, therefore read exactly the fields they expect.

Self-contained Hub custom-code file: it imports only transformers and its sibling `configuration_delta_gpt.py`.
"""

from __future__ import annotations

from typing import Any

from transformers import LlamaConfig, MistralConfig, PreTrainedConfig, Qwen2Config, Qwen3Config

from .configuration_delta_gpt import DeltaResidualConfigMixin, FieldRule

# model_type of a supported source family -> its transformers config class.
DELTA_LLAMA_FAMILIES: dict[str, type[PreTrainedConfig]] = {
    "llama": LlamaConfig,
    "mistral": MistralConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
}

# DeltaLlamaConfig's own field, checked before the family's config is built from it.
SOURCE_MODEL_TYPE_RULE = FieldRule(
    "source_model_type",
    "choice",
    tuple(DELTA_LLAMA_FAMILIES),
    f"expected one of {tuple(DELTA_LLAMA_FAMILIES)} (the Llama-family decoders whose layers DeltaLlama reuses)",
)

# Keys of a family config's dict that describe a saved checkpoint or the config class, never carried over.
_NOT_CARRIED = ("model_type", "architectures", "auto_map", "transformers_version", "_name_or_path")

# Every Auto class a saved DeltaLlama directory can be loaded with, through Hub custom code.
AUTO_MAP = {
    "AutoConfig": "configuration_delta_llama.DeltaLlamaConfig",
    "AutoModel": "modeling_delta_llama.DeltaLlamaModel",
    "AutoModelForCausalLM": "modeling_delta_llama.DeltaLlamaForCausalLM",
    "AutoModelForSequenceClassification": "modeling_delta_llama.DeltaLlamaForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_delta_llama.DeltaLlamaForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling_delta_llama.DeltaLlamaForQuestionAnswering",
}


class DeltaLlamaConfig(PreTrainedConfig, DeltaResidualConfigMixin):
    r"""
    Configuration of a DeltaLlama model: a Llama-family decoder whose two residual connections per layer
    (`input_layernorm -> self_attn -> +`, `post_attention_layernorm -> mlp -> +`) are Delta residuals.

    Args:
        source_model_type (`str`, defaults to `"llama"`):
            The family whose attention, MLP, RMSNorm and rotary embedding the model uses: one of `"llama"`,
            `"mistral"`, `"qwen2"`, `"qwen3"`.
        use_cache (`bool`, defaults to `True`):
            Whether the model returns its cache (the key/value cache, and the Delta variants' recent states) for
            generation to reuse, as in the family's config. Declared here because transformers drops it from the
            extra keyword arguments of a config; the family's config checks its value.
        delta_* :
            The Delta residual, exactly as in `DeltaGPTConfig` (both modes, any `delta_value_channels`, the
            variants); see its docstring. `delta_mode="additive"` with beta = 0 computes the source model.
        **kwargs:
            Any field of the family's config (`hidden_size`, `num_key_value_heads`, `rope_parameters`,
            `sliding_window`, ...), with the family's defaults.
    """

    model_type = "delta_llama"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]  # the cache output, named `cache` from transformers 5.24
    # The sublayer between the Delta residuals is always the family's softmax attention (no DeltaNet mixer here).
    token_mixer = "attention"

    source_model_type: str = "llama"
    use_cache: bool = True

    def __post_init__(self, **kwargs):
        self.check_fields((SOURCE_MODEL_TYPE_RULE,))
        if "token_mixer" in kwargs and kwargs.pop("token_mixer") != "attention":
            raise ValueError(
                "DeltaLlamaConfig supports only token_mixer='attention' (the family's own attention); "
                "use DeltaGPTConfig for the DeltaNet token mixer."
            )
        # The family's own config fills its defaults and derived fields; they become attributes of this config.
        family = DELTA_LLAMA_FAMILIES[self.source_model_type](use_cache=self.use_cache, **kwargs)
        own = {f for f in type(self).__dataclass_fields__}
        carried = {k: v for k, v in family.to_dict().items() if k not in own and k not in _NOT_CARRIED}
        carried.update({k: v for k, v in kwargs.items() if k not in carried})  # e.g. attn_implementation
        super().__post_init__(**carried)
        if getattr(self, "auto_map", None) is None:
            self.auto_map = dict(AUTO_MAP)
        self.validate_delta_residual()

    def validate(self) -> None:
        super().validate()
        self.validate_delta_residual()

    def to_dict(self) -> dict[str, Any]:
        return self.drop_runtime_fields(super().to_dict())

    @classmethod
    def _reference_backbone(cls, overrides: dict) -> dict:
        """The authors' backbone at their 124M defaults, on the closest family (Qwen3: RMSNorm, QK-norm, SwiGLU, RoPE
        without biases, tied embeddings): 12 layers, 6 heads of 128 (no grouped KV), width 768, SwiGLU width
        floor(8 d / 3), vocabulary 50304, RMSNorm epsilon 1e-5, RoPE theta 10000. Sizes follow `overrides`."""
        hidden = overrides.get("hidden_size", 768)
        heads = overrides.get("num_attention_heads", 6)
        return dict(
            source_model_type="qwen3",
            vocab_size=50304,
            hidden_size=hidden,
            num_hidden_layers=12,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            head_dim=128,
            intermediate_size=8 * hidden // 3,
            max_position_embeddings=1024,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            attention_bias=False,
            tie_word_embeddings=True,
        )

    def family_config(self) -> PreTrainedConfig:
        """The source family's own config with the same architecture (the Delta fields dropped): what `export`
        writes, and what the tests compare against."""
        family_class = DELTA_LLAMA_FAMILIES[self.source_model_type]
        own = set(type(self).__dataclass_fields__) - set(family_class.__dataclass_fields__)  # keeps use_cache
        fields = {k: v for k, v in self.to_dict().items() if k not in own and k not in _NOT_CARRIED}
        family = family_class(**fields)
        family._attn_implementation = self._attn_implementation
        return family


__all__ = ["DELTA_LLAMA_FAMILIES", "DeltaLlamaConfig"]
