"""What a Delta model's step costs the host, Delta / GPT-2, counted and timed on the CPU (issue: one op per residual).

A GPU step at GPT-2-small's shape was host-bound (the first H200 run): its cost follows the operations it launches
and the host time between them. Three measurements, each Delta / GPT-2 for every variant:

1. Launches per step on the route a GPU takes: `delta_implementation="triton"` (one Triton op per Delta residual)
   against `"eager"` (the tensor ops), counted on the CPU with Triton's interpreter (`TRITON_INTERPRET=1`, set by this
   script before Triton is imported). A launch is an aten operator that runs a kernel (a leaf in torch.profiler's
   operator tree, not a view or an allocation; inside a custom op too) plus each Triton kernel launch. One eager
   training step (forward and backward, bf16 autocast, batch 1 x 16 tokens, 2 layers, width 64) and one cached
   batch-1 decoding step. Counts do not depend on the width.
2. The compiled step's GEMMs: `mm` / `addmm` / `bmm` / `baddbmm` nodes in the AOT forward and backward graphs of a
   fullgraph-compiled training step (what inductor hands to cuBLAS on CUDA), Delta minus GPT-2, per Delta residual.
3. Compute-free host time: one training step at a shape with almost no compute (12 layers, width 64, 16 tokens, one
   thread, bf16 autocast), wall time, Delta / GPT-2, the two interleaved, with an A/A row (GPT-2 against a copy of
   itself) for the noise floor; on the CPU's own "auto" route (the tensor ops: native kernels are asked for by name),
   on the Triton route with its kernels stubbed out (the host's share: dispatch, autograd, the op's Python;
   Triton's own launcher cost is not in it), and with `--native` on the native CPU kernels (one op per residual).

    python -m ddl_lab.benchmarks.bench_launches --native   # all rows, ~4 min on 2 cores (+ the native build)
    python -m ddl_lab.benchmarks.bench_launches --quick    # fewer variants and timed steps (the test's run)

Results: ddl_lab/benchmarks/results/launches.{json,md}.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports Triton: its kernels run on the CPU

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import GPT2Config, GPT2LMHeadModel

import ddl_hf
from ddl_lab.common import provenance, write_results

#: The variants (the CLI's names, as tests/builders.py's CLIENT_VARIANTS) and the launch goal of each family (issue).
VARIANTS = {
    "additive-dv1": dict(),
    "paper-dv1": dict(delta_mode="paper"),
    "write-only-paper-dv1": dict(delta_mode="paper", delta_erase=False),
    "additive-dv4": dict(delta_value_channels=4),
    "paper-dv4": dict(delta_mode="paper", delta_value_channels=4),
    "cc-dv4": dict(delta_value_channels=4, delta_state_read="channel_conv"),
    "tc-dv1": dict(delta_state_read="temporal_conv"),
    "reference-tc-dv4": dict(
        delta_mode="paper",
        delta_value_channels=4,
        delta_state_read="temporal_conv",
        delta_value="sigmoid",
        delta_shared_read=True,
    ),
}
QUICK_VARIANTS = ("paper-dv1", "paper-dv4")
LAUNCH_GOALS = {"dv1": 1.15, "dv4": 1.25, "cc": 1.25, "tc": 1.35}
HOST_GOALS = {"dv1": 1.10, "dv4": 1.20}
# Operators that launch no kernel: allocations and host-side helpers (views are found by their schema, `is_view`).
INTERPRETER = "triton_interpreter"
NO_LAUNCH = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "resize_",
    "lift_fresh",
    "promote_types",
    "_unsafe_view",
}


def goal_family(name: str) -> str:
    if name.startswith(("tc", "reference-tc")):
        return "tc"
    if name.startswith("cc"):
        return "cc"
    return "dv4" if name.endswith("dv4") else "dv1"


BACKBONE = dict(vocab_size=97, n_positions=64, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def models(variant: str | None, layers: int, width: int, implementation: str = "eager") -> torch.nn.Module:
    """GPT-2, or DeltaGPT of `variant` with the same backbone (the authors' from-scratch start: open gates), in
    training mode."""
    torch.manual_seed(0)
    if variant is None:
        return GPT2LMHeadModel(GPT2Config(**BACKBONE, n_layer=layers, n_embd=width)).train()
    config = ddl_hf.DeltaGPTConfig(
        **BACKBONE, n_layer=layers, n_embd=width, **VARIANTS[variant], delta_implementation=implementation
    )
    return ddl_hf.DeltaGPTForCausalLM(config).train()


# --- 1. launches -------------------------------------------------------------------------------------------------


def _is_view(name: str) -> bool:
    packet = getattr(torch.ops.aten, name, None)
    return packet is not None and any(getattr(packet, o).is_view for o in packet.overloads())


class TritonLaunches:
    """Counts Triton kernel launches (the interpreter's `run`); `stub=True` skips the kernels' work too."""

    def __init__(self, stub: bool = False):
        from triton.runtime.interpreter import InterpretedFunction

        self.cls, self.stub, self.count = InterpretedFunction, stub, 0

    def __enter__(self) -> TritonLaunches:
        self.original = self.cls.run
        counter = self

        def run(fn, *args, **kwargs):
            counter.count += 1
            if counter.stub:
                return None
            # the interpreter's own copies between torch and numpy are no launch on a GPU: marked, then left out
            with torch.profiler.record_function(INTERPRETER):
                return counter.original(fn, *args, **kwargs)

        self.cls.run = run
        return self

    def __exit__(self, *exc) -> None:
        self.cls.run = self.original


def count_launches(fn) -> dict:
    """Launching aten operators (profiler leaves that are no view and no allocation) and Triton launches of `fn()`."""
    with TritonLaunches() as triton_launches, profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    aten = 0
    for event in prof.events():
        name = event.name
        if not name.startswith("aten::") or any(c.name.startswith("aten::") for c in event.cpu_children):
            continue
        parent = event.cpu_parent
        while parent is not None and parent.name != INTERPRETER:
            parent = parent.cpu_parent
        if parent is not None:
            continue
        short = name.removeprefix("aten::")
        if short not in NO_LAUNCH and not _is_view(short):
            aten += 1
    return {"aten": aten, "triton": triton_launches.count, "launches": aten + triton_launches.count}


def training_step(model: torch.nn.Module, ids: torch.Tensor):
    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
        loss.backward()

    return step


def decoding_step(model: torch.nn.Module, ids: torch.Tensor):
    """One cached batch-1 token after a prompt (no autograd), as `generate` runs it."""
    model.eval()
    with torch.no_grad():
        cache = model(ids[:, :-1], use_cache=True).past_key_values

    def step():
        with torch.no_grad():
            model(ids[:, -1:], past_key_values=cache, use_cache=True)
            cache.crop(-1)  # back to the prompt: every step decodes the same position

    return step


def launches(variants: list[str]) -> dict:
    ids = torch.randint(1, 97, (1, 16), generator=torch.Generator().manual_seed(0))
    rows = {}
    for name in [None, *variants]:
        row = {}
        for implementation in ("eager", "triton") if name else ("eager",):
            model = models(name, layers=2, width=64, implementation=implementation)
            training_step(model, ids)()  # first call: lazy imports and caches
            row[implementation] = {
                "train": count_launches(training_step(model, ids)),
                "decode": count_launches(decoding_step(model, ids)),
            }
        rows[name or "gpt2"] = row
    return rows


# --- 2. the compiled step's GEMMs ---------------------------------------------------------------------------------

GEMMS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm")


def compiled_gemms(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """GEMM nodes in the AOT forward and backward graphs of a fullgraph-compiled training step."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    count = 0

    def compiler(graph, _):
        nonlocal count
        count += sum(any(str(n.target).startswith(g + ".") for g in GEMMS) for n in graph.graph.nodes)
        return make_boxed_func(graph.forward)

    torch._dynamo.reset()
    model.loss_type = "ForCausalLM"  # unset, transformers' loss property logs: a graph break
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=compiler, bw_compiler=compiler), fullgraph=True)
    training_step(compiled, ids)()
    return count


