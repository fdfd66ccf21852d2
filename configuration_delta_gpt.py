"""DeltaGPT configuration: GPT-2's config plus the Deep Delta Learning residual settings.

Self-contained Hub custom-code file: it imports only torch, transformers and its siblings `delta_compat.py` and
`delta_state.py`.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, NamedTuple

# First: importing delta_compat checks the installed transformers / torch, so that this file, the first Hub file
# transformers loads, stops below the supported range with one clear error.
from .delta_compat import MINIMUM_TRANSFORMERS  # noqa: F401

# isort: split
from transformers import GPT2Config

from .delta_state import state_plan

DELTA_MODES = ("additive", "paper")
DELTA_GATES = ("linear", "mlp")
TOKEN_MIXERS = ("attention", "delta_net")
DELTA_NET_RULES = ("delta", "write_only")
# The paper's variants (the authors' reference code names them TC, CC, EC and "constant value"; docs/variants.md).
DELTA_STATE_READS = ("linear", "temporal_conv", "channel_conv")
DELTA_EMBED_EXPANDS = ("repeat", "conv")
DELTA_VALUES = ("linear", "constant", "sigmoid")
# How new Delta parameters start: "exact" (beta = delta_beta_init for every token, default 0, and identity
# convolutions, so a converted GPT-2 is reproduced exactly) or "reference" (the authors' from-scratch choices: a
# random gate around delta_beta_init, default 1, and averaging convolutions). None (auto) = "exact" for parameters a
# loaded checkpoint lacks, "reference" for a model built from its config. `DeltaGPTConfig`'s docstring has each case.
DELTA_INITS = ("exact", "reference")
# Which kernels run a model's Delta residuals, reads and DeltaNet rule, as `attn_implementation` chooses attention:
# "auto" (Triton's on CUDA where Triton imports, the tensor ops elsewhere), "eager" (the tensor ops), "triton",
# "native" (the CPU kernels). Chosen per model, not saved (`DeltaResidualConfigMixin.drop_runtime_fields`).
DELTA_IMPLEMENTATIONS = ("auto", "eager", "triton", "native")
# The authors' model files that `reference(variant=...)` reproduces (docs/variants.md).
REFERENCE_VARIANTS = ("dv1", "tc", "tc_ec", "cc", "cc_ec")
REFERENCE_READS = {"tc": "temporal_conv", "cc": "channel_conv"}
# Old spellings still accepted, with a FutureWarning: {old: new}.
DELTA_NET_RULE_ALIASES = {"additive": "write_only"}


class FieldRule(NamedTuple):
    """One row of a config's field table: the values `field` may take. `kind` says what `allowed` holds:
    "choice": the allowed values; "int": the smallest allowed integer; "number": (low, high), a finite number in
    that closed interval; "positive": nothing, a finite number > 0; "bool": nothing, True or False. `optional`: None
    is allowed too. `expected`: the error's "expected ..." text; empty = the kind's own wording."""

    field: str
    kind: str
    allowed: Any = None
    expected: str = ""
    optional: bool = False

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.optional
        if self.kind == "choice":
            return value in self.allowed
        if self.kind == "bool":
            return isinstance(value, bool)
        # numbers: bool is an int subclass, never a count or a size here
        if isinstance(value, bool) or not isinstance(value, int if self.kind == "int" else (int, float)):
            return False
        if self.kind == "int":
            return value >= self.allowed
        if not math.isfinite(value):
            return False
        if self.kind == "positive":
            return value > 0
        low, high = self.allowed
        return low <= value <= high

    def message(self) -> str:
        if self.expected:
            return self.expected
        if self.kind == "choice":
            return f"expected one of {self.allowed}"
        if self.kind == "int":
            return f"expected an integer >= {self.allowed}"
        if self.kind == "positive":
            return "expected a finite number > 0"
        if self.kind == "number":
            low, high = self.allowed
            return "expected a finite number" if low == -high == -math.inf else f"expected a number in [{low}, {high}]"
        return "expected True or False"


# The Delta residual's fields (DeltaResidualConfigMixin), checked in this order; the checks between fields (a
# variant that needs d_v > 1, the channel convolution's size) follow in `validate_delta_residual`.
DELTA_FIELD_RULES = (
    FieldRule("delta_mode", "choice", DELTA_MODES),
    FieldRule("delta_value_channels", "int", 1),
    FieldRule(
        "delta_beta_init",
        "number",
        (0.0, 2.0),
        "expected a number in [0, 2] (0 = identity/source model, 1 = projection, 2 = reflection), or None for the "
        "delta_init scheme's value",
        optional=True,
    ),
    FieldRule("delta_init", "choice", DELTA_INITS, f"expected None (auto) or one of {DELTA_INITS}", optional=True),
    FieldRule("delta_gate", "choice", DELTA_GATES),
    FieldRule("delta_gate_hidden_size", "int", 1),
    FieldRule("delta_eps", "positive"),
    FieldRule("delta_state_read", "choice", DELTA_STATE_READS),
    FieldRule("delta_embed_expand", "choice", DELTA_EMBED_EXPANDS),
    FieldRule("delta_conv_size", "int", 1),
    FieldRule("delta_value", "choice", DELTA_VALUES),
    FieldRule("delta_value_constant", "number", (-math.inf, math.inf)),
    FieldRule("delta_value_scale", "positive"),
    FieldRule(
        "delta_shared_read",
        "bool",
        expected="expected True (one read per block, the reference's) or False (one per residual)",
    ),
    FieldRule(
        "delta_erase", "bool", expected="expected True (erase and write) or False (write-only: X' = X + beta k v^T)"
    ),
    FieldRule("delta_implementation", "choice", DELTA_IMPLEMENTATIONS),
)
# DeltaGPTConfig's token mixer fields; `validate_token_mixer` adds the head size check.
TOKEN_MIXER_FIELD_RULES = (
    FieldRule("token_mixer", "choice", TOKEN_MIXERS),
    FieldRule("delta_net_heads", "int", 1, "expected None (= n_head) or an integer >= 1", optional=True),
    FieldRule("delta_net_head_dim", "int", 1, "expected None (= n_embd // heads) or an integer >= 1", optional=True),
    FieldRule("delta_net_conv_size", "int", 0, "expected an integer >= 0 (0 = no short convolution)"),
    FieldRule(
        "delta_net_allow_negative_eigval", "bool", expected="expected True (beta in (0, 2)) or False (beta in (0, 1))"
    ),
    FieldRule("delta_net_rule", "choice", DELTA_NET_RULES),
    FieldRule("delta_net_chunk_size", "int", 1),
)

# Every Auto class a saved DeltaGPT directory can be loaded with, through Hub custom code.
AUTO_MAP = {
    "AutoConfig": "configuration_delta_gpt.DeltaGPTConfig",
    "AutoModel": "modeling_delta_gpt.DeltaGPTModel",
    "AutoModelForCausalLM": "modeling_delta_gpt.DeltaGPTForCausalLM",
    "AutoModelForSequenceClassification": "modeling_delta_gpt.DeltaGPTForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_delta_gpt.DeltaGPTForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling_delta_gpt.DeltaGPTForQuestionAnswering",
}


@dataclasses.dataclass(kw_only=True)
class DeltaResidualConfigMixin:
    """The Delta residual's config fields and their validation, shared by every Delta model's config (DeltaGPTConfig,
    DeltaLlamaConfig): one definition, so a field or a check added here holds for both. The fields are documented in
    `DeltaGPTConfig`'s docstring. A dataclass, so that transformers' config dataclasses inherit its fields."""

    delta_mode: str = "additive"
    delta_value_channels: int = 1
    delta_beta_init: float | None = None
    delta_init: str | None = None
    delta_state_read: str = "linear"
    delta_embed_expand: str = "repeat"
    delta_conv_size: int = 4
    delta_shared_read: bool = False
    delta_value: str = "linear"
    delta_value_constant: float = 2.0
    delta_value_scale: float = 4.0
    delta_erase: bool = True
    delta_gate: str = "linear"
    delta_gate_hidden_size: int = 64
    delta_eps: float = 1e-6
    delta_implementation: str = "auto"

    @classmethod
    def reference(cls, variant: str = "tc", value_channels: int | None = None, **kwargs: Any) -> Any:
        """The authors' configuration of one of their model files (github.com/yifanzhang-pro/deep-delta-learning,
        `model/`, commit d1f7621), as far as this model's backbone allows (docs/variants.md, "The reference preset").

        `variant`: `"dv1"` (`DDL-vdim1-gpt-mha-rope-TC.py`, d_v = 1), `"tc"` (`DDL-gpt-mha-rope-TC.py`), `"tc_ec"`
        (`-TC-EC.py`), `"cc"` (`-CC.py`), `"cc_ec"` (`-CC-EC.py`); `value_channels` defaults to theirs (4; 1 for
        `"dv1"`). Paper mode, their initialisation (`delta_init="reference"`, beta 1), v = 4 sigmoid(W_v r + b) from
        the un-normalised read, k's epsilon 1e-5, one compressor per block. `kwargs` override any field.
        """
        if variant not in REFERENCE_VARIANTS:
            raise ValueError(f"{cls.__name__}.reference(variant={variant!r}): expected one of {REFERENCE_VARIANTS}.")
        channels = (1 if variant == "dv1" else 4) if value_channels is None else value_channels
        if (variant == "dv1") != (channels == 1):
            raise ValueError(
                f"{cls.__name__}.reference(variant={variant!r}, value_channels={channels}): 'dv1' is the d_v = 1 "
                "file, every other variant an expanded state (value_channels > 1)."
            )
        fields: dict[str, Any] = dict(
            delta_mode="paper",
            delta_init="reference",
            delta_beta_init=1.0,
            delta_value="sigmoid",
            delta_value_scale=4.0,
            delta_eps=1e-5,
            delta_gate="linear",
            delta_erase=True,
            delta_value_channels=channels,
            delta_state_read="linear" if variant == "dv1" else REFERENCE_READS[variant[:2]],
            delta_embed_expand="conv" if variant.endswith("_ec") else "repeat",
            # their CC kernel defaults to d_v (`ddl_state_shortconv_kernel_size` set to d_v when only d_v is given)
            delta_conv_size=channels if variant.startswith("cc") else 4,
            delta_shared_read=channels > 1,
        )
        fields.update(cls._reference_backbone(kwargs))
        fields.update(kwargs)
        return cls(**fields)

    @classmethod
    def _reference_backbone(cls, overrides: dict) -> dict:
        """Backbone fields of the reference preset (none for GPT-2's backbone)."""
        return {}

    def _delta_fail(self, field: str, allowed: str) -> None:
        raise ValueError(f"{type(self).__name__}.{field}={getattr(self, field)!r} is invalid: {allowed}.")

    def check_fields(self, rules: tuple[FieldRule, ...]) -> None:
        """A ValueError naming the first field that breaks its rule, its value and what is allowed."""
        for rule in rules:
            if not rule.accepts(getattr(self, rule.field)):
                self._delta_fail(rule.field, rule.message())

    def validate_delta_residual(self) -> None:
        """The residual's fields (`DELTA_FIELD_RULES`), then the variants' needs (docs/variants.md): a ValueError
        naming the field, the value and what is allowed."""
        self.check_fields(DELTA_FIELD_RULES)
        fail, channels = self._delta_fail, self.delta_value_channels
        if self.delta_state_read == "channel_conv":
            if channels < 2:
                fail("delta_state_read", "'channel_conv' mixes value channels: needs delta_value_channels > 1")
            if self.delta_conv_size > channels:
                fail("delta_conv_size", f"expected <= delta_value_channels={channels} for 'channel_conv'")
        if self.delta_embed_expand == "conv" and channels < 2:
            fail("delta_embed_expand", "'conv' fills the value channels: needs delta_value_channels > 1")

    def drop_runtime_fields(self, d: dict[str, Any]) -> dict[str, Any]:
        """`d` (a `to_dict`) without `delta_implementation`: how this process runs the model, not what the model is,
        so not saved, as transformers does not save `attn_implementation`."""
        d.pop("delta_implementation", None)
        return d

    @property
    def delta_temporal(self) -> bool:
        """Whether a variant convolves over tokens (TC, EC), so that generation must cache recent states or
        embeddings: whether its `state_plan` has windows."""
        return bool(state_plan(self).windows)


class DeltaGPTConfig(GPT2Config, DeltaResidualConfigMixin):
    r"""
    Configuration of a DeltaGPT model: every GPT-2 field under GPT-2's name, plus the Delta residual.

    Each attention and MLP residual `x + F(x)` of GPT-2 becomes a Delta block acting on the residual state
    `X` (shape `[..., n_embd]` when `delta_value_channels == 1`, `[..., n_embd, delta_value_channels]` otherwise):

        c = LayerNorm(read(X)),  h = F(c),  k = h / sqrt(|h|^2 + eps^2),
        beta = 2 * sigmoid(gate(c)) * rho,  v = W_v c,
        paper:    X' = X          + beta * k (v^T - k^T X)
        additive: X' = X + h 1^T  + beta * k (v^T - k^T X)

    `rho = clamp(beta_open, 0, 1)` is a learned per-block opening with a straight-through gradient. It is what lets
    `delta_beta_init=0.0` make beta *exactly* zero (so the additive model is exactly GPT-2) while the gate still
    gets a non-zero gradient: a smooth gate that is >= 0 and equals 0 sits at its minimum and has zero gradient.

    Args:
        delta_mode (`str`, defaults to `"additive"`):
            `"additive"` keeps GPT-2's `x + F(x)` and adds the Delta term (beta = 0 is exactly GPT-2);
            `"paper"` is eq. 2.5 of the paper (beta = 0 makes every block the identity).
        delta_value_channels (`int`, defaults to 1):
            d_v, the number of value channels of the residual state (1 = vector state, >1 = expanded matrix state).
        delta_beta_init (`float`, *optional*):
            Initial beta b of every Delta block, in [0, 2] (0 = no update, 1 = projection, 2 = reflection); how it is
            met depends on `delta_init`. None (default) = the scheme's value: 0.0 under `"exact"`, 1.0 (the reference
            code's) under `"reference"`; the model writes the value it used back into the config.
        delta_init (`str`, *optional*):
            How new Delta parameters start:
            `"exact"`: the gate's last weight starts at 0, so beta = b for every token: exactly for b in [0, 1]
            (opening rho = b, gate bias 0); for b in (1, 2] rho = 1 and the bias is logit(b / 2), exact to float
            rounding. Read convolutions start as the identity. With b = 0 an additive model computes GPT-2
            bit for bit (so a converted GPT-2 is reproduced) and a paper-mode model is a stack of identity blocks.
            `"reference"`: the authors' from-scratch init: random gate weights and rho = 1, so beta =
            2 sigmoid(w^T c + logit(b / 2)) varies per token around b (b / 2 clamped to [1e-6, 1 - 1e-6]); b = 1 by
            default, so a from-scratch paper-mode model is not a stack of identity blocks. b = 0 closes the gate
            instead (rho = 0, gate bias 0): beta is exactly 0 for every token, as under `"exact"`, and rho still gets
            a gradient. Temporal/channel read convolutions start as an average over their taps under this scheme,
            so with b = 0 a TC or CC model still differs from its backbone.
            None (default, auto) = `"exact"` for Delta parameters that a loaded checkpoint lacks (conversion,
            `from_pretrained` of a GPT-2 checkpoint) and `"reference"` for a model built from its config; the model
            writes the scheme it used back into the config.
        delta_state_read (`str`, defaults to `"linear"`):
            How a sublayer reads the expanded state (and how the final state is read before `ln_f`): `"linear"` (the
            read vector), `"temporal_conv"` (the reference's TC: a causal depthwise convolution over the last
            `delta_conv_size` tokens, then the read vector) or `"channel_conv"` (CC: a convolution across the d_v
            value channels, then the read vector; needs d_v > 1 and `delta_conv_size <= d_v`).
        delta_embed_expand (`str`, defaults to `"repeat"`):
            How the embedding becomes the d x d_v state: `"repeat"` over the channels, or `"conv"` (EC: a causal
            depthwise convolution over time with one kernel per value channel; needs d_v > 1).
        delta_conv_size (`int`, defaults to 4):
            Kernel size of the variant convolutions (tokens for the temporal ones, channels for `"channel_conv"`).
        delta_shared_read (`bool`, defaults to `False`):
            True: a block's attention and MLP residuals read the state with one compressor (the MLP's read uses the
            attention residual's read vector and convolution), as the authors' code does. False: each residual has
            its own. Only matters for d_v > 1 or a convolution read.
        delta_value (`str`, defaults to `"linear"`):
            `"linear"` v = W_v c from the normalised sublayer input c; `"sigmoid"` v = `delta_value_scale` *
            sigmoid(W_v r + b) from the un-normalised read r (the state itself at d_v = 1, the read of the state at
            d_v > 1), the authors' default; or `"constant"` v = `delta_value_constant` in every channel.
        delta_value_constant (`float`, defaults to 2.0):
            The value written by `delta_value="constant"`.
        delta_value_scale (`float`, defaults to 4.0):
            The range (0, scale) of `delta_value="sigmoid"` (the authors' `ddl_v_sigmoid_scale`).
        delta_erase (`bool`, defaults to `True`):
            False drops the erase term: the write-only ablation X' = X + beta k v^T (+ h 1^T in additive mode).
        delta_gate (`str`, defaults to `"linear"`):
            `"linear"` gate logit `w^T c + b`, or `"mlp"` for the paper's eq. A.2 `w^T tanh(W_in c)`.
        delta_gate_hidden_size (`int`, defaults to 64):
            Hidden width of the `"mlp"` gate.
        delta_eps (`float`, defaults to 1e-6):
            epsilon of the direction normalisation `k = h / sqrt(|h|^2 + eps^2)`.
        delta_implementation (`str`, defaults to `"auto"`):
            Which kernels run the Delta residuals, the TC reads and DeltaNet's rule, chosen per model as
            `attn_implementation` chooses attention (also `from_pretrained(..., delta_implementation=...)` and
            `model.set_delta_implementation(...)`; not saved): `"eager"` the tensor ops (the readable reference);
            `"triton"` one Triton op per Delta residual and per read, forward and backward (CUDA; CPU tensors under
            Triton's interpreter, `TRITON_INTERPRET=1`), and fla's delta rule; `"native"` the CPU kernels of
            `ddl_hf.native`; `"auto"` Triton's on CUDA where they run, the tensor ops elsewhere. Kernels other than
            the tensor ops come from the `ddl_hf` package: a saved directory loaded through its Hub files alone
            (`ddl_hf` not imported) runs `"auto"` as `"eager"`.
        token_mixer (`str`, defaults to `"attention"`):
            The sublayer inside each attention Delta residual: `"attention"` (GPT-2's softmax attention) or
            `"delta_net"` (DeltaNet: the delta rule over time, `S_t = S_{t-1}(I - beta k k^T) + beta v k^T`,
            `o_t = S_t q_t`, with a constant-size recurrent state per head instead of a KV cache).
        delta_net_heads (`int`, *optional*):
            DeltaNet heads; defaults to `n_head`.
        delta_net_head_dim (`int`, *optional*):
            d_k = d_v per DeltaNet head; defaults to `n_embd // delta_net_heads`.
        delta_net_conv_size (`int`, defaults to 4):
            Kernel size of the short causal depthwise convolution on q, k, v; 0 disables it.
        delta_net_allow_negative_eigval (`bool`, defaults to `False`):
            beta = 2 sigmoid(.) in (0, 2) instead of sigmoid(.) in (0, 1): the transition I - beta k k^T can then have
            the negative eigenvalue 1 - beta (beta = 2 is a reflection).
        delta_net_rule (`str`, defaults to `"delta"`):
            `"delta"` (erase and replace) or `"write_only"` (purely additive linear attention `S_t = S_{t-1} + beta v
            k^T`, the same layer with the erase term removed; a baseline). The old spelling `"additive"` is accepted
            with a FutureWarning: `delta_mode="additive"` means something else (keep GPT-2's `x + F(x)`).
        delta_net_chunk_size (`int`, defaults to 64):
            Chunk length of the chunkwise-parallel delta rule used for training and prefill.
    """

    model_type = "delta_gpt"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]  # the cache output, named `cache` from transformers 5.24

    # The Delta residual's fields (delta_mode ... delta_eps) come from DeltaResidualConfigMixin.
    token_mixer: str = "attention"
    delta_net_heads: int | None = None
    delta_net_head_dim: int | None = None
    delta_net_conv_size: int = 4
    delta_net_allow_negative_eigval: bool = False
    delta_net_rule: str = "delta"
    delta_net_chunk_size: int = 64

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if isinstance(self.delta_net_rule, str) and self.delta_net_rule in DELTA_NET_RULE_ALIASES:
            new = DELTA_NET_RULE_ALIASES[self.delta_net_rule]
            warnings.warn(
                f"delta_net_rule={self.delta_net_rule!r} is deprecated; use delta_net_rule={new!r} (same behaviour).",
                FutureWarning,
                stacklevel=2,
            )
            self.delta_net_rule = new
        if getattr(self, "auto_map", None) is None:
            self.auto_map = dict(AUTO_MAP)
        self.validate_delta()

    def validate(self) -> None:
        super().validate()
        self.validate_delta()

    def to_dict(self) -> dict[str, Any]:
        return self.drop_runtime_fields(super().to_dict())

    def validate_delta(self) -> None:
        """Raise a ValueError naming the field, the value and what is allowed."""
        self.validate_delta_residual()
        if self.add_cross_attention:
            self._delta_fail("add_cross_attention", "DeltaGPT is decoder-only; cross-attention is not supported")
        self.validate_token_mixer()

    @property
    def layer_types(self) -> list[str]:
        """transformers' kind of every layer, from `token_mixer`: `"linear_attention"` (DeltaNet: a fixed-size recurrent
        state, no KV cache) or `"full_attention"`. transformers' cache builders, mask helpers and support checks
        (context parallelism, quantized caches) read it. Derived, so it never disagrees with `token_mixer`."""
        kind = "linear_attention" if self.token_mixer == "delta_net" else "full_attention"
        return [kind] * self.num_hidden_layers

    @layer_types.setter
    def layer_types(self, value: list[str] | None) -> None:
        """Accepts only what `token_mixer` implies (a saved config may carry it); DeltaGPT has no mixed stacks."""
        if value is not None and list(value) != self.layer_types:
            raise ValueError(
                f"DeltaGPTConfig.layer_types={list(value)!r} is invalid: it follows token_mixer="
                f"{self.token_mixer!r} ({self.layer_types[:1]} for each of the {self.num_hidden_layers} layers); "
                "set token_mixer instead."
            )

    def validate_token_mixer(self) -> None:
        """The token mixer fields (`TOKEN_MIXER_FIELD_RULES`) and DeltaNet's head size: a ValueError naming the field,
        the value and what is allowed."""
        self.check_fields(TOKEN_MIXER_FIELD_RULES)
        fail, heads = self._delta_fail, self.delta_net_heads or self.n_head
        if self.delta_net_head_dim is None and self.token_mixer == "delta_net" and self.n_embd % heads:
            fail("delta_net_head_dim", f"None needs n_embd={self.n_embd} divisible by {heads} heads; set it")


__all__ = ["DeltaGPTConfig", "DeltaResidualConfigMixin", "FieldRule"]
