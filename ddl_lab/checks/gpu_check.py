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
from functools import partial
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from transformers import PreTrainedModel
from transformers.utils import logging as hf_logging

from ddl_hf import DeltaGPTConfig, DeltaGPTForCausalLM
from ddl_hf.delta_ops import delta_kernels
from ddl_lab import builders
from ddl_lab.checks.gpu_report import SECTIONS, TRITON_PAIR, markdown, metrics, progress_line, summary
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
#: The Delta models profiled beside their GPT-2 baseline: the cheapest and the expanded state.
PROFILE_VARIANTS = ("additive-dv1", "paper-dv4")

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

# Shapes: GPT-2 small (124M); Llama of the same depth and width. Every key is also the cost section's.
FULL = dict(
    shape=dict(
        n_layer=12, n_embd=768, n_head=12, vocab_size=50257, llama_vocab_size=32000, batch=8, seq=1024, prompt=32
    ),
    new_tokens=32,
    decode_batches=(1, 32),
    train_pairs=8,
    decode_pairs=3,
)
TINY = dict(
    FULL,
    shape=dict(n_layer=2, n_embd=64, n_head=4, vocab_size=512, llama_vocab_size=512, batch=4, seq=64, prompt=8),
    new_tokens=4,
    train_pairs=2,
    decode_pairs=1,
)

# --- models ------------------------------------------------------------------------------------------------------


def family_of(variant: str) -> str:
    """The baseline family of a variant (or of DELTA_NET_ROW, a DeltaGPT)."""
    return "gpt2" if variant == DELTA_NET_ROW else VARIANTS[variant][0]


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
    """The variant over `baseline`'s config, on the CPU, in eval mode, running `implementation` ("auto" takes Triton's
    op on CUDA), holding every baseline weight (the Delta ones are extra, from seed 1); DELTA_NET_ROW: a DeltaNet
    DeltaGPT of its shape, weights its own (its token mixer is not GPT-2's attention)."""
    torch.manual_seed(1)
    if variant != DELTA_NET_ROW:
        return builders.delta_over(baseline, {**_COMMON, **VARIANTS[variant][1]}, implementation).eval()
    fields = {k: v for k, v in baseline.config.to_dict().items() if k not in ("model_type", "transformers_version")}
    config = DeltaGPTConfig(**fields, **_COMMON, token_mixer="delta_net", delta_implementation=implementation)
    return DeltaGPTForCausalLM(config).eval()


def implementation_ran(model: PreTrainedModel, device: torch.device) -> str:
    """What `model`'s `delta_implementation` (here "auto", "eager" or "triton") runs for its Delta residuals on
    `device`: "triton" (the one op per residual) or "eager" (the tensor ops); "auto" as what it resolved to."""
    requested = model.config.delta_implementation
    ran = "triton" if delta_kernels(requested, torch.empty(0, device=device)).residual is not None else "eager"
    return requested if ran == requested else f"{requested} → {ran}"


def triton_unavailable(device: torch.device) -> str | None:
    """Why `delta_implementation="triton"` cannot run on `device`'s tensors here (the library's reason), or None."""
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


def warm(*steps: Callable[[], None]) -> None:
    """Two untimed calls of each step: AdamW's state exists, compilation (torch.compile, Triton) is done."""
    for step in steps:
        step()
        step()


