"""Study 2: does the Delta residual's difference to its baseline move with model size?

The authors' configuration (the Llama-style backbone of their code, their initialisation of backbone and Delta
parameters, the reference preset of each variant) trained from scratch at three widths, each with as many training
tokens as parameters (at least `MIN_STEPS` steps) and at most two passes over the bundled corpus:

    python -m ddl_lab.studies.bench_pretrain_scaling      # the study (about 1.5 h on 2 cores; resumes where it stopped)
    python -m ddl_lab.studies.bench_pretrain_scaling --quick   # the same pipeline on toy sizes (a few minutes)
    python -m ddl_lab.studies.bench_pretrain_scaling --report-only   # the report from the runs finished so far

Every run is one `bench_pretrain.py` worker (same harness, data, statistics and per-run cache as the first study;
a run is written only once complete, so a killed study redoes it and never counts half of it). At the middle width
every row is also trained at two more learning rates (seed 0) and, where another is better, its remaining seeds
there; the same rows on GPT-2's backbone give continuity with the first study.

Writes `ddl_lab/studies/results/pretrain_scaling.{json,md,png}` and the study's table in `docs/studies.md`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time
from pathlib import Path
from typing import Any

from ddl_lab.common import provenance, pyplot, save_figure, study_parser, study_plan, write_results
from ddl_lab.studies import bench_pretrain as bp

RESULTS = bp.RESULTS
STUDIES = Path(__file__).resolve().parents[2] / "docs" / "studies.md"
STUDIES_BEGIN, STUDIES_END = "<!-- pretrain_scaling:begin -->", "<!-- pretrain_scaling:end -->"

#: The study's rows (bench_pretrain.VARIANTS names): the baseline, the authors' d_v = 1 / d_v = 4 TC / d_v = 4 CC,
#: our conversion mode built from scratch, and the baseline reading through a learnable token convolution with every
#: gate shut (identity start: the averaging start stalls with shut gates, docs/variants.md).
ROWS = ("gpt2", "ref_dv1", "ref_dv4_tc", "ref_dv4_cc", "additive_dv1", "gpt2_tc_id")
SHARED_LR = 3e-3  # the first study's


@dataclasses.dataclass(frozen=True)
class Plan:
    base_preset: str  # bench_pretrain preset the sizes start from
    widths: tuple[int, ...]  # d at 4 heads; the middle one carries the learning-rate sweep and the GPT-2 rows
    seeds: tuple[int, ...]  # per width
    sweep_lrs: tuple[float, ...]  # at the middle width; contains SHARED_LR
    tokens_per_param: float
    min_steps: int
    fixed_steps: int | None = None  # quick: every size the same steps
    workers: int = 2


_FULL = Plan(
    "cpu",
    widths=(32, 80, 160),
    seeds=(3, 3, 3),
    sweep_lrs=(1.5e-3, 3e-3, 6e-3),
    tokens_per_param=1.0,
    min_steps=200,
)
PLANS = {
    "full": _FULL,
    # The same pipeline on toy sizes, every size the same steps, in this process.
    "quick": dataclasses.replace(
        _FULL, base_preset="quick", widths=(16, 24, 32), seeds=(2, 2, 2), min_steps=0, fixed_steps=16, workers=0
    ),
}


@dataclasses.dataclass(frozen=True)
class Cell:
    """One bench_pretrain study: a backbone, a width and a learning rate."""

    arch: str
    width: int
    lr: float
    steps: int
    warmup: int

    @property
    def init(self) -> str:
        return "reference" if self.arch == "llama" else "hf"

    def forward(self, plan: Plan, cache_dir: str) -> list[str]:
        """bench_pretrain's arguments for this cell (what its workers rebuild the preset from)."""
        fields = dict(n_embd=self.width, n_head=4, steps=self.steps, warmup_steps=self.warmup, learning_rate=self.lr)
        return [
            "--preset",
            plan.base_preset,
            "--arch",
            self.arch,
            "--init",
            self.init,
            "--cache-dir",
            cache_dir,
            "--set",
            *(f"{k}={v}" for k, v in fields.items()),
        ]


