"""Turn a GPT-2 checkpoint into a DeltaGPT that starts equivalent to it, and back.

Three layers, each usable on its own:

* `convert_gpt2(source, **overrides)`: in memory, GPT-2 weights -> `DeltaGPTForCausalLM` (Delta gates at
  `delta_beta_init`, default beta = 0 exactly, so the additive model computes the source's function).
* `convert_checkpoint(source, output, ...)`: the whole job behind the CLI. Writes a complete Hub repository
  (config with `auto_map`, the two custom-code files, safetensors, tokenizer, generation config, model card) to a
  temporary directory beside `output`, verifies the written files against the source, and only then renames the
  directory into place, so a failure at any point leaves no partial output.
* `export_to_gpt2(model)`: the exact way back, allowed only when every Delta gate is closed.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import errno
import math
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import CommitOperationAdd, HfApi, ModelCard, ModelCardData
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoTokenizer, GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as hf_logging

from .configuration_delta_gpt import DeltaGPTConfig
from .modeling_delta_gpt import DeltaGPTForCausalLM

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_MAX_SHARD_SIZE = "2GB"
# Largest |logit difference| accepted when the conversion is meant to be exact (additive mode, beta = 0).
# In float32 the Delta term is exactly 0, so the measured figure is 0; the bound leaves room for kernels that
# reorder sums. Half precisions round the same operations the same way, but allow for their coarser grid.
EQUIVALENCE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
# Parameter-name markers of everything a GPT-2 checkpoint does not have.
DELTA_PARAM_MARKERS = (".attn_delta.", ".mlp_delta.", "transformer.read_out")
# Files that make the output directory a tokenizer repository as well (any one of them is enough).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json")

# Held-out text for the verification report (written for this package; not in any training set we use).
SAMPLE_TEXT = (
    "The lighthouse keeper wrote the weather into a ledger every evening: wind from the west, a grey swell, "
    "two fishing boats back before dark. Nobody had asked him to keep the ledger, and nobody read it, but the "
    "habit had outlived three inspectors and one storm that took the roof off the boathouse.\n\n"
    "In spring the council sent a young engineer to install an automatic lamp. She stayed a week, measured the "
    "tower twice, and spent her last evening reading the ledger from the first page. When she left she asked "
    "whether she could come back in the autumn, not to finish the lamp, which already worked, but to see if the "
    "swallows returned to the same beam above the door. He said they always did, and that he had written it down."
)


class ConversionError(ValueError):
    """A conversion problem the user can fix; the message names the problem and the fix."""


# ----------------------------------------------------------------------------------------------------------------
# Loading and checking the source
# ----------------------------------------------------------------------------------------------------------------


def _config_override_names() -> set[str]:
    return {f.name for f in dataclasses.fields(DeltaGPTConfig)}


def _check_gpt2_config(config, source_name: str) -> None:
    """Refuse configs DeltaGPT cannot reproduce, naming the flag and what to do instead."""
    model_type = getattr(config, "model_type", None)
    if model_type == DeltaGPTConfig.model_type:
        raise ConversionError(
            f"{source_name} is already a DeltaGPT (model_type 'delta_gpt'); load it with "
            "AutoModelForCausalLM.from_pretrained instead of converting it again."
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
    unknown = sorted(set(overrides) - _config_override_names())
    if unknown:
        raise ConversionError(
            f"Unknown DeltaGPTConfig field(s) {unknown}. Valid Delta fields: delta_mode, delta_value_channels, "
            "delta_beta_init, delta_gate, delta_gate_hidden_size, delta_eps (and any GPT-2 config field)."
        )
    fields = gpt2_config.to_dict()
    for key in ("model_type", "architectures", "auto_map", "transformers_version", "_name_or_path"):
        fields.pop(key, None)
    fields = {key: value for key, value in fields.items() if key in _config_override_names()}
    try:
        config = DeltaGPTConfig(**{**fields, **overrides})
    except ValueError as error:
        raise ConversionError(f"Invalid DeltaGPT setting: {error}") from error
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


@contextlib.contextmanager
def _progress_bars(enabled: bool) -> Iterator[None]:
    """Turn transformers' own bars (loading/writing weights) off with ours, and restore them afterwards."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled and not enabled:
            hf_logging.enable_progress_bar()


