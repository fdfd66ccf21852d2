"""One-command check of DeltaGPT / DeltaLlama on an accelerator: correctness, no host synchronisation, and cost.

    python checks/gpu_check.py                        # on the GPU; sized for under 8 minutes on one H100
    python checks/gpu_check.py --device cpu --tiny    # the same code paths on the CPU, tiny shapes, 1-2 pairs
    python checks/gpu_check.py --device cpu --tiny --compiled-variants   # without the compiled rows

On 2 busy CPU cores the whole tiny run takes a few minutes, most of it dynamo compiling the compiled rows.

Everything is built inside the repository: models from their configs (random weights, the Delta model sharing every
baseline weight), data from random token ids; nothing is downloaded, and nothing imports `datasets`. Results go to
`checks/results/gpu_check.{json,md}` (or `--out DIR`) with their command, commit, machine, device and versions.

Sections (each check catches its own exception and is recorded as an error; one failure loses no other result):

- correctness: float32 logits of every variant on the device against the same model on the CPU; bf16 autocast
  against float32, bounded relative to the baseline's (GPT-2's / Llama's) own bf16 error; greedy `generate` with the
  cache against without it; SDPA against eager attention, and flash attention where it is installed.
- sync: a training step (forward + backward) and a cached decoding step under
  `torch.cuda.set_sync_debug_mode("error")`, with GPT2LMHeadModel / LlamaForCausalLM as the controls (CUDA only).
- fla: DeltaNet's delta rule through flash-linear-attention's kernels against the float64 recurrent reference, and a
  DeltaNet model with `delta_implementation="triton"` (fla's rule) against the same model with `"eager"`: logits
  and a training step (CUDA with fla installed).
- profile: one eager training step of GPT-2 and of two Delta variants at the 124M shape under torch.profiler: wall
  time beside the device's busy time, kernel launches, and busy time by class (matmul, attention, other).
- triton: each Delta variant's eager training step at the 124M shape with `delta_implementation="eager"` (the tensor
  ops) and `"triton"` (one Triton op per Delta residual, `ddl_hf.triton_delta`) beside its baseline, as the cost
  section times it; the "triton" model's bf16-autocast loss and gradients against float32 "eager"; kernel launches
  per step of both. Where Triton cannot run (the CPU), "eager" stands in and the report says so.
- cost: Delta model against its baseline in one process, interleaved pairs (ABBA), each ratio next to the baseline
  timed against itself (the A/A noise floor): training tokens/s and peak memory at the 124M shape (bf16 autocast,
  eager and `torch.compile`), batch-1 and batch-32 decoding tokens/s (eager, and compiled with the static cache
  where the variant has one). Rows that would run past the time budget (`--budget-s`) are skipped and say so.

Delta models run `delta_implementation="auto"` (Triton's op on CUDA, the tensor ops on the CPU) except where a section
says otherwise; the cost, profile and correctness rows record which implementation ran.

    python checks/gpu_check.py --sections triton      # the Triton section alone
    TRITON_INTERPRET=1 python checks/gpu_check.py --device cpu --tiny --sections triton   # its values, on the CPU
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib.metadata
import inspect
import math
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from transformers import CompileConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedModel
from transformers import utils as hf_utils
from transformers.utils import logging as hf_logging

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ddl_hf
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # _common, bench_overhead (imported or run)
from _common import cpu_model, provenance, write_results
from bench_overhead import delta_implementation, live_bytes, peak_train_bytes

from ddl_hf import DeltaGPTConfig, DeltaGPTForCausalLM, DeltaLlamaConfig, DeltaLlamaForCausalLM

# --- what is checked ---------------------------------------------------------------------------------------------

_COMMON = dict(delta_beta_init=0.5)  # a generic open gate: additive mode at beta 0 would be the baseline exactly
#: name -> (baseline family, Delta fields). Every section runs every variant; the compiled cost rows a subset.
VARIANTS: dict[str, tuple[str, dict]] = {
    "additive-dv1": ("gpt2", dict(delta_mode="additive", delta_value_channels=1)),
    "paper-dv1": ("gpt2", dict(delta_mode="paper", delta_value_channels=1)),
    "additive-dv4": ("gpt2", dict(delta_mode="additive", delta_value_channels=4)),
    "paper-dv4": ("gpt2", dict(delta_mode="paper", delta_value_channels=4)),
    "paper-dv4-tc": ("gpt2", dict(delta_mode="paper", delta_value_channels=4, delta_state_read="temporal_conv")),
    "paper-dv4-cc": ("gpt2", dict(delta_mode="paper", delta_value_channels=4, delta_state_read="channel_conv")),
    "llama-additive-dv1": ("llama", dict(delta_mode="additive", delta_value_channels=1)),
    "llama-paper-dv4": ("llama", dict(delta_mode="paper", delta_value_channels=4)),
}
#: Compiled cost rows (kind, variant), in priority order: the budget guard drops the last first. TC decoding runs over
#: DeltaStaticStateCache (a static cache refused by a model would be recorded as "not supported").
COMPILED_ROWS = (
    ("train", "additive-dv1"),
    ("decode", "paper-dv4-tc"),
    ("decode", "additive-dv1"),
    ("train", "paper-dv4"),
    ("decode", "paper-dv4"),
    ("train", "llama-additive-dv1"),
    ("decode", "llama-additive-dv1"),
    ("train", "paper-dv4-tc"),
)
FLASH = (("flash_attention_2", "is_flash_attn_2_available"), ("flash_attention_3", "is_flash_attn_3_available"))

# Shapes. check: correctness and sync (deep enough that errors accumulate); cost: GPT-2 small (124M).
FULL = dict(
    check=dict(n_layer=6, n_embd=384, n_head=6, vocab_size=8192, batch=2, seq=128, prompt=16, new_tokens=16),
    cost=dict(
        n_layer=12, n_embd=768, n_head=12, vocab_size=50257, llama_vocab_size=32000, batch=8, seq=1024, prompt=32
    ),
    new_tokens=32,
    decode_batches=(1, 32),
    train_pairs=8,
    decode_pairs=3,
)
TINY = dict(
    check=dict(n_layer=2, n_embd=64, n_head=4, vocab_size=512, batch=2, seq=32, prompt=8, new_tokens=8),
    cost=dict(n_layer=2, n_embd=64, n_head=4, vocab_size=512, llama_vocab_size=512, batch=4, seq=64, prompt=8),
    new_tokens=4,
    decode_batches=(1, 32),
    train_pairs=2,
    decode_pairs=1,
)

EPS_FP32 = torch.finfo(torch.float32).eps  # 2^-23
EPS_BF16 = torch.finfo(torch.bfloat16).eps  # 2^-7
FP32_HEADROOM = 8
BF16_FACTOR = 4


def fp32_bound(shape: dict) -> float:
    """Bound on max|Δ logits| / max|logits| between two float32 evaluations that differ only in summation order:
    a D-term dot product rounds to about sqrt(D)·eps, once per residual update (2 per layer), 8x headroom."""
    return FP32_HEADROOM * EPS_FP32 * 2 * shape["n_layer"] * math.sqrt(shape["n_embd"])


FP32_BOUND_TEXT = f"{FP32_HEADROOM}·ε₃₂·2L·√D (ε₃₂ = 2^-23, L layers, width D)"
BF16_BOUND_TEXT = f"{BF16_FACTOR} × max(the baseline's own error, ε_bf16 = 2^-7)"

# --- models ------------------------------------------------------------------------------------------------------


def base_config(family: str, shape: dict) -> GPT2Config | LlamaConfig:
    """The baseline's config: GPT-2 (dropout off), or a Llama of the same depth and width (GQA, SwiGLU 8/3·D)."""
    if family == "llama":
        return LlamaConfig(
            num_hidden_layers=shape["n_layer"],
            hidden_size=shape["n_embd"],
            num_attention_heads=shape["n_head"],
            num_key_value_heads=shape["n_head"] // 2,
            intermediate_size=64 * math.ceil(8 * shape["n_embd"] / 3 / 64),
            vocab_size=shape.get("llama_vocab_size", shape["vocab_size"]),
            max_position_embeddings=1024,
        )
    return GPT2Config(
        n_layer=shape["n_layer"],
        n_embd=shape["n_embd"],
        n_head=shape["n_head"],
        vocab_size=shape["vocab_size"],
        bos_token_id=shape["vocab_size"] - 1,  # <|endoftext|> is the last token, as in GPT-2's 50257
        eos_token_id=shape["vocab_size"] - 1,
        n_positions=1024,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


def build_baseline(family: str, shape: dict) -> PreTrainedModel:
    torch.manual_seed(0)
    config = base_config(family, shape)
    config._attn_implementation = "sdpa"
    return (LlamaForCausalLM if family == "llama" else GPT2LMHeadModel)(config).eval()


def build_delta(variant: str, baseline: PreTrainedModel, implementation: str = "auto") -> PreTrainedModel:
    """The variant over `baseline`'s config, on the CPU, holding every baseline weight (the Delta ones are extra),
    running `implementation` (`delta_implementation`: "auto", the default, takes Triton's op on CUDA)."""
    family, fields = VARIANTS[variant]
    architecture = {
        k: v for k, v in baseline.config.to_dict().items() if k not in ("model_type", "transformers_version")
    }
    torch.manual_seed(1)
    if family == "llama":
        config = DeltaLlamaConfig(source_model_type="llama", **architecture, **_COMMON, **fields)
    else:
        config = DeltaGPTConfig(**architecture, **_COMMON, **fields)
    config._attn_implementation = "sdpa"
    delta = (DeltaLlamaForCausalLM if family == "llama" else DeltaGPTForCausalLM)(config)
    state = {k: v.detach().to("cpu") for k, v in baseline.state_dict().items()}
    _, unexpected = delta.load_state_dict(state, strict=False)
    if unexpected:
        raise RuntimeError(f"baseline weights that the Delta model lacks: {unexpected}")
    delta.set_delta_implementation(implementation)
    return delta.eval()


def implementation_ran(model: PreTrainedModel, device: torch.device) -> str:
    """What `model`'s `delta_implementation` runs for its Delta residuals on `device`: "triton" (the one op per
    residual), "native" or "eager" (the tensor ops); "auto" as what it resolved to ("auto → triton")."""
    from ddl_hf.delta_ops import delta_kernels

    requested = model.config.delta_implementation
    kernels = delta_kernels(requested, torch.empty(0, device=device))
    ran = "triton" if kernels.residual is not None else "native" if kernels.residual_step is not None else "eager"
    return requested if ran == requested else f"{requested} → {ran}"


def triton_unavailable(device: torch.device) -> str | None:
    """Why `delta_implementation="triton"` cannot run on `device`'s tensors here (the library's own reason), or
    None."""
    from ddl_hf.delta_ops import delta_kernels

    try:
        delta_kernels("triton", torch.empty(0, device=device))
    except (ImportError, RuntimeError) as error:  # DeltaImplementationUnavailable is a RuntimeError
        return str(error)
    return None


def running(model: PreTrainedModel, implementation: str, step: Callable[[], None]) -> Callable[[], None]:
    """`step` with `model` set to `implementation` (per model, as `set_attn_implementation`): one model's weights
    and optimizer stepped either way."""

    def run() -> None:
        model.set_delta_implementation(implementation)
        step()

    return run


def cache_kwarg(model: torch.nn.Module, cache: object) -> dict:
    """The cache under the name this transformers gives it (`cache` from 5.24, `past_key_values` before)."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}


def cache_out(outputs: object) -> object:
    return outputs["cache"] if "cache" in outputs else outputs["past_key_values"]


def random_ids(vocab: int, *shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b|, in float64."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@contextlib.contextmanager
def exact_fp32() -> Iterator[None]:
    """IEEE float32 matmuls and convolutions on CUDA (no TF32), restored afterwards."""
    targets = [t for t in (torch.backends.cuda.matmul, getattr(torch.backends.cudnn, "conv", None)) if t is not None]
    if not all(hasattr(t, "fp32_precision") for t in targets):  # before torch 2.9: the legacy flags
        saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
        return
    saved = [t.fp32_precision for t in targets]
    for t in targets:
        t.fp32_precision = "ieee"
    try:
        yield
    finally:
        for t, value in zip(targets, saved):
            t.fp32_precision = value


def autocast(device: torch.device, enabled: bool = True) -> contextlib.AbstractContextManager:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


def logits_of(model: torch.nn.Module, ids: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    with torch.no_grad(), autocast(ids.device, bf16):
        return model(input_ids=ids).logits.float()


def free(device: torch.device) -> None:
    """Give a finished row's GPU memory back (models hold reference cycles); on the CPU nothing to gain."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


# --- recording ---------------------------------------------------------------------------------------------------


def guarded(fn: Callable[[], dict]) -> dict:
    """`fn()`'s record, or an error record with the exception: one failing check never loses the others."""
    start = time.perf_counter()
    try:
        record = fn()
    except Exception as error:  # recorded in the results, not swallowed
        record = {"status": "error", "error": f"{type(error).__name__}: {error}"[:2000]}
        record["traceback"] = traceback.format_exc(limit=-6)[-4000:]
    record["wall_s"] = round(time.perf_counter() - start, 3)
    return record


def passed(ok: bool) -> str:
    return "pass" if ok else "fail"


def fp32_record(errors: dict, bound: float) -> dict:
    """The Delta model against the float32 bound; the baseline's status says whether the bound itself holds here."""
    return {
        "status": passed(errors["delta"] <= bound),
        "error": errors["delta"],
        "baseline_error": errors["baseline"],
        "baseline_status": passed(errors["baseline"] <= bound),
        "bound": bound,
    }


# --- correctness -------------------------------------------------------------------------------------------------


def check_models(
    plan: dict, variants: list[str]
) -> Iterator[tuple[str, str, Callable[[], tuple[PreTrainedModel, PreTrainedModel]]]]:
    """(variant, family, builder of (baseline, Delta) on the CPU) for each of `variants`, at the check shape."""
    for variant in variants:
        family = VARIANTS[variant][0]

        def build(variant: str = variant, family: str = family) -> tuple[PreTrainedModel, PreTrainedModel]:
            baseline = build_baseline(family, plan["check"])
            return baseline, build_delta(variant, baseline)

        yield variant, family, build


def correctness_row(variant: str, build: Callable, plan: dict, device: torch.device) -> dict:
    """Every correctness check of one variant; each its own record."""
    shape = plan["check"]
    bound = fp32_bound(shape)
    row: dict = {"variant": variant}
    baseline, delta = build()
    row["implementation"] = implementation_ran(delta, device)
    ids = random_ids(delta.config.vocab_size, shape["batch"], shape["seq"], seed=2)

    def device_vs_cpu() -> dict:
        with exact_fp32():
            cpu = {"delta": logits_of(delta, ids), "baseline": logits_of(baseline, ids)}
            errors = {}
            for name, model in (("delta", delta), ("baseline", baseline)):
                errors[name] = rel_err(logits_of(copy.deepcopy(model).to(device), ids.to(device)), cpu[name])
        return fp32_record(errors, bound)

    row["device_vs_cpu_fp32"] = guarded(device_vs_cpu)
    delta, baseline = delta.to(device), baseline.to(device)
    ids = ids.to(device)

    def bf16_autocast() -> dict:
        with exact_fp32():
            errors = {
                name: rel_err(logits_of(m, ids, bf16=True), logits_of(m, ids)) for name, m in _pair(baseline, delta)
            }
        limit = BF16_FACTOR * max(errors["baseline"], EPS_BF16)
        return {
            "status": passed(errors["delta"] <= limit),
            "error": errors["delta"],
            "baseline_error": errors["baseline"],
            "bound": limit,
        }

    row["bf16_autocast"] = guarded(bf16_autocast)

    def generate_cache() -> dict:
        prompt = ids[:, : shape["prompt"]]
        n = shape["new_tokens"]
        kwargs = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        kwargs["attention_mask"] = torch.ones_like(prompt)
        with exact_fp32(), torch.no_grad():
            cached = delta.generate(prompt, use_cache=True, **kwargs)
            plain = delta.generate(prompt, use_cache=False, **kwargs)
            if torch.equal(cached, plain):
                return {"status": "pass", "equal": True, "new_tokens": n}
            # Different tokens are still right where the uncached logits of the two choices tie within the bound.
            position = int((cached != plain).any(0).nonzero()[0])
            b = int((cached[:, position] != plain[:, position]).nonzero()[0])
            logits = logits_of(delta, plain[b : b + 1, :position])[0, -1]
        gap = (logits[cached[b, position]] - logits[plain[b, position]]).abs().item() / logits.abs().max().item()
        return {
            "status": passed(gap <= bound),
            "equal": False,
            "first_difference": position,
            "relative_logit_gap": gap,
            "note": "differs first where the two tokens' logits tie within the float32 bound" if gap <= bound else "",
        }

    row["generate_cache"] = guarded(generate_cache)

    def sdpa_vs_eager() -> dict:
        with exact_fp32():
            errors = {}
            for name, model in _pair(baseline, delta):
                sdpa = logits_of(model, ids)
                model.set_attn_implementation("eager")
                try:
                    errors[name] = rel_err(logits_of(model, ids), sdpa)
                finally:
                    model.set_attn_implementation("sdpa")
        return fp32_record(errors, bound)

    row["sdpa_vs_eager"] = guarded(sdpa_vs_eager)

    for implementation, probe in FLASH:

        def flash(implementation: str = implementation, probe: str = probe) -> dict:
            if device.type != "cuda":
                return {"status": "skipped", "reason": "flash attention runs on CUDA only"}
            if not getattr(hf_utils, probe, lambda: False)():
                return {"status": "skipped", "reason": f"{implementation} is not installed"}
            errors = {}
            for name, model in _pair(baseline, delta):
                half = copy.deepcopy(model).to(torch.bfloat16)
                sdpa = logits_of(half, ids)
                half.set_attn_implementation(implementation)
                errors[name] = rel_err(logits_of(half, ids), sdpa)
                del half
            limit = BF16_FACTOR * max(errors["baseline"], EPS_BF16)
            return {
                "status": passed(errors["delta"] <= limit),
                "error": errors["delta"],
                "baseline_error": errors["baseline"],
                "bound": limit,
                "against": "sdpa, both in bfloat16",
            }

        row[implementation] = guarded(flash)
    return row


def _pair(baseline: PreTrainedModel, delta: PreTrainedModel) -> tuple[tuple[str, PreTrainedModel], ...]:
    return ("baseline", baseline), ("delta", delta)


def correctness_section(plan: dict, device: torch.device, variants: list[str]) -> dict:
    rows = []
    for variant, _, build in check_models(plan, variants):
        record = guarded(lambda variant=variant, build=build: correctness_row(variant, build, plan, device))
        record.setdefault("variant", variant)
        rows.append(record)
        free(device)
        print(f"correctness {variant:20s} {_statuses(record)}", flush=True)
    return {
        "shape": plan["check"],
        "fp32_bound": fp32_bound(plan["check"]),
        "fp32_bound_formula": FP32_BOUND_TEXT,
        "bf16_bound_formula": BF16_BOUND_TEXT,
        "metric": "max|Δ logits| / max|reference logits|",
        "rows": rows,
    }


def _statuses(record: dict) -> str:
    if record.get("status") == "error":
        return f"error: {record['error']}"
    return " ".join(f"{k}={v['status']}" for k, v in record.items() if isinstance(v, dict) and "status" in v)


# --- synchronisation ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def sync_debug_error() -> Iterator[None]:
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def synchronised(error: RuntimeError) -> dict:
    """The failure record of sync debug mode's error; any other error is raised (and recorded as an error)."""
    if "synchroniz" not in str(error).lower():
        raise error
    return {"status": "fail", "synchronises": str(error)[:1000]}


def sync_checks(model: PreTrainedModel, plan: dict, device: torch.device) -> dict:
    """A training step (bf16 autocast forward with labels, backward) and one cached decoding step (no mask: an
    unpadded batch), each run once to warm up, then again under sync debug mode "error"."""
    shape = plan["check"]
    model.to(device)
    ids = random_ids(model.config.vocab_size, shape["batch"], shape["seq"], seed=3).to(device)

    def train_step() -> dict:
        model.train()

        def step() -> None:
            with autocast(device):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()

        step()
        model.zero_grad(set_to_none=True)
        try:
            with sync_debug_error():
                step()
        except RuntimeError as error:
            return synchronised(error)
        finally:
            model.zero_grad(set_to_none=True)
            model.eval()
        return {"status": "pass"}

    def decode_step() -> dict:
        with torch.no_grad():
            out = model(input_ids=ids[:, : shape["prompt"]], use_cache=True)
            cache, token = cache_out(out), out.logits[:, -1:].argmax(-1)
            token = model(input_ids=token, use_cache=True, **cache_kwarg(model, cache)).logits[:, -1:].argmax(-1)
            try:
                with sync_debug_error():
                    model(input_ids=token, use_cache=True, **cache_kwarg(model, cache))
            except RuntimeError as error:
                return synchronised(error)
        return {"status": "pass"}

    return {"train_step": guarded(train_step), "decode_step": guarded(decode_step)}


def sync_section(plan: dict, device: torch.device, variants: list[str]) -> dict:
    if device.type != "cuda":
        reason = "torch.cuda.set_sync_debug_mode needs CUDA: on the CPU there is no device to synchronise with"
        return {"status": "skipped", "reason": reason, "rows": []}
    rows = []
    jobs: list[tuple[str, bool, Callable[[], PreTrainedModel]]] = [
        (f"control: {family}", True, lambda family=family: build_baseline(family, plan["check"]))
        for family in ("gpt2", "llama")
    ]
    for variant, _, build in check_models(plan, variants):
        jobs.append((variant, False, lambda build=build: build()[1]))
    for name, control, build in jobs:
        record = guarded(lambda build=build: sync_checks(build(), plan, device))
        record.update(variant=name, control=control)
        rows.append(record)
        free(device)
        print(f"sync        {name:20s} {_statuses(record)}", flush=True)
    return {"shape": plan["check"], "rows": rows}


# --- cost --------------------------------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(
    fn_a: Callable[[], object], fn_b: Callable[[], object], pairs: int, device: torch.device, warmup: bool = True
) -> dict:
    """Median wall seconds of A and B (order alternating per pair, ABBA) and the median per-pair ratio B / A."""
    if warmup:
        fn_a()
        fn_b()
    a, b = [], []
    for i in range(pairs):
        for fn, times in ((fn_a, a), (fn_b, b)) if i % 2 == 0 else ((fn_b, b), (fn_a, a)):
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            times.append(time.perf_counter() - start)
    ratios = [tb / ta for ta, tb in zip(a, b)]
    return {
        "baseline_s": statistics.median(a),
        "delta_s": statistics.median(b),
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "pairs": pairs,
    }


