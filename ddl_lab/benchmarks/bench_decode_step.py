"""One cached decoding step of DeltaGPT against GPT-2 of the same shape and weights, with an A/A twin: the model's own
share of `bench_overhead`'s batch-1 generation ratio, measured closely enough to tell 1.05 from 1.08.

`bench_overhead` times whole `generate` calls (15 pairs); their medians move by ~0.04 between runs on a shared
machine. Here each model is prefilled once, then one token is decoded over and over from the same cache (the cache is
cropped back after each step, so the context length stays fixed): hundreds of ~40 ms steps, the three models
(GPT-2, a deep copy of it, DeltaGPT) in a rotating order so that each holds each position equally often. Times are
process CPU seconds with one torch thread (as in `bench_overhead`). Reported per variant: each model's median step,
the median of the per-round ratios Delta / GPT-2 with a distribution-free 95% interval (order statistics of the
binomial), the same for the A/A twin, and the median per-round difference in milliseconds.

`--profile` adds where the difference goes: torch.profiler's self CPU time per operator, per step, Delta minus GPT-2,
largest first, the two models profiled in alternating chunks (profiling adds its own per-op cost to both, and the
large matmuls' times move by several percent between chunks; read it as a breakdown of the small operators and of
the time outside operators, not as the ratio).

    python -m ddl_lab.benchmarks.bench_decode_step                       # GPT-2-small, delta_implementation="native"
    python -m ddl_lab.benchmarks.bench_decode_step --profile --variants 4:additive
    python -m ddl_lab.benchmarks.bench_decode_step --compiled --variants 1:additive 1:paper 4:paper  # compiled step
    python -m ddl_lab.benchmarks.bench_decode_step --without-kernel      # what the native kernels earn over "eager"
    python -m ddl_lab.benchmarks.bench_decode_step --quick               # tiny shape, a few seconds (tested)
"""

from __future__ import annotations

import argparse
import copy
import itertools
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
import transformers
from scipy import stats
from torch.profiler import ProfilerActivity, profile
from transformers import StaticCache

from ddl_hf.delta_compat import cache_argument, cache_of
from ddl_hf.native import native_build_problem
from ddl_lab.builders import SHAPES, build_pair
from ddl_lab.common import provenance, write_results

MODELS = ("gpt2", "twin", "delta")
# `--without-kernel` took the op whose native kernel to unregister when kernels were registered process-wide; they
# are chosen per model now (`delta_implementation`), and these names take the whole native set away, as "native".
FORMER_NATIVE_OPS = ("delta_update", "tc_read", "residual_step")


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median: order statistics j < k with P(X_(j) <= median <= X_(k)) >= level
    (the binomial(n, 1/2) count of values below the median)."""
    ordered = sorted(values)
    n = len(ordered)
    j = int(stats.binom.ppf((1 - level) / 2, n, 0.5))  # 1-based rank of the lower bound, then the symmetric upper
    j = max(j, 1)
    return ordered[j - 1], ordered[n - j]


def summary(values: list[float]) -> dict[str, float]:
    low, high = median_interval(values)
    return {"median": statistics.median(values), "ci_low": low, "ci_high": high}


class Stepper:
    """A model prefilled once; `step()` decodes the prompt's last token again from that cache and takes it back out.

    Eager: transformers' dynamic cache, cropped by one token after each step. `static=True`: a `StaticCache` one
    token longer than the prompt, whose layers' write position is moved back after each step (the step writes the
    same slot again); `compiled=True` (implies static) runs the step as transformers' compiled decoding does,
    `torch.compile(model.__call__, fullgraph=True)` over the static cache, compiled on the first step."""

    def __init__(self, model: torch.nn.Module, prompt: torch.Tensor, static: bool = False, compiled: bool = False):
        self.model = model.eval()
        self.length = prompt.shape[1]
        self.static = static or compiled
        self.call = torch.compile(model.__call__, fullgraph=True) if compiled else model
        with torch.inference_mode():
            if self.static:
                self.cache = StaticCache(config=model.config, max_cache_len=self.length + 1)
                model(prompt, use_cache=True, **cache_argument(self.cache))
                if not all(hasattr(layer, "cumulative_length") for layer in self.cache.layers):
                    raise SystemExit(
                        f"bench_decode_step: transformers {transformers.__version__}'s static cache layers keep no "
                        "`cumulative_length` (the write position this step moves back; 5.16 to 5.24 have it)"
                    )
            else:
                self.cache = cache_of(model(prompt, use_cache=True))
        self.token = prompt[:, -1:]
        self.position = torch.tensor([[self.length]])

    def step(self) -> torch.Tensor:
        """The next-token logits after the prompt's last token, decoded again."""
        with torch.inference_mode():
            out = self.call(self.token, position_ids=self.position, use_cache=True, **cache_argument(self.cache))
            if self.static:
                for layer in self.cache.layers:  # the next step writes the same slot again
                    layer.cumulative_length.sub_(1)
        if not self.static:
            self.cache.crop(-1)  # remove the token just written (a negative count: every transformers version)
        return out.logits


