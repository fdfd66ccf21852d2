"""Study 3: does erasing help with capacity held equal, and does each Delta row beat its baseline at its own best rate?

Study 2's recipe (the Llama-style backbone, the authors' init and reference presets, tokens = parameters) at its
largest width, d = 160. Rows: the baseline, reference d_v = 1 and d_v = 4 CC, and each one's write-only twin (the
same state, read, compressor and value; only the erase term `- k^T X` removed, `delta_erase=False`); `--tc` adds
d_v = 4 TC and its twin. Each row trains at its own learning rate, chosen on selection seeds that never count in the
comparison; the comparison seeds (disjoint, asserted) then run at the chosen rates:

    python -m ddl_lab.studies.bench_pretrain_controls         # the study (resumes where it stopped; prints an estimate)
    python -m ddl_lab.studies.bench_pretrain_controls --quick   # the same pipeline on toy sizes (about a minute)
    python -m ddl_lab.studies.bench_pretrain_controls --report-only   # the report from the runs finished so far

Every run is one `bench_pretrain.py` worker in study 2's cells and cache (a run at study 2's width, rate and seed is
the same run and is reused; a killed run is redone). Paired differences with 95% t-intervals at equal steps and at
equal compute (the dearer run's curve where it has spent the cheaper one's training time, step costs measured in the
same runs). Writes `ddl_lab/studies/results/pretrain_controls.{json,md,png}`.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import math
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ddl_lab.common import provenance, pyplot, save_figure, study_parser, study_plan, write_results
from ddl_lab.studies import bench_pretrain as bp
from ddl_lab.studies import bench_pretrain_scaling as scaling

RESULTS = bp.RESULTS
SCALING_RESULTS = RESULTS / "pretrain_scaling.json"

#: The write-only twins: a reference preset with the erase term removed (bench_pretrain.VARIANTS entries).
WRITE_ONLY = {
    "ref_dv1_write_only": ("reference d_v=1 write-only", dict(reference="dv1", delta_erase=False)),
    "ref_dv4_cc_write_only": ("reference d_v=4 CC write-only", dict(reference="cc", delta_erase=False)),
    "ref_dv4_tc_write_only": ("reference d_v=4 TC write-only", dict(reference="tc", delta_erase=False)),
}
TWIN = {"ref_dv1": "ref_dv1_write_only", "ref_dv4_cc": "ref_dv4_cc_write_only", "ref_dv4_tc": "ref_dv4_tc_write_only"}
ROWS = (bp.BASELINE, "ref_dv1", "ref_dv1_write_only", "ref_dv4_cc", "ref_dv4_cc_write_only")
TC_ROWS = ("ref_dv4_tc", "ref_dv4_tc_write_only")
EDGE_NOTE = "at the edge of the grid"


def register_variants() -> None:
    """Add the write-only twins to bench_pretrain's variants (in this process and in its workers, `worker_main`).

    `bench_pretrain.build_models` hands a reference preset only its `reference` name, so a twin is built as its
    preset and its erase term switched off afterwards (the only thing `delta_erase` sets, `DeltaResidual.erase`).
    """
    for name, spec in WRITE_ONLY.items():
        bp.VARIANTS.setdefault(name, spec)
    if getattr(bp.build_models, "_controls", False):
        return
    build = bp.build_models

    def build_models(preset, vocab_size, variant, seed):
        model = build(preset, vocab_size, variant, seed)
        if variant in WRITE_ONLY and model.config.delta_erase:
            model.config.delta_erase = False
            for block in model.delta_residuals().values():
                block.erase = False
        return model

    build_models._controls = True
    bp.build_models = build_models


@contextmanager
def workers_run_this_script():
    """bench_pretrain's worker processes start this module (so that they know the twins), then run as its workers."""
    module, bp.WORKER_MODULE = bp.WORKER_MODULE, "ddl_lab.studies.bench_pretrain_controls"
    try:
        yield
    finally:
        bp.WORKER_MODULE = module