def train_step_fn(model: torch.nn.Module, ids: torch.Tensor, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """Forward (bf16 autocast) with labels, backward, AdamW."""

    def step() -> None:
        with autocast(ids.device):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def peak_step_memory(step: Callable[[], None], model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Peak tensor bytes of one training step (`bytes`): the model's parameters, buffers and AdamW state, plus the
    most the step allocates on top (CUDA: the caching allocator's peak above what was allocated when the step began;
    CPU: the running sum of the profiler's allocations). On CUDA also the allocator's own readings, everything in
    the process counted: `allocated_at_start` and `peak_allocated` (what a graph keeps between steps shows there)."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return {"bytes": peak_train_bytes(step, model, optimizer)}  # bench_overhead's, from the profiler
    before = live_bytes(model, optimizer)
    synchronize(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return {"bytes": before + peak - start, "allocated_at_start": start, "peak_allocated": peak}


def generate_fn(model: PreTrainedModel, prompt: torch.Tensor, new_tokens: int, compiled: str | None) -> Callable:
    """Greedy `generate` of exactly `new_tokens`; `compiled` (a torch.compile backend): static cache and
    transformers' compiled decoding step."""
    extra: dict = {}
    if compiled:
        # dynamic=False: one static graph per batch size. With automatic dynamic shapes, the second batch size (or
        # the next model through transformers' shared forward wrapper) recompiles mid-timing into a dynamic graph.
        config = CompileConfig(fullgraph=True, dynamic=False, backend=compiled, mode="default")
        config._compile_all_devices = True  # transformers compiles on CUDA only unless asked
        extra = dict(cache_implementation="static", compile_config=config)
    mask = torch.ones_like(prompt)

    def run() -> None:
        with torch.inference_mode():
            model.generate(
                prompt,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
                **extra,
            )

    return run


class CostRunner:
    """Holds each family's baseline (and its optimizer, compiled form and A/A floors) across the rows."""

    def __init__(self, plan: dict, device: torch.device, backend: str):
        self.plan, self.device, self.backend = plan, device, backend
        self.shape = plan["cost"]
        self.baselines: dict[str, dict] = {}

    def baseline(self, family: str) -> dict:
        if family not in self.baselines:
            model = build_baseline(family, self.shape).to(self.device)
            model.loss_type = "ForCausalLM"  # transformers resolves the loss through a property that logs otherwise
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            self.baselines[family] = {"model": model, "optimizer": optimizer, "floors": {}, "compiled": None}
        return self.baselines[family]

    def ids(self, vocab: int) -> torch.Tensor:
        return random_ids(vocab, self.shape["batch"], self.shape["seq"], seed=4).to(self.device)

    def floor(self, family: str, metric: str, measure: Callable[[], dict]) -> dict:
        floors = self.baselines[family]["floors"]
        if metric not in floors:
            floors[metric] = measure()
        return floors[metric]

    def train(self, variant: str, compiled: bool) -> dict:
        family = VARIANTS[variant][0]
        base = self.baseline(family)
        delta = build_delta(variant, base["model"], "auto").to(self.device)
        delta.loss_type = "ForCausalLM"
        models = [base["model"], delta]
        if compiled:
            if base["compiled"] is None:
                base["compiled"] = torch.compile(base["model"], fullgraph=True, dynamic=False, backend=self.backend)
            callables = [base["compiled"], torch.compile(delta, fullgraph=True, dynamic=False, backend=self.backend)]
        else:
            callables = models
        for model in models:
            model.train()
        ids = self.ids(base["model"].config.vocab_size)
        optimizer = torch.optim.AdamW(delta.parameters(), lr=1e-4)
        step_a = train_step_fn(callables[0], ids, base["optimizer"])
        step_b = train_step_fn(callables[1], ids, optimizer)
        kind = "compiled" if compiled else "eager"
        pairs = self.plan["train_pairs"]
        for step in (step_a, step_b):  # compiles (when compiled) and creates the AdamW state: not timed
            step()
            step()

        def aa_time() -> dict:
            return interleaved(step_a, step_a, pairs, self.device, warmup=False)

        def aa_memory() -> dict:
            first = peak_step_memory(step_a, base["model"], base["optimizer"])
            second = peak_step_memory(step_a, base["model"], base["optimizer"])
            return {
                "baseline_bytes": first["bytes"],
                "delta_bytes": second["bytes"],
                "ratio": second["bytes"] / first["bytes"],
                "baseline_allocator": {k: v for k, v in first.items() if k != "bytes"},
            }

        floor_time = self.floor(family, f"train_{kind}", aa_time)
        floor_memory = self.floor(family, f"memory_{kind}", aa_memory)
        timing = interleaved(step_a, step_b, pairs, self.device, warmup=False)
        memory_a = floor_memory["baseline_bytes"]  # the baseline's step does not change between rows
        memory_b = peak_step_memory(step_b, delta, optimizer)
        for model in models:
            model.eval()
        return {
            "implementation": implementation_ran(delta, self.device),
            f"train_{kind}": throughput(timing, floor_time, ids.numel()),
            f"peak_train_memory_{kind}": {
                "baseline_bytes": memory_a,
                "delta_bytes": memory_b["bytes"],
                "ratio": memory_b["bytes"] / memory_a,
                "aa_floor": aa_summary(floor_memory),
                "baseline_allocator": floor_memory["baseline_allocator"],
                "delta_allocator": {k: v for k, v in memory_b.items() if k != "bytes"},
            },
        }

    def decode(self, variant: str, compiled: bool) -> dict:
        family = VARIANTS[variant][0]
        base = self.baseline(family)
        baseline = base["model"].eval()
        delta = build_delta(variant, baseline, "auto").to(self.device).eval()
        backend = self.backend if compiled else None
        kind = "compiled" if compiled else "eager"
        n = self.plan["new_tokens"]
        record = {"implementation": implementation_ran(delta, self.device)}
        for batch in self.plan["decode_batches"]:
            prompt = random_ids(baseline.config.vocab_size, batch, self.shape["prompt"], seed=5).to(self.device)
            run_a, run_b = (generate_fn(m, prompt, n, backend) for m in (baseline, delta))
            metric = f"decode_b{batch}_{kind}"
            try:
                run_b()  # the first call compiles, or refuses the static cache
            except ValueError as error:
                if "not supported" not in str(error):
                    raise
                record[metric] = {"status": "not supported", "reason": str(error)[:500]}
                continue
            floor = self.floor(
                family, metric, lambda run_a=run_a: interleaved(run_a, run_a, self.plan["decode_pairs"], self.device)
            )
            timing = interleaved(run_a, run_b, self.plan["decode_pairs"], self.device)
            record[metric] = throughput(timing, floor, batch * n)
        return record


def aa_summary(floor: dict) -> dict:
    return {k: floor[k] for k in ("ratio", "ratio_min", "ratio_max", "pairs") if k in floor}


def throughput(timing: dict, floor: dict, tokens: int) -> dict:
    """Tokens/s of both and the cost ratio (Delta time / baseline time: > 1 is slower), with the A/A floor."""
    return {
        "baseline_tokens_per_s": tokens / timing["baseline_s"],
        "delta_tokens_per_s": tokens / timing["delta_s"],
        "tokens_per_call": tokens,
        **timing,
        "aa_floor": aa_summary(floor),
    }


def cost_plan(variants: list[str], compiled_variants: list[str]) -> list[tuple[str, str, bool]]:
    """(kind, variant, compiled), in the order they run: what the budget guard drops goes last."""
    rows = [("train", v, False) for v in variants] + [("decode", v, False) for v in variants]
    return rows + [(kind, v, True) for kind, v in COMPILED_ROWS if v in compiled_variants]


#: Expected seconds of a row on the GPU before one of its kind has measured (then: the last such row's time).
FIRST_ROW_ESTIMATE_S = {("train", False): 10, ("decode", False): 20, ("train", True): 120, ("decode", True): 120}
GRACE_S = 60  # a row expected to end later than this past the budget is not started


def cost_section(
    plan: dict,
    device: torch.device,
    backend: str,
    selection: tuple[list[str], list[str]],
    start: float,
    budget_s: float,
    save: Callable[[], None],
) -> dict:
    """`selection`: (variants, compiled variants). Rows that would start after `budget_s` seconds from `start`, or
    that are expected to end more than GRACE_S after it, are skipped and recorded as such."""
    runner = CostRunner(plan, device, backend)
    section: dict = {
        "shape": plan["cost"],
        "new_tokens": plan["new_tokens"],
        "decode_batches": list(plan["decode_batches"]),
        "train_pairs": plan["train_pairs"],
        "decode_pairs": plan["decode_pairs"],
        "compile_backend": backend,
        "budget_s": budget_s,
        "rows": [],
    }
    last: dict[tuple[str, bool], float] = {}
    # Every Delta variant is a new graph of the same forwards: room for all of them (the default stops at 8).
    dynamo_config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    with dynamo_config.patch({limit: max(getattr(dynamo_config, limit), 64)}):
        for kind, variant, compiled in cost_plan(*selection):
            _cost_row(runner, section, last, (kind, variant, compiled), start, budget_s)
            save()
    return section


def _cost_row(
    runner: CostRunner, section: dict, last: dict, job: tuple[str, str, bool], start: float, budget_s: float
) -> None:
    """One cost row, or its skip when past the budget, appended to `section`; `last`: seconds of the last measured
    row of each kind, the estimate for the next."""
    kind, variant, compiled = job
    device = runner.device
    elapsed = time.perf_counter() - start
    expected = last.get((kind, compiled), FIRST_ROW_ESTIMATE_S[kind, compiled] if device.type == "cuda" else 0)
    row: dict = {"kind": kind, "variant": variant, "family": VARIANTS[variant][0], "compiled": compiled}
    if elapsed >= budget_s or elapsed + expected > budget_s + GRACE_S:
        reason = f"time budget: {elapsed:.0f} s spent, about {expected:.0f} s more expected, budget {budget_s:.0f} s"
        row.update(status="skipped", reason=reason)
    else:
        measure = runner.train if kind == "train" else runner.decode
        row.update(guarded(lambda: measure(variant, compiled)))
        row.setdefault("status", "ok")
        if any("ratio" in m for m in _metrics(row).values()):  # a refusal says nothing about the next row's time
            last[kind, compiled] = row["wall_s"]
    section["rows"].append(row)
    section["floors"] = {f: dict(b["floors"]) for f, b in runner.baselines.items()}
    free(device)
    print(
        f"cost        {kind:6s} {'compiled' if compiled else 'eager':8s} {variant:20s} {_cost_line(row)}",
        flush=True,
    )


def _metrics(row: dict) -> dict:
    return {k: v for k, v in row.items() if isinstance(v, dict) and ("ratio" in v or v.get("status"))}


def _cost_line(row: dict) -> str:
    if row["status"] != "ok":
        return f"{row['status']}: {row.get('reason') or row.get('error')}"
    return " ".join(f"{k} {v['ratio']:.3f}" if "ratio" in v else f"{k} {v['status']}" for k, v in _metrics(row).items())


# --- profile: where a training step's time goes -------------------------------------------------------------------

#: The Delta models profiled beside their GPT-2 baseline: the cheapest and the expanded state.
PROFILE_VARIANTS = ("additive-dv1", "paper-dv4")
#: Kernel classes, by name: attention's kernels and the GEMM libraries' (cuBLAS, CUTLASS, cuBLASLt's nvjet). Every
#: other kernel (elementwise, reductions, copies, the optimizer) is "other": what the Delta residual adds lands there.
KERNEL_CLASSES = (  # in order: attention's kernels may be CUTLASS ones (fmha_cutlassF...)
    ("attention", re.compile(r"flash|fmha|attention|sdpa|efficient", re.IGNORECASE)),
    (
        "matmul",
        re.compile(r"gemm|cublas|cutlass|nvjet|xmma|wgmma|splitk|^aten::(mm|addmm|bmm|baddbmm)$", re.IGNORECASE),
    ),
)


#: aten operators that change metadata or allocate and launch no kernel: left out of the CPU's stand-in count.
NO_KERNEL = frozenset(
    f"aten::{op}"
    for op in [
        *("view", "_unsafe_view", "_reshape_alias", "as_strided", "alias", "detach", "expand", "permute", "transpose"),
        *("t", "unsqueeze", "squeeze", "select", "slice", "narrow", "unbind", "split", "split_with_sizes", "empty"),
        *("empty_strided", "resize_", "lift_fresh", "set_", "is_nonzero"),
    ]
)


def kernel_class(name: str) -> str:
    return next((label for label, pattern in KERNEL_CLASSES if pattern.search(name)), "other")


#: The Triton op of a whole Delta residual (`ddl_hf.triton_delta`), as the profiler names its calls.
TRITON_OP = "ddl_hf::delta_residual"


def step_kernels(step: Callable[[], None], device: torch.device) -> dict:
    """One call of `step` under torch.profiler: the device's kernels (CUDA), or on the CPU a stand-in (the matmul and
    attention operators and the aten operators that call no other, by self time), as launches and busy milliseconds
    per class, with the ten costliest "other" kernels; and the calls of the Triton op (`TRITON_OP`, forward; 0 where
    the tensor ops ran)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        synchronize(device)
    if device.type == "cuda":
        kernels = [(e.name, e.time_range.elapsed_us()) for e in prof.events() if e.device_type == DeviceType.CUDA]
    else:
        kernels = [
            (e.name, e.self_cpu_time_total)
            for e in prof.events()
            if e.name.startswith("aten::")
            and e.name not in NO_KERNEL
            and (kernel_class(e.name) != "other" or not any(c.name.startswith("aten::") for c in e.cpu_children))
        ]
    by_class = {label: {"kernels": 0, "ms": 0.0} for label in ("matmul", "attention", "other")}
    other: dict[str, list[float]] = {}
    for name, us in kernels:
        label = kernel_class(name)
        by_class[label]["kernels"] += 1
        by_class[label]["ms"] += us / 1e3
        if label == "other":
            entry = other.setdefault(name, [0, 0.0])
            entry[0] += 1
            entry[1] += us / 1e3
    top = sorted(other.items(), key=lambda item: -item[1][1])[:10]
    return {
        "triton_op_calls": sum(e.name == TRITON_OP for e in prof.events()),
        "kernels": len(kernels),
        "busy_ms": sum(us for _, us in kernels) / 1e3,
        "by_class": by_class,
        "top_other": [{"name": name[:120], "kernels": n, "ms": ms} for name, (n, ms) in top],
    }


def profile_section(plan: dict, device: torch.device) -> dict:
    """GPT-2 and each Delta variant of PROFILE_VARIANTS (`delta_implementation="auto"`: Triton's op on CUDA; each row
    says what ran) at the cost shape: one eager bf16 training step's wall time (median of 3, no profiler) beside the
    device's busy time and kernel launches from one profiled step. Busy well below wall: the host's dispatch sets the
    pace (more launches cost time even when each is short); busy near wall: the kernels do, and "other" says how much
    of them is not matmul or attention. The triton section profiles "eager" beside "triton"."""
    shape = plan["cost"]
    baseline = build_baseline("gpt2", shape).to(device)
    baseline.loss_type = "ForCausalLM"
    ids = random_ids(shape["vocab_size"], shape["batch"], shape["seq"], seed=4).to(device)
    rows = []
    for name in ("gpt2", *PROFILE_VARIANTS):
        model = baseline if name == "gpt2" else build_delta(name, baseline, "auto").to(device)
        model.loss_type = "ForCausalLM"
        model.train()
        step = train_step_fn(model, ids, torch.optim.AdamW(model.parameters(), lr=1e-4))
        step()
        step()  # AdamW's state exists; caches are warm
        walls = []
        for _ in range(3):
            synchronize(device)
            begin = time.perf_counter()
            step()
            synchronize(device)
            walls.append(time.perf_counter() - begin)
        record = {"model": name, "implementation": "-" if model is baseline else implementation_ran(model, device)}
        record.update(wall_ms=statistics.median(walls) * 1e3, **step_kernels(step, device))
        rows.append(record)
        print(
            f"profile     {name:20s} {record['implementation']:16s} wall {record['wall_ms']:.1f} ms, busy "
            f"{record['busy_ms']:.1f} ms, {record['kernels']} kernels",
            flush=True,
        )
        model.eval()
        if model is not baseline:
            del model, step
            free(device)
    return {"shape": shape, "tokens": ids.numel(), "rows": rows}


# --- triton: the Delta residual as one Triton op against the tensor ops (ddl_hf.triton_delta) -------------------

#: The two implementations the section compares: the tensor ops, and one Triton op per Delta residual.
TRITON_PAIR = ("eager", "triton")


def loss_and_grads(model: PreTrainedModel, ids: torch.Tensor, bf16: bool) -> tuple[torch.Tensor, dict]:
    """The training loss and every parameter's gradient of one forward and backward (`model`'s own implementation),
    the gradients cleared again afterwards."""
    model.zero_grad(set_to_none=True)
    with autocast(ids.device, bf16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach().float(), grads


def loss_and_grads_check(model: PreTrainedModel, ids: torch.Tensor, implementation: str) -> dict:
    """`model`'s bf16-autocast loss and gradients with `implementation` against the same model in float32 with
    "eager" (TF32 off), bounded as the correctness section bounds bf16: BF16_FACTOR times "eager"'s own bf16 error
    against the same reference, at least bf16's eps; the gradients per parameter (each its own error and bound; the
    worst parameter, by error over bound, is recorded)."""
    with delta_implementation(model, "eager"):
        with exact_fp32():
            reference = loss_and_grads(model, ids, bf16=False)
        eager = loss_and_grads(model, ids, bf16=True)
    with delta_implementation(model, implementation):
        mine = loss_and_grads(model, ids, bf16=True)
    loss_error, eager_loss_error = rel_err(mine[0], reference[0]), rel_err(eager[0], reference[0])
    loss_bound = BF16_FACTOR * max(eager_loss_error, EPS_BF16)
    loss = {"status": passed(loss_error <= loss_bound), "error": loss_error, "bound": loss_bound}
    loss["eager_error"] = eager_loss_error
    names = sorted(reference[1])
    missing = sorted(set(names) ^ set(mine[1]))
    errors = {name: rel_err(mine[1][name], reference[1][name]) for name in names if name in mine[1]}
    bounds = {name: BF16_FACTOR * max(rel_err(eager[1][name], reference[1][name]), EPS_BF16) for name in errors}
    worst = max(errors, key=lambda name: errors[name] / bounds[name])
    grads = {
        "status": passed(not missing and all(errors[name] <= bounds[name] for name in errors)),
        "error": errors[worst],
        "bound": bounds[worst],
        "worst_parameter": worst,
        "parameters": len(errors),
        "largest_error": max(errors.values()),
    }
    if missing:
        grads["missing"] = missing[:20]  # a gradient one implementation gives and the other does not
    status = passed(loss["status"] == grads["status"] == "pass")
    return {"status": status, "implementation": implementation, "loss": loss, "grads": grads}


def triton_row(runner: CostRunner, variant: str, implementation: str, launches: dict) -> dict:
    """One variant: the bf16 check of `implementation` against float32 "eager", then the eager training step with
    "eager" and with `implementation` (one model, the same AdamW) each against the baseline's (its A/A floor is the
    cost section's, `CostRunner.floor`), then the launches of one profiled step of each. `launches`: each family's
    baseline launches, profiled once."""
    family = VARIANTS[variant][0]
    device = runner.device
    base = runner.baseline(family)
    baseline = base["model"].train()
    delta = build_delta(variant, baseline, "eager").to(device).train()
    delta.loss_type = "ForCausalLM"
    ids = runner.ids(baseline.config.vocab_size)
    row: dict = {
        "variant": variant,
        "family": family,
        "implementations": dict(zip(TRITON_PAIR, ("eager", implementation))),
    }
    row["bf16_loss_and_grads"] = guarded(lambda: loss_and_grads_check(delta, ids, implementation))

    def timings() -> dict:
        delta_step = train_step_fn(delta, ids, torch.optim.AdamW(delta.parameters(), lr=1e-4))
        steps = {"eager": running(delta, "eager", delta_step), "triton": running(delta, implementation, delta_step)}
        base_step = train_step_fn(baseline, ids, base["optimizer"])
        for step in (base_step, *steps.values()):  # AdamW's state, Triton's compilation: not timed
            step()
            step()
        pairs = runner.plan["train_pairs"]
        floor = runner.floor(
            family, "train_eager", lambda: interleaved(base_step, base_step, pairs, device, warmup=False)
        )
        record: dict = {}
        for name, step in steps.items():
            timing = interleaved(base_step, step, pairs, device, warmup=False)
            record[f"train_{name}"] = throughput(timing, floor, ids.numel())
        record["triton_vs_eager"] = record["train_triton"]["delta_s"] / record["train_eager"]["delta_s"]
        if family not in launches:
            launches[family] = step_kernels(base_step, device)
        record["launches"] = {"baseline": launches[family]}
        record["launches"].update({name: step_kernels(step, device) for name, step in steps.items()})
        return record

    row.update(guarded(timings))
    baseline.eval()
    return row


def triton_section(plan: dict, device: torch.device, variants: list[str]) -> dict:
    """`delta_implementation="triton"` against `"eager"` for each of `variants` at the cost shape (`triton_row`).
    Where Triton cannot run on `device`'s tensors (the CPU without Triton's interpreter), "eager" stands in for it:
    the section's code runs, the rows say what ran, and no number is Triton's."""
    problem = triton_unavailable(device)
    implementation = "eager" if problem else "triton"
    section: dict = {"shape": plan["cost"], "train_pairs": plan["train_pairs"], "triton_ran": not problem, "rows": []}
    if problem:
        section["note"] = (
            f'Triton cannot run here: {problem.rstrip(".")}. "eager" stands in for "triton": this exercises the'
            " section's code, and no number below is Triton's"
        )
    elif device.type != "cuda":
        section["note"] = (
            f"Triton's interpreter on {device.type} tensors: its values hold, its times and launches do not"
        )
    runner = CostRunner(plan, device, backend="eager")  # eager steps only: its baselines and A/A floors
    launches: dict = {}
    for variant in variants:
        row = guarded(lambda variant=variant: triton_row(runner, variant, implementation, launches))
        row.setdefault("variant", variant)
        section["rows"].append(row)
        section["floors"] = {family: dict(b["floors"]) for family, b in runner.baselines.items()}
        free(device)
        print(f"triton      {variant:20s} {_triton_line(row)}", flush=True)
    return section


def _triton_line(row: dict) -> str:
    if "train_triton" not in row:
        return _statuses(row)
    counts = row["launches"]
    return (
        f"eager {row['train_eager']['ratio']:.3f} triton {row['train_triton']['ratio']:.3f} (of the baseline), "
        f"launches {counts['eager']['kernels']} -> {counts['triton']['kernels']}, {_statuses(row)}"
    )


# --- report ------------------------------------------------------------------------------------------------------


def _records(key: str, label: str, record: dict) -> Iterator[tuple[str, str, dict]]:
    """The checks with a status among `record`'s values, and one level below (a check's float32 twin)."""
    for name, value in record.items():
        if isinstance(value, dict) and "status" in value:
            yield key, f"{label}{name}", value
            for sub, nested in value.items():
                if isinstance(nested, dict) and "status" in nested:
                    yield key, f"{label}{name} {sub}", nested


def all_checks(results: dict) -> Iterator[tuple[str, str, dict]]:
    """(section, label, record) of every check with a status."""
    for key in ("correctness", "sync", "fla", "profile", "triton"):
        section = results.get(key) or {}
        if section.get("status") in ("error", "skipped"):
            yield key, "section", section
        yield from _records(key, "", section)  # a section's own checks beside its rows (fla: the model's logits)
        for row in section.get("rows", []):
            label = row.get("variant") or row.get("case") or row.get("model")
            if row.get("status") == "error":
                yield key, label, row
            yield from _records(key, f"{label} ", row)
    cost = results.get("cost") or {}
    if cost.get("status") == "error":
        yield "cost", "section", cost
    for row in cost.get("rows", []):
        label = f"{row['kind']} {'compiled' if row['compiled'] else 'eager'} {row['variant']}"
        yield "cost", label, row
        for name, record in _metrics(row).items():
            if record.get("status"):
                yield "cost", f"{label} {name}", record


def summary(results: dict) -> dict:
    counts: dict[str, int] = {}
    failures = []
    for section, label, record in all_checks(results):
        counts[record["status"]] = counts.get(record["status"], 0) + 1
        if record["status"] in ("fail", "error"):
            failures.append({"section": section, "check": label, "status": record["status"], **_why(record)})
    return {"counts": counts, "failures": failures}


def _why(record: dict) -> dict:
    return {k: record[k] for k in ("error", "synchronises", "reason") if k in record}


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}" if abs(value) < 1e-2 else f"{value:.{digits}f}"


def _cell(record: dict | None) -> str:
    if not record:
        return "-"
    status = record.get("status", "?")
    if status == "pass" and "error" in record:
        return f"pass ({_num(record['error'])})"
    if status == "fail" and "error" in record:
        return f"**fail** ({_num(record['error'])})"
    return {"fail": "**fail**", "error": "**error**"}.get(status, status)


def _ratio_cell(record: dict | None) -> str:
    if not record:
        return "-"
    if "ratio" not in record:
        return record.get("status", "-")
    floor = record.get("aa_floor", {})
    spread = f"[{floor['ratio_min']:.2f}, {floor['ratio_max']:.2f}]" if "ratio_min" in floor else ""
    return f"{record['ratio']:.3f} (A/A {floor.get('ratio', float('nan')):.3f} {spread})".replace(" )", ")")


def _heading(title: str, intro: str, section: dict) -> tuple[list[str], bool]:
    """A section's title and intro, and whether it ran; where it did not, the line that says why."""
    lines = [f"## {title}", "", intro, ""]
    if section.get("status") in ("skipped", "error"):
        return lines + _not_run(section), False
    return lines, True