def _describe_mismatch(entry) -> str:
    """transformers reports (name, shape in the checkpoint, shape the config asks for)."""
    if isinstance(entry, tuple) and len(entry) == 3:
        name, found, expected = entry
        return f"{name} {list(found)} in the checkpoint, {list(expected)} for config.json"
    return str(entry)


def load_gpt2(source: str | os.PathLike, dtype: str | torch.dtype | None = "auto") -> GPT2LMHeadModel:
    """Load a GPT-2 LM from a Hub id or a directory, refusing anything that is not exactly GPT-2.

    `from_pretrained` on its own would silently initialise missing weights and drop unexpected ones; a conversion
    that claims equivalence must instead refuse and list them.
    """
    name = os.fspath(source)
    try:
        config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as error:
        raise ConversionError(
            f"Cannot read a model config from {name!r}: {error}\nPass a Hub id such as 'gpt2' (this needs network "
            "access or a copy in the Hugging Face cache) or a local directory containing config.json."
        ) from error
    _check_gpt2_config(config, repr(name))
    try:
        with _quiet_transformers():
            # ignore_mismatched_sizes: report wrongly shaped weights by name below instead of a bare error.
            model, info = GPT2LMHeadModel.from_pretrained(
                name, dtype=_resolve_dtype(dtype), output_loading_info=True, ignore_mismatched_sizes=True
            )
    except (OSError, RuntimeError, ValueError) as error:
        raise ConversionError(
            f"Cannot load GPT-2 weights from {name!r}: {error}\n"
            "Check that the directory holds model.safetensors (or pytorch_model.bin) matching its config.json."
        ) from error
    problems = []
    if info["missing_keys"]:
        problems.append(f"missing weights: {', '.join(sorted(info['missing_keys']))}")
    if info["unexpected_keys"]:
        problems.append(f"unexpected weights: {', '.join(sorted(info['unexpected_keys']))}")
    if info["mismatched_keys"]:
        shapes = [_describe_mismatch(entry) for entry in sorted(info["mismatched_keys"], key=str)]
        problems.append(f"weights with the wrong shape: {', '.join(shapes)}")
    if problems:
        raise ConversionError(
            f"{name!r} does not hold exactly the weights of a GPT2LMHeadModel for its config: "
            + "; ".join(problems)
            + ". Converting it would not start from the source's function. Re-save the source with "
            "GPT2LMHeadModel.save_pretrained (or fix config.json so it matches the weights)."
        )
    return model.eval()


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
    if isinstance(source, GPT2LMHeadModel):
        _check_gpt2_config(source.config, f"The {type(source).__name__} passed in")
        gpt2, dtype = source, overrides.pop("dtype", None)
        dtype = gpt2.dtype if dtype in (None, "auto") else _resolve_dtype(dtype)
        state_dict = gpt2.state_dict()
        if not share_weights:
            state_dict = {name: tensor.detach().clone() for name, tensor in state_dict.items()}
    elif isinstance(source, (str, os.PathLike)):
        gpt2 = load_gpt2(source, overrides.pop("dtype", "auto"))
        dtype, state_dict = gpt2.dtype, gpt2.state_dict()
    else:
        if hasattr(source, "config"):
            _check_gpt2_config(source.config, f"The {type(source).__name__} passed in")
        raise ConversionError(
            f"source must be a Hub id, a directory or a GPT2LMHeadModel, not a {type(source).__name__}. "
            "Load the checkpoint with GPT2LMHeadModel.from_pretrained (or pass its path) instead."
        )
    config = _delta_config(gpt2.config, overrides)

    # from_pretrained with a state dict builds the model on the meta device and initialises only what the state
    # dict lacks (the Delta parameters, via _init_weights), so this is fast even for gpt2-xl.
    with _quiet_transformers():
        model, info = DeltaGPTForCausalLM.from_pretrained(
            None, config=config, state_dict=state_dict, dtype=dtype, output_loading_info=True
        )
    really_missing = sorted(k for k in info["missing_keys"] if not any(m in k for m in DELTA_PARAM_MARKERS))
    if really_missing or info["unexpected_keys"] or info["mismatched_keys"]:
        raise ConversionError(
            "GPT-2 weights do not match the DeltaGPT layout: "
            f"missing {really_missing}, unexpected {sorted(info['unexpected_keys'])}, "
            f"wrong shape {sorted(str(k) for k in info['mismatched_keys'])}."
        )
    model.generation_config = copy.deepcopy(gpt2.generation_config)
    return model.train(gpt2.training)