@dataclasses.dataclass(frozen=True)
class Plan:
    base_preset: str  # bench_pretrain preset the sizes start from
    widths: tuple[int, ...]  # d at 4 heads
    lrs: tuple[float, ...]  # the selection grid
    selection_seeds: tuple[int, ...]  # pick each row's rate; never in the comparison
    comparison_seeds: tuple[int, ...]
    tokens_per_param: float
    min_steps: int
    fixed_steps: int | None = None
    workers: int = 2

    def __post_init__(self) -> None:
        if set(self.selection_seeds) & set(self.comparison_seeds):
            raise ValueError(f"selection seeds {self.selection_seeds} overlap comparison seeds {self.comparison_seeds}")

    def recipe(self, width: int) -> scaling.Plan:
        """Study 2's plan at one width (its cells, data and workers)."""
        return scaling.Plan(
            self.base_preset,
            widths=(width,),
            seeds=(len(self.comparison_seeds),),
            sweep_lrs=self.lrs,
            tokens_per_param=self.tokens_per_param,
            min_steps=self.min_steps,
            fixed_steps=self.fixed_steps,
            workers=self.workers,
        )


PLANS = {
    # Study 2's d = 80 sweep put the baseline's best at its lowest rate, the Delta rows' at its highest: a wider grid.
    "full": Plan(
        "cpu",
        widths=(160,),
        lrs=(7.5e-4, 1.5e-3, 3e-3, 6e-3, 1.2e-2),
        selection_seeds=(100, 101),
        comparison_seeds=(0, 1, 2, 3, 4),  # 0-2 at 3e-3 are study 2's own runs where a row picks 3e-3
        tokens_per_param=1.0,
        min_steps=200,
    ),
    "quick": Plan(
        "quick",
        widths=(16,),
        lrs=(3e-3, 6e-3),
        selection_seeds=(100,),
        comparison_seeds=(0, 1),
        tokens_per_param=1.0,
        min_steps=0,
        fixed_steps=20,  # one curve point at the preset's eval_every
        workers=0,
    ),
}


def cells(plan: Plan, width: int) -> dict[float, scaling.Cell]:
    """{lr: study 2's Llama cell at this width and rate}."""
    return {lr: c for (arch, _, lr), c in scaling.cells(plan.recipe(width)).items() if arch == "llama"}


def done(plan: Plan, cell: scaling.Cell, cache_dir: str, row: str, seed: int) -> bool:
    return bp.run_path(scaling.folder_of(plan.recipe(cell.width), cell, cache_dir), row, seed).exists()


def load(plan: Plan, cell: scaling.Cell, cache_dir: str) -> dict[str, dict[int, dict]]:
    folder = scaling.folder_of(plan.recipe(cell.width), cell, cache_dir)
    return bp.load_runs(folder) if (folder / "runs").exists() else {}


def choose_lrs(plan: Plan, selection: dict[str, dict[float, list[float]]]) -> dict[str, float]:
    """Per row, the rate of the lowest mean final validation loss over the selection seeds (complete rows only)."""
    return {
        row: min(by_lr, key=lambda lr: statistics.fmean(by_lr[lr]))
        for row, by_lr in selection.items()
        if len(by_lr) == len(plan.lrs) and all(len(v) == len(plan.selection_seeds) for v in by_lr.values())
    }


def selection_losses(plan: Plan, rows: tuple[str, ...], runs: dict[float, dict]) -> dict[str, dict[float, list[float]]]:
    out: dict[str, dict[float, list[float]]] = {}
    for row in rows:
        for lr in plan.lrs:
            mine = runs[lr].get(row, {})
            finals = [mine[s]["final_valid_loss"] for s in plan.selection_seeds if s in mine]
            if finals:
                out.setdefault(row, {})[lr] = finals
    return out


# ---------------------------------------------------------------------------------------------------------------
# Estimate
# ---------------------------------------------------------------------------------------------------------------

STARTUP_SECONDS = 15.0  # a worker's imports, data loading and first evaluation


def step_costs(width: int, params: int, path: Path = SCALING_RESULTS) -> dict[str, float]:
    """Study 2's training CPU seconds per step per row (two runs side by side), at `width` or scaled by parameters
    from its largest width; a twin costs what its Delta row costs."""
    import json

    sizes = {s["width"]: s for s in json.loads(path.read_text())["analysis"]["sizes"].values() if s["arch"] == "llama"}
    ref = sizes.get(width) or sizes[max(sizes)]
    scale = 1.0 if width in sizes else params / ref["params"]
    costs = {v: r["step_cpu_seconds"] * scale for v, r in ref["variants"].items()}
    return costs | {twin: costs[row] for row, twin in TWIN.items() if row in costs}


