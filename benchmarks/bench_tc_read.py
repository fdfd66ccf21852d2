"""The TC read's cost, one pass (`temporal_conv_read`, with tensor ops and with the optional native TC read of
`ddl_hf.native` alone, where it builds) against its definition (convolution, then the sum over the value
channels), beside GPT-2 in one process: training-step CPU time and saved activations, as ratios to GPT-2; and greedy
decoding at batch 1, the one-token window read (`temporal_conv_read_window`) against the per-tap one pass it
replaced for that step.

    python benchmarks/bench_tc_read.py             # small shape (L4 D256 T256 B8), d_v = 4, paper mode
    python benchmarks/bench_tc_read.py --quick     # tiny shape, a few pairs

Writes `benchmarks/results/tc_read{,_quick}.{json,md}`. The definition is swapped in by replacing
`DeltaConvContext.convolve_read` with `convolve(...).sum(-1)` for its rows; everything else is the same model.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from _common import provenance, write_results
from bench_overhead import SHAPES, build_pair, generate_fn, interleaved, train_step_fn

from ddl_hf.delta_ops import temporal_conv_read
from ddl_hf.modeling_delta_gpt import DeltaConvContext, DeltaStateConv
from ddl_hf.native import load_training_kernels, native_build_problem

VARIANTS = {
    "TC": dict(delta_state_read="temporal_conv"),
    "TC+EC": dict(delta_state_read="temporal_conv", delta_embed_expand="conv"),
}
ONE_PASS = DeltaConvContext.convolve_read


def definition(self: DeltaConvContext, x: torch.Tensor, key: str, weight: torch.Tensor, kernel=None) -> torch.Tensor:
    return self.convolve(x, key, weight).sum(-1)


def per_tap(self: DeltaConvContext, x: torch.Tensor, key: str, weight: torch.Tensor, kernel=None) -> torch.Tensor:
    """The cached read before the one-token window path: always the per-tap one pass (no packed rows here)."""
    if self.cache is None:
        return ONE_PASS(self, x, key, weight, kernel)
    size = weight.shape[-1]
    history = self.history(x, key, size)
    return temporal_conv_read(history[:, size - 1 :], weight, history[:, : size - 1])


def set_native_read(model: torch.nn.Module, kernels) -> None:
    for module in model.modules():
        if isinstance(module, DeltaStateConv):
            module.native_read = kernels


def saved_mib(model: torch.nn.Module, ids: torch.Tensor) -> float:
    """MiB of distinct storages autograd saves for the backward of one training forward."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model.train()(ids)
    return sum(storages.values()) / 2**20


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--pairs", type=int, default=None, help="interleaved A/B pairs per row (default 7; quick 3)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = {"provenance": provenance(argv), "rows": []}
    shape_name = "tiny" if args.quick else "small"
    shape, pairs = SHAPES[shape_name], args.pairs or (3 if args.quick else 7)
    ids = torch.randint(
        0, shape["vocab_size"], (shape["batch"], shape["seq"]), generator=torch.Generator().manual_seed(0)
    )
    for variant, fields in VARIANTS.items():
        gpt2, delta = build_pair(shape, 4, "paper", fields)
        step_a, _ = train_step_fn(gpt2, ids)
        step_b, _ = train_step_fn(delta, ids)
        base_saved = saved_mib(gpt2, ids)
        reads = [("one pass", ONE_PASS, False), ("conv then sum", definition, False)]
        if native_build_problem() is None:
            reads.insert(0, ("native one pass", ONE_PASS, True))
        for read, implementation, native in reads:
            DeltaConvContext.convolve_read = implementation
            if native:  # the native TC read alone (enable_native_training would also swap the Delta update's ops)
                set_native_read(delta, load_training_kernels())
            try:
                step = interleaved(step_a, step_b, pairs)
                saved = saved_mib(delta, ids)
            finally:
                DeltaConvContext.convolve_read = ONE_PASS
                set_native_read(delta, None)
            row = {
                "shape": shape_name,
                "variant": variant,
                "read": read,
                "train_step": step,
                "saved_mib": saved,
                "gpt2_saved_mib": base_saved,
                "saved_ratio": saved / base_saved,
            }
            results["rows"].append(row)
            print(
                f"{variant:6s} {read:14s} train step {step['ratio']:.3f} [{step['ratio_min']:.3f}, "
                f"{step['ratio_max']:.3f}]  saved activations {saved / base_saved:.3f}",
                flush=True,
            )
    prompt = ids[:1, :32]
    new_tokens = 16 if args.quick else 32
    for variant, fields in VARIANTS.items():
        gpt2, delta = build_pair(shape, 4, "paper", fields)
        gen_a, gen_b = generate_fn(gpt2, prompt, new_tokens), generate_fn(delta, prompt, new_tokens)
        for read, implementation in (("one-token window", ONE_PASS), ("per tap", per_tap)):
            DeltaConvContext.convolve_read = implementation
            try:
                gen = interleaved(gen_a, gen_b, pairs)
            finally:
                DeltaConvContext.convolve_read = ONE_PASS
            results["rows"].append({"shape": shape_name, "variant": variant, "read": read, "generation_b1": gen})
            print(
                f"{variant:6s} {read:16s} decode b=1 {gen['ratio']:.3f} [{gen['ratio_min']:.3f}, "
                f"{gen['ratio_max']:.3f}]",
                flush=True,
            )
    lines = [
        "# The TC read: one pass vs convolution then sum (d_v = 4, paper mode)",
        "",
        "Ratios to GPT-2 of the same shape in the same process: training-step process CPU time (median of "
        "interleaved pairs, [min, max]) and the storages autograd saves for the backward of one forward.",
        "",
        "| shape | variant | read | train step | saved activations | saved MiB (GPT-2) |",
        "|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        if "train_step" not in row:
            continue
        step = row["train_step"]
        saved = f"{row['saved_ratio']:.3f} | {row['saved_mib']:.0f} ({row['gpt2_saved_mib']:.0f})"
        lines.append(
            f"| {row['shape']} | {row['variant']} | {row['read']} | {step['ratio']:.3f} [{step['ratio_min']:.3f}, "
            f"{step['ratio_max']:.3f}] | {saved} |"
        )
    lines += [
        "",
        f"Greedy decoding at batch 1 ({new_tokens} new tokens after a 32-token prompt, KV cache and cached windows): "
        "process CPU time per call, ratio to GPT-2 (median of interleaved pairs, [min, max]).",
        "",
        "| shape | variant | cached read | decode b=1 |",
        "|---|---|---|---|",
    ]
    for row in results["rows"]:
        if "generation_b1" in row:
            gen = row["generation_b1"]
            lines.append(
                f"| {row['shape']} | {row['variant']} | {row['read']} | {gen['ratio']:.3f} [{gen['ratio_min']:.3f}, "
                f"{gen['ratio_max']:.3f}] |"
            )
    write_results(args.out, "tc_read_quick" if args.quick else "tc_read", results, "\n".join(lines) + "\n")
    return results


if __name__ == "__main__":
    main()