# ----------------------------------------------------------------------------------------------------------------
# Verification
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class EquivalenceReport:
    """How closely a converted DeltaGPT reproduces its source GPT-2 on the same tokens."""

    max_abs_logit_diff: float
    source_perplexity: float
    converted_perplexity: float
    greedy_tokens: int
    greedy_identical: bool
    eval_tokens: int = 0
    eval_text: str = "given input_ids"
    delta_mode: str = "additive"
    beta_init: float = 0.0
    value_channels: int = 1
    dtype: str = "float32"
    max_beta: float = 0.0  # largest beta any Delta block produced on the evaluation tokens

    @property
    def perplexity_change(self) -> float:
        """Relative perplexity change of the converted model, e.g. 0.0 for an exact conversion."""
        return self.converted_perplexity / self.source_perplexity - 1.0

    @property
    def expected_equivalent(self) -> bool:
        """Additive mode with every beta = 0 is GPT-2 exactly; any other setting changes the function."""
        return self.delta_mode == "additive" and self.max_beta == 0.0

    def perplexity_same_to(self, digits: int = 4) -> bool:
        return f"{self.source_perplexity:.{digits}g}" == f"{self.converted_perplexity:.{digits}g}"

    def __str__(self) -> str:
        lines = [
            "Equivalence report (converted DeltaGPT vs source GPT-2)",
            f"  setting                      : delta_mode={self.delta_mode}, value_channels={self.value_channels}, "
            f"beta_init={self.beta_init:g}, dtype={self.dtype}",
            f"  evaluated on                 : {self.eval_tokens} tokens of {self.eval_text}",
            f"  max |logit difference|       : {self.max_abs_logit_diff:.3e}",
            f"  perplexity source / converted: {self.source_perplexity:.6g} / {self.converted_perplexity:.6g}"
            f" ({self.perplexity_change:+.4%}; same to 4 significant digits: {self.perplexity_same_to(4)})",
            f"  greedy {self.greedy_tokens} tokens identical  : {self.greedy_identical}",
            f"  largest beta on these tokens : {self.max_beta:.3g}",
        ]
        if self.delta_mode == "paper" and self.beta_init == 0.0:
            lines.append(
                "  note: paper mode at beta = 0 makes every Delta block the identity map, so the model starts as "
                f"embeddings -> ln_f -> lm_head; the perplexity change above ({self.perplexity_change:+.2%}) is the "
                "cost of that choice until fine-tuning opens the gates."
            )
        elif not self.expected_equivalent:
            lines.append(
                "  note: beta != 0 (or paper mode) changes the function at step 0; the perplexity change above is the "
                "cost of that choice. Use the defaults (additive, beta_init=0) for an exact start."
            )
        return "\n".join(lines)


@torch.no_grad()
def equivalence_report(
    source: GPT2LMHeadModel,
    converted: DeltaGPTForCausalLM,
    input_ids: torch.Tensor,
    greedy_tokens: int = 64,
    eval_text: str = "given input_ids",
) -> EquivalenceReport:
    """Compare logits and perplexity on `input_ids` [batch, seq], and greedy continuations of its first row.

    The prompt for the greedy comparison is the first (up to) 8 tokens; `min_new_tokens` stops EOS from cutting
    the comparison short.
    """
    source_out = source(input_ids, labels=input_ids)
    converted_out = converted(input_ids, labels=input_ids, output_betas=True)
    betas = converted_out.betas or ()
    max_beta = max((float(b.max()) for b in betas), default=0.0)
    prompt = input_ids[:1, : max(1, min(8, input_ids.shape[1]))]
    greedy_tokens = max(0, min(greedy_tokens, source.config.n_positions - prompt.shape[1]))
    kwargs = dict(max_new_tokens=greedy_tokens, min_new_tokens=greedy_tokens, do_sample=False, pad_token_id=0)
    if greedy_tokens:
        greedy_identical = bool(torch.equal(source.generate(prompt, **kwargs), converted.generate(prompt, **kwargs)))
    else:
        greedy_identical = True
    config = converted.config
    return EquivalenceReport(
        max_abs_logit_diff=(source_out.logits.float() - converted_out.logits.float()).abs().max().item(),
        source_perplexity=math.exp(source_out.loss.item()),
        converted_perplexity=math.exp(converted_out.loss.item()),
        greedy_tokens=greedy_tokens,
        greedy_identical=greedy_identical,
        eval_tokens=int(input_ids.numel()),
        eval_text=eval_text,
        delta_mode=config.delta_mode,
        beta_init=float(config.delta_beta_init),
        value_channels=int(config.delta_value_channels),
        dtype=str(converted.dtype).removeprefix("torch."),
        max_beta=max_beta,
    )


