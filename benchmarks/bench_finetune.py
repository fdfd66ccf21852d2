"""Eval loss after the same fine-tuning budget: GPT-2 vs DeltaGPT (additive, d_v = 1 and 4), 3 seeds.

    python benchmarks/bench_finetune.py                 # default base (the demo's cached small GPT-2), ~10 min
    python benchmarks/bench_finetune.py --base gpt2     # any GPT-2 Hub id / directory (online)

Every variant starts from the same base GPT-2 (DeltaGPT is converted from it, beta = 0, so all variants start
from the same function), is fine-tuned with `DeltaTrainer` on the same Shakespeare batches for the same number of
steps at the same learning rate, and is evaluated on a held-out play. Writes `results/finetune.{json,md,png}`.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import atomic_path, provenance, write_json, write_markdown
from transformers import set_seed

import ddl_hf
from ddl_hf.corpus import lm_datasets
from ddl_hf.training import BaseSpec, base_gpt2, finetune

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = {
    "gpt2": {},
    "delta_dv1": {"delta_value_channels": 1},
    "delta_dv4": {"delta_value_channels": 4},
}
LABELS = {"gpt2": "GPT-2", "delta_dv1": "DeltaGPT additive d_v=1", "delta_dv4": "DeltaGPT additive d_v=4"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default=None, help="GPT-2 Hub id or directory (default: the demo's small GPT-2)")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--delta-lr-scale", type=float, default=1.0, help="lr multiplier of the Delta parameters")
    parser.add_argument("--eval-blocks", type=int, default=24)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--output-dir", default=str(RESULTS))
    parser.add_argument("--name", default="finetune", help="stem of the result files")
    parser.add_argument("--base-spec", default=None, help="JSON BaseSpec overrides for the default base")
    parser.add_argument("--from-json", default=None, help="only re-render the report of an earlier results JSON")
    return parser.parse_args(argv)


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    names = list(results["variants"])
    for i, name in enumerate(names):
        losses = [run["eval_loss_after"] for run in results["variants"][name]["runs"]]
        mean, std = mean_std(losses)
        ax.bar(i, mean, yerr=std, capsize=6, color=f"C{i}", alpha=0.75)
        ax.scatter([i] * len(losses), losses, color="k", s=12, zorder=3)
    before = results["variants"][names[0]]["runs"][0]["eval_loss_before"]
    ax.axhline(before, color="gray", linestyle=":", label=f"before fine-tuning ({before:.3f})")
    ax.set_xticks(range(len(names)), [LABELS[n] for n in names], fontsize=8)
    all_losses = [r["eval_loss_after"] for n in names for r in results["variants"][n]["runs"]]
    low, high = min(all_losses), max(max(all_losses), before)
    ax.set_ylim(low - 0.15 * (high - low + 1e-3), high + 0.1 * (high - low + 1e-3))
    ax.set_ylabel("eval loss (held-out play)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def write_report(results: dict, out: Path, name: str) -> None:
    """Markdown table (mean ± std, per seed, paired difference to GPT-2 at the same seed) and the plot."""
    b = results["budget"]
    seeds = results["seeds"]
    lines = [
        f"Base: {results['base']} ({results['base_params'] / 1e6:.1f}M parameters). Budget: {b['steps']} steps x "
        f"{b['batch_size']} x {b['block_size']} tokens, lr {b['learning_rate']} (Delta parameters x"
        f"{b['delta_lr_scale']}), {b['scheduler']}; eval on {b['eval_text']}; seeds {seeds}.",
        "",
        "| model | eval loss after (mean ± std) | eval perplexity after | per seed | paired diff. vs GPT-2 (mean) |",
        "|---|---|---|---|---|",
    ]
    reference = results["variants"].get("gpt2")
    for v in results["variants"].values():
        per_seed = ", ".join(f"{r['eval_loss_after']:.4f}" for r in v["runs"])
        paired = "—"
        if reference is not None and v is not reference:
            diffs = [r["eval_loss_after"] - g["eval_loss_after"] for r, g in zip(v["runs"], reference["runs"])]
            paired = f"{statistics.fmean(diffs):+.4f} ({', '.join(f'{d:+.4f}' for d in diffs)})"
        lines.append(
            f"| {v['label']} | {v['mean']:.4f} ± {v['std']:.4f} | {math.exp(v['mean']):.2f} | {per_seed} | {paired} |"
        )
    first = next(iter(results["variants"].values()))["runs"][0]
    lines += ["", f"Eval loss before fine-tuning (all variants, same function): {first['eval_loss_before']:.4f}."]
    write_markdown(out / f"{name}.md", "\n".join(lines) + "\n", results.get("provenance"))
    plot(results, out / f"{name}.png", f"eval loss after {b['steps']} fine-tuning steps, {len(seeds)} seeds")
    print("\n".join(lines))
    print(f"\nwritten to {out}/{name}.{{json,md,png}} in {results['wall_seconds']:.0f} s")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.from_json:  # re-render the table and plot of an earlier run, without training
        path = Path(args.from_json)
        results = json.loads(path.read_text())
        write_report(results, path.parent, path.stem)
        return results
    start = time.time()
    prov = provenance(None if argv is None else [__file__, *argv])
    spec = BaseSpec(**json.loads(args.base_spec)) if args.base_spec else BaseSpec()
    gpt2, tokenizer, origin = base_gpt2(args.base, cache_dir=args.cache_dir, spec=spec)
    block_size = min(spec.block_size, gpt2.config.n_positions)
    data = lm_datasets(
        tokenizer,
        block_size,
        max_train_blocks=args.steps * args.batch_size,
        max_eval_blocks=args.eval_blocks,
    )
    results: dict = {
        "provenance": prov,
        "base": origin,
        "base_params": sum(p.numel() for p in gpt2.parameters()),
        "budget": {
            "steps": args.steps,
            "batch_size": args.batch_size,
            "block_size": block_size,
            "learning_rate": args.lr,
            "delta_lr_scale": args.delta_lr_scale,
            "scheduler": "cosine, 10% warmup",
            "train_text": "shakespeare-train",
            "eval_text": f"shakespeare-eval ({len(data['eval'])} blocks)",
        },
        "seeds": args.seeds,
        "variants": {},
    }
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.variants:
            runs = []
            for seed in args.seeds:
                print(f"== {LABELS[name]}, seed {seed}", flush=True)
                set_seed(seed)  # also seeds the random init of the new Delta parameters
                model = copy.deepcopy(gpt2) if name == "gpt2" else ddl_hf.convert_gpt2(gpt2, **VARIANTS[name])
                run_start = time.time()
                run = finetune(
                    model.train(),
                    data["train"],
                    data["eval"],
                    Path(scratch) / f"{name}-{seed}",
                    steps=args.steps,
                    learning_rate=args.lr,
                    batch_size=args.batch_size,
                    seed=seed,
                    delta_lr_scale=args.delta_lr_scale if name != "gpt2" else 1.0,
                    disable_tqdm=False,
                )
                betas = {}
                if name != "gpt2":
                    with torch.no_grad():
                        ids = torch.tensor(data["eval"]["input_ids"][:4])
                        out = model.eval()(ids, output_betas=True)
                        betas = {"mean_beta_per_block": [round(float(b.mean()), 4) for b in out.betas]}
                runs.append(
                    {
                        "seed": seed,
                        "eval_loss_before": run.eval_loss_before,
                        "eval_loss_after": run.eval_loss_after,
                        "perplexity_after": math.exp(run.eval_loss_after),
                        "seconds": round(time.time() - run_start, 1),
                        **betas,
                    }
                )
                print(f"   eval loss {run.eval_loss_before:.4f} -> {run.eval_loss_after:.4f}", flush=True)
            after = [r["eval_loss_after"] for r in runs]
            mean, std = mean_std(after)
            results["variants"][name] = {"label": LABELS[name], "mean": mean, "std": std, "runs": runs}
    results["wall_seconds"] = round(time.time() - start, 1)

    out = Path(args.output_dir)
    write_json(out / f"{args.name}.json", results)
    write_report(results, out, args.name)
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
