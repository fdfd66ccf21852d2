"""Study 5: does the Delta rows' deficit to the baseline shrink with training length?

Studies 2 and 3 trained every row for about one token per parameter; the authors train about 400. This study keeps
study 2's recipe (the Llama-style backbone, the authors' init and reference presets) at one width and trains it for
several lengths, each a whole run with its warm-up and cosine schedule stretched to its steps:

    python -m ddl_lab.studies.bench_pretrain_length          # the study (prints its estimate; resumes where it stopped)
    python -m ddl_lab.studies.bench_pretrain_length --quick   # the same pipeline on toy sizes (under a minute)
    python -m ddl_lab.studies.bench_pretrain_length --report-only   # the report from the runs finished so far

Rates follow study 3's rule per length and row: the lowest mean final validation loss over selection seeds that never
count in the comparison. The first length tries a 2x ladder; each later length tries the rate the row chose at the
length before and its neighbours on the ladder, and a choice at the end of its grid adds the next rate beyond it.
Comparison seeds (disjoint, asserted) then run at each row's chosen rate; a seed has the same data order and start at
every length, so each seed gives a paired difference to the baseline per length and a slope of that difference
against log2(tokens per parameter): the trend is the mean of the per-seed slopes with its t-interval.

Every run is one `bench_pretrain.py` worker in study 2's cells and cache (study 3's workers, which know the
write-only twin), and each finished run is also kept in `results/pretrain_length_runs.jsonl` beside it, from which a
fresh cache is refilled, so a study stopped in one session resumes in the next. Writes
`ddl_lab/studies/results/pretrain_length.{json,md,png}` after every phase.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from ddl_lab.common import atomic_write_text, provenance, pyplot, save_figure, study_parser, study_plan, write_results
from ddl_lab.studies import bench_pretrain as bp
from ddl_lab.studies import bench_pretrain_controls as controls
from ddl_lab.studies import bench_pretrain_scaling as scaling

RESULTS = bp.RESULTS
LADDER = 3e-3  # rates are LADDER * 2**k (exact in binary, so the cells' cache keys match studies 2 and 3)


def rate(exp: int) -> float:
    return LADDER * 2.0**exp


@dataclasses.dataclass(frozen=True)
class Plan:
    base_preset: str  # bench_pretrain preset the sizes start from
    width: int  # d at 4 heads
    lengths: tuple[float, ...]  # training tokens per baseline parameter, shortest first
    rows: tuple[str, ...]  # bench_pretrain variants, the baseline first
    extra_rows: tuple[str, ...]  # trained at every length once `rows` are done at every length
    first_grid: tuple[int, ...]  # ladder exponents tried at the first length
    neighbours: int  # later lengths: the previous choice and this many ladder steps either side
    max_extend: int  # per length and row: rates added beyond a grid's end when the choice sits there
    selection_seeds: tuple[tuple[int, ...], ...]  # per length
    comparison_seeds: tuple[int, ...]
    workers: int = 2

    def __post_init__(self) -> None:
        if len(self.selection_seeds) != len(self.lengths):
            raise ValueError("one tuple of selection seeds per length")
        if set().union(*self.selection_seeds) & set(self.comparison_seeds):
            raise ValueError(f"selection seeds {self.selection_seeds} overlap comparison seeds {self.comparison_seeds}")

    def recipe(self, length: float, lrs: tuple[float, ...] = ()) -> controls.Plan:
        """Study 3's plan at this width and length (its cells, cache folders and workers)."""
        return controls.Plan(
            self.base_preset,
            widths=(self.width,),
            lrs=lrs,
            selection_seeds=tuple(sorted(set().union(*self.selection_seeds))),
            comparison_seeds=self.comparison_seeds,
            tokens_per_param=length,
            min_steps=0,
            workers=self.workers,
        )


PLANS = {
    # d = 80, study 2's middle width: 1x is study 2's own cell (341 steps) and 16x (5,449 steps, 3.4 passes) is what
    # the cores allow; at d = 160 the same lengths would cost about four times as much.
    "full": Plan(
        "cpu",
        width=80,
        lengths=(1.0, 4.0, 16.0),
        rows=(bp.BASELINE, "ref_dv1", "ref_dv4_cc", "ref_dv4_tc"),
        extra_rows=("ref_dv1_write_only",),
        first_grid=(-2, -1, 0, 1, 2),  # 7.5e-4 .. 1.2e-2: study 2's d = 80 sweep chose both of its ends
        neighbours=1,
        max_extend=2,
        selection_seeds=((100, 101), (100, 101), (100,)),  # 16x: one seed, its runs are 2/3 of the budget
        comparison_seeds=(0, 1, 2, 3, 4),
    ),
    "quick": Plan(
        "quick",
        width=16,
        lengths=(0.5, 1.0, 2.0),
        rows=(bp.BASELINE, "ref_dv1"),
        extra_rows=("ref_dv1_write_only",),
        first_grid=(0, 1),
        neighbours=0,
        max_extend=0,
        selection_seeds=((100,), (100,), (100,)),
        comparison_seeds=(0, 1),
        workers=0,
    ),
}


