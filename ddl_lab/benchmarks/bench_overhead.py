"""Overhead of DeltaGPT over transformers' GPT2LMHeadModel of the same shape, measured side by side; for the
Llama-family shapes (`--shapes llama-small smollm-135m`), of DeltaLlama over transformers' LlamaForCausalLM.

Both models live in ONE process. Every timed metric runs A/B pairs after a warm-up, alternating the order inside
each pair (ABBA...) so slow drift of a noisy machine cancels; we report the median time of each model and the
median of the per-pair ratios DeltaGPT / GPT-2 (absolute times are not comparable between runs).

Time is the process CPU time with one torch thread by default (`--threads`): on a shared machine it does not count
the time other tenants hold the cores, which is what makes wall-clock ratios swing there. Wall-clock medians and
ratios are recorded next to it in the JSON. Caches and memory bandwidth are still shared, so each shape also times
the baseline against a deep copy of itself with the same pairs (the A/A noise floor; `--no-noise-floor` skips it):
how far a ratio strays from 1.0 when nothing differs.

Peak training memory is measured exactly at the tensor-allocator level: bytes held by parameters and AdamW state
before a step, plus the maximum of the running sum of every allocation and free recorded by
`torch.profiler(profile_memory=True)` during one full training step (forward, backward, AdamW). It counts tensor
memory only (no Python heap, no malloc fragmentation), which is what the Delta blocks can change.

Compiled rows (`--compiled`): both models under `torch.compile(fullgraph=True)` (inductor): the training step
(compiled forward and backward, eager AdamW) and static-cache decoding with transformers' compiled decoding step
(`cache_implementation="static"`, `CompileConfig(fullgraph=True)`); compilation is done in the warm-up and not
timed. `fullgraph=True` makes any graph break in a Delta block an error.

    python -m ddl_lab.benchmarks.bench_overhead        # full run: small + GPT-2-small shapes, variant and compiled rows
    python -m ddl_lab.benchmarks.bench_overhead --quick    # tiny shape, base rows only, a minute or two
    python -m ddl_lab.benchmarks.bench_overhead --quick --shapes small --no-paper-variants   # one shape, for iteration
    python -m ddl_lab.benchmarks.bench_overhead --shapes llama-small --no-compiled           # DeltaLlama vs Llama
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from ddl_hf.native import native_build_problem
from ddl_lab.builders import SHAPES, build_pair, delta_implementation
from ddl_lab.common import (
    generate_fn,
    interleaved,
    peak_train_bytes,
    provenance,
    ratio_spread,
    train_and_decode,
    train_step_fn,
    write_results,
)

DELTA_VARIANTS = [(1, "additive"), (1, "paper"), (4, "additive"), (4, "paper")]
# Compiled rows (both models compiled): the goal is stated at d_v = 1; d_v = 4 paper for reference.
COMPILED_VARIANTS = [(1, "additive"), (1, "paper"), (4, "paper")]
# The decode-speed goals (docs/performance.md), DeltaGPT / GPT-2 of one run: (shape, metric) -> {d_v: largest ratio}.
GOALS = {
    ("gpt2-small", "generation_b1"): {1: 1.03, 4: 1.10},
    ("gpt2-small", "train_step"): {1: 1.03, 4: 1.20},
    ("gpt2-small", "peak_train_memory"): {1: 1.03, 4: 1.15},
    ("small", "generation_b1"): {1: 1.10, 4: 1.20},
    ("small", "train_step"): {1: 1.10, 4: 1.25},
    ("small", "peak_train_memory"): {1: 1.05, 4: 1.15},
}
COMPILED_GOAL = {1: 1.03}
# The paper's variants (docs/variants.md), in paper mode as the reference code trains them: (d_v, name, fields).
PAPER_VARIANTS = [
    (1, "constant v", dict(delta_value="constant")),
    (1, "TC", dict(delta_state_read="temporal_conv")),
    (4, "write-only", dict(delta_erase=False)),
    (4, "TC", dict(delta_state_read="temporal_conv")),
    (4, "CC", dict(delta_state_read="channel_conv")),
    (4, "EC", dict(delta_embed_expand="conv")),
    (4, "TC+EC", dict(delta_state_read="temporal_conv", delta_embed_expand="conv")),
    (4, "CC+EC", dict(delta_state_read="channel_conv", delta_embed_expand="conv")),
]


def saved_activation_bytes(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """Bytes of the distinct non-parameter storages autograd saves for the backward of one forward."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    storages = []  # alive until the forward is done, so that no address is reused for another saved tensor

    def pack(t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_ptrs:
            saved[storage.data_ptr()] = storage.nbytes()
            storages.append(storage)
        # The graph is never run backward, so the hook keeps storages, not tensors. Returning `t` itself leaked the
        # whole graph (~0.5 GB per call at the small shape): a saved output refers to its own grad_fn, a cycle that
        # Python's gc cannot see.

    def unpack(_: None) -> torch.Tensor:
        raise RuntimeError("saved_activation_bytes measures a forward only; its graph cannot run backward")

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        loss = model(input_ids=ids, labels=ids).loss
    del loss
    storages.clear()
    return sum(saved.values())


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def forward_fn(model: torch.nn.Module, ids: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        with torch.inference_mode():
            model(input_ids=ids)

    return run


def bench_variant(
    shape_name: str,
    value_channels: int,
    mode: str,
    pairs: int,
    gen_pairs: int,
    gen_tokens: int,
    variant: str = "",
    fields: dict | None = None,
    native: bool = False,
) -> dict:
    """One row, the Delta model with the tensor ops (`delta_implementation="eager"`); `native`: also train
    (`train_step_native`) and decode at batch 1 (`generation_b1_native`) with the same model set to
    `delta_implementation="native"` (`ddl_hf.native`'s kernels)."""
    shape = SHAPES[shape_name]
    gpt2, delta = build_pair(shape, value_channels, mode, fields)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape["vocab_size"], (shape["batch"], shape["seq"]), generator=g)
    row = {"shape": shape_name, **shape, "d_v": value_channels, "mode": mode, "torch_threads": torch.get_num_threads()}
    row["variant"], row["fields"] = variant, dict(fields or {})
    row["params"] = {"gpt2": n_params(gpt2), "delta": n_params(delta), "ratio": n_params(delta) / n_params(gpt2)}

    step_a, opt_a = train_step_fn(gpt2, ids)
    step_b, opt_b = train_step_fn(delta, ids)
    row["train_step"] = interleaved(step_a, step_b, pairs)
    if native:  # the same steps again, the Delta update and TC read with the native training kernels
        with delta_implementation(delta, "native"):
            row["train_step_native"] = interleaved(step_a, step_b, pairs)
    del step_a, step_b
    mem_ids = torch.randint(0, shape["vocab_size"], (shape["memory_batch"], shape["seq"]), generator=g)
    step_a, _ = train_step_fn(gpt2, mem_ids, opt_a)
    step_b, _ = train_step_fn(delta, mem_ids, opt_b)
    mem_a, mem_b = peak_train_bytes(step_a, gpt2, opt_a), peak_train_bytes(step_b, delta, opt_b)
    row["peak_train_memory"] = {"gpt2_bytes": mem_a, "delta_bytes": mem_b, "ratio": mem_b / mem_a}
    saved_a, saved_b = saved_activation_bytes(gpt2, mem_ids), saved_activation_bytes(delta, mem_ids)
    row["saved_activations"] = {"gpt2_bytes": saved_a, "delta_bytes": saved_b, "ratio": saved_b / saved_a}
    del opt_a, opt_b, step_a, step_b
    for model in (gpt2, delta):
        model.eval()
        for p in model.parameters():
            p.grad = None

    row["inference_forward"] = interleaved(forward_fn(gpt2, ids), forward_fn(delta, ids), pairs)
    for batch in (1, 8):
        prompt = torch.randint(0, shape["vocab_size"], (batch, 16), generator=g)
        result = interleaved(generate_fn(gpt2, prompt, gen_tokens), generate_fn(delta, prompt, gen_tokens), gen_pairs)
        row[f"generation_b{batch}"] = with_tokens_per_s(result, batch, gen_tokens)
        if batch == 1 and native:  # the same prompt again, with the optional native decoding kernel
            with delta_implementation(delta, "native"):
                result = interleaved(
                    generate_fn(gpt2, prompt, gen_tokens), generate_fn(delta, prompt, gen_tokens), gen_pairs
                )
            row["generation_b1_native"] = with_tokens_per_s(result, batch, gen_tokens)
    return row


def with_tokens_per_s(result: dict, batch: int, new_tokens: int) -> dict:
    result["new_tokens"] = new_tokens
    result["gpt2_tokens_per_s"] = batch * new_tokens / result["gpt2_s"]
    result["delta_tokens_per_s"] = batch * new_tokens / result["delta_s"]
    return result


def bench_compiled(
    shape_name: str, value_channels: int, mode: str, pairs: int, gen_pairs: int, gen_tokens: int
) -> dict:
    """Both models compiled (inductor, fullgraph): the training step and static-cache decoding at batch 1.

    The first calls compile (several per model: the training graph, then decoding); they are the warm-up and
    are not timed. Eager AdamW in both, so the ratio is that of the compiled forward and backward.
    """
    shape = SHAPES[shape_name]
    gpt2, delta = build_pair(shape, value_channels, mode)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape["vocab_size"], (shape["batch"], shape["seq"]), generator=g)
    row = {"shape": shape_name, **shape, "d_v": value_channels, "mode": mode, "torch_threads": torch.get_num_threads()}
    row["variant"], row["fields"], row["compiled"] = "", {}, True
    for model in (gpt2, delta):
        # transformers resolves the loss through a property that logs (a graph break) when `loss_type` is unset.
        model.loss_type = "ForCausalLM"
    torch._dynamo.reset()
    start = time.perf_counter()
    compiled_a, compiled_b = (torch.compile(m, fullgraph=True) for m in (gpt2, delta))
    step_a, opt_a = train_step_fn(compiled_a, ids, torch.optim.AdamW(gpt2.parameters(), lr=1e-4))
    step_b, opt_b = train_step_fn(compiled_b, ids, torch.optim.AdamW(delta.parameters(), lr=1e-4))
    row["train_step"] = interleaved(step_a, step_b, pairs, warmup=2)
    del step_a, step_b, opt_a, opt_b, compiled_a, compiled_b
    for model in (gpt2, delta):
        model.eval()
        for p in model.parameters():
            p.grad = None
    prompt = torch.randint(0, shape["vocab_size"], (1, 16), generator=g)
    run_a, run_b = (generate_fn(m, prompt, gen_tokens, compiled=True) for m in (gpt2, delta))
    row["generation_b1"] = with_tokens_per_s(interleaved(run_a, run_b, gen_pairs, warmup=2), 1, gen_tokens)
    row["wall_s_including_compilation"] = time.perf_counter() - start
    torch._dynamo.reset()
    return row