def sample_input_ids(tokenizer, config: GPT2Config, max_tokens: int = 512) -> tuple[torch.Tensor, str]:
    """Held-out evaluation tokens: `SAMPLE_TEXT` through the tokenizer, or fixed random ids without one."""
    limit = min(max_tokens, config.n_positions)
    if tokenizer is not None:
        ids = tokenizer(SAMPLE_TEXT, return_tensors="pt").input_ids[:, :limit]
        if ids.shape[1] >= 2 and int(ids.max()) < config.vocab_size:
            return ids, "held-out sample text (ddl_hf.conversion.SAMPLE_TEXT)"
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (1, min(limit, 128)), generator=generator)
    return ids, "fixed random token ids (no usable tokenizer)"


# ----------------------------------------------------------------------------------------------------------------
# Export back to GPT-2
# ----------------------------------------------------------------------------------------------------------------


def _delta_blocks(model) -> Iterator[tuple[str, torch.nn.Module, torch.nn.LayerNorm]]:
    """(name, DeltaResidual, the LayerNorm that produces its gate input) for every Delta block."""
    for i, block in enumerate(model.transformer.h):
        yield f"transformer.h.{i}.attn_delta", block.attn_delta, block.ln_1
        yield f"transformer.h.{i}.mlp_delta", block.mlp_delta, block.ln_2


@torch.no_grad()
def beta_upper_bounds(model: DeltaGPTForCausalLM) -> dict[str, float]:
    """The largest beta each Delta block can produce, over every possible input. 0.0 means beta is exactly 0
    for every input (rho == 0, or a gate so negative that even float64 sigmoid underflows).

    beta = 2 sigmoid(g(c)) rho with rho = clamp(beta_open, 0, 1) and c = LayerNorm(x) = gamma * n + b_ln, where n is
    zero-mean with |n| < sqrt(D). Since sigmoid > 0, beta is identically 0 exactly when rho == 0.
    - linear gate g(c) = w.c + b: the supremum of g over all inputs is w.b_ln + b + sqrt(D) |center(w * gamma)|
      (the best zero-mean n points along the centred w * gamma), so the bound is the least upper bound;
    - mlp gate g(c) = w.tanh(W c) + b: |tanh| <= 1 gives g <= |w|_1 + b, an upper bound that may not be reached.
    """
    bounds = {}
    for name, delta, norm in _delta_blocks(model):
        rho = float(delta.beta_open.float().clamp(0.0, 1.0))
        if rho == 0.0:
            bounds[name] = 0.0
            continue
        gate = delta.beta_proj
        if isinstance(gate, torch.nn.Linear):
            w, b = gate.weight.float()[0], float(gate.bias.float()[0])
            scaled = w * norm.weight.float()
            centred = scaled - scaled.mean()
            g_max = float(w @ norm.bias.float()) + b + math.sqrt(w.numel()) * float(centred.norm())
        else:
            out = gate[-1]
            g_max = float(out.weight.float().abs().sum()) + float(out.bias.float()[0])
        # Stable sigmoid in float64; it reaches 0.0 only below g = -745, where the model's float32 beta is 0 too.
        sigmoid = 1.0 / (1.0 + math.exp(-g_max)) if g_max >= 0 else math.exp(g_max) / (1.0 + math.exp(g_max))
        bounds[name] = 2.0 * rho * sigmoid
    return bounds