def without_kernels(delta: torch.nn.Module, prompt: torch.Tensor) -> Stepper:
    """A stepper over a copy of `delta` set to `delta_implementation="eager"` (the tensor ops; `delta` keeps its
    own): in the same process and rotation as the others, what `delta`'s kernels earn (`--without-kernel`)."""
    tensor_ops = copy.deepcopy(delta)
    tensor_ops.set_delta_implementation("eager")
    return Stepper(tensor_ops, prompt)


def time_rounds(steppers: dict[str, Stepper], rounds: int, warmup: int) -> dict[str, list[float]]:
    """Process CPU seconds of each model's step, one step each per round, the order cycling through every
    permutation of the models."""
    orders = list(itertools.permutations(steppers))
    for _ in range(warmup):
        for s in steppers.values():
            s.step()
    times: dict[str, list[float]] = {name: [] for name in steppers}
    for i in range(rounds):
        for name in orders[i % len(orders)]:
            start = time.process_time()
            steppers[name].step()
            times[name].append(time.process_time() - start)
    return times


def op_breakdown(steppers: dict[str, Stepper], steps: int, top: int, chunk: int = 10) -> list[dict]:
    """Self CPU microseconds per step of each operator, Delta minus GPT-2, largest absolute difference first; first
    the step's whole process CPU time under the profiler and its part outside every operator (Python, module calls,
    argument handling). The two models are profiled in alternating chunks of `chunk` steps (drift cancels, as in the
    timed rounds), after one unrecorded chunk each (the profiler's own first-use cost)."""
    per_op: dict[str, dict[str, float]] = defaultdict(lambda: {"gpt2": 0.0, "delta": 0.0})
    whole = {"gpt2": 0.0, "delta": 0.0}
    chunks = max(1, steps // chunk)
    for i in range(chunks + 1):
        for name in ("gpt2", "delta") if i % 2 == 0 else ("delta", "gpt2"):
            start = time.process_time()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(chunk):
                    steppers[name].step()
            if i == 0:
                continue
            whole[name] += (time.process_time() - start) * 1e6 / (chunks * chunk)
            for event in prof.key_averages():
                per_op[event.key][name] += event.self_cpu_time_total / (chunks * chunk)
    rows = [
        {"op": op, "gpt2_us": t["gpt2"], "delta_us": t["delta"], "diff_us": t["delta"] - t["gpt2"]}
        for op, t in per_op.items()
    ]
    in_ops = {k: sum(r[k] for r in rows) for k in ("gpt2_us", "delta_us")}
    step = {"gpt2_us": whole["gpt2"], "delta_us": whole["delta"]}
    outside = {k: step[k] - in_ops[k] for k in step}
    summary_rows = [
        {"op": "(whole step, under the profiler)", **step, "diff_us": step["delta_us"] - step["gpt2_us"]},
        {"op": "(inside operators)", **in_ops, "diff_us": in_ops["delta_us"] - in_ops["gpt2_us"]},
        {"op": "(outside operators)", **outside, "diff_us": outside["delta_us"] - outside["gpt2_us"]},
    ]
    return [*summary_rows, *sorted(rows, key=lambda r: -abs(r["diff_us"]))[:top]]


def bench(shape_name: str, value_channels: int, mode: str, args: argparse.Namespace) -> dict:
    shape = SHAPES[shape_name]
    if args.compiled:
        torch._dynamo.reset()  # the three compiled calls of the previous row would count against the recompile limit
    gpt2, delta = build_pair(shape, value_channels, mode, implementation="native" if args.native else "eager")
    twin = copy.deepcopy(gpt2)
    prompt = torch.randint(0, shape["vocab_size"], (1, args.context), generator=torch.Generator().manual_seed(1))
    steppers = {name: Stepper(m, prompt, compiled=args.compiled) for name, m in zip(MODELS, (gpt2, twin, delta))}
    if args.without_kernel:
        steppers["without"] = without_kernels(delta, prompt)
    times = time_rounds(steppers, args.rounds, args.warmup)
    row = {
        "shape": shape_name,
        "value_channels": value_channels,
        "mode": mode,
        "compiled": args.compiled,
        "rounds": args.rounds,
        "context": args.context,
        "step_ms": {name: statistics.median(t) * 1e3 for name, t in times.items()},
        "ratio": summary([d / g for d, g in zip(times["delta"], times["gpt2"])]),
        "aa_ratio": summary([t / g for t, g in zip(times["twin"], times["gpt2"])]),
        "diff_ms": summary([(d - g) * 1e3 for d, g in zip(times["delta"], times["gpt2"])]),
    }
    if args.without_kernel:
        row["without_kernel"] = args.without_kernel
        row["without_ratio"] = summary([w / g for w, g in zip(times["without"], times["gpt2"])])
        row["kernel_ratio"] = summary([d / w for d, w in zip(times["delta"], times["without"])])
    if args.profile:
        row["ops"] = op_breakdown(steppers, args.profile_steps, args.top)
    return row


def fmt(s: dict, digits: int = 3) -> str:
    return f"{s['median']:.{digits}f} [{s['ci_low']:.{digits}f}, {s['ci_high']:.{digits}f}]"


def markdown(results: dict) -> str:
    lines = [
        "One cached decoding step (batch 1, the context length fixed by taking the token back out of the cache),",
        "DeltaGPT and an A/A copy of GPT-2 against GPT-2, process CPU time, "
        + (
            "compiled (static cache, `torch.compile(fullgraph=True)`; no native kernel runs under compilation). "
            if results["compiled"]
            else (
                'delta_implementation="native" (the native kernels). '
                if results["native"]
                else 'delta_implementation="eager" (the tensor ops, no native kernels). '
            )
        )
        + "Medians of per-round ratios with a distribution-free 95% interval.",
        "",
        "| shape | d_v | mode | GPT-2 ms | A/A ms | Delta ms | Delta / GPT-2 | A/A | Delta − GPT-2 ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        ms = r["step_ms"]
        lines.append(
            f"| {r['shape']} | {r['value_channels']} | {r['mode']} | {ms['gpt2']:.2f} | {ms['twin']:.2f} | "
            f"{ms['delta']:.2f} | {fmt(r['ratio'])} | {fmt(r['aa_ratio'])} | {fmt(r['diff_ms'], 2)} |"
        )
    kernel_rows = [r for r in results["rows"] if "without_kernel" in r]
    if kernel_rows:
        lines += [
            "",
            "What the kernels earn, in the same rounds: a copy of DeltaGPT stepping with "
            'delta_implementation="eager" (the tensor ops).',
            "",
            "| shape | d_v | mode | kernel | without it / GPT-2 | with it / without it |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['shape']} | {r['value_channels']} | {r['mode']} | `{r['without_kernel']}` | "
            f"{fmt(r['without_ratio'])} | {fmt(r['kernel_ratio'])} |"
            for r in kernel_rows
        ]
    for r in results["rows"]:
        if "ops" not in r:
            continue
        lines += [
            "",
            f"Where the difference goes, {r['shape']} d_v = {r['value_channels']} {r['mode']}: self CPU µs per step "
            "under torch.profiler, largest differences first.",
            "",
            "| operator | GPT-2 µs | Delta µs | Delta − GPT-2 µs |",
            "|---|---|---|---|",
        ]
        lines += [f"| `{o['op']}` | {o['gpt2_us']:.1f} | {o['delta_us']:.1f} | {o['diff_us']:+.1f} |" for o in r["ops"]]
    return "\n".join(lines) + "\n"


def parse_variant(text: str) -> tuple[int, str]:
    value_channels, _, mode = text.partition(":")
    if not value_channels.isdigit() or mode not in ("additive", "paper"):
        raise argparse.ArgumentTypeError(f"a variant is D_V:MODE, MODE additive or paper (4:paper); got {text!r}")
    return int(value_channels), mode


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shape, few rounds (seconds)")
    parser.add_argument("--shape", choices=[s for s, v in SHAPES.items() if v.get("arch") != "llama"])
    parser.add_argument("--variants", nargs="+", type=parse_variant, help="D_V:MODE ... (default: 1 and 4, both modes)")
    parser.add_argument("--rounds", type=int, help="timed rounds (one step of each model per round)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--context", type=int, default=64, help="prompt length the step decodes after")
    parser.add_argument(
        "--native",
        action=argparse.BooleanOptionalAction,
        default=True,
        help='DeltaGPT with delta_implementation="native" (ddl_hf.native\'s kernels); --no-native: "eager"',
    )
    parser.add_argument(
        "--compiled", action="store_true", help="static cache and torch.compile, as generate's compiled decoding"
    )
    parser.add_argument(
        "--without-kernel",
        nargs="?",
        const="native",
        choices=("native", *FORMER_NATIVE_OPS),
        help='also time a copy of DeltaGPT with delta_implementation="eager": what the native kernels earn, in one '
        "process (kernels are chosen per model: an op name, as before, takes all of them away too)",
    )
    parser.add_argument("--profile", action="store_true", help="add the per-operator breakdown")
    parser.add_argument("--profile-steps", type=int, default=100, help="profiled steps per model, in chunks of 10")
    parser.add_argument("--top", type=int, default=15, help="operators listed in the breakdown")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--name", default=None, help="basename of the result files (default: decode_step[_quick])")
    args = parser.parse_args(argv)
    if args.without_kernel and (args.compiled or not args.native):
        parser.error("--without-kernel compares the native kernels with the tensor ops: needs --native, not --compiled")
    if args.without_kernel in FORMER_NATIVE_OPS:
        print(
            f"bench_decode_step: --without-kernel {args.without_kernel}: kernels are chosen per model now "
            '(delta_implementation), so the copy runs "eager", without every native kernel'
        )
        args.without_kernel = "native"
    args.shape = args.shape or ("tiny" if args.quick else "gpt2-small")
    args.rounds = args.rounds or (12 if args.quick else 300)
    if args.quick:
        args.warmup, args.profile_steps = 1, 20
    variants = args.variants or [(1, "additive"), (1, "paper"), (4, "additive"), (4, "paper")]
    torch.set_num_threads(args.threads)
    prov = provenance(None if argv is None else [__file__, *argv])
    if args.native and (problem := native_build_problem()):
        raise SystemExit(f"bench_decode_step: the native kernels do not build here ({problem}); use --no-native")
    rows = []
    for value_channels, mode in variants:
        row = bench(args.shape, value_channels, mode, args)
        print(f"bench_decode_step: d_v={value_channels} {mode}: {fmt(row['ratio'])}, A/A {fmt(row['aa_ratio'])}")
        rows.append(row)
    implementation = "native" if args.native else "eager"
    results = {
        "provenance": prov,
        "native": args.native,
        "delta_implementation": implementation,
        "compiled": args.compiled,
        "rows": rows,
    }
    name = args.name or ("decode_step_quick" if args.quick else "decode_step")
    write_results(args.out, name, results, markdown(results))
    return results


if __name__ == "__main__":
    main()
