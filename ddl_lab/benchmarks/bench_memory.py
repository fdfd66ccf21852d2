"""Peak training memory of each Delta variant against its baseline, side by side in one process.

    python -m ddl_lab.benchmarks.bench_memory            # GPT-2-small shape, every row, eager (about 20 min on 2 cores)
    python -m ddl_lab.benchmarks.bench_memory --compiled    # the same under torch.compile (inductor; adds compile time)
    python -m ddl_lab.benchmarks.bench_memory --quick         # the tiny shape: the pipeline in seconds (tested)

Each row builds the baseline (GPT-2, or Llama for the DeltaLlama row) and the Delta model over the same weights
(`ddl_lab.builders.build_pair`), runs one warm-up AdamW step on each (so the optimizer state exists), then measures one
more training step of each, without and with gradient checkpointing: the peak of tensor bytes (parameters, gradients,
AdamW state and activations, from the allocator events `torch.profiler` records; `ddl_lab.common.peak_train_bytes`)
and, without checkpointing, the bytes autograd saves for the backward (`saved_activation_bytes`). Ratios are Delta /
baseline. The allocator's accounting is exact and deterministic, so the noise floor is the baseline's own spread
across rows (A/A: the same baseline measured once per row), written beside the ratios.

The authors' figures (their Table 4, GPT-2 small at 124M on a GPU; batch and length not restated here): d_v = 1
1.00x, CC 1.05x, TC without EC 1.31x of the baseline's 2.94 GB. Theirs and ours share no absolute scale: the ratio
depends on how much of the peak is activations rather than weights and AdamW state, so the activation share of our
baseline is reported too. Writes `ddl_lab/benchmarks/results/memory{_compiled}{_quick}.{json,md}`.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from ddl_hf import DeltaGPTConfig, DeltaGPTForCausalLM
from ddl_lab.benchmarks import bench_overhead as bo
from ddl_lab.builders import SHAPES as BENCH_SHAPES
from ddl_lab.builders import build_pair
from ddl_lab.common import live_bytes, peak_train_bytes, provenance, train_step_fn, write_results

#: Fields of the authors' preset that `build_pair` sets itself (mode, d_v) or that do not change memory (beta_init).
PAIR_FIELDS = ("delta_mode", "delta_value_channels", "delta_beta_init")


def reference(variant: str) -> tuple[int, str, dict]:
    """(d_v, mode, fields) of the authors' preset `variant` (`DeltaGPTConfig.reference`)."""
    config = DeltaGPTConfig.reference(variant)
    fields = {k: v for k, v in config.to_dict().items() if k.startswith("delta_") and k not in PAIR_FIELDS}
    return config.delta_value_channels, config.delta_mode, fields


#: name -> (architecture, d_v, mode, fields). The authors' presets are their files' configurations (paper mode,
#: sigmoid value, shared read); "TC" is theirs without EC, the row their Table 4 reports.
ROWS: dict[str, Callable[[], tuple[str, int, str, dict]]] = {
    "additive d_v=1 (conversion)": lambda: ("gpt", 1, "additive", {}),
    "reference d_v=1": lambda: ("gpt", *reference("dv1")),
    "reference d_v=4 CC": lambda: ("gpt", *reference("cc")),
    "reference d_v=4 TC": lambda: ("gpt", *reference("tc")),
    "reference d_v=4 TC+EC": lambda: ("gpt", *reference("tc_ec")),
    "DeltaNet mixer d_v=1": lambda: ("gpt", 1, "additive", dict(token_mixer="delta_net")),
    "DeltaLlama d_v=4 TC": lambda: ("llama", 4, "paper", dict(delta_state_read="temporal_conv")),
}
#: The authors' ratios for the rows that have one.
AUTHORS = {"reference d_v=1": 1.00, "reference d_v=4 CC": 1.05, "reference d_v=4 TC": 1.31}
SHAPES = {
    # GPT-2 small and, for the DeltaLlama row, SmolLM-135M's shape (bench_overhead's), at a memory batch and length
    # where activations are a large part of the peak, as in training.
    "gpt2-small": {"gpt": "gpt2-small", "llama": "smollm-135m", "batch": 2, "seq": 512},
    "tiny": {"gpt": "tiny", "llama": "llama-small", "batch": 2, "seq": 32},
}


def set_checkpointing(model: torch.nn.Module, on: bool) -> None:
    """transformers' activation checkpointing, under the installed release's name (renamed in 5.23)."""
    if hasattr(model, "activation_checkpointing_enable"):
        enable, disable, kwargs = "activation_checkpointing_enable", "activation_checkpointing_disable", "activation_"
    else:
        enable, disable, kwargs = "gradient_checkpointing_enable", "gradient_checkpointing_disable", "gradient_"
    if on:
        getattr(model, enable)(**{f"{kwargs}checkpointing_kwargs": {"use_reentrant": False}})
    else:
        getattr(model, disable)()


def measure(model: torch.nn.Module, ids: torch.Tensor, checkpointing: bool, compiled: bool) -> int:
    """Peak tensor bytes of one training step after a warm-up step."""
    set_checkpointing(model, checkpointing)
    runner = torch.compile(model) if compiled else model
    step, optimizer = train_step_fn(runner, ids)
    step()  # AdamW state, and the compilation when compiled
    peak = peak_train_bytes(step, model, optimizer)
    del optimizer
    for parameter in model.parameters():
        parameter.grad = None
    return peak