METRICS_AA = ("train_step", "generation_b1")  # what the A/A noise floor times


def aa_pairs(row: dict) -> list[tuple[str, dict]]:
    return [(metric, row[metric]) for metric in METRICS_AA]


def bench_noise_floor(shape_name: str, pairs: int, gen_pairs: int, gen_tokens: int) -> dict:
    """The baseline against a copy of itself (A/A), timed exactly as the rows are: how far a ratio of this run
    strays from 1.0 when nothing differs. A Delta ratio inside this spread is not told apart from the baseline."""
    shape = SHAPES[shape_name]
    baseline = build_pair(shape, 1, "additive")[0]
    twin = copy.deepcopy(baseline)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape["vocab_size"], (shape["batch"], shape["seq"]), generator=g)
    prompt = torch.randint(0, shape["vocab_size"], (1, 16), generator=g)
    row = {"shape": shape_name, **shape, "torch_threads": torch.get_num_threads()}
    row |= train_and_decode(baseline, twin, ids, prompt, pairs, gen_tokens, gen_pairs)
    row["generation_b1"] = with_tokens_per_s(row["generation_b1"], 1, gen_tokens)
    return row


def shape_label(r: dict) -> str:
    return f"{r['shape']} (L{r['n_layer']} D{r['n_embd']} T{r['seq']} B{r['batch']}, memory B{r['memory_batch']})"