def finish(key: str, section: dict, row: dict, device: torch.device) -> None:
    """Append a finished row to `section` (of `key`), print it, and give its GPU memory back (models hold reference
    cycles; on the CPU nothing to gain)."""
    section["rows"].append(row)
    print(progress_line(key, row), flush=True)
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
    """The models every section times: each family's baseline (with its optimizer, token ids, compiled form) and its
    A/A floors, built once and held across the rows, and the Delta models over it; `train`, `decode`: one cost row."""

    def __init__(self, plan: dict, device: torch.device, backend: str = "eager"):
        self.plan, self.device, self.backend = plan, device, backend
        self.shape = plan["shape"]
        self.tokens = self.shape["batch"] * self.shape["seq"]  # of a training step
        self.baselines: dict[str, dict] = {}
        self.floors: dict[str, dict] = {}  # by family, by metric: the baseline timed against itself (A/A)

    def baseline(self, family: str) -> dict:
        if family not in self.baselines:
            model = build_baseline(family, self.shape).to(self.device)
            model.loss_type = "ForCausalLM"  # transformers resolves the loss through a property that logs otherwise
            ids = random_ids(model.config.vocab_size, self.shape["batch"], self.shape["seq"], seed=4).to(self.device)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            self.baselines[family] = dict(model=model, optimizer=optimizer, ids=ids, compiled=None, launches=None)
            self.floors[family] = {}
        return self.baselines[family]

    def delta(self, variant: str, implementation: str = "auto") -> PreTrainedModel:
        """`variant` (or DELTA_NET_ROW) over its family's baseline, on the device, running `implementation`."""
        model = build_delta(variant, self.baseline(family_of(variant))["model"], implementation).to(self.device)
        model.loss_type = "ForCausalLM"
        return model

    def steps(self, family: str, delta: PreTrainedModel, compiled: bool = False) -> tuple[Callable, Callable, object]:
        """The bf16 training steps of the baseline (its AdamW held across rows) and of `delta` (a new AdamW, returned
        third) on the family's token ids; `compiled`: of their torch.compile'd forms (the baseline's compiled once)."""
        base = self.baseline(family)
        models = [base["model"], delta]
        if compiled:
            if base["compiled"] is None:
                base["compiled"] = torch.compile(base["model"], fullgraph=True, dynamic=False, backend=self.backend)
            models = [base["compiled"], torch.compile(delta, fullgraph=True, dynamic=False, backend=self.backend)]
        step_a, _ = train_step_fn(models[0], base["ids"], base["optimizer"], autocast=torch.bfloat16)
        step_b, optimizer = train_step_fn(models[1], base["ids"], autocast=torch.bfloat16)
        return step_a, step_b, optimizer

    def floor(self, family: str, metric: str, measure: Callable[[], dict]) -> dict:
        floors = self.floors[family]
        if metric not in floors:
            floors[metric] = measure()
        return floors[metric]

    def against_baseline(self, family: str, metric: str, run_a: Callable, run_b: Callable, batch: int = 0) -> dict:
        """`run_b` timed against the baseline's `run_a` in interleaved pairs (`throughput`), beside the A/A floor of
        `metric` (`run_a` against itself, once per family): warmed training steps, or with `batch` decoding calls of
        that batch size (a warm-up pair first)."""
        pairs, tokens, warmup = self.plan["train_pairs"], self.tokens, 0
        if batch:
            pairs, tokens, warmup = self.plan["decode_pairs"], batch * self.plan["new_tokens"], 1
        floor = self.floor(family, metric, lambda: interleaved(run_a, run_a, pairs, warmup, self.device))
        return throughput(interleaved(run_a, run_b, pairs, warmup, self.device), floor, tokens)

    def train(self, variant: str, compiled: bool) -> dict:
        family, kind = family_of(variant), "compiled" if compiled else "eager"
        base, delta = self.baseline(family), self.delta(variant)
        step_a, step_b, optimizer = self.steps(family, delta, compiled)
        warm(step_a, step_b)

        def aa_memory() -> dict:  # the baseline's step against itself; its reading serves every row of the family
            a, b = (peak_step_memory(step_a, base["model"], base["optimizer"]) for _ in range(2))
            return {**memory_ratio(a["bytes"], b), "baseline_allocator": allocator(a)}

        timing = self.against_baseline(family, f"train_{kind}", step_a, step_b)
        floor = self.floor(family, f"memory_{kind}", aa_memory)
        reading = peak_step_memory(step_b, delta, optimizer)
        memory = {**memory_ratio(floor["baseline_bytes"], reading), "aa_floor": aa_summary(floor)}
        memory.update(baseline_allocator=floor["baseline_allocator"], delta_allocator=allocator(reading))
        return {
            "implementation": implementation_ran(delta, self.device),
            f"train_{kind}": timing,
            f"peak_train_memory_{kind}": memory,
        }

    def decode(self, variant: str, compiled: bool) -> dict:
        family, kind = family_of(variant), "compiled" if compiled else "eager"
        baseline, delta = self.baseline(family)["model"].eval(), self.delta(variant)
        record = {"implementation": implementation_ran(delta, self.device)}
        for batch in self.plan["decode_batches"]:
            prompt = random_ids(baseline.config.vocab_size, batch, self.shape["prompt"], seed=5).to(self.device)
            # dynamic=False: one static graph per batch size. With automatic dynamic shapes, the second batch size (or
            # the next model through transformers' shared forward wrapper) recompiles mid-timing into a dynamic graph.
            n, options = self.plan["new_tokens"], dict(backend=self.backend, dynamic=False)
            run_a, run_b = (generate_fn(m, prompt, n, compiled, **options) for m in (baseline, delta))
            metric = f"decode_b{batch}_{kind}"
            try:
                run_b()  # the first call compiles, or refuses the static cache
            except ValueError as error:
                if "not supported" not in str(error):
                    raise
                record[metric] = {"status": "not supported", "reason": str(error)[:500]}
                continue
            record[metric] = self.against_baseline(family, metric, run_a, run_b, batch)
        return record


