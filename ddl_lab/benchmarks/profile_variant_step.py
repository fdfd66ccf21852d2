"""Where a variant's training step spends its time beyond GPT-2's: torch.profiler on one training step (forward,
backward, AdamW) of GPT-2 and of each d_v = 4 paper-mode variant of the same shape, in one process.

The extra CPU time is split by the autograd Functions that hold the Delta math: the Delta update
(`_FusedDeltaUpdate`, forward and backward) and the TC read (`_TemporalConvRead`); the rest of the extra ("other":
gate and value projections, CC's folded read, EC's expansion, the linear read, AdamW on the Delta parameters, the
Python around them) is the difference that remains. The profiler's own cost per operator inflates every total a
little (both models alike); the shares, not the milliseconds, are what to read. Each variant runs the tensor ops
(`delta_implementation="eager"`); where the optional native kernels build (`ddl_hf.native`), every variant is
profiled again with `delta_implementation="native"` (the native whole-residual op, counted as the Delta update, and
TC read).

    python -m ddl_lab.benchmarks.profile_variant_step            # small shape (L4 D256 T256 B8), 9 profiled steps each
    python -m ddl_lab.benchmarks.profile_variant_step --quick    # tiny shape, 1 step

Writes `results/variant_step_profile{,_quick}.{json,md}` beside it: per variant the step's total, the extra over
GPT-2, each part as a fraction of GPT-2's step, and the aten operators that add most.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers.utils import logging as hf_logging

from ddl_hf.native import native_build_problem
from ddl_lab.builders import SHAPES, build_pair
from ddl_lab.common import provenance, train_step_fn, write_results

VARIANTS = {
    "linear read": {},
    "TC": dict(delta_state_read="temporal_conv"),
    "CC": dict(delta_state_read="channel_conv"),
    "EC": dict(delta_embed_expand="conv"),
    "TC+EC": dict(delta_state_read="temporal_conv", delta_embed_expand="conv"),
}
# Named parts: the profiler events of the Delta math's autograd Functions (forward, then backward). With the native
# kernels the Delta update is the whole residual's op (`_Residual`: gate and value too).
PARTS = {
    "Delta update": ("_FusedDeltaUpdate", "_FusedDeltaUpdateBackward", "_Residual", "_ResidualBackward"),
    "TC read": ("_TemporalConvRead", "_TemporalConvReadBackward"),
}


def profiled_step(step) -> dict:
    """One step under the profiler: its total self CPU time (ms), the CPU time inside each part, per-operator time."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = prof.key_averages()
    return {
        "total_ms": sum(e.self_cpu_time_total for e in events) / 1e3,
        "parts_ms": {
            part: sum(e.cpu_time_total for e in events if e.key in names) / 1e3 for part, names in PARTS.items()
        },
        "operators_ms": {e.key: e.self_cpu_time_total / 1e3 for e in events if e.key.startswith("aten::")},
    }


def median_profile(profiles: list[dict]) -> dict:
    """The median over steps of every quantity (an operator missing from a step counts 0 there)."""
    operators = {op for p in profiles for op in p["operators_ms"]}
    return {
        "total_ms": statistics.median(p["total_ms"] for p in profiles),
        "parts_ms": {part: statistics.median(p["parts_ms"][part] for p in profiles) for part in PARTS},
        "operators_ms": {op: statistics.median(p["operators_ms"].get(op, 0.0) for p in profiles) for op in operators},
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shape, one profiled step")
    parser.add_argument(
        "--steps", type=int, default=None, help="profiled steps per model, interleaved (default 9; quick 1)"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    shape_name = "tiny" if args.quick else "small"
    shape, steps = SHAPES[shape_name], args.steps or (1 if args.quick else 9)
    ids = torch.randint(
        0, shape["vocab_size"], (shape["batch"], shape["seq"]), generator=torch.Generator().manual_seed(0)
    )
    results = {
        "provenance": provenance(None if argv is None else [__file__, *argv]),
        "shape": shape_name,
        "steps": steps,
        "rows": [],
    }
    runs = [(variant, fields, False) for variant, fields in VARIANTS.items()]
    if native_build_problem() is None:
        runs += [(f"{variant}, native", fields, True) for variant, fields in VARIANTS.items()]
    for variant, fields, native in runs:
        gpt2, delta = build_pair(shape, 4, "paper", fields, implementation="native" if native else "eager")
        base_step, delta_step = train_step_fn(gpt2, ids)[0], train_step_fn(delta, ids)[0]
        for step in (base_step, delta_step, base_step, delta_step):  # warm-up: allocator, AdamW state
            step()
        pairs = [(profiled_step(base_step), profiled_step(delta_step)) for _ in range(steps)]  # interleaved
        base, mine = median_profile([a for a, _ in pairs]), median_profile([b for _, b in pairs])
        extra = mine["total_ms"] - base["total_ms"]
        parts = dict(mine["parts_ms"], other=extra - sum(mine["parts_ms"].values()))
        added = {op: ms - base["operators_ms"].get(op, 0.0) for op, ms in mine["operators_ms"].items()}
        top = dict(sorted(added.items(), key=lambda item: -item[1])[:5])
        row = {
            "variant": variant,
            "fields": fields,
            "gpt2_ms": base["total_ms"],
            "delta_ms": mine["total_ms"],
            "ratio": mine["total_ms"] / base["total_ms"],
            "parts_ms": parts,
            "parts_share_of_gpt2": {part: ms / base["total_ms"] for part, ms in parts.items()},
            "top_added_operators_ms": top,
        }
        results["rows"].append(row)
        shares = " ".join(f"{p} {s:+.3f}" for p, s in row["parts_share_of_gpt2"].items())
        print(f"{variant:12s} ratio {row['ratio']:.3f}: {shares}", flush=True)
    write_results(
        args.out, "variant_step_profile_quick" if args.quick else "variant_step_profile", results, markdown(results)
    )
    return results


def markdown(results: dict) -> str:
    shape = SHAPES[results["shape"]]
    label = f"{results['shape']} (L{shape['n_layer']} D{shape['n_embd']} T{shape['seq']} B{shape['batch']})"
    lines = [
        f"# Where a variant's training step goes beyond GPT-2's ({label}, d_v = 4, paper mode)",
        "",
        f"torch.profiler, {results['steps']} training steps per model after two warm-up steps, the two models' "
        "steps interleaved, one torch thread; medians over the steps. Self CPU time per step (the profiler's "
        "per-operator cost included, both models alike); the parts of the extra time as fractions of GPT-2's step: "
        "the Delta update's and the TC read's autograd Functions (forward + backward), and everything else.",
        "",
        "| variant | GPT-2 ms | variant ms | ratio | Delta update | TC read | other | operators adding most (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        share = row["parts_share_of_gpt2"]
        top = ", ".join(f"{op.removeprefix('aten::')} {ms:.0f}" for op, ms in row["top_added_operators_ms"].items())
        lines.append(
            f"| {row['variant']} | {row['gpt2_ms']:.0f} | {row['delta_ms']:.0f} | {row['ratio']:.3f} | "
            f"{share['Delta update']:+.3f} | {share['TC read']:+.3f} | {share['other']:+.3f} | {top} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