def run_seconds(cell: scaling.Cell, preset: bp.Preset, cost: float, delta: bool) -> float:
    """A run's wall time: its steps, its evaluations (forward only, a third of a training block) and its start."""
    evals = cell.steps // preset.eval_every * preset.curve_eval_blocks + preset.final_eval_blocks * (1 + delta)
    return cell.steps * cost * (1 + evals / (3 * cell.steps * preset.batch_size)) + STARTUP_SECONDS


def estimate(plan: Plan, rows: tuple[str, ...], cache_dir: str) -> dict[str, Any]:
    """Wall time of the runs not cached yet, `plan.workers` at a time (a run's steps and cost do not depend on its
    rate)."""
    preset = bp.PRESETS[plan.base_preset]
    seconds, count = 0.0, 0
    for width in plan.widths:
        costs = step_costs(width, scaling.baseline_params(plan.recipe(width), "llama", width))
        by_lr = cells(plan, width)
        jobs = [
            (by_lr[lr], row, s)
            for lr in plan.lrs
            for row in rows
            for s in plan.selection_seeds
            if not done(plan, by_lr[lr], cache_dir, row, s)
        ]
        # A row's comparison rate is the chosen one once its selection is complete; until then a run counts as cached
        # only if it is at every rate.
        chosen = choose_lrs(
            plan, selection_losses(plan, rows, {lr: load(plan, c, cache_dir) for lr, c in by_lr.items()})
        )
        jobs += [
            (by_lr[chosen.get(row, plan.lrs[0])], row, s)
            for row in rows
            for s in plan.comparison_seeds
            if not all(
                done(plan, by_lr[lr], cache_dir, row, s) for lr in ([chosen[row]] if row in chosen else plan.lrs)
            )
        ]
        for cell, row, _ in jobs:
            seconds += run_seconds(cell, preset, costs.get(row, costs[bp.BASELINE]), row != bp.BASELINE)
            count += 1
    return {"runs": count, "wall_seconds": seconds / max(1, plan.workers), "workers": plan.workers}


# ---------------------------------------------------------------------------------------------------------------
# Analysis
# ---------------------------------------------------------------------------------------------------------------


def check_starts(runs: dict[float, dict[str, dict[int, dict]]], rtol: float = 1e-6) -> None:
    """Refuse runs that did not start where their twins at the other rates started.

    A row and seed start from the same weights at every rate and are evaluated on the same data before the first
    step, so their step-0 validation losses agree (bit for bit on one machine). A cached run whose step-0 loss differs
    from the majority trained on other code, e.g. from before a fix: the report stops and names its file to delete.
    """
    starts: dict[tuple[str, int], dict[float, float]] = {}
    for lr, by_row in runs.items():
        for row, by_seed in by_row.items():
            for seed, run in by_seed.items():
                step, loss = run["curve"][0]
                if step == 0:
                    starts.setdefault((row, seed), {})[lr] = loss
    odd = []
    for (row, seed), by_lr in sorted(starts.items()):
        losses = list(by_lr.values())
        usual = max(losses, key=lambda x: sum(math.isclose(x, y, rel_tol=rtol) for y in losses))
        odd += [
            f"{row} seed {seed} at lr {lr:g}: {loss:.6f} (the other rates: {usual:.6f})"
            for lr, loss in by_lr.items()
            if not math.isclose(loss, usual, rel_tol=rtol)
        ]
    if odd:
        raise SystemExit(
            "bench_pretrain_controls: runs whose step-0 validation loss differs from their own row and seed at the "
            "other rates (trained on other code; delete their runs/<row>-seed<seed>.json and run again):\n  "
            + "\n  ".join(odd)
        )


