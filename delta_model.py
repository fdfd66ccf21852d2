"""The Delta model around its layers, shared by every Delta model family (DeltaGPT, DeltaLlama).

What a Delta base model adds around its stack of blocks (`DeltaStackMixin`: the cache, the convolution context of
packed and padded rows, the expansion of the embedding, the records behind `hidden_states` / `expanded_states`, the
read-out before the final norm), and what its `PreTrainedModel` base adds (`DeltaPreTrainedMixin`: which modules and
parameters are Delta, their initialisation, the cache `generate` needs, the names older directories saved the reads
under). Also the input checks. What the model carries across tokens is its `StatePlan` (`delta_state.py`); the
layers are in `delta_layers.py` and `delta_reads.py`, the math in `delta_ops.py`.

Self-contained Hub custom-code file: it imports only torch, transformers and its sibling files, which
`save_pretrained` copies next to the weights.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

# First: below the supported transformers / torch it stops here with one clear error (delta_compat.py).
from .delta_compat import (
    CACHE_ARG,
    check_checkpoint_format,
    hidden_states_indices,
    was_loaded,
)

# isort: split
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.configuration_utils import PreTrainedConfig
from transformers.generation import GenerationMode

from .delta_layers import (
    DeltaResidual,
    beta_upper_bound,
    init_delta_residual_as_reference,
    init_delta_residual_exactly,
    resolve_delta_init,
)
from .delta_net import DeltaNetCache
from .delta_ops import prepare_delta_kernels
from .delta_reads import (
    DeltaConvContext,
    DeltaEmbedExpand,
    DeltaRead,
    DeltaStateCache,
    DeltaStateConv,
    WindowSource,
)
from .delta_state import (
    StatePlan,
    packed_document_starts,
    refuse_state_across_tokens_in_serving_engines,
    state_plan,
)

# ----------------------------------------------------------------------------------------------------------------
# The Delta steps around a stack of layers
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class DeltaOutputs:
    """The Delta models' outputs besides transformers' (a family's output class lists it first among its bases, so
    that these fields come after the transformers output's own):

    betas (`tuple[torch.FloatTensor]`, *optional*, returned with `output_betas=True`):
        One `[batch_size, seq_len]` tensor per Delta residual, two per layer (attention, then MLP).
    expanded_states (`tuple[torch.FloatTensor]`, *optional*, with `output_expanded_states=True`, d_v > 1 only):
        The residual state `[batch_size, seq_len, hidden_size, d_v]` entering every layer and leaving the last one.
    """

    betas: tuple[torch.FloatTensor, ...] | None = None
    expanded_states: tuple[torch.FloatTensor, ...] | None = None


def state_cache_class(plan: StatePlan) -> type[DeltaStateCache | DeltaNetCache] | None:
    """The cache class that keeps `plan`'s state across tokens, and says what `generate` may do with it (`require`,
    `rolls_back`, `static_form`, `refuse_rollback`): DeltaNet's (its recurrent states, and any windows), the windows'
    (TC / EC), or None (transformers' own caches)."""
    if plan.recurrent:
        return DeltaNetCache
    return DeltaStateCache if plan.windows else None


@dataclass
class StateRecords:
    """What a forward records of the residual state for its outputs: `hidden` (the `output_hidden_states` request: a
    flag, or indices where transformers takes them), `expanded` (`output_expanded_states`), and per layer its input
    state and that state's `[.., hidden_size]` entry of `hidden_states` (the state itself at d_v = 1)."""

    hidden: object
    expanded: bool
    states: list[torch.Tensor] = field(default_factory=list)
    reads: list[torch.Tensor] = field(default_factory=list)


class _ReadInGraph(torch.autograd.Function):
    """The expanded state X unchanged, with its read h = X w made one of its parents, so that a `hidden_states` entry
    is in the graph as GPT-2's are (`h.retain_grad()` works). The gradient reaching X passes on whole: its component
    along u = w / |w|^2 goes through h (dL/dh holding X - h u^T fixed), the rest straight to X."""

    @staticmethod
    def forward(ctx, read: torch.Tensor, state: torch.Tensor, u: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(u, w)
        return state.view_as(state)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        u, w = ctx.saved_tensors
        grad_read = grad @ u
        return grad_read, grad - grad_read.unsqueeze(-1) * w, None, None


class DeltaStackMixin:
    """The Delta steps a base model adds around its stack of layers (DeltaGPT, DeltaLlama): the cache, the context of
    the temporal convolutions, X_0 from the embedding, the state records for the outputs. The model builds its
    `embed_expand` and `read_out` with `init_state_modules`, and sets `state_plan` (`DeltaPreTrainedMixin`)."""

    def init_state_modules(self, config: PreTrainedConfig) -> None:
        """The stack's own Delta modules: EC's expansion of the embedding into the state (None: a repeat over the
        value channels) and the read-out of the last state for the final norm (docs/variants.md)."""
        self.value_channels = config.delta_value_channels
        self.embed_expand = (
            DeltaEmbedExpand(config.hidden_size, self.value_channels, config.delta_conv_size)
            if config.delta_embed_expand == "conv"
            else None
        )
        self.read_out = DeltaRead(config)

    def delta_cache(self, cache: Cache | None, use_cache: bool | None) -> Cache | None:
        """The cache to run with: a new one of the kind the variant needs when asked for (`use_cache`), else the given
        one, refused where it cannot keep what runs over tokens (DeltaNet's state, the TC / EC windows). A training
        forward (training mode, autograd on) builds none of those that carry state across tokens unless given one:
        their windows and states would cost each read a copy of the state, for a cache nobody decodes from. GPT-2's
        key-value cache (references, no copy) is built as transformers builds it."""
        keeper = state_cache_class(self.state_plan)
        training = self.training and torch.is_grad_enabled()
        if use_cache and cache is None and not (training and keeper is not None):
            cache = DynamicCache(config=self.config) if keeper is None else keeper(self.config)
        if keeper is not None:
            keeper.require(cache)
        return cache

    def delta_context(
        self,
        attention_mask: torch.Tensor | dict | None,
        cache: Cache | None,
        position_ids: torch.Tensor | None,
        shape: tuple[int, int],
        past_seen_tokens: int,
        kwargs: dict,
    ) -> DeltaConvContext:
        """What runs over tokens needs besides its input: the 2-D padding mask, the cache of the convolution windows
        (not under gradient checkpointing, whose recomputed layers must not write twice), and where packed documents
        start (`position_ids` restarting at 0, flash-attention's `cu_seq_lens` kwargs)."""
        plan, starts = self.state_plan, None
        if plan.across_tokens:
            cu_seq_lens = kwargs.get("cu_seq_lens_q", kwargs.get("cu_seq_lens_k"))
            starts = packed_document_starts(position_ids, cu_seq_lens, shape, past_seen_tokens)
        two_d = isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 2
        checkpointing = self.gradient_checkpointing and self.training
        return DeltaConvContext(
            token_mask=attention_mask if two_d else None,
            cache=cache if plan.windows and not checkpointing else None,
            document_starts=starts,
        )

    def state_records(self, kwargs: dict) -> StateRecords | None:
        """Takes the output flags out of `kwargs` and returns where to record the states for `hidden_states` /
        `expanded_states`, or None when neither is asked for (`betas` and `attentions` are transformers' recorders)."""
        hidden = kwargs.pop("output_hidden_states", None)
        hidden = self.config.output_hidden_states if hidden is None else hidden
        expanded = bool(kwargs.pop("output_expanded_states", False)) and self.value_channels > 1
        for flag in ("output_attentions", "output_betas"):
            kwargs.pop(flag, None)
        hidden = None if hidden is None or hidden is False else hidden
        return StateRecords(hidden, expanded) if hidden is not None or expanded else None

    def expand_state(self, embeddings: torch.Tensor, context: WindowSource) -> torch.Tensor:
        """X_0: the embedding itself (d_v = 1), convolved into the channels (EC), or repeated over them (a view)."""
        if self.embed_expand is not None:
            return self.embed_expand(embeddings, context)
        if self.value_channels > 1:
            return embeddings.unsqueeze(-1).expand(*embeddings.shape, self.value_channels)
        return embeddings

    def record_state(self, state: torch.Tensor, records: StateRecords | None) -> torch.Tensor:
        """Record a layer's input state and its `hidden_states` entry: at d_v > 1 its read with the final read vector,
        made one of the state's parents when autograd is on, so that the entry is in the graph as GPT-2's are."""
        if records is None:
            return state
        read = state
        if self.value_channels > 1:
            w = self.read_out.weights.detach().to(state.dtype)
            read = state @ w
            if torch.is_grad_enabled():
                norm = w @ w
                u = torch.where(norm > 0, w / norm, torch.zeros_like(w))  # w = 0: the read carries no gradient
                state = _ReadInGraph.apply(read, state, u, w)
        records.states.append(state)
        records.reads.append(read)
        return state

    def state_outputs(
        self, records: StateRecords | None, final_state: torch.Tensor, last_hidden_state: torch.Tensor
    ) -> dict[str, tuple[torch.Tensor | None, ...] | None]:
        """`hidden_states` (transformers' contract: `[batch, seq_len, hidden_size]`, one per layer input and the
        final `last_hidden_state`; None where a chosen-layer request skips one) and `expanded_states` (the states
        `[.., hidden_size, d_v]` entering every layer, and the last one)."""
        if records is None:
            return {"hidden_states": None, "expanded_states": None}
        hidden = None
        if records.hidden is not None:
            entries = (*records.reads, last_hidden_state)
            chosen = set(hidden_states_indices(self, records.hidden, len(entries)))
            hidden = tuple(entry if i in chosen else None for i, entry in enumerate(entries))
        expanded = (*records.states, final_state) if records.expanded else None
        return {"hidden_states": hidden, "expanded_states": expanded}


def check_token_ids(input_ids: torch.Tensor | None, vocab_size: int) -> None:
    """A clear error for token ids outside the vocabulary (not an index error deep inside the embedding), checked on
    the device without making the host wait (`torch._assert_async`)."""
    if input_ids is None or not input_ids.numel():
        return
    inside = ((input_ids >= 0) & (input_ids < vocab_size)).all()
    torch._assert_async(
        inside,
        f"input_ids contain token ids outside [0, vocab_size={vocab_size}). Use the tokenizer the model was trained "
        "with, or call model.resize_token_embeddings(len(tokenizer)) after adding tokens.",
    )


# ----------------------------------------------------------------------------------------------------------------
# Directories saved before the reads became modules of the block
# ----------------------------------------------------------------------------------------------------------------

#: (old name, new name) of the read parameters: until e568c07 a residual held its read (`attn_delta.read_weights`,
#: `attn_delta.read_conv.weight`) and the model its read-out (`read_out`, `read_out_conv.weight`). `from_pretrained`
#: renames them on load (transformers' `key_mapping`), and only there: a model built or converted now saves the new
#: names. A registered conversion mapping would be reverted on every save, writing the old names into new
#: directories, and transformers expects each registered conversion to apply to every instance (a d_v = 1 model has
#: no read weights). Re-saving a loaded old directory keeps its layout, transformers' rule for renames used at load.
RENAMED_WEIGHTS = (  # regex sources, as vLLM's weight mapper takes them too (vllm_models.py)
    ("attn_delta.read_weights", "attn_read.weights"),
    ("attn_delta.read_conv.weight", "attn_read.conv.weight"),
    ("mlp_delta.read_weights", "mlp_read.weights"),
    ("mlp_delta.read_conv.weight", "mlp_read.conv.weight"),
    ("read_out_conv.weight", "read_out.conv.weight"),
    ("read_out(?![_.])", "read_out.weights"),  # the bare parameter, not `read_out_conv` / the new names
)


class DeltaSite(NamedTuple):
    """Where a Delta residual sits: its module name, its short label, the module, and the norm feeding it."""

    name: str
    short_name: str
    residual: nn.Module
    norm: nn.Module


#: The modules that a source checkpoint lacks: their parameters are `delta_parameters()`.
DELTA_MODULES = (DeltaResidual, DeltaRead, DeltaEmbedExpand)


class DeltaPreTrainedMixin:
    """What every Delta model's `PreTrainedModel` base adds: the one place that says which modules and parameters are
    Delta (conversion, export, DeltaTrainer, DeltaStatsCallback and `ddl-hf inspect` all ask these methods), and the
    Delta initialisation. The family's base sets `layers_attribute` (its base model's list of layers)."""

    layers_attribute: str = "layers"
    # transformers' `_keep_in_fp32_modules`: every quantizer (bitsandbytes 4 / 8 bit, ...) leaves these modules
    # unquantized, and a float16 load keeps their checkpoint tensors in float32 (bf16 loads are unchanged). They are the
    # precision-critical Delta parts: each residual (the gate `beta_proj` and its MLP form, `beta_open`, `v_proj`), each
    # block's reads (`attn_read`, `mlp_read`: the read vector and the TC / CC convolution), the read-out's convolution
    # and EC's; not the read-out's read vector (`read_out.weights`), cast to the state's dtype where it is used.
    # transformers matches each entry by `re.match` from the start of a module name (quantizers; or a suffix) and by
    # `re.search` in a parameter name (the float16 plan): `.+\.` ties the names to a layer, so the sublayers' own
    # `self_attn.v_proj`, `c_attn` still quantize. DeltaNet's beta projection (`attn.b_proj`, num_heads outputs) is kept
    # out of quantization only: `$` ends at the module name, so no parameter name matches and it keeps the model's
    # dtype, as the mixer computes it. Each instance declares only the entries it has a module for (`post_init`), as
    # transformers' `test_keep_in_fp32_modules_exist` asks; that test matches state-dict names, which the
    # quantization-only `$` entry never does by design.
    _keep_in_fp32_modules = [r".+\.(?:attn|mlp)_(?:delta|read)", r".+\.attn\.b_proj$", "read_out.conv", "embed_expand"]

    def __init__(self, config, *inputs, **kwargs):
        super().__init__(config, *inputs, **kwargs)
        refuse_state_across_tokens_in_serving_engines(self.config)
        #: What this model carries across tokens: every question about it reads this (`delta_state.py`).
        self.state_plan = state_plan(self.config)
        keeper = state_cache_class(self.state_plan)
        # transformers' capability flags, per instance (they depend on the variant): a state that cannot roll back
        # makes the model stateful (generate refuses assisted decoding); one without a static cache cannot run
        # transformers' compiled generation, which tools and tests that read the flag skip up front (the refusal in
        # `_prepare_cache_for_generation` stays). DeltaNet: neither (`DeltaNetCache`); TC / EC: both.
        if keeper is not None and not keeper.rolls_back:
            self._is_stateful = True
        if keeper is not None and keeper.static_form is None:
            self._can_compile_fullgraph = False

    @classmethod
    def from_pretrained(cls, *args, key_mapping: dict[str, str] | None = None, **kwargs):
        """transformers' `from_pretrained`; a directory saved under the old read names (`RENAMED_WEIGHTS`) loads
        through its `key_mapping` (a caller's own entries come after them)."""
        key_mapping = {**dict(RENAMED_WEIGHTS), **(key_mapping or {})}
        return super().from_pretrained(*args, key_mapping=key_mapping, **kwargs)

    def set_delta_implementation(self, implementation: str) -> None:
        """Run this model's Delta residuals, reads and DeltaNet rule with `implementation` ("auto", "eager",
        "triton", "native"; `DeltaGPTConfig.delta_implementation`), as `set_attn_implementation` chooses attention:
        one that cannot run here, or not on this model's device, is a clear error now, not at the first forward."""
        prepare_delta_kernels(implementation, self.device.type)
        self.config.delta_implementation = implementation

    def post_init(self) -> None:
        # Not the device: a model is often built on the CPU (or meta) and moved.
        prepare_delta_kernels(self.config.delta_implementation)
        names = [name for name, _ in self.named_modules()]
        self._keep_in_fp32_modules = [
            entry
            for entry in type(self)._keep_in_fp32_modules
            if any(re.fullmatch(rf"(?:.*\.)?(?:{entry})", name) for name in names)
        ]
        super().post_init()

    def delta_residuals(self, short_names: bool = False) -> dict[str, nn.Module]:
        """Every Delta residual in forward order (per layer: attention, then MLP), by module name.

        Names are relative to this model (`transformer.h.0.attn_delta` on a head model), or `L0.attn`, `L0.mlp`, ...
        with `short_names=True`. A wrapper that a tool put in a residual's place (peft's `modules_to_save`) is
        returned as it is: it runs, and forwards attribute access to, the active copy.
        """
        return {site.short_name if short_names else site.name: site.residual for site in self.delta_sites()}

    def delta_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters that the source checkpoint does not have (gates, values, reads), by name."""
        owners = tuple(f"{name}." for name, module in self.named_modules() if isinstance(module, DELTA_MODULES))
        return {name: p for name, p in self.named_parameters() if name.startswith(owners)}

    @torch.no_grad()
    def beta_upper_bounds(self) -> dict[str, float]:
        """The largest beta each Delta residual can produce over every input (see `beta_upper_bound`)."""
        return {site.name: beta_upper_bound(site.residual, site.norm) for site in self.delta_sites()}

    def _base_prefix(self) -> str:
        return "" if self.base_model is self else f"{self.base_model_prefix}."

    def _validate_generation_mode(self, generation_mode: GenerationMode, *args, **kwargs) -> None:
        """Refuse assisted decoding up front for a state that cannot roll back over rejected draft tokens (DeltaNet's),
        naming why (transformers' own check says only "stateful model")."""
        keeper = state_cache_class(self.state_plan)
        if keeper is not None and generation_mode == GenerationMode.ASSISTED_GENERATION:
            keeper.refuse_rollback("with assisted / speculative decoding or prompt lookup")
        return super()._validate_generation_mode(generation_mode, *args, **kwargs)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args, **kwargs) -> None:
        """`generate` builds a cache from the config; a model with state across tokens needs the cache that keeps it
        (`state_cache_class`), or its static form."""
        keeper = state_cache_class(self.state_plan)
        if keeper is None:
            return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        keeper.require(model_kwargs.get(CACHE_ARG))  # before generate asks it for its length
        if getattr(generation_config, "is_assistant", False):
            keeper.refuse_rollback("as the assistant (draft model) of assisted decoding")
        if model_kwargs.get(CACHE_ARG) is not None or generation_config.use_cache is False:
            return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        implementation = generation_config.cache_implementation
        if implementation == "static" and keeper.static_form is not None:  # sized as generate sizes a StaticCache
            super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
            length = model_kwargs[CACHE_ARG].layers[0].max_cache_len
            model_kwargs[CACHE_ARG] = keeper.static_form(self.config, max_cache_len=length)
            return None
        if implementation not in (None, "dynamic"):
            settings = " and ".join(self.state_plan.settings)
            raise ValueError(
                f"cache_implementation={implementation!r} is not supported with {settings}: its state across tokens "
                f"is kept by {keeper.__name__}. Leave cache_implementation unset"
                f"{' (or static)' if keeper.static_form is not None else ''}."
            )
        model_kwargs[CACHE_ARG] = keeper(self.config)

    def delta_sites(self) -> list[DeltaSite]:
        """Every Delta residual with its name, short name and the norm that feeds its sublayer and gate."""
        prefix = f"{self._base_prefix()}{self.layers_attribute}"
        return [
            DeltaSite(f"{prefix}.{i}.{attr}", f"L{i}.{attr.removesuffix('_delta')}", residual, norm)
            for i, layer in enumerate(getattr(self.base_model, self.layers_attribute))
            for attr, (residual, norm) in layer.delta_residuals().items()
        ]

    def _initialize_missing_keys(self, is_quantized: bool) -> None:
        """Loading a checkpoint: Delta parameters it lacks (a source checkpoint: conversion) get the exact init
        unless the config asks otherwise, so `delta_init=None` never changes a converted model's function. A load
        that supplied no weight at all (`from_pretrained(None, config=..., state_dict={})`, as sharded loading and
        transformers' own init tests do) builds the model from its config, as `XxxForCausalLM(config)` does."""
        tied = set(self._tied_weights_keys or ())  # marked as loaded even when the checkpoint lacks both ends
        supplied = any(was_loaded(p) for name, p in self.named_parameters() if name not in tied)
        resolve_delta_init(self.config, loading=supplied)
        super()._initialize_missing_keys(is_quantized)

    def _adjust_missing_and_unexpected_keys(self, loading_info) -> None:
        """A ddl-hf 0.1 checkpoint (0-dim `beta_open`) is refused with one line naming `ddl-hf upgrade`."""
        check_checkpoint_format(self, loading_info)
        super()._adjust_missing_and_unexpected_keys(loading_info)

    def initialize_weights(self) -> None:
        """Built from its config (from scratch): `delta_init=None` becomes the reference code's init."""
        resolve_delta_init(self.config, loading=False)
        super().initialize_weights()

    def init_delta_weights(self, module: nn.Module) -> None:
        """The Delta part of `_init_weights`: residuals that start at exactly `config.delta_beta_init` (or the
        reference's start), read vectors at 1 / d_v, identity (exact) or averaging (reference) convolutions."""
        config = self.config
        resolve_delta_init(config, loading=False)  # no-op once resolved
        if isinstance(module, DeltaResidual):
            if config.delta_init == "reference":
                init_delta_residual_as_reference(module, float(config.delta_beta_init))
            else:
                init_delta_residual_exactly(module, float(config.delta_beta_init), config.initializer_range)
        elif isinstance(module, DeltaRead) and module.weights is not None:
            init.constant_(module.weights, 1.0 / module.weights.numel())
        elif isinstance(module, DeltaStateConv):
            if config.delta_init == "exact":
                init.copy_(module.weight, module.identity())
            else:
                init.constant_(module.weight, 1.0 / module.size)
        elif isinstance(module, DeltaEmbedExpand):
            init.copy_(module.weight, module.identity())  # the reference code starts EC as the repeat, too


__all__ = [
    "DELTA_MODULES",
    "RENAMED_WEIGHTS",
    "DeltaOutputs",
    "DeltaPreTrainedMixin",
    "DeltaSite",
    "DeltaStackMixin",
    "StateRecords",
    "check_token_ids",
    "state_cache_class",
]