def export_to_gpt2(model: DeltaGPTForCausalLM) -> GPT2LMHeadModel:
    """Return a plain GPT2LMHeadModel computing exactly the same function as `model`, or refuse.

    Exact only for an additive DeltaGPT whose every gate is closed (rho = clamp(beta_open, 0, 1) == 0, so beta is
    0 for every input) and, with d_v > 1, whose read vectors sum to 1 (then the expanded state is x 1^T and reading
    it gives x back). Otherwise raises ValueError naming the largest beta found (see `beta_upper_bounds`).
    """
    config = model.config
    if getattr(config, "model_type", None) != DeltaGPTConfig.model_type or not hasattr(model, "lm_head"):
        raise ValueError(f"export_to_gpt2 needs a DeltaGPTForCausalLM, got {type(model).__name__}.")
    if config.delta_mode != "additive":
        raise ValueError(
            "Cannot export a paper-mode DeltaGPT to GPT-2: with delta_mode='paper' a block at beta = 0 is the "
            "identity, not GPT-2's x + F(x), so no GPT-2 computes the same function."
        )
    bounds = beta_upper_bounds(model)
    open_blocks = {name: bound for name, bound in bounds.items() if bound > 0.0}
    if open_blocks:
        worst = max(open_blocks, key=open_blocks.get)
        rho = float(model.get_submodule(worst).beta_open.detach().float().clamp(0, 1))
        raise ValueError(
            f"Cannot export to GPT-2 exactly: {len(open_blocks)} of {len(bounds)} Delta blocks have an open gate. "
            f"Largest beta found: {open_blocks[worst]:.6g} in {worst} (the supremum over all inputs; its opening "
            f"rho = clamp(beta_open, 0, 1) = {rho:.6g}). A GPT-2 has no Delta term, so only a model with every "
            "beta_open <= 0 can be exported."
        )
    if config.delta_value_channels > 1:
        reads = {"transformer.read_out": model.transformer.read_out}
        for name, delta, _ in _delta_blocks(model):
            reads[f"{name}.read_weights"] = delta.read_weights
        sums = {name: float(w.detach().float().sum()) for name, w in reads.items()}
        off = {name: total for name, total in sums.items() if abs(total - 1.0) > 1e-6}
        if off:
            raise ValueError(
                "Cannot export to GPT-2 exactly: with d_v > 1 every read vector must sum to 1 so that reading the "
                f"state x 1^T gives x back; these do not: {off}."
            )

    fields = {k: v for k, v in config.to_dict().items() if not k.startswith("delta_")}
    for key in ("model_type", "architectures", "auto_map", "transformers_version", "_name_or_path"):
        fields.pop(key, None)
    gpt2_config = GPT2Config(**fields)
    gpt2_config._attn_implementation = config._attn_implementation
    state_dict = {
        name: tensor.detach().clone()
        for name, tensor in model.state_dict().items()
        if not any(marker in name for marker in DELTA_PARAM_MARKERS)
    }
    with _quiet_transformers():
        gpt2, info = GPT2LMHeadModel.from_pretrained(
            None, config=gpt2_config, state_dict=state_dict, dtype=model.dtype, output_loading_info=True
        )
    if info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]:  # a DeltaGPT layout bug
        raise ValueError(f"DeltaGPT weights do not map onto GPT-2: {info}")
    gpt2.generation_config = copy.deepcopy(model.generation_config)
    return gpt2.train(model.training)


# ----------------------------------------------------------------------------------------------------------------
# Writing a Hub-ready directory
# ----------------------------------------------------------------------------------------------------------------