def compare(a: dict[int, dict], b: dict[int, dict]) -> dict[str, Any]:
    """a - b per shared seed at equal steps (final loss) and at equal compute: the dearer run's curve at the step where
    it has spent the cheaper one's training CPU time, against the cheaper one's last point (curve subset)."""
    seeds = sorted(set(a) & set(b))
    cost_a = statistics.median(a[s]["step_cpu_seconds"] for s in seeds)
    cost_b = statistics.median(b[s]["step_cpu_seconds"] for s in seeds)
    ratio = cost_a / cost_b
    steps = a[seeds[0]]["curve"][-1][0]
    at_a, at_b = steps * min(1.0, 1.0 / ratio), steps * min(1.0, ratio)

    def paired(x: list[float], y: list[float]) -> dict:
        return scaling.with_per_seed(bp.paired_difference(x, y), x, y)

    return {
        "seeds": seeds,
        "cost_ratio": ratio,
        "equal_compute_steps": [at_a, at_b],
        "equal_steps": paired([a[s]["final_valid_loss"] for s in seeds], [b[s]["final_valid_loss"] for s in seeds]),
        "equal_compute": paired(
            [bp.loss_at_step(a[s]["curve"], at_a) for s in seeds], [bp.loss_at_step(b[s]["curve"], at_b) for s in seeds]
        ),
    }


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (the family-wise error over all of `pvalues`, any dependence between them):
    sorted ascending, the i-th smallest (from 0) becomes max over j <= i of min(1, (m - j) p_(j)). NaN stays NaN and
    does not count in m."""
    order = sorted((p, i) for i, p in enumerate(pvalues) if not math.isnan(p))
    adjusted, running = [float("nan")] * len(pvalues), 0.0
    for rank, (p, i) in enumerate(order):
        running = max(running, min(1.0, (len(order) - rank) * p))
        adjusted[i] = running
    return adjusted


def contrasts(rows: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """(row, control, what the difference isolates): the erase term at equal capacity, then each row vs the baseline."""
    out = [
        (row, TWIN[row], f"the erase term, {bp.label(row, 'llama').removeprefix('reference ')} held equal")
        for row in rows
        if row in TWIN and TWIN[row] in rows
    ]
    out += [(row, bp.BASELINE, "vs the baseline, each at its own rate") for row in rows if row != bp.BASELINE]
    return out


def code_versions(codes: list[dict | None]) -> dict[str, int]:
    """How many runs each commit trained ("<hash> (dirty)" with uncommitted changes; "unrecorded": runs from before
    bench_pretrain recorded it)."""
    names = [
        "unrecorded"
        if c is None
        else f"{c.get('commit') or 'not a git checkout'}" + (" (dirty)" if c.get("dirty") else "")
        for c in codes
    ]
    return dict(sorted(collections.Counter(names).items()))


def analyse_width(plan: Plan, rows: tuple[str, ...], width: int, cache_dir: str) -> dict[str, Any]:
    by_lr = cells(plan, width)
    runs = {lr: load(plan, cell, cache_dir) for lr, cell in by_lr.items()}
    check_starts(runs)
    selection = selection_losses(plan, rows, runs)
    chosen = choose_lrs(plan, selection)
    compared = {
        row: {s: runs[lr][row][s] for s in plan.comparison_seeds if s in runs[lr].get(row, {})}
        for row, lr in chosen.items()
    }
    table = {}
    for row in rows:
        entry: dict[str, Any] = {
            "label": bp.label(row, "llama"),
            "selection": {str(lr): statistics.fmean(v) for lr, v in selection.get(row, {}).items()},
        }
        if row in chosen:
            lr, mine = chosen[row], compared[row]
            entry |= {"lr": lr, "lr_at_edge": lr in (min(plan.lrs), max(plan.lrs)), "seeds": sorted(mine)}
        if row in chosen and compared[row]:
            mine = compared[row]
            finals = [r["final_valid_loss"] for r in mine.values()]
            entry |= {
                "params": next(iter(mine.values()))["params"],
                "final": dict(zip(("mean", "std"), bp.mean_std(finals))),
                "step_cpu_seconds": statistics.median(r["step_cpu_seconds"] for r in mine.values()),
            }
            regimes = [r["beta_regimes"] for r in mine.values() if "beta_regimes" in r]
            if regimes:
                entry["beta_regimes"] = {
                    res: {k: statistics.fmean(r[res][k] for r in regimes) for k in regimes[0][res]}
                    for res in regimes[0]
                }
        table[row] = entry
    comparisons = {}
    for row, control, meaning in contrasts(rows):
        if len(set(compared.get(row, {})) & set(compared.get(control, {}))) >= 2:
            comparisons[f"{row} - {control}"] = {
                "row": row,
                "control": control,
                "meaning": meaning,
                "lrs": [chosen[row], chosen[control]],
            } | compare(compared[row], compared[control])
    # Every interval in the report is a test at 5%: the whole table (both budgets) is one family for Holm.
    tests = [c[budget] for c in comparisons.values() for budget in ("equal_steps", "equal_compute")]
    for test, adjusted in zip(tests, holm([t["p"] for t in tests]), strict=True):
        test["p_holm"] = adjusted
    seeds = set(plan.selection_seeds) | set(plan.comparison_seeds)
    code = [run.get("code") for r in runs.values() for row in rows for s, run in r.get(row, {}).items() if s in seeds]
    cell = next(iter(by_lr.values()))
    stats = scaling.prepare(plan.recipe(width), cell, cache_dir)["stats"]
    preset = bp.PRESETS[plan.base_preset]
    return {
        "width": width,
        "params": scaling.baseline_params(plan.recipe(width), "llama", width),
        "steps": cell.steps,
        "warmup": cell.warmup,
        "tokens": cell.steps * preset.batch_size * preset.block_size,
        "epochs": stats["epochs"],
        "rows": table,
        "comparisons": comparisons,
        "code": code_versions(code),
    }


# ---------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------


def fmt_p(test: dict) -> str:
    """The test's p-value and, in brackets, its Holm-adjusted one."""
    return f"{test['p']:.3f} ({test['p_holm']:.3f})"


