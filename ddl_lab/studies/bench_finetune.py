"""Fine-tuning a converted model: GPT-2 vs DeltaGPT converted from it (beta = 0), several seeds, paired statistics.

    python -m ddl_lab.studies.bench_pretrain              # first: trains (and keeps) the base GPT-2s
    python -m ddl_lab.studies.bench_finetune              # then: ~25 min on 2 CPU cores, results/finetune.{json,md,png}
    python -m ddl_lab.studies.bench_finetune --base gpt2  # any GPT-2 Hub id or directory (online), GPT-2's tokenizer

The base is a GPT-2 that has really learned: the from-scratch study's baseline (`bench_pretrain.py`, seed 0: a
byte-level BPE of 512 tokens, trained on five Austen novels to a validation loss far below the unigram entropy).
It is fine-tuned on a different author and form (four Shakespeare comedies) and evaluated on a fifth (*A Midsummer
Night's Dream*). Every variant starts from the same function (DeltaGPT converted with beta = 0 computes the base's
logits exactly, in additive mode), sees the same batches in the same order (`data_seed` = seed) with the same
optimizer and schedule; per seed the comparison is paired. Variants: GPT-2; DeltaGPT additive with the Delta
parameters' learning rate x1 and x10; additive starting at a small beta; the paper mode converted (its blocks start
as the identity, so it starts far from the base). Beta is logged over training (`DeltaStatsCallback`).
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from ddl_lab.common import provenance, pyplot, save_figure, write_results
from ddl_lab.studies.bench_pretrain import fmt_ci, mean_std, paired_difference, verdict

RESULTS = Path(__file__).resolve().parent / "results"

#: name -> (label, convert_gpt2 overrides or None for GPT-2, Delta learning-rate multiplier).
VARIANTS: dict[str, tuple[str, dict | None, float]] = {
    "gpt2": ("GPT-2", None, 1.0),
    "additive": ("DeltaGPT additive, Delta lr x1", {}, 1.0),
    "additive_lr10": ("DeltaGPT additive, Delta lr x10", {}, 10.0),
    "additive_beta0.1": ("DeltaGPT additive, beta init 0.1", {"delta_beta_init": 0.1}, 1.0),
    "paper": ("DeltaGPT paper mode (converted)", {"delta_mode": "paper"}, 1.0),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default=None, help="GPT-2 Hub id or directory (default: bench_pretrain's base)")
    parser.add_argument(
        "--pretrain-set",
        nargs="+",
        default=[],
        metavar="FIELD=VALUE",
        help="fine-tune the base that bench_pretrain trains with these --set overrides (e.g. arch=... or dropout=0.1)",
    )
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--eval-every", type=int, default=40)
    parser.add_argument("--eval-blocks", type=int, default=128, help="leading blocks of the held-out play")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--output-dir", default=str(RESULTS))
    parser.add_argument("--name", default="finetune", help="stem of the result files")
    parser.add_argument("--from-json", default=None, help="only re-render the report of an earlier results JSON")
    args = parser.parse_args(argv)
    if "gpt2" not in args.variants:
        parser.error("--variants must include gpt2: every comparison is paired with it")
    return args


def default_base(pretrain_set: list[str] = ()) -> Path:
    """The from-scratch study's GPT-2 baseline at seed 0 (cpu preset, `--set pretrain_set`), kept by bench_pretrain."""
    from ddl_lab.studies import bench_pretrain

    ns = bench_pretrain.parse_args(["--set", *pretrain_set] if pretrain_set else [])
    folder = bench_pretrain.cache_root(ns, bench_pretrain.resolve_preset(ns))
    base = bench_pretrain.run_path(folder, "gpt2", 0).with_suffix("")
    if not (base / "config.json").exists():
        raise SystemExit(
            f"bench_finetune: no base GPT-2 at {base}. Run `python -m ddl_lab.studies.bench_pretrain"
            f"{' --set ' + ' '.join(pretrain_set) if pretrain_set else ''}` first (it trains and keeps it), or pass "
            "--base with a GPT-2 Hub id or directory."
        )
    return base