def allocator(reading: dict) -> dict:
    """The CUDA allocator's own readings of a `peak_step_memory` record (none on the CPU)."""
    return {k: v for k, v in reading.items() if k != "bytes"}


def memory_ratio(baseline: int, delta: dict) -> dict:
    """The baseline's peak bytes beside the Delta model's (a `peak_step_memory` record), and their ratio."""
    return {"baseline_bytes": baseline, "delta_bytes": delta["bytes"], "ratio": delta["bytes"] / baseline}


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
    variants, compiled_variants = selection  # eager rows first, then the compiled: what the budget guard drops last
    jobs = [(kind, v, False) for kind in ("train", "decode") for v in variants]
    jobs += [(kind, v, True) for kind, v in COMPILED_ROWS if v in compiled_variants]
    section: dict = {**plan, "compile_backend": backend, "budget_s": budget_s, "rows": [], "floors": runner.floors}
    last: dict[tuple[str, bool], float] = {}  # seconds of the last measured row of each kind: the next one's estimate
    # Every Delta variant is a new graph of the same forwards: room for all of them (the default stops at 8).
    with torch._dynamo.config.patch(recompile_limit=max(torch._dynamo.config.recompile_limit, 64)):
        for kind, variant, compiled in jobs:
            elapsed = time.perf_counter() - start
            expected = last.get((kind, compiled), FIRST_ROW_ESTIMATE_S[kind, compiled] if device.type == "cuda" else 0)
            row: dict = {"kind": kind, "variant": variant, "family": family_of(variant), "compiled": compiled}
            if elapsed >= budget_s or elapsed + expected > budget_s + GRACE_S:
                spent = f"{elapsed:.0f} s spent, about {expected:.0f} s more expected, budget {budget_s:.0f} s"
                row.update(status="skipped", reason=f"time budget: {spent}")
            else:
                row.update(guarded(partial(getattr(runner, kind), variant, compiled)))  # runner.train or .decode
                row.setdefault("status", "ok")
                if any("ratio" in m for m in metrics(row).values()):  # a refusal says nothing about the next row's time
                    last[kind, compiled] = row["wall_s"]
            finish("cost", section, row, device)
            save()
    return section


# --- profile: where a training step's time goes -------------------------------------------------------------------

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
#: The Triton op of a whole Delta residual (`ddl_hf.triton_delta`), as the profiler names its calls.
TRITON_OP = "ddl_hf::delta_residual"


def kernel_class(name: str) -> str:
    return next((label for label, pattern in KERNEL_CLASSES if pattern.search(name)), "other")


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
    other: dict[str, dict] = {}  # by kernel name
    for name, us in kernels:
        label = kernel_class(name)
        tallies = [by_class[label]]
        if label == "other":
            tallies.append(other.setdefault(name, {"name": name[:120], "kernels": 0, "ms": 0.0}))
        for tally in tallies:
            tally["kernels"] += 1
            tally["ms"] += us / 1e3
    return {
        "triton_op_calls": sum(e.name == TRITON_OP for e in prof.events()),
        "kernels": len(kernels),
        "busy_ms": sum(us for _, us in kernels) / 1e3,
        "by_class": by_class,
        "top_other": sorted(other.values(), key=lambda tally: -tally["ms"])[:10],
    }


def profile_row(runner: CostRunner, name: str) -> dict:
    """GPT-2 ("gpt2") or a Delta variant over it (`delta_implementation="auto"`, and what it ran): one eager bf16
    training step's wall time (median of 3, no profiler), then the device's busy time and launches in one profiled."""
    base = runner.baseline("gpt2")
    model = base["model"] if name == "gpt2" else runner.delta(name)
    step, _ = train_step_fn(model, base["ids"], autocast=torch.bfloat16)
    warm(step)
    walls = [timed(step, runner.device)[1] for _ in range(3)]
    implementation = "-" if name == "gpt2" else implementation_ran(model, runner.device)
    wall_ms = statistics.median(walls) * 1e3
    return {"model": name, "implementation": implementation, "wall_ms": wall_ms, **step_kernels(step, runner.device)}