def markdown(results: dict) -> str:
    plan = results["plan"]
    lines = ["# Study 3: the erase term at equal capacity, each row at its own learning rate", ""]
    if results["runs_done"] < results["runs_planned"]:
        lines += [f"**Partial results: {results['runs_done']} of {results['runs_planned']} planned runs.**", ""]
    lines += [
        "Study 2's recipe (`--arch llama --init reference`, the reference presets, tokens = parameters; "
        "docs/studies.md). A write-only twin is its Delta row with the erase term removed (`delta_erase=False`: "
        "X' = X + β k vᵀ), the same state, read, compressor and value. Each row's learning rate is the lowest mean "
        f"final validation loss over the selection seeds {plan['selection_seeds']}; the comparison seeds "
        f"{plan['comparison_seeds']} (disjoint) then run at that rate. Δ = row − control per comparison seed "
        "(same data order and backbone start), mean and 95% t-interval, at **equal steps** and at **equal compute** "
        "(the dearer run's curve where it has spent the cheaper one's training CPU time, measured in these runs, "
        f"{max(1, plan['workers'])} run(s) at a time). Negative = the row has the lower validation loss. Runs are "
        "cached across commits; every run's step-0 validation loss equals its row and seed's at the other rates "
        "(checked before this report: the same starting function).",
    ]
    for size in results["analysis"]:
        lrs = plan["lrs"]
        lines += [
            "",
            f"## d = {size['width']} ({size['params']:,} parameters, {size['steps']} steps, warm-up {size['warmup']}, "
            f"{size['tokens']:,} tokens, {size['epochs']:.2f} passes)",
            "",
            "### Learning rates (mean final validation loss over the selection seeds; bold = chosen)",
            "",
            "| row | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | chosen |",
            "|---|" + "---|" * (len(lrs) + 1),
        ]
        for entry in size["rows"].values():
            lr = entry.get("lr")
            picks = [
                ("**{:.4f}**" if float(x) == lr else "{:.4f}").format(entry["selection"][x])
                if (x := str(v)) in entry["selection"]
                else ""
                for v in lrs
            ]
            chosen = "" if lr is None else f"{lr:g}" + (f" ({EDGE_NOTE})" if entry["lr_at_edge"] else "")
            lines.append(f"| {entry['label']} | " + " | ".join(picks) + f" | {chosen} |")
        lines += [
            "",
            "### Paired differences (comparison seeds)",
            "",
            "Each verdict reads its own 95% interval; p is the paired t-test's, and Holm's adjusts it for every test "
            f"in this table ({2 * len(size['comparisons'])}: each comparison at both budgets), the family-wise error "
            "at 5%: a difference whose Holm p is above 0.05 is not resolved once the table is read as a whole.",
            "",
            "| row − control | isolates | lrs | n | step cost | Δ equal steps [95% CI] | | p (Holm) "
            "| Δ equal compute [95% CI] | | p (Holm) |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for c in size["comparisons"].values():
            es, ec = c["equal_steps"], c["equal_compute"]
            lines.append(
                f"| {bp.label(c['row'], 'llama')} − {bp.label(c['control'], 'llama')} | {c['meaning']} | "
                f"{c['lrs'][0]:g} / {c['lrs'][1]:g} | {es['n']} | {c['cost_ratio']:.2f}× | {bp.fmt_ci(es)} | "
                f"{bp.verdict(es)} | {fmt_p(es)} | {bp.fmt_ci(ec)} | {bp.verdict(ec)} | {fmt_p(ec)} |"
            )
        lines += [
            "",
            "### Rows at their chosen rates",
            "",
            "| row | lr | seeds | final loss | s/step |",
            "|---|---|---|---|---|",
        ]
        for entry in size["rows"].values():
            if "final" in entry:
                lines.append(
                    f"| {entry['label']} | {entry['lr']:g} | {entry['seeds']} | {entry['final']['mean']:.4f} ± "
                    f"{entry['final']['std']:.4f} | {entry['step_cpu_seconds']:.4f} |"
                )
        regimes = {e["label"]: e["beta_regimes"] for e in size["rows"].values() if "beta_regimes" in e}
        if regimes:
            first = next(iter(regimes.values()))
            lines += [
                "",
                "### β regimes (keep < 0.5 / project 0.5–1.5 / reflect > 1.5, share of validation tokens, mean over "
                "the comparison seeds)",
                "",
                "| residual | " + " | ".join(regimes) + " |",
                "|---|" + "---|" * len(regimes),
            ]
            for res in first:
                lines.append(
                    f"| {res} | "
                    + " | ".join(
                        f"{r[res]['keep']:.2f} / {r[res]['project']:.2f} / {r[res]['reflect']:.2f}"
                        for r in regimes.values()
                    )
                    + " |"
                )
        lines += [
            "",
            "Code that trained these runs (commit: runs): "
            + ", ".join(f"{name}: {n}" for name, n in size.get("code", {}).items())
            + ".",
        ]
    est = results["estimate"]
    lines += [
        "",
        f"Wall time of this invocation: {results['wall_seconds'] / 60:.1f} min; estimated at its start from study 2's "
        f"step costs: {est['wall_seconds'] / 60:.0f} min for {est['runs']} runs.",
    ]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    plt = pyplot()

    sizes = results["analysis"]
    fig, axes = plt.subplots(len(sizes), 3, figsize=(18, 4.8 * len(sizes)), squeeze=False)
    for (ax_steps, ax_compute, ax_lr), size in zip(axes, sizes, strict=True):
        names = list(size["comparisons"])
        for ax, key in ((ax_steps, "equal_steps"), (ax_compute, "equal_compute")):
            for y, name in enumerate(names):
                d = size["comparisons"][name][key]
                err = [[d["mean"] - d["ci_low"]], [d["ci_high"] - d["mean"]]] if not math.isnan(d["ci_low"]) else None
                ax.errorbar([d["mean"]], [y], xerr=err, fmt="o", capsize=3, color=f"C{int(' - gpt2' in name)}")
            ax.axvline(0, color="black", lw=0.8)
            ax.set_yticks(range(len(names)), [n.replace(" - ", " − ") for n in names], fontsize=7)
            ax.invert_yaxis()
            ax.set(xlabel="Δ validation loss (95% CI)", title=f"d = {size['width']}: {key.replace('_', ' ')}")
        for row, entry in size["rows"].items():
            lrs = sorted(float(x) for x in entry["selection"])
            base = row == bp.BASELINE
            ax_lr.plot(
                lrs,
                [entry["selection"][str(lr)] for lr in lrs],
                "o-",
                label=entry["label"],
                lw=2.2 if base else 1.2,
                color="black" if base else None,
            )
        ax_lr.set_xscale("log")
        ax_lr.set(xlabel="learning rate", ylabel="final validation loss (selection seeds)", title="Selection")
        ax_lr.legend(fontsize=7)
    save_figure(fig, path)


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = study_parser(__doc__, "toy sizes and steps: the pipeline in about a minute", RESULTS)
    parser.add_argument("--widths", type=int, nargs="+", default=None, help="default: the plan's (160)")
    parser.add_argument("--tc", action="store_true", help="add reference d_v=4 TC and its write-only twin")
    return parser.parse_args(argv)


def train(plan: Plan, jobs: list[tuple[scaling.Cell, str, int]], cache_dir: str, phase: str) -> None:
    todo = [(c, r, s) for c, r, s in jobs if not done(plan, c, cache_dir, r, s)]
    print(f"bench_pretrain_controls: {phase}: {len(todo)} runs to train, {len(jobs) - len(todo)} cached", flush=True)
    with workers_run_this_script():
        if plan.workers == 0:  # in this process: a line per run
            for i, (cell, row, seed) in enumerate(todo):
                print(f"  [{i + 1}/{len(todo)}] d={cell.width} lr={cell.lr:g} {row} seed {seed}", flush=True)
                scaling.run_jobs(plan.recipe(cell.width), [(cell, row, seed)], cache_dir)
            return
        for width in sorted({c.width for c, _, _ in todo}, reverse=True):  # bench_pretrain's progress bar
            scaling.run_jobs(plan.recipe(width), [j for j in todo if j[0].width == width], cache_dir)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    plan = study_plan(PLANS, args)
    if args.widths:
        plan = dataclasses.replace(plan, widths=tuple(args.widths))
    rows = ROWS + (TC_ROWS if args.tc else ())
    register_variants()
    from ddl_hf.training import default_cache_dir

    cache_dir = args.cache_dir or str(default_cache_dir() / "pretrain")
    import torch

    torch.set_num_threads(1)

    prov = provenance(None if argv is None else [__file__, *argv])
    started = time.time()
    est = estimate(plan, rows, cache_dir)
    print(
        f"bench_pretrain_controls: estimated {est['wall_seconds'] / 60:.0f} min for {est['runs']} runs "
        f"({plan.workers or 1} at a time, from study 2's step costs)",
        flush=True,
    )
    by_width = {w: cells(plan, w) for w in plan.widths}
    for w, by_lr in by_width.items():  # data once per cell, before the workers; at most two passes, as in study 2
        for cell in by_lr.values():
            stats = scaling.prepare(plan.recipe(w), cell, cache_dir)["stats"]
            if stats["epochs"] > 2.0 + 1e-9:
                raise SystemExit(f"bench_pretrain_controls: d={w} needs {stats['epochs']:.2f} passes (at most 2)")
    widths = sorted(plan.widths, reverse=True)  # the longest runs first
    selection = [
        (by_width[w][lr], row, s) for w in widths for s in plan.selection_seeds for lr in plan.lrs for row in rows
    ]
    if not args.report_only:
        train(plan, selection, cache_dir, "selection")
    comparison = []
    for w in widths:
        runs = {lr: load(plan, cell, cache_dir) for lr, cell in by_width[w].items()}
        chosen = choose_lrs(plan, selection_losses(plan, rows, runs))
        comparison += [
            (by_width[w][chosen[row]], row, s) for s in plan.comparison_seeds for row in rows if row in chosen
        ]
    if not args.report_only:
        train(plan, comparison, cache_dir, "comparison")
    planned = len(selection) + len(plan.widths) * len(rows) * len(plan.comparison_seeds)
    finished = sum(done(plan, c, cache_dir, r, s) for c, r, s in selection + comparison)
    results = {
        "provenance": prov,
        "plan": dataclasses.asdict(plan),
        "rows": list(rows),
        "runs_planned": planned,
        "runs_done": finished,
        "estimate": est,
        "wall_seconds": time.time() - started,
        "analysis": [analyse_width(plan, rows, w, cache_dir) for w in plan.widths],
    }
    name = "pretrain_controls_quick" if args.quick else "pretrain_controls"
    out = Path(args.output_dir)
    report = markdown(results)
    write_results(out, name, results, report)
    plot(results, out / f"{name}.png")
    print(report)
    return results


def worker_main(argv: list[str]) -> None:
    """A bench_pretrain worker that knows the write-only twins (`workers_run_this_script`)."""
    register_variants()
    bp.main(argv)


if __name__ == "__main__":
    if "--worker" in sys.argv[1:]:
        worker_main(sys.argv[1:])
    else:
        main()