def load_base(name: str | Path):
    from transformers import AutoTokenizer, GPT2LMHeadModel

    from ddl_hf.training import use_causal_lm_loss_accounting

    model = use_causal_lm_loss_accounting(GPT2LMHeadModel.from_pretrained(name).eval())
    return model, AutoTokenizer.from_pretrained(name)


def one_run(base, data, variant: str, seed: int, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """Fine-tune one (variant, seed); return the eval curve, the final eval loss and beta over training."""
    from transformers import set_seed

    import ddl_hf
    from ddl_hf.callbacks import DeltaStatsCallback
    from ddl_hf.training import finetune

    _, overrides, delta_lr_scale = VARIANTS[variant]
    set_seed(seed)  # also seeds the random init of the new Delta parameters (values, gate weights)
    model = copy.deepcopy(base) if overrides is None else ddl_hf.convert_gpt2(base, **overrides)
    started = time.process_time()
    run = finetune(
        model.train(),
        data["train"],
        data["eval"],
        scratch / f"{variant}-{seed}",
        steps=args.steps,
        learning_rate=args.lr,
        batch_size=args.batch_size,
        seed=seed,
        delta_lr_scale=delta_lr_scale,
        callbacks=[] if overrides is None else [DeltaStatsCallback()],
        eval_strategy="steps",
        eval_steps=args.eval_every,
        disable_tqdm=False,
    )
    history = run.log_history
    curve = {0: run.eval_loss_before} | {e["step"]: e["eval_loss"] for e in history if "eval_loss" in e}
    curve[args.steps] = run.eval_loss_after
    return {
        "variant": variant,
        "seed": seed,
        "eval_loss_before": run.eval_loss_before,
        "eval_loss_after": run.eval_loss_after,
        "curve": sorted(curve.items()),
        "beta_mean": [(e["step"], e["beta_mean"]) for e in history if "beta_mean" in e],
        "beta_max": [(e["step"], e["beta_max"]) for e in history if "beta_max" in e],
        "cpu_seconds": time.process_time() - started,
    }


def analyse(runs: dict[str, list[dict]]) -> dict[str, dict]:
    base = {r["seed"]: r["eval_loss_after"] for r in runs["gpt2"]}
    table = {}
    for variant, variant_runs in runs.items():
        after = [r["eval_loss_after"] for r in variant_runs]
        row: dict[str, Any] = {"label": VARIANTS[variant][0], "seeds": [r["seed"] for r in variant_runs]}
        row["before"] = variant_runs[0]["eval_loss_before"]
        row["after"] = dict(zip(("mean", "std"), mean_std(after)))
        if variant != "gpt2":
            row["vs_gpt2"] = paired_difference(after, [base[r["seed"]] for r in variant_runs])
            row["final_beta_mean"] = mean_std([r["beta_mean"][-1][1] for r in variant_runs if r["beta_mean"]])
            row["final_beta_max"] = mean_std([r["beta_max"][-1][1] for r in variant_runs if r["beta_max"]])
        table[variant] = row
    return table


def markdown(results: dict) -> str:
    b = results["budget"]
    lines = [
        "# Fine-tuning a converted model: GPT-2 vs DeltaGPT",
        "",
        f"Base: {results['base']} ({results['base_params']:,} parameters). Fine-tuning: {b['steps']} steps x "
        f"{b['batch_size']} x {b['block_size']} tokens of {b['train_text']} ({b['train_tokens']:,} tokens), AdamW lr "
        f"{b['learning_rate']:g} (cosine, 10% warm-up); eval on {b['eval_text']} ({b['eval_tokens']:,} tokens); "
        f"seeds {results['seeds']}.",
        "",
        "Δ = variant − GPT-2 at the same seed (same batches), mean and 95% t-interval; negative = better than GPT-2.",
        "",
        "| variant | eval loss before | after (mean ± std) | Δ vs GPT-2 [95% CI] | | β mean / max at the end |",
        "|---|---|---|---|---|---|",
    ]
    for row in results["analysis"].values():
        after = f"{row['after']['mean']:.4f} ± {row['after']['std']:.4f}"
        if "vs_gpt2" not in row:
            lines.append(f"| {row['label']} | {row['before']:.4f} | {after} | | | |")
            continue
        beta = f"{row['final_beta_mean'][0]:.3f} / {row['final_beta_max'][0]:.3f}"
        lines.append(
            f"| {row['label']} | {row['before']:.4f} | {after} | {fmt_ci(row['vs_gpt2'])} | "
            f"{verdict(row['vs_gpt2'])} | {beta} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    import numpy as np

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2))
    for variant, runs in results["runs"].items():
        steps = np.array([s for s, _ in runs[0]["curve"]])
        losses = np.array([[v for _, v in r["curve"]] for r in runs])
        style = dict(lw=2.2, color="black") if variant == "gpt2" else dict(lw=1.2)
        (line,) = ax.plot(steps, losses.mean(0), label=VARIANTS[variant][0], **style)
        ax.fill_between(steps, losses.min(0), losses.max(0), color=line.get_color(), alpha=0.15)
        if runs[0]["beta_mean"]:
            beta_steps = [s for s, _ in runs[0]["beta_mean"]]
            betas = np.array([[v for _, v in r["beta_mean"]] for r in runs])
            bx.plot(beta_steps, betas.mean(0), color=line.get_color(), label=VARIANTS[variant][0])
    ax.set(xlabel="step", ylabel="eval loss (held-out play)", title="Eval loss (mean, band = seed range)")
    ax.legend(fontsize=7)
    bx.set(xlabel="step", ylabel="mean β over training batches", title="β over fine-tuning")
    bx.legend(fontsize=7)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = Path(args.output_dir)
    if args.from_json:  # re-render the table and plot of an earlier run, without training
        results = json.loads(Path(args.from_json).read_text())
        write_results(out, args.name, results, markdown(results))
        plot(results, out / f"{args.name}.png")
        return results
    import torch

    torch.set_num_threads(args.threads)
    prov = provenance(None if argv is None else [__file__, *argv])
    from ddl_hf.corpus import lm_datasets

    start = time.time()
    base_name = args.base or default_base(args.pretrain_set)
    base, tokenizer = load_base(base_name)
    block_size = min(args.block_size, base.config.n_positions)
    data = lm_datasets(
        tokenizer, block_size, max_train_blocks=args.steps * args.batch_size, max_eval_blocks=args.eval_blocks
    )
    results: dict[str, Any] = {
        "provenance": prov,
        "base": str(args.base)
        if args.base
        else "bench_pretrain.py's GPT-2 baseline, seed 0"
        + (f" (--set {' '.join(args.pretrain_set)})" * bool(args.pretrain_set)),
        "base_params": sum(p.numel() for p in base.parameters()),
        "budget": {
            "steps": args.steps,
            "batch_size": args.batch_size,
            "block_size": block_size,
            "learning_rate": args.lr,
            "train_text": "four Shakespeare comedies",
            "train_tokens": len(data["train"]) * block_size,
            "eval_text": "A Midsummer Night's Dream",
            "eval_tokens": len(data["eval"]) * block_size,
        },
        "seeds": args.seeds,
        "runs": {},
    }
    with tempfile.TemporaryDirectory() as scratch:
        for variant in args.variants:
            results["runs"][variant] = []
            for seed in args.seeds:
                print(f"== {VARIANTS[variant][0]}, seed {seed}", flush=True)
                run = one_run(base, data, variant, seed, args, Path(scratch))
                results["runs"][variant].append(run)
                print(f"   eval loss {run['eval_loss_before']:.4f} -> {run['eval_loss_after']:.4f}", flush=True)
    results["analysis"] = analyse(results["runs"])
    results["wall_seconds"] = round(time.time() - start, 1)
    write_results(out, args.name, results, markdown(results))
    plot(results, out / f"{args.name}.png")
    print(markdown(results))
    return results


if __name__ == "__main__":
    main()