def model_card(
    base_model: str,
    report: EquivalenceReport | None,
    config: DeltaGPTConfig,
    command: str | None = None,
    load_id: str = "THIS_REPO",
) -> ModelCard:
    """A model card (README.md) saying what the model is, how it was made, how it checks out, and how to load it.

    `load_id` is the Hub id (or path) shown in the loading examples.
    """
    card_data = ModelCardData(
        library_name="transformers",
        base_model=base_model,
        pipeline_tag="text-generation",
        tags=["delta-gpt", "deep-delta-learning", "gpt2", "text-generation", "custom_code"],
    )
    how = command or (
        f"ddl_hf.convert_checkpoint({base_model!r}, OUT, delta_mode={config.delta_mode!r}, "
        f"value_channels={config.delta_value_channels}, beta_init={config.delta_beta_init})"
    )
    exact = config.delta_mode == "additive" and config.delta_beta_init == 0.0
    body = f"""
# DeltaGPT converted from `{base_model}`

A GPT-2 ({config.n_layer} layers, {config.n_embd} wide, {config.n_head} heads) whose every attention and MLP residual
is a Deep Delta Learning block (Zhang, Liu, Wang, Gu, *Deep Delta Learning*, arXiv 2601.00417):
`X' = X [+ F(x) 1^T] + beta k (v^T - k^T X)` with a learned gate beta in [0, 2].

| setting | value |
|---|---|
| delta_mode | `{config.delta_mode}` |
| value channels d_v | {config.delta_value_channels} |
| initial beta | {config.delta_beta_init:g} |
| gate | `{config.delta_gate}` |

{
        "With these settings the model computes exactly the function of the source GPT-2 until fine-tuning opens "
        "the gates."
        if exact
        else "These settings change the function of the source GPT-2 at step 0; see the perplexity change below."
    }

## How it was made

Converted with the `ddl_hf` package:

```bash
{how}
```

All GPT-2 weights are copied under their own names; the Delta parameters are new. The conversion was verified
against the source on held-out text before the files were written:

```
{report if report is not None else "(not verified)"}
```

## How to load

With `ddl_hf` installed (`pip install ddl-hf`), no remote code is needed:

```python
import ddl_hf  # registers DeltaGPT with the Auto classes
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{load_id}")
tokenizer = AutoTokenizer.from_pretrained("{load_id}")
```

With only `torch` and `transformers`, the two custom-code files in this repository are used:

```python
model = AutoModelForCausalLM.from_pretrained("{load_id}", trust_remote_code=True)
```

`model(..., output_betas=True).betas` returns the gate of every Delta block. While every gate is closed,
`ddl_hf.export_to_gpt2(model)` turns the model back into a plain `GPT2LMHeadModel`.
"""
    return ModelCard(f"---\n{card_data.to_yaml()}\n---\n{body}")


def _check_output(output: Path, force: bool) -> None:
    if output.exists() and not output.is_dir():
        raise ConversionError(f"--output {output} exists and is a file; choose a directory path.")
    if output.is_dir() and any(output.iterdir()) and not force:
        raise ConversionError(
            f"--output {output} already exists and is not empty; nothing was written. "
            "Choose another directory, or pass --force (force=True) to replace it."
        )


def _load_tokenizer(source: str | os.PathLike):
    """The source's tokenizer, or None when the source has none (weights-only directories)."""
    name = os.fspath(source)
    if os.path.isdir(name) and not any(os.path.exists(os.path.join(name, f)) for f in TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError, TypeError) as error:
        if os.path.isdir(name):
            raise ConversionError(
                f"The tokenizer files in {name} cannot be loaded: {error}. Fix or remove them and retry."
            ) from error
        return None  # a Hub repository without tokenizer files


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _commit_directory(tmp: Path, output: Path) -> None:
    """Move the finished `tmp` into place as `output`; an existing `output` is replaced only once tmp is complete."""
    if output.exists() and any(output.iterdir()):
        backup = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=output.parent))
        backup.rmdir()
        os.replace(output, backup)
        try:
            os.replace(tmp, output)
        except BaseException:
            os.replace(backup, output)
            raise
        shutil.rmtree(backup, ignore_errors=True)
    else:
        if output.exists():
            output.rmdir()  # empty directory: same as absent
        os.replace(tmp, output)


def convert_checkpoint(
    source: str | os.PathLike | GPT2LMHeadModel,
    output: str | os.PathLike,
    *,
    delta_mode: str = "additive",
    value_channels: int = 1,
    beta_init: float = 0.0,
    dtype: str = "auto",
    force: bool = False,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    base_model: str | None = None,
    tokenizer=None,
    progress: bool = True,
    command: str | None = None,
    hub_repo_id: str | None = None,
    **config_overrides,
) -> EquivalenceReport:
    """Convert `source` and write a complete, verified Hub repository to `output`; return the verification report.

    Everything is written to a temporary directory beside `output` (same filesystem, so the final rename is
    atomic), reloaded from there and compared with the source; only then is it renamed to `output`. On any error,
    including KeyboardInterrupt or a full disk, the temporary directory is removed and `output` is left as it was.
    Raises ConversionError when the additive beta = 0 conversion is not equivalent (a bug: nothing is written).
    `hub_repo_id` (where the output will be pushed, if known) is used in the model card's loading examples.
    """
    output = Path(output).absolute()
    _check_output(output, force)
    torch_dtype = _resolve_dtype(dtype)
    source_name = source if isinstance(source, (str, os.PathLike)) else None
    if base_model is None:
        base_model = (
            os.fspath(source_name)
            if source_name is not None
            else getattr(source.config, "_name_or_path", "") or "gpt2-in-memory"
        )
    overrides = dict(
        config_overrides, delta_mode=delta_mode, delta_value_channels=value_channels, delta_beta_init=beta_init
    )

    with _progress_bars(progress):
        return _convert_checkpoint(
            source,
            source_name,
            output,
            torch_dtype,
            overrides,
            max_shard_size,
            base_model,
            tokenizer,
            progress,
            command,
            hub_repo_id or os.fspath(output),
        )