def _not_run(section: dict) -> list[str]:
    """The line that says why a section did not run (skipped, or the error that stopped it)."""
    return [f"{section['status'].capitalize()}: {section.get('reason') or section.get('error')}.", ""]


def _implementations(rows: list[dict]) -> str:
    """The implementations `rows` ran ("auto → triton"), in order, without repeats."""
    return ", ".join(f'"{name}"' for name in dict.fromkeys(row.get("implementation", "?") for row in rows))


def markdown(results: dict) -> str:
    info, totals = results["device"], results["summary"]["counts"]
    lines = [
        "# GPU check",
        "",
        f"Device: {info['name']} ({info['device']}"
        + (f", CUDA {info['cuda']}, capability {info['capability']}" if info.get("cuda") else "")
        + f"); mode: {'tiny' if results['tiny'] else 'full'}; wall {results.get('wall_s', 0):.0f} s. "
        + "Checks: "
        + ", ".join(f"{n} {s}" for s, n in sorted(totals.items())),
        "",
    ]
    correctness = results.get("correctness") or {}
    if correctness.get("rows"):
        c = correctness
        lines += [
            "## Correctness",
            "",
            f"Shape L{c['shape']['n_layer']} D{c['shape']['n_embd']}, batch {c['shape']['batch']} × {c['shape']['seq']}"
            f" tokens. Error = {c['metric']}. Float32 (TF32 off) against the bound {c['fp32_bound_formula']} ="
            f" {c['fp32_bound']:.2e}; bfloat16 against {c['bf16_bound_formula']}. Baseline: GPT-2 (GPT-2 variants)"
            " or Llama (DeltaLlama) of the same shape and weights; its own error in brackets. Delta models on the"
            f" device: `delta_implementation` {_implementations(c['rows'])}; on the CPU (`device vs CPU`'s reference)"
            " the tensor ops."
            + (" On the CPU, `device vs CPU` compares two CPU runs." if info["device"] == "cpu" else ""),
            "",
            "| variant | device vs CPU fp32 | bf16 autocast | generate cache = no cache | SDPA vs eager | flash-attn 2"
            " | flash-attn 3 |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in c["rows"]:
            if row.get("status") == "error":
                lines.append(f"| {row['variant']} | **error**: {row['error']} | | | | | |")
                continue
            cells = []
            for key in ("device_vs_cpu_fp32", "bf16_autocast", "generate_cache", "sdpa_vs_eager"):
                record = row.get(key) or {}
                cell = _cell(record)
                if "baseline_error" in record:
                    cell += f" [{_num(record['baseline_error'])}]"
                cells.append(cell)
            cells += [_cell(row.get(k)) for k, _ in FLASH]
            lines.append(f"| {row['variant']} | " + " | ".join(cells) + " |")
        lines.append("")
    sync = results.get("sync") or {}
    if sync:
        heading, ran = _heading(
            "No synchronisation",
            "A training step (bf16 autocast forward with labels, backward) and a cached decoding step (no mask) under"
            ' `torch.cuda.set_sync_debug_mode("error")`, after one warm-up call each; GPT2LMHeadModel and'
            " LlamaForCausalLM of the same shape are the controls.",
            sync,
        )
        lines += heading
        if ran:
            lines += ["| model | train step | decode step |", "|---|---|---|"]
            for row in sync["rows"]:
                cells = [
                    _cell(row.get(k)) if row.get("status") != "error" else "**error**"
                    for k in ("train_step", "decode_step")
                ]
                lines.append(f"| {row['variant']} | {cells[0]} | {cells[1]} |")
            lines.append("")
    cost = results.get("cost") or {}
    if cost.get("rows"):
        s = cost["shape"]
        lines += [
            "## Cost",
            "",
            f"Delta model against its baseline in one process (L{s['n_layer']} D{s['n_embd']}, GPT-2 vocabulary"
            f" {s['vocab_size']}, Llama {s['llama_vocab_size']}). Ratio = Delta time per token / baseline's (> 1 is"
            f" slower; memory: Delta / baseline), median of interleaved pairs; next to it the baseline timed against"
            f" itself (A/A: median [min, max] pair). Training: batch {s['batch']} × {s['seq']}, bf16 autocast, AdamW,"
            f" {cost['train_pairs']} pairs; decoding: {cost['new_tokens']} new tokens after a {s['prompt']}-token"
            f" prompt, {cost['decode_pairs']} pairs; compiled: `torch.compile(fullgraph=True, dynamic=False)`, backend"
            f' {cost["compile_backend"]}, static cache for decoding. Delta models: `delta_implementation="auto"`'
            " (Triton's op on CUDA), and what it ran.",
            "",
            "| variant | kind | implementation | train step | peak train memory | "
            + " | ".join(f"decode b={b}" for b in cost["decode_batches"])
            + " |",
            "|---|---|---|---|---|" + "---|" * len(cost["decode_batches"]),
        ]
        merged: dict[tuple[str, bool], dict] = {}
        for row in cost["rows"]:
            key = (row["variant"], row["compiled"])
            entry = merged.setdefault(key, {})
            if row.get("implementation"):
                entry["implementation"] = row["implementation"]
            if row["status"] == "ok":
                entry.update(_metrics(row))
            else:
                entry[row["kind"]] = row["status"] + (f": {row['error']}" if row["status"] == "error" else "")
        for (variant, compiled), entry in merged.items():
            kind = "compiled" if compiled else "eager"
            train = _ratio_cell(entry.get(f"train_{kind}")) if f"train_{kind}" in entry else entry.get("train", "-")
            memory = _ratio_cell(entry.get(f"peak_train_memory_{kind}")) if f"train_{kind}" in entry else "-"
            decodes = [
                _ratio_cell(entry.get(f"decode_b{b}_{kind}"))
                if f"decode_b{b}_{kind}" in entry
                else entry.get("decode", "-")
                for b in cost["decode_batches"]
            ]
            cells = [variant, kind, entry.get("implementation", "-"), train, memory, *decodes]
            lines.append("| " + " | ".join(cells) + " |")
        lines += [
            "",
            "Absolute tokens/s (baseline → Delta):",
            "",
            "| variant | metric | baseline | Delta |",
            "|---|---|---|---|",
        ]
        for row in cost["rows"]:
            for name, record in _metrics(row).items():
                if "baseline_tokens_per_s" in record:
                    lines.append(
                        f"| {row['variant']} | {name} | {record['baseline_tokens_per_s']:.0f} | "
                        f"{record['delta_tokens_per_s']:.0f} |"
                    )
                elif "baseline_bytes" in record:
                    lines.append(
                        f"| {row['variant']} | {name} (MiB) | {record['baseline_bytes'] / 2**20:.0f} | "
                        f"{record['delta_bytes'] / 2**20:.0f} |"
                    )
        lines.append("")
    prof = results.get("profile") or {}
    if prof:
        heading, ran = _heading(
            "Where a training step's time goes",
            "One eager training step (bf16 autocast, AdamW) of GPT-2 and of Delta variants at the cost shape: wall time"
            " (median of 3, no profiler) beside the device's busy time and its kernel launches in one profiled step,"
            " split into matmul, attention and other kernels (by kernel name; memcpy and memset count as other). On the"
            " CPU a stand-in: the matmul and attention operators and the aten operators that call no other. Busy well"
            " below wall: the host's dispatch sets the pace.",
            prof,
        )
        lines += heading
        if ran:
            lines += [
                "| model | implementation | wall ms | busy ms | kernels | matmul ms | attention ms |"
                " other ms (kernels) |",
                "|---|---|---|---|---|---|---|---|",
            ]
            for row in prof["rows"]:
                c = row["by_class"]
                lines.append(
                    f"| {row['model']} | {row.get('implementation', '-')} | {row['wall_ms']:.1f} |"
                    f" {row['busy_ms']:.1f} | {row['kernels']} |"
                    f" {c['matmul']['ms']:.1f} | {c['attention']['ms']:.1f} |"
                    f" {c['other']['ms']:.1f} ({c['other']['kernels']}) |"
                )
            for row in prof["rows"][1:]:
                lines += [
                    "",
                    f"Costliest other kernels, {row['model']}:",
                    "",
                    "| kernel | launches | ms |",
                    "|---|---|---|",
                ]
                lines += [f"| `{k['name']}` | {k['kernels']} | {k['ms']:.2f} |" for k in row["top_other"]]
            lines.append("")
    tri = results.get("triton") or {}
    if tri:
        s = tri.get("shape")
        where = f" (L{s['n_layer']} D{s['n_embd']}, batch {s['batch']} × {s['seq']})" if s else ""
        heading, ran = _heading(
            "Triton's Delta residual op against the tensor ops",
            'Each Delta variant with `delta_implementation="eager"` (the tensor ops) and `"triton"` (one'
            f" `ddl_hf::delta_residual` op per Delta residual, forward and backward) at the cost shape{where}:"
            " one eager training step (bf16 autocast, AdamW), ratio = Delta time / baseline's (GPT-2's, or Llama's),"
            f" median of {tri.get('train_pairs', '?')} interleaved pairs, with the baseline's A/A floor as in the cost"
            ' section; triton / eager: the two medians. Correctness: the "triton" model\'s bf16-autocast loss and'
            ' every parameter\'s gradient against the same model in float32 with "eager" (TF32 off), bound'
            f' {BF16_BOUND_TEXT}, the baseline here being "eager" in bf16 (per parameter; the worst shown).'
            " Launches: the device's kernels in one profiled step (on the CPU, the profile section's stand-in),"
            " baseline → eager → triton; op calls: the Triton op's forward calls per step.",
            tri,
        )
        lines += heading
        if ran:
            if tri.get("note"):
                lines += [f"**{tri['note']}.**", ""]
            lines += [
                "| variant | eager / baseline | triton / baseline | triton / eager | bf16 loss | bf16 grads |"
                " launches | op calls |",
                "|---|---|---|---|---|---|---|---|",
            ]
            for row in tri["rows"]:
                check = row.get("bf16_loss_and_grads") or {}
                cells = [_cell(check.get("loss") or check), _cell(check.get("grads"))]
                if "train_triton" in row:
                    counts = row["launches"]
                    timed = [_ratio_cell(row["train_eager"]), _ratio_cell(row["train_triton"])]
                    timed.append(f"{row['triton_vs_eager']:.3f}")
                    kernels = [counts[name]["kernels"] for name in ("baseline", *TRITON_PAIR)]
                    calls = [counts[name]["triton_op_calls"] for name in TRITON_PAIR]
                    cells += [" → ".join(map(str, kernels)), " → ".join(map(str, calls))]
                else:
                    timed = [_cell(row), "", ""]
                    cells += ["", ""]
                lines.append(f"| {row['variant']} | " + " | ".join(timed + cells) + " |")
            lines.append("")
    fla = results.get("fla") or {}
    if fla:
        heading, ran = _heading(
            "DeltaNet through fla's kernels",
            'The delta-rule kernel of `delta_implementation="triton"` (fla\'s chunk form for bf16 and T > 1,'
            " fused_recurrent otherwise) against `delta_rule_recurrent` in float64 on the device (relative error of"
            " output and final state; bound: 8 times our torch form's error on the same inputs), then a DeltaNet"
            " DeltaGPT with \"triton\" (fla's rule, Triton's op for its Delta residuals) against the same model with"
            ' "eager": its logits, and its bf16 training step (ratio < 1: "triton" faster).',
            fla,
        )
        lines += heading
        if ran:
            lines += ["| case | rule vs float64 recurrent |", "|---|---|"]
            lines += [f"| {row['case']} | {_cell(row['check'])} |" for row in fla["rows"]]
            model = fla.get("model_logits") or {}
            lines += [f"| DeltaNet model's logits vs float32 eager: bf16 autocast | {_cell(model)} |"]
            lines += [f"| DeltaNet model's logits vs float32 eager: float32 | {_cell(model.get('fp32'))} |"]
            lines += ["", f"Training step, triton / eager: {_ratio_cell(fla.get('train_step_fla_vs_torch'))}", ""]
    failures = results["summary"]["failures"]
    lines += ["## Failures", ""]
    lines += [f"- {f['section']}: {f['check']}: {f['status']} {_why(f)}" for f in failures] or ["None."]
    return "\n".join(lines) + "\n"


# --- fla: DeltaNet's delta rule through flash-linear-attention's kernels ------------------------------------------

#: (tokens, dtype) of the kernel comparisons: one decoding step, a chunk, several chunks with a ragged end.
FLA_CASES = ((1, torch.float32), (64, torch.float32), (200, torch.float32), (64, torch.bfloat16), (200, torch.bfloat16))


def _rule_error(
    inputs: list[torch.Tensor], dtype: torch.dtype, exact: tuple[torch.Tensor, torch.Tensor], kernel: Callable | None
) -> float:
    """The larger relative error of `delta_rule`'s output and final state in `dtype` against `exact`, with `kernel`
    (a `DeltaKernels.delta_rule`; None: the torch forms)."""
    from ddl_hf.delta_net_ops import delta_rule

    o, final = delta_rule(*(x.to(dtype) for x in inputs[:4]), initial_state=inputs[4], kernel=kernel)
    return max(rel_err(o.double(), exact[0]), rel_err(final.double(), exact[1]))


def fla_rule_errors(device: torch.device, kernel: Callable, heads: int = 4, d: int = 64) -> list[dict]:
    """`kernel`, a delta-rule kernel (`delta_implementation="triton"`'s: fla's chunk form for half precision and
    T > 1, else fused_recurrent), on random inputs with an initial state, against `delta_rule_recurrent` in float64
    on the same device (relative error of the output and the final state). The bound is derived, not guessed: 8 times
    the error our torch form makes on the same inputs in the same dtype (most of it the inputs' own rounding), at
    least 1e-6."""
    from ddl_hf.delta_net_ops import delta_rule_recurrent

    rows = []
    for tokens, dtype in FLA_CASES:
        g = torch.Generator(device="cpu").manual_seed(tokens)
        q, k = (torch.nn.functional.normalize(torch.randn(2, heads, tokens, d, generator=g), dim=-1) for _ in "qk")
        v = torch.randn(2, heads, tokens, d, generator=g)
        beta = torch.rand(2, heads, tokens, generator=g)
        state = torch.randn(2, heads, d, d, generator=g) * 0.1
        inputs = [x.to(device) for x in (q, k, v, beta, state)]
        exact = delta_rule_recurrent(*(x.double() for x in inputs[:4]), inputs[4].double())
        error = _rule_error(inputs, dtype, exact, kernel)
        ours = _rule_error(inputs, dtype, exact, None)
        bound = max(8 * ours, 1e-6)
        record = {"status": passed(error <= bound), "error": error, "bound": bound, "torch_error": ours}
        rows.append({"case": f"T={tokens} {str(dtype).removeprefix('torch.')}", "check": record})
    return rows


def implementation_model_check(model: PreTrainedModel, ids: torch.Tensor, implementation: str) -> dict:
    """`model`'s logits with `implementation` against the same model in float32 with "eager" (the tensor ops): under
    bf16 autocast (bound: BF16_FACTOR times "eager"'s own bf16 error, at least bf16's eps, the rule the correctness
    section applies to every variant) and in float32 (`fp32`: the float32 bound of the model's shape). What an
    op-level comparison cannot see, the model's own inputs to the kernels (dtypes, layouts, a state carried between
    chunks), these see. The model runs the implementation it had before afterwards."""
    with delta_implementation(model, "eager"):
        with exact_fp32():
            reference = logits_of(model, ids)
        eager_bf16 = rel_err(logits_of(model, ids, bf16=True), reference)
    with delta_implementation(model, implementation):
        error = rel_err(logits_of(model, ids, bf16=True), reference)
        with exact_fp32():
            fp32_error = rel_err(logits_of(model, ids), reference)
    bound = BF16_FACTOR * max(eager_bf16, EPS_BF16)
    shape = {"n_layer": model.config.num_hidden_layers, "n_embd": model.config.hidden_size}
    return {
        "status": passed(error <= bound),
        "error": error,
        "bound": bound,
        "torch_error": eager_bf16,
        "implementation": implementation,
        "fp32": {"status": passed(fp32_error <= fp32_bound(shape)), "error": fp32_error, "bound": fp32_bound(shape)},
    }


def fla_section(plan: dict, device: torch.device) -> dict:
    """fla's kernels against our torch forms on the device: the rule's numbers, then a DeltaNet model with
    `delta_implementation="triton"` (fla's delta rule, and Triton's op for its Delta residuals) against the same
    model with "eager": its logits, and its bf16 training step (ratio < 1: "triton" is faster)."""
    from ddl_hf.delta_ops import delta_kernels
    from ddl_hf.fla_kernels import fla_available

    if device.type != "cuda":
        return {"status": "skipped", "reason": "fla's kernels run on CUDA only"}
    if not fla_available():
        return {"status": "skipped", "reason": "fla is not installed (pip install 'ddl-hf[fla]')"}
    if problem := triton_unavailable(device):
        return {"status": "skipped", "reason": problem}
    section = {"rows": fla_rule_errors(device, delta_kernels("triton", torch.empty(0, device=device)).delta_rule)}
    config = base_config("gpt2", plan["cost"]).to_dict()
    fields = {k: v for k, v in config.items() if k not in ("model_type", "transformers_version")}
    torch.manual_seed(1)
    delta_config = DeltaGPTConfig(**fields, **_COMMON, token_mixer="delta_net", delta_implementation="eager")
    model = DeltaGPTForCausalLM(delta_config).to(device).train()
    model.loss_type = "ForCausalLM"
    ids = random_ids(model.config.vocab_size, plan["cost"]["batch"], plan["cost"]["seq"], seed=5).to(device)
    section["model_logits"] = guarded(lambda: implementation_model_check(model, ids[:2], "triton"))
    step = train_step_fn(model, ids, torch.optim.AdamW(model.parameters(), lr=1e-4))
    torch_step, fla_step = (running(model, implementation, step) for implementation in TRITON_PAIR)
    pairs = plan["train_pairs"]
    floor = interleaved(torch_step, torch_step, pairs, device)
    timing = interleaved(torch_step, fla_step, pairs, device)
    section["train_step_fla_vs_torch"] = {**timing, "aa_floor": floor, "status": "ok"}
    return section


# --- main --------------------------------------------------------------------------------------------------------


def device_info(device: torch.device) -> dict:
    info: dict = {"device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            name=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
        )
    else:
        info["name"] = cpu_model()
    packages = {}
    for package in ("triton", "fla-core", "accelerate", "peft", "flash_attn", "flash_attn_3", "datasets"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            packages[package] = importlib.metadata.version(package)
    info["packages"] = packages
    return info


SECTIONS = (
    "correctness",
    "sync",
    "fla",
    "profile",
    "triton",
    "cost",
)  # cost last: its budget guard drops what is left


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and 1-2 pairs: the code paths in seconds")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results", help="output folder")
    parser.add_argument("--name", default="gpu_check", help="basename of the result files")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument(
        "--compiled-variants",
        nargs="*",
        choices=list(VARIANTS),
        help="variants of the compiled cost rows (default: those of COMPILED_ROWS among --variants)",
    )
    parser.add_argument("--budget-s", type=float, default=420, help="skip the cost rows left after this many seconds")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument(
        "--compile-backend",
        help="torch.compile backend of the compiled rows (default: inductor; aot_eager with --tiny on the CPU, "
        "the same graph capture without the C++ build)",
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    hf_logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    plan = TINY if args.tiny else FULL
    backend = args.compile_backend or ("aot_eager" if args.tiny and device.type == "cpu" else "inductor")
    compiled = args.compiled_variants
    compiled = [v for _, v in COMPILED_ROWS if v in args.variants] if compiled is None else compiled

    prov = provenance(None if argv is None else [__file__, *argv])
    results: dict = {"provenance": prov, "device": device_info(device)}
    results["tiny"] = args.tiny
    results["variants"] = {name: {"family": f, **_COMMON, **fields} for name, (f, fields) in VARIANTS.items()}

    def save() -> None:
        results["wall_s"] = time.perf_counter() - start
        results["summary"] = summary(results)
        write_results(args.out, args.name, results, markdown(results))

    for name in args.sections:
        if name == "correctness":
            run = lambda: correctness_section(plan, device, args.variants)  # noqa: E731
        elif name == "sync":
            run = lambda: sync_section(plan, device, args.variants)  # noqa: E731
        elif name == "fla":
            run = lambda: fla_section(plan, device)  # noqa: E731
        elif name == "profile":
            run = lambda: profile_section(plan, device)  # noqa: E731
        elif name == "triton":
            run = lambda: triton_section(plan, device, args.variants)  # noqa: E731
        else:
            run = lambda: cost_section(  # noqa: E731
                plan, device, backend, (args.variants, compiled), start, args.budget_s, save
            )
        results[name] = guarded(run)
        save()
    print(markdown(results).split("## Correctness")[0].strip())
    print(f"wrote {args.out / args.name}.json and .md")
    return results


if __name__ == "__main__":
    main()