def baseline_params(plan: Plan, arch: str, width: int) -> int:
    """Parameters of the baseline at this width (the vocabulary of the preset's tokenizer)."""
    preset = dataclasses.replace(
        bp.PRESETS[plan.base_preset], n_embd=width, n_head=4, arch=arch, init="reference" if arch == "llama" else "hf"
    )
    return sum(p.numel() for p in bp.build_models(preset, preset.vocab_size, bp.BASELINE, 0).parameters())


def cells(plan: Plan) -> dict[tuple[str, int, float], Cell]:
    """Every (arch, width, lr) the plan trains: Llama at every width and the shared LR, the sweep at the middle
    width, GPT-2 at the middle width. Steps: tokens = `tokens_per_param` x the baseline's parameters."""
    preset = bp.PRESETS[plan.base_preset]
    tokens_per_step = preset.batch_size * preset.block_size
    middle = plan.widths[len(plan.widths) // 2]
    out = {}
    for width in plan.widths:
        steps = plan.fixed_steps or max(
            plan.min_steps, math.ceil(plan.tokens_per_param * baseline_params(plan, "llama", width) / tokens_per_step)
        )
        warmup = max(2, round(steps * preset.warmup_steps / bp.PRESETS["cpu"].steps))  # the first study's 50/900
        lrs = plan.sweep_lrs if width == middle else (SHARED_LR,)
        for lr in lrs:
            out["llama", width, lr] = Cell("llama", width, lr, steps, warmup)
        if width == middle:
            out["gpt2", width, SHARED_LR] = Cell("gpt2", width, SHARED_LR, steps, warmup)
    return out


def folder_of(plan: Plan, cell: Cell, cache_dir: str) -> Path:
    args = bp.parse_args(cell.forward(plan, cache_dir))
    return bp.cache_root(args, bp.resolve_preset(args))


def prepare(plan: Plan, cell: Cell, cache_dir: str) -> dict:
    args = bp.parse_args(cell.forward(plan, cache_dir))
    return bp.prepare_data(args, bp.resolve_preset(args))


def run_jobs(plan: Plan, jobs: list[tuple[Cell, str, int]], cache_dir: str) -> None:
    """Train the jobs not cached yet: `plan.workers` bench_pretrain worker processes, or in this process (0)."""
    if plan.workers == 0:
        for cell, variant, seed in jobs:
            if not bp.run_path(folder_of(plan, cell, cache_dir), variant, seed).exists():
                bp.main([*cell.forward(plan, cache_dir), "--worker", variant, str(seed)])
        return
    work = [(cell.forward(plan, cache_dir), folder_of(plan, cell, cache_dir), v, s) for cell, v, s in jobs]
    bp.launch(work, plan.workers, threads=1)


def best_lrs(plan: Plan, runs: dict[float, dict[str, dict[int, dict]]]) -> dict[str, float]:
    """Per row, the learning rate of the lowest seed-0 final validation loss at the middle width."""
    return {
        row: min(
            (lr for lr in plan.sweep_lrs if 0 in runs[lr].get(row, {})),
            key=lambda lr: runs[lr][row][0]["final_valid_loss"],
        )
        for row in ROWS
        if all(0 in runs[lr].get(row, {}) for lr in plan.sweep_lrs)
    }


# ---------------------------------------------------------------------------------------------------------------
# Analysis
# ---------------------------------------------------------------------------------------------------------------


def trend(small: dict, large: dict) -> dict[str, float]:
    """Change of the paired difference from the smallest to the largest width, with a Welch 95% interval (the seeds
    of different widths are independent runs)."""
    from scipy import stats

    a, b = small["per_seed"], large["per_seed"]
    if len(a) < 2 or len(b) < 2:
        return {"mean": statistics.fmean(b) - statistics.fmean(a), "ci_low": math.nan, "ci_high": math.nan}
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    dof = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1)) if se > 0 else 1.0
    mean = statistics.fmean(b) - statistics.fmean(a)
    half = stats.t.ppf(0.975, dof) * se
    return {"mean": mean, "ci_low": mean - half, "ci_high": mean + half}