def gemms(variants: list[str]) -> dict:
    ids = torch.randint(1, 97, (1, 16), generator=torch.Generator().manual_seed(0))
    baseline = compiled_gemms(models(None, 2, 64), ids)
    rows = {"gpt2": {"gemms": baseline}}
    for name in variants:
        rows[name] = {}
        for implementation in ("eager", "triton"):
            found = compiled_gemms(models(name, 2, 64, implementation), ids)
            rows[name][implementation] = {"gemms": found, "extra_per_residual": (found - baseline) / 4}
    return rows


# --- 3. compute-free host time ------------------------------------------------------------------------------------


def host_time(variants: list[str], steps: int, native: bool = False) -> dict:
    """Median wall time of a training step, Delta / GPT-2, interleaved step by step (12 layers, width 64, 16
    tokens), with an A/A row; "auto" (this CPU's route), the Triton route with its kernels stubbed, and with `native`
    the native CPU kernels (one op per residual, asked for by name)."""
    ids = torch.randint(1, 97, (1, 16), generator=torch.Generator().manual_seed(0))
    gpt2, twin = models(None, 12, 64), models(None, 12, 64)

    def ratio(delta_step, stub: bool = False) -> float:
        base = training_step(gpt2, ids)
        times: dict[str, list[float]] = {"delta": [], "gpt2": []}
        with TritonLaunches(stub=stub):
            for i in range(steps + 3):
                for key, fn in (
                    (("delta", delta_step), ("gpt2", base)) if i % 2 else (("gpt2", base), ("delta", delta_step))
                ):
                    start = time.perf_counter()
                    fn()
                    if i >= 3:
                        times[key].append(time.perf_counter() - start)
        return statistics.median(times["delta"]) / statistics.median(times["gpt2"])

    rows = {"A/A (gpt2 / gpt2)": {"auto": ratio(training_step(twin, ids))}}
    for name in variants:
        rows[name] = {
            "auto": ratio(training_step(models(name, 12, 64, "auto"), ids)),
            "triton_stubbed": ratio(training_step(models(name, 12, 64, "triton"), ids), stub=True),
        }
        if native:
            rows[name]["native"] = ratio(training_step(models(name, 12, 64, "native"), ids))
    return rows


