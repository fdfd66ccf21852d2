"""One-command cost report of DeltaGPT / DeltaLlama on an accelerator: time, kernel launches and memory against
GPT-2 / Llama. Correctness and host synchronisation are tests: `python -m pytest -m gpu` on the GPU (tests/gpu).

    python -m ddl_lab.checks.gpu_check                        # on the GPU; sized for under 8 minutes on one H100
    python -m ddl_lab.checks.gpu_check --device cpu --tiny    # the same code paths on the CPU, tiny shapes, 1-2 pairs
    python -m ddl_lab.checks.gpu_check --sections triton      # one section
    TRITON_INTERPRET=1 python -m ddl_lab.checks.gpu_check --device cpu --tiny --sections triton  # on the CPU

Models are built from their configs (random weights, the Delta model sharing every baseline weight), data from random
token ids: nothing is downloaded, nothing imports `datasets`. Results: `ddl_lab/checks/results/gpu_check.{json,md}` (or
`--out DIR`) with command, commit, machine, device and versions. A failing section or row is recorded as an error.

- profile: one eager training step of GPT-2 and two Delta variants at the 124M shape under torch.profiler: wall time
  beside the device's busy time, kernel launches, busy time by class (matmul, attention, other).
- triton: each variant's eager training step with `delta_implementation="eager"` (the tensor ops) and `"triton"`
  (one Triton op per Delta residual) beside its baseline, and launches per step of both; a DeltaNet row adds fla's
  delta rule where installed. Where Triton cannot run (the CPU), "eager" stands in and the report says so.
- cost: Delta model against its baseline in one process, interleaved pairs (ABBA), each ratio beside the baseline
  timed against itself (the A/A floor): training tokens/s and peak memory at the 124M shape (bf16 autocast, eager
  and `torch.compile`), batch-1 and batch-32 decoding (eager, and compiled with the static cache). Rows past the
  time budget (`--budget-s`) are skipped and say so.

Delta models run `delta_implementation="auto"` (Triton's op on CUDA, the tensor ops on the CPU) unless a section says
otherwise; every row records what ran.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import math
import re
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from transformers import PreTrainedModel
from transformers.utils import logging as hf_logging

from ddl_hf import DeltaGPTConfig, DeltaGPTForCausalLM
from ddl_lab import builders
from ddl_lab.checks.gpu_report import SECTIONS, TRITON_PAIR, markdown, metrics, summary
from ddl_lab.common import (
    cpu_model,
    generate_fn,
    interleaved,
    peak_step_memory,
    provenance,
    synchronize,
    timed,
    train_step_fn,
    write_results,
)

# --- what is measured --------------------------------------------------------------------------------------------

_COMMON = dict(delta_beta_init=0.5)  # a generic open gate: additive mode at beta 0 would be the baseline exactly
# VARIANTS (builders.GPU_VARIANTS): every section runs every variant; the compiled cost rows a subset.
VARIANTS = builders.GPU_VARIANTS
#: The triton section's extra row: a DeltaNet DeltaGPT, whose "triton" also runs fla's delta rule (where installed).
DELTA_NET_ROW = "delta-net"


def family_of(variant: str) -> str:
    """The baseline family of a variant (or of DELTA_NET_ROW, a DeltaGPT)."""
    return "gpt2" if variant == DELTA_NET_ROW else VARIANTS[variant][0]


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

# Shapes: GPT-2 small (124M); Llama of the same depth and width.
FULL = dict(
    cost=dict(
        n_layer=12, n_embd=768, n_head=12, vocab_size=50257, llama_vocab_size=32000, batch=8, seq=1024, prompt=32
    ),
    new_tokens=32,
    decode_batches=(1, 32),
    train_pairs=8,
    decode_pairs=3,
)
TINY = dict(
    cost=dict(n_layer=2, n_embd=64, n_head=4, vocab_size=512, llama_vocab_size=512, batch=4, seq=64, prompt=8),
    new_tokens=4,
    decode_batches=(1, 32),
    train_pairs=2,
    decode_pairs=1,
)

# --- models ------------------------------------------------------------------------------------------------------


def build_baseline(family: str, shape: dict) -> PreTrainedModel:
    """transformers' GPT-2 (dropout off, <|endoftext|> the last token) or a Llama of the same depth and width (GQA,
    SwiGLU 8/3·D, its own vocabulary), random weights from seed 0, SDPA attention, in eval mode."""
    if family == "llama":
        width, vocab = shape["n_embd"], shape.get("llama_vocab_size", shape["vocab_size"])
        intermediate = 64 * math.ceil(8 * width / 3 / 64)
        llama = dict(shape, arch="llama", kv_heads=shape["n_head"] // 2, intermediate=intermediate, vocab_size=vocab)
        return builders.build_baseline(llama).eval()
    end = shape["vocab_size"] - 1
    no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return builders.build_baseline(shape, bos_token_id=end, eos_token_id=end, **no_dropout).eval()


def build_delta(variant: str, baseline: PreTrainedModel, implementation: str = "auto") -> PreTrainedModel:
    """The variant over `baseline`'s config, on the CPU, holding every baseline weight (the Delta ones are extra, from
    seed 1), running `implementation` (`delta_implementation`: "auto", the default, takes Triton's op on CUDA)."""
    torch.manual_seed(1)
    return builders.delta_over(baseline, {**_COMMON, **VARIANTS[variant][1]}, implementation).eval()


def delta_net(baseline: PreTrainedModel, implementation: str = "eager") -> PreTrainedModel:
    """A DeltaNet DeltaGPT of `baseline`'s shape (its own weights: the token mixer is not GPT-2's attention)."""
    fields = {k: v for k, v in baseline.config.to_dict().items() if k not in ("model_type", "transformers_version")}
    torch.manual_seed(1)
    config = DeltaGPTConfig(**fields, **_COMMON, token_mixer="delta_net", delta_implementation=implementation)
    return DeltaGPTForCausalLM(config)


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
    """`step` with `model` running `implementation` (per model, as `set_attn_implementation`): one model's weights
    and optimizer stepped either way. Switching costs the host ~0.1 ms a call, within the A/A floor of a step."""

    def run() -> None:
        with builders.delta_implementation(model, implementation):
            step()

    return run


def random_ids(vocab: int, *shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def free(device: torch.device) -> None:
    """Give a finished row's GPU memory back (models hold reference cycles); on the CPU nothing to gain."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def guarded(fn: Callable[[], dict]) -> dict:
    """`fn()`'s record, or an error record with the exception: one failing row never loses the others."""
    start = time.perf_counter()
    try:
        record = fn()
    except Exception as error:  # recorded in the results, not swallowed
        record = {"status": "error", "error": f"{type(error).__name__}: {error}"[:2000]}
        record["traceback"] = traceback.format_exc(limit=-6)[-4000:]
    record["wall_s"] = round(time.perf_counter() - start, 3)
    return record


# --- cost --------------------------------------------------------------------------------------------------------


class CostRunner:
    """The models every section times: each family's baseline (with its optimizer, compiled form and A/A floors),
    built once and held across the rows, and the Delta models over it; `train` and `decode` measure one cost row."""

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

    def delta(self, variant: str, implementation: str = "auto") -> PreTrainedModel:
        """`variant` (or DELTA_NET_ROW) over its family's baseline, on the device, running `implementation`."""
        baseline = self.baseline(family_of(variant))["model"]
        if variant == DELTA_NET_ROW:
            model = delta_net(baseline, implementation)
        else:
            model = build_delta(variant, baseline, implementation)
        model = model.to(self.device)
        model.loss_type = "ForCausalLM"
        return model

    def ids(self, vocab: int) -> torch.Tensor:
        return random_ids(vocab, self.shape["batch"], self.shape["seq"], seed=4).to(self.device)

    def floor(self, family: str, metric: str, measure: Callable[[], dict]) -> dict:
        floors = self.baselines[family]["floors"]
        if metric not in floors:
            floors[metric] = measure()
        return floors[metric]

    def floors(self) -> dict:
        """Each family's A/A floors so far, by metric."""
        return {family: dict(base["floors"]) for family, base in self.baselines.items()}

    def against_baseline(
        self, family: str, metric: str, run_a: Callable, run_b: Callable, pairs: int, tokens: int, warmup: int = 0
    ) -> dict:
        """`run_b` timed against the baseline's `run_a` in interleaved pairs (`throughput`), beside the A/A floor of
        `metric`: `run_a` timed against itself, once per family."""

        def timing(run: Callable) -> dict:
            return interleaved(run_a, run, pairs, warmup, self.device)

        floor = self.floor(family, metric, lambda: timing(run_a))
        return throughput(timing(run_b), floor, tokens)

    def train(self, variant: str, compiled: bool) -> dict:
        family = VARIANTS[variant][0]
        base = self.baseline(family)
        delta = self.delta(variant)
        models = [base["model"], delta]
        if compiled:
            if base["compiled"] is None:
                base["compiled"] = torch.compile(base["model"], fullgraph=True, dynamic=False, backend=self.backend)
            callables = [base["compiled"], torch.compile(delta, fullgraph=True, dynamic=False, backend=self.backend)]
        else:
            callables = models
        ids = self.ids(base["model"].config.vocab_size)
        optimizer = torch.optim.AdamW(delta.parameters(), lr=1e-4)
        step_a, _ = train_step_fn(callables[0], ids, base["optimizer"], autocast=torch.bfloat16)
        step_b, _ = train_step_fn(callables[1], ids, optimizer, autocast=torch.bfloat16)
        kind = "compiled" if compiled else "eager"
        for step in (step_a, step_b):  # compiles (when compiled) and creates the AdamW state: not timed
            step()
            step()

        def aa_memory() -> dict:
            first = peak_step_memory(step_a, base["model"], base["optimizer"])
            second = peak_step_memory(step_a, base["model"], base["optimizer"])
            return {
                "baseline_bytes": first["bytes"],
                "delta_bytes": second["bytes"],
                "ratio": second["bytes"] / first["bytes"],
                "baseline_allocator": {k: v for k, v in first.items() if k != "bytes"},
            }

        timing = self.against_baseline(family, f"train_{kind}", step_a, step_b, self.plan["train_pairs"], ids.numel())
        floor_memory = self.floor(family, f"memory_{kind}", aa_memory)
        memory_a = floor_memory["baseline_bytes"]  # the baseline's step does not change between rows
        memory_b = peak_step_memory(step_b, delta, optimizer)
        for model in models:
            model.eval()
        return {
            "implementation": implementation_ran(delta, self.device),
            f"train_{kind}": timing,
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
        baseline = self.baseline(family)["model"].eval()
        delta = self.delta(variant).eval()
        kind = "compiled" if compiled else "eager"
        n = self.plan["new_tokens"]
        record = {"implementation": implementation_ran(delta, self.device)}
        for batch in self.plan["decode_batches"]:
            prompt = random_ids(baseline.config.vocab_size, batch, self.shape["prompt"], seed=5).to(self.device)
            # dynamic=False: one static graph per batch size. With automatic dynamic shapes, the second batch size (or
            # the next model through transformers' shared forward wrapper) recompiles mid-timing into a dynamic graph.
            options = dict(backend=self.backend, dynamic=False)
            run_a, run_b = (generate_fn(m, prompt, n, compiled, **options) for m in (baseline, delta))
            metric = f"decode_b{batch}_{kind}"
            try:
                run_b()  # the first call compiles, or refuses the static cache
            except ValueError as error:
                if "not supported" not in str(error):
                    raise
                record[metric] = {"status": "not supported", "reason": str(error)[:500]}
                continue
            pairs = self.plan["decode_pairs"]
            record[metric] = self.against_baseline(family, metric, run_a, run_b, pairs, batch * n, warmup=1)
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
        if any("ratio" in m for m in metrics(row).values()):  # a refusal says nothing about the next row's time
            last[kind, compiled] = row["wall_s"]
    section["rows"].append(row)
    section["floors"] = runner.floors()
    free(device)
    print(
        f"cost        {kind:6s} {'compiled' if compiled else 'eager':8s} {variant:20s} {_cost_line(row)}",
        flush=True,
    )


def _cost_line(row: dict) -> str:
    if row["status"] != "ok":
        return f"{row['status']}: {row.get('reason') or row.get('error')}"
    return " ".join(f"{k} {v['ratio']:.3f}" if "ratio" in v else f"{k} {v['status']}" for k, v in metrics(row).items())


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
    runner = CostRunner(plan, device, backend="eager")  # eager steps only: its baseline GPT-2 and token ids
    baseline = runner.baseline("gpt2")["model"]
    ids = runner.ids(baseline.config.vocab_size)
    rows = []
    for name in ("gpt2", *PROFILE_VARIANTS):
        model = baseline if name == "gpt2" else runner.delta(name)
        step, _ = train_step_fn(model, ids, autocast=torch.bfloat16)
        step()
        step()  # AdamW's state exists; caches are warm
        walls = [timed(step, device)[1] for _ in range(3)]
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
    return {"shape": plan["cost"], "tokens": ids.numel(), "rows": rows}


# --- triton: the Delta residual as one Triton op against the tensor ops (ddl_hf.triton_delta) -------------------

#: The two implementations the section compares: the tensor ops, and one Triton op per Delta residual.


def triton_row(runner: CostRunner, variant: str, implementation: str, launches: dict) -> dict:
    """One variant (or DELTA_NET_ROW): its eager training step with "eager" and with `implementation` (one model, the
    same AdamW) each against the baseline's (its A/A floor is the cost section's, `CostRunner.floor`), then the
    launches of one profiled step of each. `launches`: each family's baseline launches, profiled once."""
    family = family_of(variant)
    device = runner.device
    base = runner.baseline(family)
    baseline = base["model"]
    delta = runner.delta(variant, "eager")
    ids = runner.ids(baseline.config.vocab_size)
    row: dict = {
        "variant": variant,
        "family": family,
        "implementations": dict(zip(TRITON_PAIR, ("eager", implementation))),
    }
    if variant == DELTA_NET_ROW:
        from ddl_hf.fla_kernels import fla_available

        row["fla"] = implementation == "triton" and device.type == "cuda" and fla_available()
    delta_step, _ = train_step_fn(delta, ids, autocast=torch.bfloat16)
    steps = {"eager": running(delta, "eager", delta_step), "triton": running(delta, implementation, delta_step)}
    base_step, _ = train_step_fn(baseline, ids, base["optimizer"], autocast=torch.bfloat16)
    for step in (base_step, *steps.values()):  # AdamW's state, Triton's compilation: not timed
        step()
        step()
    pairs = runner.plan["train_pairs"]
    for name, step in steps.items():
        row[f"train_{name}"] = runner.against_baseline(family, "train_eager", base_step, step, pairs, ids.numel())
    row["triton_vs_eager"] = row["train_triton"]["delta_s"] / row["train_eager"]["delta_s"]
    if family not in launches:
        launches[family] = step_kernels(base_step, device)
    row["launches"] = {"baseline": launches[family], **{name: step_kernels(s, device) for name, s in steps.items()}}
    baseline.eval()
    return row


def triton_section(plan: dict, device: torch.device, variants: list[str]) -> dict:
    """`delta_implementation="triton"` against `"eager"` for each of `variants` and DELTA_NET_ROW at the cost shape
    (`triton_row`). Where Triton cannot run on `device`'s tensors (the CPU without Triton's interpreter), "eager"
    stands in for it: the section's code runs, the rows say what ran, and no number is Triton's."""
    problem = triton_unavailable(device)
    implementation = "eager" if problem else "triton"
    section: dict = {"shape": plan["cost"], "train_pairs": plan["train_pairs"], "triton_ran": not problem, "rows": []}
    if problem:
        section["note"] = (
            f'Triton cannot run here: {problem.rstrip(".")}. "eager" stands in for "triton": this exercises the'
            " section's code, and no number below is Triton's"
        )
    elif device.type != "cuda":
        section["note"] = f"Triton's interpreter on {device.type} tensors: its times and launches do not hold"
    runner = CostRunner(plan, device, backend="eager")  # eager steps only: its baselines and A/A floors
    launches: dict = {}
    for variant in [*variants, DELTA_NET_ROW]:
        row = guarded(lambda variant=variant: triton_row(runner, variant, implementation, launches))
        row.setdefault("variant", variant)
        section["rows"].append(row)
        section["floors"] = runner.floors()
        free(device)
        print(f"triton      {variant:20s} {_triton_line(row)}", flush=True)
    return section


def _triton_line(row: dict) -> str:
    if "train_triton" not in row:
        return f"{row.get('status')}: {row.get('error')}"
    counts = row["launches"]
    return (
        f"eager {row['train_eager']['ratio']:.3f} triton {row['train_triton']['ratio']:.3f} (of the baseline), "
        f"launches {counts['eager']['kernels']} -> {counts['triton']['kernels']}"
    )


#: Sections that ran here once and are tests now (tests/gpu): `--sections` names them and says where they went.
MOVED = ("correctness", "sync", "fla")


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


def section_name(name: str) -> str:
    """`--sections`' type: one of SECTIONS; a section that moved to the tests says so."""
    if name in MOVED:
        raise argparse.ArgumentTypeError(
            f"{name!r} is a test now, not a section (tests/gpu): run `python -m pytest -m gpu` on the GPU"
        )
    if name not in SECTIONS:
        raise argparse.ArgumentTypeError(f"invalid choice: {name!r} (choose from {', '.join(SECTIONS)})")
    return name


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and 1-2 pairs: the code paths in seconds")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results", help="output folder")
    parser.add_argument("--name", default="gpu_check", help="basename of the result files")
    parser.add_argument(
        "--sections", nargs="+", type=section_name, default=list(SECTIONS), help=f"of {', '.join(SECTIONS)}"
    )
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

    runs = {
        "profile": lambda: profile_section(plan, device),
        "triton": lambda: triton_section(plan, device, args.variants),
        "cost": lambda: cost_section(plan, device, backend, (args.variants, compiled), start, args.budget_s, save),
    }
    for name in args.sections:
        results[name] = guarded(runs[name])
        save()
    print(markdown(results).split("\n## ")[0].strip())
    print(f"wrote {args.out / args.name}.json and .md")
    return results


if __name__ == "__main__":
    main()