def with_per_seed(difference: dict, variant: list[float], baseline: list[float]) -> dict:
    return difference | {"per_seed": [v - b for v, b in zip(variant, baseline, strict=True)]}


def analyse_study(plan: Plan, cache_dir: str, plan_cells: dict) -> dict[str, Any]:
    middle = plan.widths[len(plan.widths) // 2]
    sizes, data = {}, {}
    for (arch, width, lr), cell in plan_cells.items():
        folder = folder_of(plan, cell, cache_dir)
        if not (folder / "data" / "stats.json").exists():
            continue
        runs = {v: r for v, r in bp.load_runs(folder).items() if v in ROWS} if (folder / "runs").exists() else {}
        data[arch, width, lr] = {"runs": runs, "stats": prepare(plan, cell, cache_dir)["stats"], "cell": cell}
    by_lr = {lr: data[("llama", middle, lr)]["runs"] for lr in plan.sweep_lrs if ("llama", middle, lr) in data}
    for (arch, width, lr), entry in data.items():
        if lr != SHARED_LR or bp.BASELINE not in entry["runs"]:
            continue
        runs = {
            v: {s: r for s, r in by_seed.items() if s < plan.seeds[plan.widths.index(width)]}
            for v, by_seed in entry["runs"].items()
        }
        analysis = bp.analyse(runs, entry["stats"], arch)
        for variant, row in analysis["variants"].items():
            for key in ("equal_steps", "equal_compute"):
                if key in row:
                    paired = [s for s in row["seeds"] if s in runs[bp.BASELINE]]
                    if key == "equal_steps":
                        v = [runs[variant][s]["final_valid_loss"] for s in paired]
                        b = [runs[bp.BASELINE][s]["final_valid_loss"] for s in paired]
                    else:
                        at, last = row["equal_compute_step"], runs[variant][paired[0]]["curve"][-1][0]
                        v = [bp.loss_at_step(runs[variant][s]["curve"], at) for s in paired]
                        b = [bp.loss_at_step(runs[bp.BASELINE][s]["curve"], last) for s in paired]
                    row[key] = with_per_seed(row[key], v, b)
        sizes[f"{arch}-{width}"] = {
            "arch": arch,
            "width": width,
            "params": analysis["variants"][bp.BASELINE]["params"],
            "steps": entry["cell"].steps,
            "warmup": entry["cell"].warmup,
            "tokens": entry["cell"].steps
            * bp.PRESETS[plan.base_preset].batch_size
            * bp.PRESETS[plan.base_preset].block_size,
            "epochs": entry["stats"]["epochs"],
            "train_tokens": entry["stats"]["train_tokens"],
            "unigram": entry["stats"]["valid_unigram_entropy"],
            "variants": analysis["variants"],
        }
    trends = {}
    llama = [sizes[f"llama-{w}"] for w in plan.widths if f"llama-{w}" in sizes]
    if len(llama) >= 2:
        for variant in ROWS[1:]:
            if variant in llama[0]["variants"] and variant in llama[-1]["variants"]:
                trends[variant] = {
                    key: trend(llama[0]["variants"][variant][key], llama[-1]["variants"][variant][key])
                    for key in ("equal_steps", "equal_compute")
                }
    sweep: dict[str, Any] = {}
    if len(by_lr) == len(plan.sweep_lrs):
        best = best_lrs(plan, by_lr)
        sweep["seed0"] = {
            row: {
                str(lr): by_lr[lr][row][0]["final_valid_loss"] for lr in plan.sweep_lrs if 0 in by_lr[lr].get(row, {})
            }
            for row in ROWS
        }
        sweep["best_lr"] = {row: lr for row, lr in best.items()}
        seeds = range(plan.seeds[plan.widths.index(middle)])
        if bp.BASELINE in best:
            base_runs = by_lr[best[bp.BASELINE]].get(bp.BASELINE, {})
            rows = {}
            for row, lr in best.items():
                mine = by_lr[lr].get(row, {})
                finals = [mine[s]["final_valid_loss"] for s in seeds if s in mine]
                entry: dict[str, Any] = {"lr": lr, "seeds": [s for s in seeds if s in mine]}
                if finals:
                    entry["final"] = dict(zip(("mean", "std"), bp.mean_std(finals)))
                paired = [s for s in seeds if s in mine and s in base_runs]
                if row != bp.BASELINE and len(paired) >= 2:
                    v = [mine[s]["final_valid_loss"] for s in paired]
                    b = [base_runs[s]["final_valid_loss"] for s in paired]
                    entry["equal_steps"] = with_per_seed(bp.paired_difference(v, b), v, b)
                rows[row] = entry
            sweep["at_best"] = rows
    return {"sizes": sizes, "trends": trends, "sweep": sweep, "middle": middle}


# ---------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------


def fmt(d: dict | None) -> str:
    return "" if d is None else bp.fmt_ci(d)


def size_table(analysis: dict, arch: str) -> list[str]:
    """Rows x widths: Δ at equal steps and at equal compute, with the step cost."""
    keys = [k for k, s in analysis["sizes"].items() if s["arch"] == arch]
    head = " | ".join(f"d={analysis['sizes'][k]['width']} ({analysis['sizes'][k]['params'] / 1e6:.2f}M)" for k in keys)
    lines = [f"| variant | {head} |", "|---|" + "---|" * len(keys)]
    for variant in ROWS:
        cells_ = []
        for k in keys:
            row = analysis["sizes"][k]["variants"].get(variant)
            if row is None:
                cells_.append("")
            elif variant == bp.BASELINE:
                cells_.append(f"{row['final']['mean']:.3f} ± {row['final']['std']:.3f} (n={len(row['seeds'])})")
            else:
                cells_.append(
                    f"{fmt(row['equal_steps'])} · {row['cost_ratio']:.2f}× · {fmt(row['equal_compute'])} "
                    f"(n={len(row['seeds'])})"
                )
        label = bp.label(variant, arch)
        lines.append(f"| {label} | " + " | ".join(cells_) + " |")
    return lines


def markdown(results: dict) -> str:
    a, plan = results["analysis"], results["plan"]
    base = bp.BASE_NAMES["llama"]
    lines = ["# Study 2: the authors' configuration at three widths", ""]
    if results["runs_done"] < results["runs_planned"]:
        lines += [f"**Partial results: {results['runs_done']} of {results['runs_planned']} planned runs.**", ""]
    sizes = [s for s in a["sizes"].values() if s["arch"] == "llama"]
    lines += [
        f"{base} backbone (RoPE θ 10,000, RMSNorm ε 1e-5, SwiGLU of width ⌊8d/3⌋, QK-norm, tied embeddings: "
        "transformers' Qwen3 layer) with the authors' initialisation of backbone and Delta parameters "
        "(`--arch llama --init reference`), 4 layers, 4 heads, context 128, a 512-token BPE of five Austen novels, "
        "validation on a sixth (65,536 tokens); batches of 8 × 128 tokens, AdamW, cosine schedule, weight decay 0.1, "
        f"no dropout; learning rate {SHARED_LR:g} unless said. Each Delta row is its reference preset "
        "(`DeltaLlamaConfig.reference`): paper mode, v = 4σ(W_v r + b), β starting around 1, their init.",
        "",
        "| width | params (baseline) | steps (warm-up) | training tokens | passes over the corpus | seeds |",
        "|---|---|---|---|---|---|",
    ]
    for s in sizes:
        seeds = len(s["variants"][bp.BASELINE]["seeds"])
        lines.append(
            f"| d = {s['width']} | {s['params']:,} | {s['steps']} ({s['warmup']}) | {s['tokens']:,} "
            f"({s['tokens'] / s['params']:.1f} per parameter) | {s['epochs']:.2f} | {seeds} |"
        )
    lines += [
        "",
        f"Cells: Δ = variant − {base} per seed (same data order, same initial backbone weights), mean and 95% "
        "t-interval, at **equal steps** · the variant's **step cost** (training CPU time per step / the baseline's, "
        "measured in the runs, two runs side by side) · at **equal compute** (the variant's curve where it has spent "
        "the baseline's time). Negative = lower validation loss than the baseline. Baseline row: its final loss.",
        "",
        "## Δ by width (the authors' backbone and init)",
        "",
        *size_table(a, "llama"),
        "",
        "## The trend: Δ at the largest width − Δ at the smallest",
        "",
        "Welch 95% interval (the widths are independent runs); negative = the Delta row gains on the baseline as "
        "the models grow.",
        "",
        "| variant | equal steps | | equal compute | |",
        "|---|---|---|---|---|",
    ]
    for variant, t in a["trends"].items():
        es, ec = t["equal_steps"], t["equal_compute"]
        lines.append(
            f"| {bp.label(variant, 'llama')} | {trend_fmt(es)} | {trend_verdict(es)} | {trend_fmt(ec)} | "
            f"{trend_verdict(ec)} |"
        )
    sweep = a.get("sweep") or {}
    if sweep:
        lrs = plan["sweep_lrs"]
        lines += [
            "",
            f"## Learning rates (d = {a['middle']})",
            "",
            "Final validation loss of seed 0 at each learning rate; the best one (bold) then gets the remaining seeds.",
            "",
            "| variant | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |",
            "|---|" + "---|" * len(lrs),
        ]
        for row, by in sweep["seed0"].items():
            best = sweep["best_lr"].get(row)
            cells_ = [
                ("**{:.4f}**" if lr == best else "{:.4f}").format(by[str(lr)]) if str(lr) in by else "" for lr in lrs
            ]
            lines.append(f"| {bp.label(row, 'llama')} | " + " | ".join(cells_) + " |")
        at_best = sweep.get("at_best", {})
        if at_best:
            shared = a["sizes"].get(f"llama-{a['middle']}", {}).get("variants", {})
            lines += [
                "",
                "Each row at its own best learning rate against the baseline at its own best "
                f"({at_best.get(bp.BASELINE, {}).get('lr', math.nan):g}), equal steps, and at the shared "
                f"{SHARED_LR:g}:",
                "",
                "| variant | best lr | seeds | Δ at the best lrs [95% CI] | Δ at the shared lr [95% CI] |",
                "|---|---|---|---|---|",
            ]
            for row, entry in at_best.items():
                if row == bp.BASELINE:
                    continue
                lines.append(
                    f"| {bp.label(row, 'llama')} | {entry['lr']:g} | {len(entry.get('seeds', []))} | "
                    f"{fmt(entry.get('equal_steps'))} | {fmt(shared.get(row, {}).get('equal_steps'))} |"
                )
    if any(s["arch"] == "gpt2" for s in a["sizes"].values()):
        lines += [
            "",
            f"## The same rows on GPT-2's backbone (d = {a['middle']}, transformers' init; continuity with the first "
            "study)",
            "",
            *size_table(a, "gpt2"),
        ]
    lines += [
        "",
        "## β regimes of the trained models",
        "",
        "Share of validation tokens with β < 0.5 (keep) / 0.5–1.5 (project) / > 1.5 (reflect) per Delta residual "
        "(L = layer), averaged over seeds, at each width (shared learning rate).",
        "",
    ]
    for variant in ROWS[1:]:
        if variant == "gpt2_tc_id":
            continue  # gates shut: beta is 0 everywhere
        per = [(s["width"], s["variants"][variant]["beta_regimes"]) for s in sizes if variant in s["variants"]]
        if not per:
            continue
        lines += [
            f"**{bp.label(variant, 'llama')}**",
            "",
            "| residual | " + " | ".join(f"d={w}" for w, _ in per) + " |",
            "|---|" + "---|" * len(per),
        ]
        for residual in per[0][1]:
            lines.append(
                f"| {residual} | "
                + " | ".join(
                    f"{r[residual]['keep']:.2f} / {r[residual]['project']:.2f} / {r[residual]['reflect']:.2f}"
                    for _, r in per
                )
                + " |"
            )
        lines.append("")
    lines += [f"Wall time of this invocation: {results['wall_seconds'] / 60:.1f} min ({plan['workers']} worker(s))."]
    return "\n".join(lines) + "\n"


def trend_fmt(t: dict) -> str:
    return bp.fmt_ci(t, digits=3)


def trend_verdict(t: dict) -> str:
    return bp.verdict(t, ("gains with size", "loses with size", "no resolved trend"))


def studies_table(results: dict) -> str:
    """The summary in docs/studies.md: Δ vs the baseline at each width, equal steps and equal compute, and the trend."""
    a = results["analysis"]
    sizes = [s for s in a["sizes"].values() if s["arch"] == "llama"]
    head = " | ".join(f"d = {s['width']} ({s['params'] / 1e6:.2f}M)" for s in sizes)
    lines = [
        f"| variant, Δ equal steps / equal compute | {head} | trend (largest − smallest), equal steps |",
        "|---|" + "---|" * (len(sizes) + 1),
    ]
    for variant in ROWS[1:]:
        cells_ = []
        for s in sizes:
            row = s["variants"].get(variant)
            cells_.append("" if row is None else f"{fmt(row['equal_steps'])} / {fmt(row['equal_compute'])}")
        t = a["trends"].get(variant, {}).get("equal_steps")
        cells_.append("" if t is None else f"{trend_fmt(t)} ({trend_verdict(t)})")
        lines.append(f"| {bp.label(variant, 'llama')} | " + " | ".join(cells_) + " |")
    base = " · ".join(f"d = {s['width']}: {s['variants'][bp.BASELINE]['final']['mean']:.3f}" for s in sizes)
    prov = results["provenance"]
    return "\n".join(
        [
            STUDIES_BEGIN,
            f"<!-- written by ddl_lab/studies/bench_pretrain_scaling.py at commit {prov['git']['commit'][:7]}; "
            "edit the script, not this block -->",
            "",
            f"Baseline ({bp.BASE_NAMES['llama']}) final validation loss: {base}.",
            "",
            *lines,
            "",
            STUDIES_END,
        ]
    )


def update_studies(results: dict, path: Path = STUDIES) -> None:
    text = path.read_text()
    if STUDIES_BEGIN not in text or STUDIES_END not in text:
        raise SystemExit(f"bench_pretrain_scaling: {path} has no {STUDIES_BEGIN} ... {STUDIES_END} block to regenerate")
    start, end = text.index(STUDIES_BEGIN), text.index(STUDIES_END) + len(STUDIES_END)
    path.write_text(text[:start] + studies_table(results) + text[end:])


def plot(results: dict, path: Path) -> None:
    plt = pyplot()

    a = results["analysis"]
    sizes = [s for s in a["sizes"].values() if s["arch"] == "llama"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    for ax, key, title in ((axes[0], "equal_steps", "equal steps"), (axes[1], "equal_compute", "equal compute")):
        for i, variant in enumerate(ROWS[1:]):
            points = [(s["params"], s["variants"][variant][key]) for s in sizes if variant in s["variants"]]
            if not points:
                continue
            x = [p * 1.04 ** (i - 2) for p, _ in points]  # spread the markers of one width apart
            y = [d["mean"] for _, d in points]
            low = [d["mean"] - d["ci_low"] if not math.isnan(d["ci_low"]) else 0 for _, d in points]
            high = [d["ci_high"] - d["mean"] if not math.isnan(d["ci_high"]) else 0 for _, d in points]
            ls = "--" if variant == "gpt2_tc_id" else "-"
            ax.errorbar(x, y, yerr=[low, high], fmt="o" + ls, capsize=3, label=bp.label(variant, "llama"))
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xscale("log")
        ax.set(
            xlabel="parameters (baseline)",
            ylabel=f"Δ validation loss vs {bp.BASE_NAMES['llama']} (95% CI)",
            title=f"Paired difference at {title}",
        )
        ax.legend(fontsize=7)
    sweep = a.get("sweep") or {}
    ax = axes[2]
    for row, by in sweep.get("seed0", {}).items():
        lrs = sorted(float(lr) for lr in by)
        ax.plot(
            lrs,
            [by[str(lr)] for lr in lrs],
            "o-",
            label=bp.label(row, "llama"),
            lw=2.2 if row == bp.BASELINE else 1.2,
            color="black" if row == bp.BASELINE else None,
        )
    ax.set_xscale("log")
    ax.set(
        xlabel="learning rate", ylabel="final validation loss (seed 0)", title=f"Learning rates at d = {a['middle']}"
    )
    if sweep:
        ax.legend(fontsize=7)
    save_figure(fig, path)


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = study_parser(__doc__, "toy sizes and steps: the pipeline in a few minutes", RESULTS)
    parser.add_argument("--no-docs", action="store_true", help="do not regenerate the table in docs/studies.md")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    plan = study_plan(PLANS, args)
    from ddl_hf.training import default_cache_dir

    cache_dir = args.cache_dir or str(default_cache_dir() / "pretrain")
    import torch

    torch.set_num_threads(1)

    prov = provenance(None if argv is None else [__file__, *argv])
    started = time.time()
    plan_cells = cells(plan)
    middle = plan.widths[len(plan.widths) // 2]
    for cell in plan_cells.values():  # data once per cell, before the workers; refuse a third pass over the corpus
        stats = prepare(plan, cell, cache_dir)["stats"]
        if stats["epochs"] > 2.0 + 1e-9:
            raise SystemExit(
                f"bench_pretrain_scaling: d={cell.width} needs {stats['epochs']:.2f} passes over the "
                "corpus (at most 2): grow the corpus or lower tokens_per_param"
            )
    # The longest runs first, so that two workers finish together; seeds outermost within a width.
    first = []
    for width, seeds in sorted(zip(plan.widths, plan.seeds, strict=True), reverse=True):
        for seed in range(seeds):
            for (_, w, lr), cell in plan_cells.items():
                if w != width:
                    continue
                if lr == SHARED_LR or seed == 0:  # other learning rates: seed 0 picks the best
                    first += [(cell, variant, seed) for variant in ROWS]
    if not args.report_only:
        run_jobs(plan, first, cache_dir)
    # Each row's remaining seeds at its best learning rate, where that is not the shared one.
    by_lr = {
        lr: {v: r for v, r in bp.load_runs(folder_of(plan, plan_cells["llama", middle, lr], cache_dir)).items()}
        for lr in plan.sweep_lrs
    }
    best = best_lrs(plan, by_lr)
    extra = [
        (plan_cells["llama", middle, lr], row, seed)
        for row, lr in best.items()
        if lr != SHARED_LR
        for seed in range(1, plan.seeds[plan.widths.index(middle)])
    ]
    if not args.report_only:
        run_jobs(plan, extra, cache_dir)
    planned = len(first) + len(extra)
    done = sum(
        bp.run_path(folder_of(plan, cell, cache_dir), variant, seed).exists() for cell, variant, seed in first + extra
    )
    results = {
        "provenance": prov,
        "plan": dataclasses.asdict(plan),
        "rows": list(ROWS),
        "runs_planned": planned,
        "runs_done": done,
        "wall_seconds": time.time() - started,
        "analysis": analyse_study(plan, cache_dir, plan_cells),
    }
    name = "pretrain_scaling_quick" if args.quick else "pretrain_scaling"
    out = Path(args.output_dir)
    report = markdown(results)
    write_results(out, name, results, report)
    plot(results, out / f"{name}.png")
    if not args.quick and not args.no_docs and out.resolve() == RESULTS.resolve():
        update_studies(results)
    print(report)
    return results


if __name__ == "__main__":
    main()