# --- report -------------------------------------------------------------------------------------------------------


def markdown(results: dict) -> str:
    counts, lines = results["launches"], []
    base = counts["gpt2"]["eager"]
    lines += [
        "## Launches per step, Delta / GPT-2 (the GPU's route, counted on the CPU)",
        "",
        f"GPT-2: {base['train']['launches']} launches per training step, {base['decode']['launches']} per decoding "
        "step (2 layers).",
        "",
        "| variant | train, eager | train, triton | goal | decode, eager | decode, triton |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in counts.items():
        if name == "gpt2":
            continue
        cells = [
            f"{row[i][s]['launches']} ({row[i][s]['launches'] / base[s]['launches']:.2f}x)"
            for s, i in (("train", "eager"), ("train", "triton"))
        ]
        decode = [
            f"{row[i]['decode']['launches']} ({row[i]['decode']['launches'] / base['decode']['launches']:.2f}x)"
            for i in ("eager", "triton")
        ]
        lines.append(
            f"| {name} | {cells[0]} | {cells[1]} | <= {LAUNCH_GOALS[goal_family(name)]:.2f}x | "
            + " | ".join(decode)
            + " |"
        )
    gem = results["gemms"]
    lines += [
        "",
        "## The compiled step's GEMMs (AOT graphs), beyond GPT-2's, per Delta residual",
        "",
        f"GPT-2: {gem['gpt2']['gemms']} GEMM nodes in the forward and backward graphs.",
        "",
        "| variant | eager | triton |",
        "| --- | --- | --- |",
    ]
    for name, row in gem.items():
        if name != "gpt2":
            lines.append(
                f"| {name} | {row['eager']['extra_per_residual']:+.2f} | {row['triton']['extra_per_residual']:+.2f} |"
            )
    host = results["host_time"]
    lines += [
        "",
        "## Compute-free host time of a training step, Delta / GPT-2 (12 layers, width 64, 16 tokens, 1 thread)",
        "",
        "| variant | auto (CPU: the tensor ops) | native (one op per residual) | triton, kernels stubbed | goal |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, row in host.items():
        goal = HOST_GOALS.get(goal_family(name)) if not name.startswith("A/A") else None
        native, stub = (f"{row[k]:.2f}" if k in row else "" for k in ("native", "triton_stubbed"))
        lines.append(f"| {name} | {row['auto']:.2f} | {native} | {stub} | {f'<= {goal:.2f}' if goal else ''} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="two variants, few timed steps (the test's run)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per host-time row (default 30; 5 quick)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results", help="output folder")
    parser.add_argument("--name", default="launches", help="basename of the result files")
    parser.add_argument("--native", action="store_true", help="also time the native CPU kernels (builds them once)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    prov = provenance(None if argv is None else [__file__, *argv])
    variants = list(QUICK_VARIANTS if args.quick else VARIANTS)
    steps = args.steps or (5 if args.quick else 30)
    results = {
        "provenance": prov,
        "launches": launches(variants),
        "gemms": gemms(variants),
        "host_time": host_time(variants, steps, args.native),
    }
    write_results(args.out, args.name, results, markdown(results))
    return results


if __name__ == "__main__":
    main()