@functools.cache
def cell(plan: Plan, length: float, exp: int) -> scaling.Cell:
    """Study 2's Llama cell at this width, length and rate: steps = length x the baseline's parameters / tokens a
    step, warm-up the same share of them as the first study's (the schedule stretched, not truncated)."""
    lr = rate(exp)
    return controls.cells(plan.recipe(length, (lr,)), plan.width)[lr]


def folder(plan: Plan, length: float, exp: int, cache_dir: str) -> Path:
    c = cell(plan, length, exp)
    return scaling.folder_of(plan.recipe(length).recipe(plan.width), c, cache_dir)


def loader(plan: Plan, cache_dir: str):
    """runs(i, exp) -> {row: {seed: run}} of the cell at length i and rate exp, read once per loader."""

    @functools.cache
    def runs(i: int, exp: int) -> dict[str, dict[int, dict]]:
        return controls.load(plan.recipe(plan.lengths[i]), cell(plan, plan.lengths[i], exp), cache_dir)

    return runs


# ---------------------------------------------------------------------------------------------------------------
# Rates
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Selection:
    """A row's rate search at one length: the ladder exponents tried, the mean selection loss of each complete one,
    the (exponent, seed) runs still missing, and the choice once there is one."""

    exps: list[int]
    losses: dict[int, float]
    missing: list[tuple[int, int]]
    choice: int | None = None
    at_edge: bool = False
    extended: int = 0


def select(plan: Plan, i: int, row: str, runs) -> Selection:
    """Study 3's rule on this length's grid: the rate of the lowest mean final validation loss over the selection
    seeds. A choice at an end of the grid adds the next rate beyond it (up to `plan.max_extend` per length), so that
    a choice at an edge means the search ran out, not the grid. Empty until the length before has chosen."""
    if i == 0:
        exps = list(plan.first_grid)
    else:
        before = select(plan, i - 1, row, runs).choice
        if before is None:
            return Selection([], {}, [])
        exps = list(range(before - plan.neighbours, before + plan.neighbours + 1))
    seeds, extended = plan.selection_seeds[i], 0
    while True:
        found = {e: [runs(i, e).get(row, {}).get(s) for s in seeds] for e in exps}
        losses = {e: statistics.fmean(r["final_valid_loss"] for r in rs) for e, rs in found.items() if all(rs)}
        missing = [(e, s) for e, rs in found.items() for s, r in zip(seeds, rs, strict=True) if r is None]
        if missing:
            return Selection(exps, losses, missing, extended=extended)
        best = min(exps, key=losses.__getitem__)
        edge = best in (exps[0], exps[-1])
        if not edge or extended == plan.max_extend:
            return Selection(exps, losses, [], best, edge, extended)
        exps = [exps[0] - 1, *exps] if best == exps[0] else [*exps, exps[-1] + 1]
        extended += 1


# ---------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------


def ensure_data(plan: Plan, cells: list[tuple[float, int]], cache_dir: str) -> None:
    """Tokenise once per call, before the workers start: the cells differ only in steps, warm-up and rate, so a new
    cell's data folder is a hard-linked copy of a prepared one's, with its own pass count."""
    preset, source = bp.PRESETS[plan.base_preset], None
    for length, exp in cells:
        target = folder(plan, length, exp, cache_dir)
        if not (target / "data" / "stats.json").exists():
            if source is None:
                scaling.prepare(plan.recipe(length).recipe(plan.width), cell(plan, length, exp), cache_dir)
            else:
                for part in ("tokenizer", "data/train", "data/valid"):
                    shutil.copytree(source / part, target / part, copy_function=os.link, dirs_exist_ok=True)
                stats = json.loads((source / "data" / "stats.json").read_text())
                stats["epochs"] = cell(plan, length, exp).steps * preset.batch_size / stats["train_blocks"]
                (target / "data" / "stats.json").write_text(json.dumps(stats, indent=2))
        source = source or target


def train(plan: Plan, i: int, jobs: list[tuple[int, str, int]], cache_dir: str, phase: str) -> None:
    """Train the missing (exponent, row, seed) runs at length i: seed by seed, the dearer rows first."""
    length = plan.lengths[i]
    ensure_data(plan, sorted({(length, e) for e, _, _ in jobs}), cache_dir)
    order = {row: n for n, row in enumerate(("ref_dv4_tc", "ref_dv4_cc"))}
    jobs = sorted(jobs, key=lambda j: (j[2], order.get(j[1], 2), j[0]))
    work = [(cell(plan, length, e), row, s) for e, row, s in jobs]
    controls.train(plan.recipe(length), work, cache_dir, f"{length:g} tokens/parameter, {phase}")