def _convert_checkpoint(
    source,
    source_name,
    output: Path,
    torch_dtype,
    overrides: dict,
    max_shard_size,
    base_model: str,
    tokenizer,
    progress: bool,
    command: str | None,
    load_id: str,
) -> EquivalenceReport:
    stages = tqdm(total=6, desc="convert", unit="step", disable=not progress, file=sys.stderr)
    created_parents = [p for p in reversed(output.parents) if not p.exists()]
    tmp: Path | None = None
    try:
        stages.set_postfix_str("loading source")
        if source_name is not None:
            gpt2 = load_gpt2(source_name, torch_dtype)
            if tokenizer is None:
                tokenizer = _load_tokenizer(source_name)  # from_pretrained already read generation_config.json
        else:
            gpt2 = source if torch_dtype == "auto" else copy.deepcopy(source).to(torch_dtype)
            gpt2.eval()
        stages.update()

        stages.set_postfix_str("converting")
        converted = _convert(gpt2, overrides, share_weights=True)
        stages.update()

        stages.set_postfix_str("writing weights")
        output.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
        tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it private; the output should get the usual permissions
        converted.save_pretrained(tmp, max_shard_size=max_shard_size)
        del converted
        stages.update()

        stages.set_postfix_str("writing tokenizer")
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        stages.update()

        stages.set_postfix_str("verifying the written files")
        with _quiet_transformers():
            reloaded = DeltaGPTForCausalLM.from_pretrained(tmp, dtype=gpt2.dtype).eval()
        input_ids, text = sample_input_ids(tokenizer, gpt2.config)
        report = equivalence_report(gpt2, reloaded, input_ids, eval_text=text)
        tolerance = EQUIVALENCE_TOLERANCE.get(gpt2.dtype, 1e-4)
        if report.expected_equivalent and not (report.max_abs_logit_diff <= tolerance and report.greedy_identical):
            raise ConversionError(
                f"Verification failed: the converted model is not equivalent to the source "
                f"(max |logit difference| {report.max_abs_logit_diff:.3e} > {tolerance:g} or greedy continuation "
                f"differs). Nothing was written to {output}. Please report this with the source you used.\n{report}"
            )
        stages.update()

        stages.set_postfix_str("model card")
        model_card(base_model, report, reloaded.config, command, load_id).save(tmp / "README.md")
        _commit_directory(tmp, output)
        tmp = None
        stages.update()
        stages.set_postfix_str("done")
        return report
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        for parent in reversed(created_parents):
            with contextlib.suppress(OSError):
                parent.rmdir()
        raise
    finally:
        stages.close()


def push_converted_to_hub(
    output: str | os.PathLike,
    repo_id: str,
    *,
    private: bool | None = None,
    token: str | None = None,
    commit_message: str = "Upload DeltaGPT converted from GPT-2",
) -> str:
    """Upload a directory written by `convert_checkpoint` as it is (the same files), return the commit URL.

    `model.push_to_hub(repo)` uploads only what `save_pretrained` writes (config, code, weights, generation config)
    plus a model card; `tokenizer.push_to_hub(repo)` adds the tokenizer. This sends every file of the folder in one
    commit, including our model card (what `hf upload REPO OUT` does too).
    """
    folder = Path(output)
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    if not (folder / "config.json").is_file():
        raise ConversionError(f"{folder} is not a converted model directory (no config.json); nothing was uploaded.")
    api = HfApi(token=token)
    repo = api.create_repo(repo_id, private=private, exist_ok=True)
    operations = [CommitOperationAdd(path_in_repo=p.relative_to(folder).as_posix(), path_or_fileobj=p) for p in files]
    commit = api.create_commit(repo_id=repo.repo_id, operations=operations, commit_message=commit_message)
    return str(getattr(commit, "commit_url", commit))


# ----------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------


