"""Does each fused op earn its place? Every fused implementation in `delta_ops` against its readable reference, in
the model, as a share of GPT-2's training step and decoded-token time (the project's bar: 2%).

For each op, the same Delta model times a training step and batch-1 greedy decoding twice, interleaved with GPT-2
(`bench_overhead`'s pairs): once with the op's entry point as the layers call it, once with the entry point replaced
by its readable reference (the paper's formula with plain autograd). The difference of the two ratios to GPT-2 is what
the fused op saves, in units of GPT-2's time; the A/A row (GPT-2 against itself) is the noise floor.

| op | entry point | readable reference |
| --- | --- | --- |
| update | `fused_delta_update` | `delta_update(X, unit_direction(h), beta, v, h?)` |
| tc_read | `temporal_conv_read` | `temporal_conv(cat([past, x]), W).sum(-1)` |
| cc_read | `channel_conv_read` | `channel_conv(X, W) @ r` |

    python -m ddl_lab.benchmarks.bench_fast_paths                 # small and GPT-2-small shapes -> results/fast_paths.*
    python -m ddl_lab.benchmarks.bench_fast_paths --quick         # tiny shape, 2 pairs: the pipeline in seconds
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

import ddl_hf.delta_layers
import ddl_hf.delta_reads
from ddl_hf.delta_ops import channel_conv, delta_update, temporal_conv, unit_direction
from ddl_lab.builders import SHAPES, build_pair
from ddl_lab.common import provenance, ratio_spread, train_and_decode, write_results

GOAL = 0.02  # a fused op stays if it saves at least 2% of GPT-2's step or token time


def reference_update(state, h, beta, value, eps, additive, erase=True, kernel=None):
    """The readable write; `kernel` (the model's native kernel, which the fused op may run) is not used here."""
    beta = beta.squeeze(-1) if beta.dim() == h.dim() else beta
    return delta_update(state, unit_direction(h, eps), beta, value, h if additive else None, erase)


def reference_tc_read(x, weight, past=None, same_document=None, kernel=None):
    """The readable TC read; `kernel` (the model's native kernel) is not used here."""
    if past is None:
        past = x.new_zeros(x.shape[0], weight.shape[-1] - 1, *x.shape[2:])
    return temporal_conv(torch.cat([past, x], 1), weight, same_document).sum(-1)


def reference_cc_read(state, weight, read, op=None):
    """The readable CC read; `op` (the model's native op) is not used here."""
    return channel_conv(state, weight) @ read.to(state.dtype)


#: op -> (the name the layers call it by, its readable reference, the model that runs it)
OPS = {
    "update (d_v = 1, additive)": ("fused_delta_update", reference_update, dict(d_v=1, mode="additive")),
    "update (d_v = 4, paper)": ("fused_delta_update", reference_update, dict(d_v=4, mode="paper")),
    "tc_read (d_v = 4)": (
        "temporal_conv_read",
        reference_tc_read,
        dict(d_v=4, mode="paper", fields=dict(delta_state_read="temporal_conv")),
    ),
    "cc_read (d_v = 4)": (
        "channel_conv_read",
        reference_cc_read,
        dict(d_v=4, mode="paper", fields=dict(delta_state_read="channel_conv")),
    ),
}


LAYERS = (ddl_hf.delta_layers, ddl_hf.delta_reads)  # the files whose modules call the ops


@contextlib.contextmanager
def replaced(name: str, function) -> Iterator[None]:
    """`name` replaced by `function` in the layer file that calls it."""
    (layers,) = [module for module in LAYERS if hasattr(module, name)]
    original = getattr(layers, name)
    setattr(layers, name, function)
    try:
        yield
    finally:
        setattr(layers, name, original)


def measure(gpt2, delta, ids, prompt, pairs: int, tokens: int) -> dict:
    """Training-step and decoded-token ratios of `delta` to `gpt2`, interleaved pairs."""
    timings = train_and_decode(gpt2, delta, ids, prompt, pairs, tokens)
    return {"train_step": timings["train_step"], "decode_b1": timings["generation_b1"]}


def bench_shape(shape_name: str, pairs: int, tokens: int) -> list[dict]:
    shape = SHAPES[shape_name]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape["vocab_size"], (shape["batch"], shape["seq"]), generator=g)
    prompt = torch.randint(0, shape["vocab_size"], (1, 16), generator=g)
    rows = []
    gpt2, twin = build_pair(shape, 1, "additive")
    floor = measure(gpt2, gpt2, ids, prompt, pairs, tokens)
    rows.append({"shape": shape_name, "op": "A/A (GPT-2 against itself)", "floor": floor})
    del twin
    for op, (name, reference, model) in OPS.items():
        gpt2, delta = build_pair(shape, model["d_v"], model["mode"], model.get("fields"))
        fused = measure(gpt2, delta, ids, prompt, pairs, tokens)
        with replaced(name, reference):
            readable = measure(gpt2, delta, ids, prompt, pairs, tokens)
        saves = {m: readable[m]["ratio"] - fused[m]["ratio"] for m in fused}
        rows.append(
            {
                "shape": shape_name,
                "op": op,
                "fused": fused,
                "reference": readable,
                "saves_share_of_gpt2": saves,
                "keep": max(saves.values()) >= GOAL,
            }
        )
        print(f"{shape_name:10s} {op:28s} saves {saves}", flush=True)
    return rows


def markdown(results: dict) -> str:
    lines = [
        "Each fused op against its readable reference in the same model, as ratios to GPT-2 (process CPU time, "
        f"interleaved pairs, median); 'saves' is their difference in units of GPT-2's time (bar: {GOAL:.0%}).",
        "",
        "| shape | op | train: fused / reference | saves | decode b=1: fused / reference | saves | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results["rows"]:
        if "floor" in r:
            f = r["floor"]
            lines.append(
                f"| {r['shape']} | {r['op']} | {ratio_spread(f['train_step'])} | | {ratio_spread(f['decode_b1'])} "
                "| | noise floor |"
            )
            continue
        s = r["saves_share_of_gpt2"]
        cells = [
            f"{r['fused'][m]['ratio']:.3f} / {r['reference'][m]['ratio']:.3f} | {s[m]:+.3f}"
            for m in ("train_step", "decode_b1")
        ]
        verdict = "keep" if r["keep"] else "below the bar"
        lines.append(f"| {r['shape']} | {r['op']} | {cells[0]} | {cells[1]} | {verdict} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shape, 2 pairs, 4 tokens")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["small", "gpt2-small"])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=16, help="tokens decoded per generate call")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--name", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.shapes, args.pairs, args.tokens = ["tiny"], 2, 4
    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    results = {"provenance": provenance(None if argv is None else [__file__, *argv]), "goal": GOAL, "rows": []}
    for shape in args.shapes:
        results["rows"] += bench_shape(shape, args.pairs, args.tokens)
    name = args.name or ("fast_paths_quick" if args.quick else "fast_paths")
    write_results(args.out, name, results, markdown(results))
    return results


if __name__ == "__main__":
    main()