def run_study(plan: Plan, groups: list[tuple[str, ...]], cache_dir: str, after_phase) -> None:
    """Each group of rows at every length, shortest first: selection (grown until no choice sits at an edge it may
    still move past), then the comparison seeds at the chosen rates; `after_phase()` after each length's comparison."""
    for rows in groups:
        for i in range(len(plan.lengths)):
            asked: list = []
            while True:
                runs = loader(plan, cache_dir)
                picks = {row: select(plan, i, row, runs) for row in rows}
                jobs = [(e, row, s) for row, sel in picks.items() for e, s in sel.missing]
                if not jobs:
                    break
                if jobs == asked:
                    raise SystemExit(f"bench_pretrain_length: runs did not appear after training: {jobs}")
                train(plan, i, jobs, cache_dir, "selection")
                asked = jobs
            runs = loader(plan, cache_dir)
            jobs = [
                (sel.choice, row, s)
                for row, sel in picks.items()
                if sel.choice is not None
                for s in plan.comparison_seeds
                if s not in runs(i, sel.choice).get(row, {})
            ]
            if jobs:
                train(plan, i, jobs, cache_dir, "comparison")
                after_phase()


def estimate(plan: Plan, groups: list[tuple[str, ...]], cache_dir: str) -> dict[str, Any]:
    """Wall time of the runs not trained yet, `plan.workers` at a time, from study 2's step costs at this width. A
    grid not known yet (its length before has not chosen) counts as 2 x neighbours + 1 rates, without extensions."""
    preset, runs = bp.PRESETS[plan.base_preset], loader(plan, cache_dir)
    params = scaling.baseline_params(plan.recipe(1.0).recipe(plan.width), "llama", plan.width)
    costs = controls.step_costs(plan.width, params)
    by_length, count = [0.0] * len(plan.lengths), 0
    for row in (r for rows in groups for r in rows):
        for i, length in enumerate(plan.lengths):
            sel = select(plan, i, row, runs)
            todo = len(sel.missing) if sel.exps else (2 * plan.neighbours + 1) * len(plan.selection_seeds[i])
            if sel.choice is None:
                todo += len(plan.comparison_seeds)
            else:
                todo += sum(s not in runs(i, sel.choice).get(row, {}) for s in plan.comparison_seeds)
            one = controls.run_seconds(
                cell(plan, length, 0), preset, costs.get(row, costs[bp.BASELINE]), row != bp.BASELINE
            )
            by_length[i] += todo * one
            count += todo
    workers = max(1, plan.workers)
    return {
        "runs": count,
        "wall_seconds": sum(by_length) / workers,
        "wall_seconds_by_length": [s / workers for s in by_length],
        "workers": plan.workers,
    }


# ---------------------------------------------------------------------------------------------------------------
# The runs kept in the repository
# ---------------------------------------------------------------------------------------------------------------


def store_runs(plan: Plan, rows: tuple[str, ...], cache_dir: str, path: Path) -> int:
    """Every finished run of this study's cells, one JSON line each ({"folder": cache folder name, "run": record})."""

    runs, lines = loader(plan, cache_dir), []
    for i, length in enumerate(plan.lengths):
        seeds = set(plan.selection_seeds[i]) | set(plan.comparison_seeds)
        for e in sorted({e for row in rows for e in select(plan, i, row, runs).exps}):
            name = folder(plan, length, e, cache_dir).name
            for row in rows:
                for seed, run in sorted(runs(i, e).get(row, {}).items()):
                    if seed in seeds:
                        lines.append(json.dumps({"folder": name, "run": run}, sort_keys=True, separators=(",", ":")))
    atomic_write_text(path, "".join(line + "\n" for line in lines))
    return len(lines)


def restore_runs(path: Path, cache_dir: str) -> int:
    """Write the kept runs that the cache lacks (a fresh machine, a cleared cache) back into it; returns how many."""
    if not path.exists():
        return 0
    restored = 0
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        target = bp.run_path(Path(cache_dir) / entry["folder"], entry["run"]["variant"], entry["run"]["seed"])
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(".tmp")
            tmp.write_text(json.dumps(entry["run"]))
            os.replace(tmp, target)
            restored += 1
    return restored


# ---------------------------------------------------------------------------------------------------------------
# Analysis
# ---------------------------------------------------------------------------------------------------------------


def per_seed_slopes(xs: list[float], by_seed: dict[int, list[float]]) -> dict[int, float]:
    """Each seed's least-squares slope of its values against xs."""
    mean_x = statistics.fmean(xs)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    return {
        seed: sum((x - mean_x) * (y - statistics.fmean(ys)) for x, y in zip(xs, ys, strict=True)) / sxx
        for seed, ys in by_seed.items()
    }