def bench_row(name: str, shape_name: str, batch: int, seq: int, compiled: bool) -> dict:
    arch, value_channels, mode, fields = ROWS[name]()
    shape = dict(BENCH_SHAPES[SHAPES[shape_name][arch]])
    if "token_mixer" in fields:  # another mixer: no baseline weight maps onto it, so it starts from its own init
        base, _ = build_pair(shape, 1, "additive")
        architecture = {
            k: v for k, v in base.config.to_dict().items() if k not in ("model_type", "transformers_version")
        }
        config = DeltaGPTConfig(**architecture, delta_mode=mode, delta_value_channels=value_channels, **fields)
        config._attn_implementation = "sdpa"
        delta = DeltaGPTForCausalLM(config)
    else:
        base, delta = build_pair(shape, value_channels, mode, fields)
    ids = torch.randint(0, shape["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))
    row: dict = {"row": name, "arch": arch, "shape": SHAPES[shape_name][arch], "d_v": value_channels, "mode": mode}
    row["fields"] = fields
    for checkpointing in (False, True):
        key = "checkpointing" if checkpointing else "plain"
        base_bytes = measure(base, ids, checkpointing, compiled)
        delta_bytes = measure(delta, ids, checkpointing, compiled)
        row[key] = {"baseline_bytes": base_bytes, "delta_bytes": delta_bytes, "ratio": delta_bytes / base_bytes}
    set_checkpointing(base, False)
    set_checkpointing(delta, False)
    saved_base, saved_delta = bo.saved_activation_bytes(base, ids), bo.saved_activation_bytes(delta, ids)
    row["saved_activations"] = {
        "baseline_bytes": saved_base,
        "delta_bytes": saved_delta,
        "ratio": saved_delta / saved_base,
    }
    optimizer = torch.optim.AdamW(base.parameters())
    row["baseline_weights_and_adamw_bytes"] = 4 * live_bytes(base, optimizer)  # params + grads + 2 moments
    row["params_ratio"] = bo.n_params(delta) / bo.n_params(base)
    return row


def aa_spread(rows: list[dict], arch: str, key: str) -> float:
    """Relative spread (max / min - 1) of one baseline's peak across the rows that measured it: 0 if deterministic."""
    values = [r[key]["baseline_bytes"] for r in rows if r["arch"] == arch]
    return max(values) / min(values) - 1 if len(values) > 1 else 0.0


def markdown(results: dict) -> str:
    mb = 2**20
    lines = [
        f"# Peak training memory ({'compiled' if results['compiled'] else 'eager'}, batch {results['batch']}, "
        f"length {results['seq']})",
        "",
        "Delta / baseline in one process; tensor bytes at the allocator (parameters, gradients, AdamW state, "
        "activations) over one training step. Authors: their Table 4 ratio where it exists.",
        "",
        "| row | baseline | peak | with checkpointing | saved activations | params | authors | baseline peak MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        authors = f"{AUTHORS[r['row']]:.2f}" if r["row"] in AUTHORS else ""
        baseline = "Llama" if r["arch"] == "llama" else "GPT-2"
        lines.append(
            f"| {r['row']} | {baseline} ({r['shape']}) | {r['plain']['ratio']:.3f} | {r['checkpointing']['ratio']:.3f} "
            f"| {r['saved_activations']['ratio']:.3f} | {r['params_ratio']:.4f} | {authors} "
            f"| {r['plain']['baseline_bytes'] / mb:.0f} |"
        )
    gpt = [r for r in results["rows"] if r["arch"] == "gpt"]
    if gpt:
        share = statistics.fmean(1 - r["baseline_weights_and_adamw_bytes"] / r["plain"]["baseline_bytes"] for r in gpt)
        lines += [
            "",
            f"Activations are {share:.0%} of the GPT-2 baseline's peak here (the rest: weights, gradients, AdamW "
            "moments); the larger that share, the further a ratio moves from 1.",
        ]
    lines += [
        "",
        "A/A (the same baseline measured once per row, relative spread of its peak): "
        + ", ".join(f"{k} {v:.2e}" for k, v in results["aa_spread"].items()),
        "",
        f"Command: `{results['provenance']['command']}`",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the tiny shape: the pipeline in seconds")
    parser.add_argument("--compiled", action="store_true", help="torch.compile both models (inductor)")
    parser.add_argument("--rows", nargs="*", choices=list(ROWS), default=list(ROWS), help="rows to measure")
    parser.add_argument("--batch", type=int, default=None, help="default 2")
    parser.add_argument("--seq", type=int, default=None, help="default 512 (--quick: 32)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="results folder")
    args = parser.parse_args(argv)
    shape_name = "tiny" if args.quick else "gpt2-small"
    batch = args.batch or SHAPES[shape_name]["batch"]
    seq = args.seq or SHAPES[shape_name]["seq"]
    prov = provenance(None if argv is None else [__file__, *argv])
    rows = []
    for i, name in enumerate(args.rows, 1):
        row = bench_row(name, shape_name, batch, seq, args.compiled)
        rows.append(row)
        print(
            f"[{i}/{len(args.rows)}] {name}: peak {row['plain']['ratio']:.3f}, checkpointing "
            f"{row['checkpointing']['ratio']:.3f}, saved activations {row['saved_activations']['ratio']:.3f}",
            flush=True,
        )
    results = {
        "provenance": prov,
        "shape": shape_name,
        "batch": batch,
        "seq": seq,
        "compiled": args.compiled,
        "rows": rows,
        "aa_spread": {
            f"{arch} {key}": aa_spread(rows, arch, key)
            for arch in sorted({r["arch"] for r in rows})
            for key in ("plain", "checkpointing")
        },
        "authors": AUTHORS,
    }
    name = "memory" + ("_compiled" if args.compiled else "") + ("_quick" if args.quick else "")
    write_results(Path(args.out), name, results, markdown(results))
    return results


if __name__ == "__main__":
    main()