def goal_lines(rows: list[dict]) -> list[str]:
    """The decode-speed goals against this run's ratios: one line per (shape, metric, d_v), additive / paper."""
    lines = ["| shape | metric | d_v | goal | additive | paper | met |", "|---|---|---|---|---|---|---|"]
    base = [r for r in rows if not r.get("variant") and not r.get("compiled")]
    compiled = [r for r in rows if r.get("compiled")]
    checks = [
        (shape, metric, d_v, goal, base) for (shape, metric), goals in GOALS.items() for d_v, goal in goals.items()
    ]
    checks += [  # training and decoding again with the optional native kernels (ddl_hf.native), same goals
        (shape, metric + "_native", d_v, goal, base)
        for (shape, metric), goals in GOALS.items()
        if metric in ("train_step", "generation_b1")
        for d_v, goal in goals.items()
    ]
    checks += [
        (shape, "compiled_" + metric, d_v, goal, compiled)
        for shape in dict.fromkeys(shape for shape, _ in GOALS)  # the goal shapes, in order
        for metric in ("train_step", "generation_b1")
        for d_v, goal in COMPILED_GOAL.items()
    ]
    for shape, metric, d_v, goal, pool in checks:
        key = metric.removeprefix("compiled_")
        found = {r["mode"]: r[key]["ratio"] for r in pool if r["shape"] == shape and r["d_v"] == d_v and key in r}
        if not found:
            continue
        cells = [f"{found[m]:.3f}" if m in found else "-" for m in ("additive", "paper")]
        met = "yes" if all(v <= goal for v in found.values()) else "**no**"
        lines.append(f"| {shape} | {metric} | {d_v} | ≤ {goal:.2f} | {cells[0]} | {cells[1]} | {met} |")
    return lines if len(lines) > 2 else []