def paired_slope(xs: list[float], by_seed: dict[int, list[float]]) -> dict[str, Any]:
    """The trend of a paired difference across lengths: the mean of the per-seed slopes against xs, with the
    t-interval and p of the slopes (seeds are independent replicates; a seed's lengths share its data order and
    start, so its own slope is the paired quantity)."""
    slopes = per_seed_slopes(xs, by_seed)
    values = list(slopes.values())
    return bp.paired_difference(values, [0.0] * len(values)) | {"per_seed": slopes}


def curve_shape(runs: list[dict]) -> dict[str, float]:
    """Means over seeds: the step where the validation curve is lowest, its drop over the last tenth of the steps
    (still falling, flat, or rising: a repeated corpus overfits), and validation − training loss at the last logged
    training loss (the mean over the `eval_every` steps before it)."""
    steps = runs[0]["curve"][-1][0]
    gaps = [
        bp.loss_at_step(r["curve"], r["train_loss"][-1][0]) - r["train_loss"][-1][1] for r in runs if r["train_loss"]
    ]
    return {
        "steps": steps,
        "min_step": statistics.median(min(r["curve"], key=lambda p: p[1])[0] for r in runs),
        "end_loss": statistics.fmean(r["curve"][-1][1] for r in runs),
        "late_drop": statistics.fmean(bp.loss_at_step(r["curve"], 0.9 * steps) - r["curve"][-1][1] for r in runs),
        "gap": statistics.fmean(gaps) if gaps else math.nan,
    }


def mean_regimes(runs: list[dict]) -> dict[str, dict[str, float]]:
    regimes = [r["beta_regimes"] for r in runs]
    return {res: {k: statistics.fmean(r[res][k] for r in regimes) for k in regimes[0][res]} for res in regimes[0]}


def analyse_length(plan: Plan, rows: tuple[str, ...], i: int, cache_dir: str) -> dict[str, Any] | None:
    """One length: each row's rate search and chosen rate, its comparison runs, and every contrast of study 3
    (row − baseline, Delta row − write-only twin) at equal steps and equal compute. None before any run exists."""
    length, runs = plan.lengths[i], loader(plan, cache_dir)
    picks = {row: select(plan, i, row, runs) for row in rows}
    exps = [e for e in sorted({e for sel in picks.values() for e in sel.exps}) if runs(i, e)]
    if not exps:
        return None
    cells = {e: runs(i, e) for e in exps}
    controls.check_starts({rate(e): r for e, r in cells.items()})
    table, compared = {}, {}
    for row, sel in picks.items():
        entry: dict[str, Any] = {
            "label": bp.label(row, "llama"),
            "grid": [rate(e) for e in sel.exps],
            "selection": {str(rate(e)): loss for e, loss in sel.losses.items()},
            "extended": sel.extended,
        }
        if sel.choice is not None:
            mine = {s: r for s, r in runs(i, sel.choice).get(row, {}).items() if s in plan.comparison_seeds}
            entry |= {"lr": rate(sel.choice), "lr_at_edge": sel.at_edge, "seeds": sorted(mine)}
            if mine:
                compared[row] = mine
                finals = [r["final_valid_loss"] for r in mine.values()]
                entry |= {
                    "params": next(iter(mine.values()))["params"],
                    "final": dict(zip(("mean", "std"), bp.mean_std(finals))),
                    "step_cpu_seconds": statistics.median(r["step_cpu_seconds"] for r in mine.values()),
                    "curve_shape": curve_shape(list(mine.values())),
                }
                if row != bp.BASELINE:
                    entry["beta_regimes"] = mean_regimes(list(mine.values()))
        table[row] = entry
    comparisons = {}
    for row, control, meaning in controls.contrasts(rows):
        if len(set(compared.get(row, {})) & set(compared.get(control, {}))) >= 2:
            comparisons[f"{row} - {control}"] = {
                "row": row,
                "control": control,
                "meaning": meaning,
                "lrs": [table[row]["lr"], table[control]["lr"]],
            } | controls.compare(compared[row], compared[control])
    preset = bp.PRESETS[plan.base_preset]
    first = cell(plan, length, exps[0])
    ensure_data(plan, [(length, exps[0])], cache_dir)  # runs restored into a fresh cache come without their data
    stats = json.loads((folder(plan, length, exps[0], cache_dir) / "data" / "stats.json").read_text())
    seeds = set(plan.selection_seeds[i]) | set(plan.comparison_seeds)
    code = [run.get("code") for r in cells.values() for row in rows for s, run in r.get(row, {}).items() if s in seeds]
    return {
        "tokens_per_param": length,
        "params": scaling.baseline_params(plan.recipe(length).recipe(plan.width), "llama", plan.width),
        "steps": first.steps,
        "warmup": first.warmup,
        "tokens": first.steps * preset.batch_size * preset.block_size,
        "passes": stats["epochs"],
        "unigram": stats["valid_unigram_entropy"],
        "selection_seeds": list(plan.selection_seeds[i]),
        "comparison_seeds": list(plan.comparison_seeds),
        "cells": [
            {
                "lr": rate(e),
                "folder": folder(plan, length, e, cache_dir).name,
                "runs": {row: sorted(r[row]) for row in rows if row in r},
            }
            for e, r in cells.items()
        ],
        "rows": table,
        "comparisons": comparisons,
        "code": controls.code_versions(code),
    }


