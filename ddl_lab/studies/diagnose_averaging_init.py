"""Where the averaging-initialised TC read stalls: GPT-2 with a TC read and every gate shut (`gpt2_tc` of
bench_pretrain.py), its convolutions starting as the average over the K taps everywhere, only in the blocks' reads,
only in the final read, or nowhere (the identity, which computes GPT-2 exactly at step 0).

    python -m ddl_lab.studies.diagnose_averaging_init            # the cpu preset, 300 steps, seed 0 (about 6 minutes)
    python -m ddl_lab.studies.diagnose_averaging_init --steps 60 # a quicker look
    python -m ddl_lab.studies.diagnose_averaging_init --quick    # a check of the pipeline, not a result (seconds)

Same data, seed, schedule and harness as the study (`bench_pretrain.train_one`); only the convolution weights differ.
`--quick` runs the same five cases on bench_pretrain's quick preset (2 layers, d = 64, context 64, 40 steps).
Writes `ddl_lab/studies/results/averaging_init.{json,md}` (`averaging_init_quick` with `--quick`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ddl_hf.delta_reads import DeltaStateConv
from ddl_lab.common import provenance, write_results
from ddl_lab.studies import bench_pretrain

#: where the convolutions start as the identity (the rest: the average over the K taps, the reference's init)
CASES = {
    "GPT-2 (baseline)": None,
    "averaging everywhere": (),
    "averaging in the blocks' reads only": ("final",),
    "averaging in the final read only": ("blocks",),
    "identity everywhere (= GPT-2 at step 0)": ("blocks", "final"),
}


def build(identity: tuple[str, ...]):
    """`bench_pretrain.build_models` for `gpt2_tc`, with the chosen convolutions set to the identity."""
    original = bench_pretrain.build_models

    def build_models(preset, vocab_size, variant, seed):
        model = original(preset, vocab_size, variant, seed)
        with torch.no_grad():
            for name, module in model.named_modules():
                where = "final" if name.endswith("read_out.conv") else "blocks"
                if isinstance(module, DeltaStateConv) and where in identity:
                    module.weight.copy_(module.identity())
        return model

    return build_models


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="bench_pretrain's quick preset: a check, not a result")
    parser.add_argument("--steps", type=int, default=None, help="default: 300 (the quick preset's 40 with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    steps = args.steps if args.steps is not None else bench_pretrain.PRESETS["quick"].steps if args.quick else 300
    bench_args = bench_pretrain.parse_args(
        ["--workers", "0", "--steps", str(steps), *(["--quick"] * args.quick)]
        + ["--cache-dir", args.cache_dir] * bool(args.cache_dir)
    )
    preset = bench_pretrain.resolve_preset(bench_args)
    results = {
        "provenance": provenance(None if argv is None else [__file__, *argv]),
        "preset": bench_args.preset,
        "steps": steps,
        "seed": args.seed,
        "rows": [],
    }
    original = bench_pretrain.build_models
    for case, identity in CASES.items():
        variant = "gpt2" if identity is None else "gpt2_tc"
        if identity is not None:
            bench_pretrain.build_models = build(identity)
        try:
            run = bench_pretrain.train_one(bench_args, preset, variant, args.seed)
        finally:
            bench_pretrain.build_models = original
        results["rows"].append({"case": case, "curve": run["curve"], "final_valid_loss": run["final_valid_loss"]})
        print(f"{case:42s} {' '.join(f'{loss:.3f}' for _, loss in run['curve'])}  final {run['final_valid_loss']:.4f}")
    evaluated = [step for step, _ in results["rows"][0]["curve"]]
    lines = [
        "# The averaging-initialised TC read: where training stalls",
        "",
        f"`gpt2_tc` of bench_pretrain.py (GPT-2 whose sublayers and final norm read the residual stream through a "
        f"causal convolution over 4 tokens; every Delta gate shut, β ≡ 0), {bench_args.preset} preset, {steps} steps, "
        f"seed {args.seed}. Validation loss on the study's curve set at each step:",
        "",
        "| convolutions start | " + " | ".join(f"step {s}" for s in evaluated) + " | final (whole set) |",
        "|---|" + "---|" * (len(evaluated) + 1),
    ]
    for row in results["rows"]:
        losses = " | ".join(f"{loss:.3f}" for _, loss in row["curve"])
        lines.append(f"| {row['case']} | {losses} | {row['final_valid_loss']:.4f} |")
    write_results(args.out, "averaging_init" + "_quick" * args.quick, results, "\n".join(lines) + "\n")
    return results


if __name__ == "__main__":
    main()