def add_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `convert` to the `ddl-hf` command line (also the console command `convert-gpt2-to-delta-gpt`)."""
    parser = subparsers.add_parser(
        "convert",
        help="convert a GPT-2 checkpoint into a DeltaGPT Hub repository",
        description="Convert a GPT-2 checkpoint (Hub id or directory) into a DeltaGPT that starts equivalent to it, "
        "write a complete Hub repository to OUT, and print a verification report.",
    )
    parser.add_argument("--source", required=True, help="Hub id (gpt2, gpt2-medium, ...) or local GPT-2 directory")
    parser.add_argument("--output", required=True, help="output directory (a complete Hub repository)")
    parser.add_argument("--delta-mode", choices=("additive", "paper"), default="additive")
    parser.add_argument("--value-channels", type=int, default=1, help="d_v, value channels of the state (default 1)")
    parser.add_argument("--beta-init", type=float, default=0.0, help="initial beta in [0, 2] (default 0: exact)")
    parser.add_argument("--gate", choices=("linear", "mlp"), default="linear", help="gate of each Delta block")
    parser.add_argument("--dtype", choices=("auto", *DTYPES), default="auto", help="auto = the source's dtype")
    parser.add_argument("--force", action="store_true", help="replace a non-empty OUT")
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE, help="safetensors shard size (2GB)")
    parser.add_argument("--base-model", help="Hub id written as base_model in the model card (default: --source)")
    parser.add_argument("--push-to-hub", metavar="REPO_ID", help="upload OUT to this Hub repository afterwards")
    parser.add_argument("--private", action="store_true", help="with --push-to-hub: create a private repository")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=run_cli)
    return parser


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """`kill PID` cleans up like Ctrl-C (the temporary directory is removed); only SIGKILL can leave one behind,
    hidden as `.OUT.tmp-*` beside OUT, never a partial OUT."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_cli(args: argparse.Namespace) -> int:
    """Run `convert` from parsed arguments; print the report, or one clear error line. Returns the exit code."""
    command = (
        f"convert-gpt2-to-delta-gpt --source {args.source} --output OUT --delta-mode {args.delta_mode} "
        f"--value-channels {args.value_channels} --beta-init {args.beta_init:g} --dtype {args.dtype}"
        + (f" --gate {args.gate}" if args.gate != "linear" else "")
    )
    if args.push_to_hub and not args.base_model and os.path.exists(args.source):
        print(
            f"note: the model card's base_model will be the local path {args.source}; pass --base-model HUB_ID "
            "to link the Hub repository to the model it was converted from.",
            file=sys.stderr,
        )
    try:
        with _sigterm_as_interrupt():
            report = convert_checkpoint(
                args.source,
                args.output,
                delta_mode=args.delta_mode,
                value_channels=args.value_channels,
                beta_init=args.beta_init,
                delta_gate=args.gate,
                dtype=args.dtype,
                force=args.force,
                max_shard_size=args.max_shard_size,
                base_model=args.base_model,
                progress=not args.quiet,
                command=command,
                hub_repo_id=args.push_to_hub,
            )
    except ConversionError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"error: interrupted; nothing was written to {args.output}.", file=sys.stderr)
        return 130
    except OSError as error:
        if error.errno == errno.ENOSPC:
            print(
                f"error: disk full while writing the conversion of {args.source} ({error}). Nothing was written to "
                f"{args.output}; free space on that filesystem or choose another --output.",
                file=sys.stderr,
            )
        else:
            print(f"error: cannot write {args.output}: {error}. Nothing was written.", file=sys.stderr)
        return 1
    print(report)
    files = sorted(p.name for p in Path(args.output).iterdir())
    print(f"Wrote {args.output}: {', '.join(files)}")
    if args.push_to_hub:
        try:
            url = push_converted_to_hub(args.output, args.push_to_hub, private=args.private or None)
        except Exception as error:  # network, auth, permissions: the local output is complete either way
            print(
                f"error: upload to {args.push_to_hub} failed: {error}. {args.output} is complete; retry with "
                f"`hf upload {args.push_to_hub} {args.output}` after `hf auth login`.",
                file=sys.stderr,
            )
            return 1
        print(f"Uploaded to {url}")
    return 0


__all__ = [
    "ConversionError",
    "EquivalenceReport",
    "add_cli",
    "beta_upper_bounds",
    "convert_checkpoint",
    "convert_gpt2",
    "equivalence_report",
    "export_to_gpt2",
    "load_gpt2",
    "model_card",
    "push_converted_to_hub",
    "run_cli",
    "sample_input_ids",
]