def trends(plan: Plan, lengths: list[dict | None]) -> dict[str, dict]:
    """Per contrast found at two lengths or more: the paired slope of Δ against log2(tokens per parameter) over the
    seeds it has at every one of those lengths, at both budgets."""
    out = {}
    names = {n for size in lengths if size for n in size["comparisons"]}
    for name in sorted(names):
        sizes = [s for s in lengths if s and name in s["comparisons"]]
        if len(sizes) < 2:
            continue
        xs = [math.log2(s["tokens_per_param"]) for s in sizes]
        seeds = sorted(set.intersection(*(set(s["comparisons"][name]["seeds"]) for s in sizes)))
        if len(seeds) < 2:
            continue
        budgets = {
            key: {
                seed: [
                    s["comparisons"][name][key]["per_seed"][s["comparisons"][name]["seeds"].index(seed)] for s in sizes
                ]
                for seed in seeds
            }
            for key in ("equal_steps", "equal_compute")
        }
        entry = {"lengths": [s["tokens_per_param"] for s in sizes], "seeds": seeds}
        entry |= {key: paired_slope(xs, by_seed) for key, by_seed in budgets.items()}
        # A straight line through three lengths or more can average a turn away: each step's own slope beside it.
        steps = range(len(sizes) - 1) if len(sizes) > 2 else range(0)
        entry["segments"] = [
            {"lengths": entry["lengths"][j : j + 2]}
            | {
                key: paired_slope(xs[j : j + 2], {seed: ys[j : j + 2] for seed, ys in by_seed.items()})
                for key, by_seed in budgets.items()
            }
            for j in steps
        ]
        out[name] = entry
    return out


def analyse(plan: Plan, rows: tuple[str, ...], cache_dir: str) -> dict[str, Any]:
    """Every length, the trends, and Holm's correction over the Δ table (every contrast at every length and both
    budgets: one family) and, separately, over the trends and their segments (one family)."""
    lengths = [analyse_length(plan, rows, i, cache_dir) for i in range(len(plan.lengths))]
    check_across_lengths(plan, rows, lengths, cache_dir)
    slopes = trends(plan, lengths)
    for family in (
        [c[k] for s in lengths if s for c in s["comparisons"].values() for k in ("equal_steps", "equal_compute")],
        [part[k] for t in slopes.values() for part in (t, *t["segments"]) for k in ("equal_steps", "equal_compute")],
    ):
        for test, adjusted in zip(family, controls.holm([t["p"] for t in family]), strict=True):
            test["p_holm"] = adjusted
    return {"lengths": lengths, "trends": slopes}


def check_across_lengths(plan: Plan, rows: tuple[str, ...], lengths: list[dict | None], cache_dir: str) -> None:
    """Study 3's step-0 check across lengths: a row and seed start from the same weights on the same data at every
    length, so their comparison runs' step-0 losses agree (within a length, `check_starts` compared the rates)."""
    runs, by_length = loader(plan, cache_dir), {}
    for i, size in enumerate(lengths):
        for row, entry in (size or {}).get("rows", {}).items():
            if "lr" in entry:
                exp = select(plan, i, row, runs).choice
                by_length.setdefault(plan.lengths[i], {})[row] = runs(i, exp).get(row, {})
    try:
        controls.check_starts(by_length)
    except SystemExit as refusal:
        raise SystemExit(str(refusal).replace(" at lr ", " at tokens/parameter ").replace("rates", "lengths")) from None


# ---------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------


def fmt_test(d: dict) -> str:
    return f"{bp.fmt_ci(d)} (p {d['p']:.3f}, Holm {d['p_holm']:.3f})" if d["n"] >= 2 else bp.fmt_ci(d)


def contrast_label(name: str) -> str:
    row, control = name.split(" - ")
    return f"{bp.label(row, 'llama')} − {bp.label(control, 'llama')}"


def slope_verdict(d: dict) -> str:
    """bench_pretrain's reading of an interval, said of a slope."""
    return bp.verdict(d, ("Δ falls with length", "Δ rises with length", "no resolved trend"))


def mean_and_spread(stats: dict[str, float]) -> str:
    """`mean ± std` over the seeds, or the one seed's value and "(1 seed)" while a cell has one (no spread yet)."""
    if math.isnan(stats["std"]):
        return f"{stats['mean']:.4f} (1 seed)"
    return f"{stats['mean']:.4f} ± {stats['std']:.4f}"