def profile_section(plan: dict, device: torch.device) -> dict:
    """GPT-2 and each of PROFILE_VARIANTS at the cost shape (`profile_row`). Busy near wall: the kernels set the pace,
    and "other" says how much of them is not matmul or attention; well below: the host's dispatch does."""
    runner = CostRunner(plan, device)  # eager steps only: its baseline GPT-2 and token ids
    section: dict = {"shape": plan["shape"], "tokens": runner.tokens, "rows": []}
    for name in ("gpt2", *PROFILE_VARIANTS):
        finish("profile", section, profile_row(runner, name), device)
    return section


# --- triton: the Delta residual as one Triton op against the tensor ops (ddl_hf.triton_delta) -------------------


def triton_row(runner: CostRunner, variant: str, implementation: str) -> dict:
    """One variant (or DELTA_NET_ROW): its eager training step with "eager" and with `implementation` (one model, the
    same AdamW) each against the baseline's (its A/A floor is the cost section's, `CostRunner.floor`), then the
    launches of one profiled step of each."""
    family, device = family_of(variant), runner.device
    implementations = dict(zip(TRITON_PAIR, ("eager", implementation)))
    row: dict = {"variant": variant, "family": family, "implementations": implementations}
    if variant == DELTA_NET_ROW:
        from ddl_hf.fla_kernels import fla_available

        row["fla"] = implementation == "triton" and device.type == "cuda" and fla_available()
    delta = runner.delta(variant, "eager")
    base_step, delta_step, _ = runner.steps(family, delta)
    steps = {name: running(delta, ran, delta_step) for name, ran in implementations.items()}
    warm(base_step, *steps.values())
    for name, step in steps.items():
        row[f"train_{name}"] = runner.against_baseline(family, "train_eager", base_step, step)
    row["triton_vs_eager"] = row["train_triton"]["delta_s"] / row["train_eager"]["delta_s"]
    base = runner.baseline(family)
    if base["launches"] is None:  # the baseline's, profiled once
        base["launches"] = step_kernels(base_step, device)
    row["launches"] = {"baseline": base["launches"], **{name: step_kernels(s, device) for name, s in steps.items()}}
    return row


def triton_section(plan: dict, device: torch.device, variants: list[str]) -> dict:
    """`delta_implementation="triton"` against `"eager"` for each of `variants` and DELTA_NET_ROW at the cost shape
    (`triton_row`); where Triton cannot run on `device`'s tensors, "eager" stands in, and the section's note says so."""
    problem = triton_unavailable(device)
    implementation = "eager" if problem else "triton"
    section: dict = {"shape": plan["shape"], "train_pairs": plan["train_pairs"], "triton_ran": not problem, "rows": []}
    if problem:
        section["note"] = (
            f'Triton cannot run here: {problem.rstrip(".")}. "eager" stands in for "triton": this exercises the'
            " section's code, and no number below is Triton's"
        )
    elif device.type != "cuda":
        section["note"] = f"Triton's interpreter on {device.type} tensors: its times and launches do not hold"
    runner = CostRunner(plan, device)  # eager steps only: its baselines and A/A floors
    section["floors"] = runner.floors
    for variant in [*variants, DELTA_NET_ROW]:
        row = guarded(partial(triton_row, runner, variant, implementation))
        row.setdefault("variant", variant)
        finish("triton", section, row, device)
    return section


#: Sections that ran here once and are tests now (tests/gpu): `--sections` names them and says where they went.
MOVED = ("correctness", "sync", "fla")


# --- main --------------------------------------------------------------------------------------------------------


def device_info(device: torch.device) -> dict:
    info: dict = {"device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gib = round(props.total_memory / 2**30, 1)
        info.update(name=props.name, capability=f"{props.major}.{props.minor}", memory_gib=gib, cuda=torch.version.cuda)
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
    compiled = (
        args.variants if args.compiled_variants is None else args.compiled_variants
    )  # cost_section picks the rows

    prov = provenance(None if argv is None else [__file__, *argv])
    results: dict = {"provenance": prov, "device": device_info(device), "tiny": args.tiny}
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