def markdown(results: dict) -> str:
    lines = [
        "Ratios are DeltaGPT / GPT-2 (DeltaLlama / Llama for the Llama-family shapes) of process CPU time (lower "
        "is better; generation: time per token), median of interleaved pairs; peak memory and saved activations at "
        "the memory batch. The `gpt2` columns of the JSON hold the baseline of either kind.",
        "",
        "| shape | d_v | mode | variant | train step | train step native | inference fwd | gen/token b=1 "
        "| gen/token b=1 native | gen/token b=8 | peak train mem | saved activations | params |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    eager = [r for r in results["rows"] if not r.get("compiled")]
    compiled = [r for r in results["rows"] if r.get("compiled")]
    for r in eager:
        lines.append(
            f"| {shape_label(r)} "
            f"| {r['d_v']} | {r['mode']} | {r.get('variant') or '-'} "
            f"| {r['train_step']['ratio']:.3f} "
            f"| {format(r['train_step_native']['ratio'], '.3f') if 'train_step_native' in r else '-'} "
            f"| {r['inference_forward']['ratio']:.3f} "
            f"| {r['generation_b1']['ratio']:.3f} "
            f"| {format(r['generation_b1_native']['ratio'], '.3f') if 'generation_b1_native' in r else '-'} "
            f"| {r['generation_b8']['ratio']:.3f} "
            f"| {r['peak_train_memory']['ratio']:.3f} | {r['saved_activations']['ratio']:.3f} "
            f"| {r['params']['ratio']:.5f} |"
        )
    lines += ["", "Absolute medians (baseline → Delta model):", ""]
    lines += [
        "| shape | d_v | mode | variant | train step s | inference fwd s | gen b=1 tok/s | gen b=8 tok/s | peak MB |"
    ]
    lines += ["|---|---|---|---|---|---|---|---|---|"]
    for r in eager:
        t, f, g1, g8, m = (
            r["train_step"],
            r["inference_forward"],
            r["generation_b1"],
            r["generation_b8"],
            r["peak_train_memory"],
        )
        lines.append(
            f"| {r['shape']} | {r['d_v']} | {r['mode']} | {r.get('variant') or '-'} "
            f"| {t['gpt2_s']:.3f} → {t['delta_s']:.3f} "
            f"| {f['gpt2_s']:.4f} → {f['delta_s']:.4f} "
            f"| {g1['gpt2_tokens_per_s']:.1f} → {g1['delta_tokens_per_s']:.1f} "
            f"| {g8['gpt2_tokens_per_s']:.1f} → {g8['delta_tokens_per_s']:.1f} "
            f"| {m['gpt2_bytes'] / 2**20:.0f} → {m['delta_bytes'] / 2**20:.0f} |"
        )
    if compiled:
        lines += [
            "",
            "Compiled (`torch.compile(fullgraph=True)`, inductor, both models; compilation not timed): training step "
            "(compiled forward + backward, eager AdamW) and static-cache decoding at batch 1 (transformers' compiled "
            "decoding step; time per token, prefill included). Ratio (GPT-2 → DeltaGPT medians):",
            "",
            "| shape | d_v | mode | train step | gen/token b=1 | train step s | gen b=1 tok/s |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in compiled:
            t, g1 = r["train_step"], r["generation_b1"]
            lines.append(
                f"| {shape_label(r)} | {r['d_v']} | {r['mode']} | {t['ratio']:.3f} | {g1['ratio']:.3f} "
                f"| {t['gpt2_s']:.3f} → {t['delta_s']:.3f} "
                f"| {g1['gpt2_tokens_per_s']:.1f} → {g1['delta_tokens_per_s']:.1f} |"
            )
    if results.get("noise_floor"):
        lines += [
            "",
            "Noise floor: the baseline against a copy of itself (A/A), same pairs and order as the rows above. Median "
            "ratio [smallest, largest single pair]; a Delta ratio within this spread is not told apart from 1.0:",
            "",
            "| shape | train step | gen/token b=1 |",
            "|---|---|---|",
        ]
        for r in results["noise_floor"]:
            cells = [ratio_spread(t) for _, t in aa_pairs(r)]
            lines.append(f"| {r['shape']} | {cells[0]} | {cells[1]} |")
    goals = goal_lines(results["rows"])
    if goals:
        lines += ["", "Goals (docs/performance.md), this run's median ratios:", "", *goals]
    return "\n".join(lines) + "\n"


def rss_mb() -> float:
    """Resident memory of this process now (Linux), to see that rows do not accumulate; 0 where unknown."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shape, fewer pairs, base rows only")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), help="override the shapes to run")
    parser.add_argument("--pairs", type=int, help="timed A/B pairs per metric")
    parser.add_argument("--gen-pairs", type=int, help="timed A/B pairs per generation metric (default: --pairs)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU time is per process)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results", help="output folder")
    parser.add_argument("--name", default=None, help="basename of the result files")
    parser.add_argument(
        "--paper-variants",
        action=argparse.BooleanOptionalAction,
        help="one paper-mode row per variant of docs/variants.md (default: on, off with --quick)",
    )
    parser.add_argument(
        "--compiled",
        action=argparse.BooleanOptionalAction,
        help="rows with both models under torch.compile (default: on, off with --quick)",
    )
    parser.add_argument(
        "--native",
        action=argparse.BooleanOptionalAction,
        help="also train with the optional native training kernels and decode at batch 1 with the native decoding "
        "kernel, ddl_hf.native (default: on where they build)",
    )
    parser.add_argument(
        "--noise-floor",
        action=argparse.BooleanOptionalAction,
        help="time the baseline against a copy of itself per shape, the A/A spread (default: on, off with --quick)",
    )
    parser.add_argument("--skip-additive", action="store_true", help="leave out the additive-mode rows")
    parser.add_argument("--skip-eager", action="store_true", help="only the compiled rows")
    args = parser.parse_args()
    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)

    shapes = args.shapes or (["tiny"] if args.quick else ["small", "gpt2-small"])
    paper_variants = not args.quick if args.paper_variants is None else args.paper_variants
    with_compiled = not args.quick if args.compiled is None else args.compiled
    native = native_build_problem() is None if args.native is None else args.native
    noise_floor = not args.quick if args.noise_floor is None else args.noise_floor
    results = {"provenance": provenance(), "quick": args.quick, "rows": [], "noise_floor": []}
    name = args.name or ("overhead_quick" if args.quick else "overhead")
    for shape_name in shapes:
        large = shape_name == "gpt2-small"
        pairs = args.pairs or (25 if args.quick else (5 if large else 9))
        gen_pairs = args.gen_pairs or args.pairs or (15 if args.quick else (3 if large else 6))
        gen_tokens = 16 if args.quick else (24 if large else 32)
        runs = [(d_v, mode, "", {}) for d_v, mode in DELTA_VARIANTS if not (args.skip_additive and mode == "additive")]
        if paper_variants:
            runs += [(d_v, "paper", variant, fields) for d_v, variant, fields in PAPER_VARIANTS]
        jobs = [] if args.skip_eager else [(False, *run) for run in runs]
        if with_compiled:
            jobs += [(True, d_v, mode, "", {}) for d_v, mode in COMPILED_VARIANTS]
        if noise_floor:
            row = bench_noise_floor(shape_name, pairs, gen_pairs, gen_tokens)
            results["noise_floor"].append(row)
            spreads = [f"{k} {ratio_spread(r)}" for k, r in aa_pairs(row)]
            print(f"{shape_name:10s} A/A noise floor: {' '.join(spreads)}", flush=True)
        for compiled, value_channels, mode, variant, fields in jobs:
            start = time.perf_counter()
            if compiled:
                row = bench_compiled(shape_name, value_channels, mode, pairs, gen_pairs, gen_tokens)
                summary = f"train {row['train_step']['ratio']:.3f} gen1 {row['generation_b1']['ratio']:.3f}"
            else:
                row = bench_variant(
                    shape_name, value_channels, mode, pairs, gen_pairs, gen_tokens, variant, fields, native
                )
                if "generation_b1_native" in row:
                    native_train = row["train_step_native"]["ratio"]
                    print(
                        f"  native train {native_train:.3f} gen1 {row['generation_b1_native']['ratio']:.3f}", flush=True
                    )
                summary = (
                    f"train {row['train_step']['ratio']:.3f} fwd {row['inference_forward']['ratio']:.3f} "
                    f"gen1 {row['generation_b1']['ratio']:.3f} gen8 {row['generation_b8']['ratio']:.3f} "
                    f"mem {row['peak_train_memory']['ratio']:.3f} params {row['params']['ratio']:.5f}"
                )
            results["rows"].append(row)
            gc.collect()  # the two models of a row hold reference cycles (hooks); free them before the next row
            label = "compiled" if compiled else variant
            print(
                f"{shape_name:10s} d_v={value_channels} {mode:8s} {label:10s} {summary}  "
                f"({time.perf_counter() - start:.0f}s, rss {rss_mb():.0f} MB)",
                flush=True,
            )
            # Written after every row, so that a long run stopped early keeps what it measured.
            write_results(args.out, name, results, markdown(results))

    print(markdown(results))


if __name__ == "__main__":
    main()