def markdown(results: dict) -> str:
    plan, a = results["plan"], results["analysis"]
    sizes = [s for s in a["lengths"] if s]
    base = bp.label(bp.BASELINE, "llama")
    lines = ["# Study 5: the Delta rows' difference to the baseline against training length", ""]
    if results["runs_done"] < results["runs_planned"]:
        pending = [f"{x:g}" for x, s in zip(plan["lengths"], a["lengths"], strict=True) if not s]
        lines += [
            f"**Partial results: {results['runs_done']} of about {results['runs_planned']} planned runs**"
            + (f"; not started: {', '.join(pending)} tokens/parameter" if pending else "")
            + ". Every number below is from the runs finished so far.",
            "",
        ]
    lines += [
        "Study 2's recipe (`--arch llama --init reference`, the reference presets; docs/studies.md) at d = "
        f"{plan['width']}, trained for {', '.join(f'{x:g}' for x in plan['lengths'])} tokens per baseline parameter, "
        "each length a whole run (warm-up and cosine schedule stretched to its steps). Per length and row, the rate of "
        "the lowest mean final validation loss over that length's selection seeds (first length: a 2× ladder; later "
        f"lengths: the row's previous choice ±{plan['neighbours']} ladder step(s); a choice at a grid's end adds the "
        f"next rate, up to {plan['max_extend']} per length), then the comparison seeds {plan['comparison_seeds']} "
        "(disjoint from the selection seeds) at the chosen rate. Δ = row − control per comparison seed (same data "
        "order and start at every length), mean and 95% t-interval, at **equal steps** and **equal compute** (the "
        "dearer run's curve where it has spent the cheaper one's training CPU time). Negative = the row is better. "
        "p: paired t-test; Holm: adjusted over the whole Δ table (every contrast, length and budget).",
        "",
        "## Lengths",
        "",
        "| tokens/param | steps (warm-up) | tokens | passes over the corpus | selection seeds | comparison seeds "
        f"| {base}: final loss | its curve: lowest at step | drop over the last 10% | valid − train at the end |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in sizes:
        b = s["rows"][bp.BASELINE]
        shape = b.get("curve_shape")
        tail = (
            f"{mean_and_spread(b['final'])} | {shape['min_step']:.0f} of {shape['steps']} | "
            f"{shape['late_drop']:+.4f} | {shape['gap']:+.4f}"
            if shape
            else "| | |"
        )
        lines.append(
            f"| {s['tokens_per_param']:g} | {s['steps']} ({s['warmup']}) | {s['tokens']:,} | {s['passes']:.2f} | "
            f"{s['selection_seeds']} | {s['comparison_seeds']} | {tail} |"
        )
    for x, planned in zip(plan["lengths"], results["planned_steps"], strict=True):
        if x not in [s["tokens_per_param"] for s in sizes]:
            lines.append(f"| {x:g} | {planned['steps']} ({planned['warmup']}) | not started | | | | | | | |")
    lines += [
        "",
        "## Rates",
        "",
        "Mean final validation loss over the selection seeds at each rate tried (bold: chosen).",
        "",
        "| tokens/param | row | rate: loss | chosen |",
        "|---|---|---|---|",
    ]
    for s in sizes:
        for entry in s["rows"].values():
            tried = ", ".join(
                ("**{}: {:.4f}**" if float(lr) == entry.get("lr") else "{}: {:.4f}").format(f"{float(lr):g}", loss)
                for lr, loss in sorted(entry["selection"].items(), key=lambda item: float(item[0]))
            )
            lr = entry.get("lr")
            chosen = (
                "pending" if lr is None else f"{lr:g}" + (f" ({controls.EDGE_NOTE})" if entry["lr_at_edge"] else "")
            )
            lines.append(f"| {s['tokens_per_param']:g} | {entry['label']} | {tried} | {chosen} |")
    lines.append("")
    names = list(dict.fromkeys(n for s in sizes for n in s["comparisons"]))
    lines += ["## Δ per length", ""]
    for key, title in (("equal_steps", "equal steps"), ("equal_compute", "equal compute")):
        lines += [
            f"**At {title}** (n; Δ [95% CI] (p, Holm); step cost)",
            "",
            "| row − control | " + " | ".join(f"{s['tokens_per_param']:g} tokens/param" for s in sizes) + " |",
            "|---|" + "---|" * len(sizes),
        ]
        for name in names:
            cells_ = []
            for s in sizes:
                c = s["comparisons"].get(name)
                cells_.append("" if c is None else f"n={c[key]['n']}: {fmt_test(c[key])}; {c['cost_ratio']:.2f}×")
            lines.append(f"| {contrast_label(name)} | " + " | ".join(cells_) + " |")
        lines.append("")
    lines += [
        "## The trend: slope of Δ against log2(tokens per parameter)",
        "",
        "Per comparison seed, the least-squares slope of its Δ over the lengths it has (nats per doubling of the "
        "training length); mean over seeds with the slopes' 95% t-interval. With three lengths or more, the rows "
        "marked → give each step between neighbouring lengths on its own (the same per-seed slope over two "
        "lengths), so a turn the straight line averages away shows. Holm over this table. Negative = the row gains "
        "on its control as training lengthens.",
        "",
        "| row − control | budget | lengths (tokens/param) | seeds | slope [95% CI] (p, Holm) | |",
        "|---|---|---|---|---|---|",
        *(
            f"| {contrast_label(name)} | {key.replace('_', ' ')} | {span} | "
            f"{len(t['seeds'])} | {fmt_test(part[key])} | {slope_verdict(part[key])} |"
            for name, t in a["trends"].items()
            for key in ("equal_steps", "equal_compute")
            for span, part in [
                (", ".join(f"{x:g}" for x in t["lengths"]), t),
                *(("{:g} → {:g}".format(*seg["lengths"]), seg) for seg in t["segments"]),
            ]
        ),
    ]
    lines += [
        "",
        "## β regimes per length",
        "",
        "Share of validation tokens with β < 0.5 (keep) / 0.5–1.5 (project) / > 1.5 (reflect) per Delta residual, "
        "mean over the comparison seeds, at each row's chosen rate.",
        "",
    ]
    residuals = next((list(e["beta_regimes"]) for s in sizes for e in s["rows"].values() if "beta_regimes" in e), [])
    if residuals:
        lines += ["| row | tokens/param | " + " | ".join(residuals) + " |", "|---|---|" + "---|" * len(residuals)]
    for row in results["rows"][1:]:
        for s in sizes:
            shares = s["rows"][row].get("beta_regimes")
            if shares:
                cells_ = (
                    f"{shares[r]['keep']:.2f} / {shares[r]['project']:.2f} / {shares[r]['reflect']:.2f}"
                    for r in residuals
                )
                lines.append(f"| {bp.label(row, 'llama')} | {s['tokens_per_param']:g} | " + " | ".join(cells_) + " |")
    lines.append("")
    lines += ["## Rows at their chosen rates", "", "| tokens/param | row | lr | seeds | final loss | s/step | curve "
              "lowest at step | drop over the last 10% |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for s in sizes:
        for e in s["rows"].values():
            if "final" in e:
                shape = e["curve_shape"]
                lines.append(
                    f"| {s['tokens_per_param']:g} | {e['label']} | {e['lr']:g} | {e['seeds']} | "
                    f"{mean_and_spread(e['final'])} | {e['step_cpu_seconds']:.4f} | "
                    f"{shape['min_step']:.0f} of {shape['steps']} | {shape['late_drop']:+.4f} |"
                )
    lines += ["", "Code that trained these runs (commit: runs), per length:"]
    lines += [
        f"- {s['tokens_per_param']:g} tokens/param: " + ", ".join(f"{n}: {k}" for n, k in s["code"].items())
        for s in sizes
    ]
    est = results["estimate"]
    lines += [
        "",
        "**What this cannot say.** One width (d = {w}, {p:,} parameters) and a {pmax:.2f}-pass corpus at the longest "
        "length finished, against the authors' 124M parameters and about 400 tokens per parameter: the trend is "
        "measured over {lo:g}–{hi:g} tokens per parameter only, and extrapolating it two decades further is a guess. "
        "Past one pass the corpus repeats, so the longest lengths also measure memorisation (the curve columns "
        "above say whether the validation loss was still falling at the end). Step costs, and so equal compute, are "
        "CPU costs measured with {k} run(s) side by side on a shared machine. Rates come from a 2× ladder and few "
        "selection seeds.".format(
            w=plan["width"],
            p=sizes[0]["params"] if sizes else 0,
            pmax=max((s["passes"] for s in sizes), default=0.0),
            lo=min(plan["lengths"]),
            hi=max(plan["lengths"]),
            k=max(1, plan["workers"]),
        ),
        "",
        f"Wall time of this invocation: {results['wall_seconds'] / 60:.1f} min; estimated at its start from study 2's "
        f"step costs: {est['wall_seconds'] / 3600:.1f} h for {est['runs']} runs ({max(1, est['workers'])} at a time).",
    ]
    return "\n".join(lines) + "\n"


def plot(results: dict, curves: dict[str, dict[str, list]], path: Path) -> None:
    """Δ against length per contrast (equal steps, equal compute) and every row's mean validation curve per length.

    `curves`: {length: {row: the comparison seeds' curves}}."""
    plt = pyplot()

    sizes = [s for s in results["analysis"]["lengths"] if s]
    fig, axes = plt.subplots(1, 3, figsize=(18, 4.8), layout="constrained")
    names = list(dict.fromkeys(n for s in sizes for n in s["comparisons"]))
    colour = {row: "black" if row == bp.BASELINE else f"C{k}" for k, row in enumerate(results["rows"])}
    lengths = results["plan"]["lengths"]
    for ax, key in ((axes[0], "equal_steps"), (axes[1], "equal_compute")):
        for k, name in enumerate(names):
            points = [(s["tokens_per_param"], s["comparisons"][name][key]) for s in sizes if name in s["comparisons"]]
            x = [p * 1.05 ** (k - len(names) / 2) for p, _ in points]  # the rows' markers side by side
            y = [d["mean"] for _, d in points]
            err = [
                [d["mean"] - d["ci_low"] if not math.isnan(d["ci_low"]) else 0 for _, d in points],
                [d["ci_high"] - d["mean"] if not math.isnan(d["ci_high"]) else 0 for _, d in points],
            ]
            row, control = name.split(" - ")
            ls = "-" if control == bp.BASELINE else ":"
            ax.errorbar(x, y, yerr=err, fmt="o" + ls, capsize=3, color=colour[row], label=contrast_label(name))
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlim(min(lengths) / 1.5, max(lengths) * 1.5)
        ax.set(xlabel="training tokens per parameter", ylabel="Δ validation loss (95% CI)", title=key.replace("_", " "))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    ax, labelled = axes[2], set()
    for s in sizes:
        tokens_per_step = s["tokens"] / s["steps"] / s["params"]
        for row, e in s["rows"].items():
            if "curve_shape" not in e:
                continue
            mine = curves[f"{s['tokens_per_param']:g}"][row]
            steps = [p[0] for p in mine[0]]
            mean = [statistics.fmean(c[j][1] for c in mine) for j in range(len(steps))]
            ax.plot(
                [max(st, 1) * tokens_per_step for st in steps],
                mean,
                color=colour[row],
                lw=0.9,
                label=None if row in labelled else e["label"],
            )
            labelled.add(row)
    ax.set_xscale("log", base=2)
    ax.set_xlim(left=1 / 64)
    ax.set_ylim(top=sizes[0]["unigram"] + 0.5 if sizes else None)
    ax.set(xlabel="tokens per parameter seen", ylabel="validation loss (curve set)", title="Curves at every length")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    save_figure(fig, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = study_parser(__doc__, "toy sizes and steps: the pipeline in under a minute", RESULTS)
    parser.add_argument("--no-extra", action="store_true", help="skip the extra rows (the d_v=1 write-only twin)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    plan = study_plan(PLANS, args)
    groups = [plan.rows] + ([] if args.no_extra else [plan.extra_rows])
    rows = tuple(r for g in groups for r in g)
    controls.register_variants()
    from ddl_hf.training import default_cache_dir

    cache_dir = args.cache_dir or str(default_cache_dir() / "pretrain")
    import torch

    torch.set_num_threads(1)

    prov = provenance(None if argv is None else [__file__, *argv])
    started = time.time()
    name = "pretrain_length_quick" if args.quick else "pretrain_length"
    out = Path(args.output_dir)
    kept = out / f"{name}_runs.jsonl"
    restored = restore_runs(kept, cache_dir)
    if restored:
        print(f"bench_pretrain_length: {restored} runs restored into the cache from {kept.name}", flush=True)
    est = estimate(plan, groups, cache_dir)
    hours = ", ".join(
        f"{x:g}x: {s / 3600:.1f} h" for x, s in zip(plan.lengths, est["wall_seconds_by_length"], strict=True)
    )
    print(
        f"bench_pretrain_length: estimated {est['wall_seconds'] / 3600:.1f} h for {est['runs']} runs "
        f"({max(1, plan.workers)} at a time, from study 2's step costs; {hours})",
        flush=True,
    )

    def report() -> dict[str, Any]:
        runs = loader(plan, cache_dir)
        analysis = analyse(plan, rows, cache_dir)
        finished = store_runs(plan, rows, cache_dir, kept)
        curves = {
            f"{s['tokens_per_param']:g}": {
                row: [runs(i, select(plan, i, row, runs).choice)[row][seed]["curve"] for seed in e["seeds"]]
                for row, e in s["rows"].items()
                if "curve_shape" in e
            }
            for i, s in enumerate(analysis["lengths"])
            if s
        }
        results = {
            "provenance": prov,
            "plan": dataclasses.asdict(plan),
            "planned_steps": [dataclasses.asdict(cell(plan, x, 0)) for x in plan.lengths],
            "rows": list(rows),
            "runs_planned": finished + estimate(plan, groups, cache_dir)["runs"],
            "runs_done": finished,
            "estimate": est,
            "wall_seconds": time.time() - started,
            "analysis": analysis,
        }
        text = markdown(results)
        write_results(out, name, results, text)
        plot(results, curves, out / f"{name}.png")
        return results | {"markdown": text}

    if not args.report_only:
        run_study(plan, groups, cache_dir, report)
    results = report()
    print(results.pop("markdown"))
    return results


if __name__ == "__main__":
    main()
