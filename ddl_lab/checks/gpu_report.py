"""The GPU check's report: its summary of what ran and failed, and the markdown written beside the JSON.

`ddl_lab.checks.gpu_check` measures; this module only reads its results dict (`markdown(results)`,
`summary(results)`), so the report can be rebuilt from a saved `gpu_check.json`.
"""

from __future__ import annotations

SECTIONS = ("profile", "triton", "cost")  # cost last: its budget guard drops what is left
TRITON_PAIR = ("eager", "triton")  # the implementations the triton section times against each other


def metrics(row: dict) -> dict:
    """A row's measured metrics: each entry that has a ratio or a status."""
    return {k: v for k, v in row.items() if isinstance(v, dict) and ("ratio" in v or v.get("status"))}


def all_checks(results: dict) -> list[tuple[str, str, dict]]:
    """(section, label, record) of each section that did not run, each row, and each cost metric with a status."""
    checks = []
    for key in SECTIONS:
        section = results.get(key) or {}
        if section.get("status") in ("error", "skipped"):
            checks.append((key, "section", section))
        for row in section.get("rows", []):
            if key != "cost":
                checks.append((key, row.get("variant") or row.get("model"), row))
                continue
            label = f"{row['kind']} {'compiled' if row['compiled'] else 'eager'} {row['variant']}"
            checks.append((key, label, row))
            checks += [(key, f"{label} {name}", m) for name, m in metrics(row).items() if m.get("status")]
    return checks


def summary(results: dict) -> dict:
    counts: dict[str, int] = {}
    failures = []
    for section, label, record in all_checks(results):
        status = record.get("status", "ok")
        counts[status] = counts.get(status, 0) + 1
        if status in ("fail", "error"):
            failures.append({"section": section, "check": label, "status": status, **_why(record)})
    return {"counts": counts, "failures": failures}


def _why(record: dict) -> dict:
    return {k: record[k] for k in ("error", "reason") if k in record}


def progress_line(key: str, row: dict) -> str:
    """A finished row of section `key` as the check prints it: what it is, then its figures or why it has none."""
    if key == "profile":
        figures = f"wall {row['wall_ms']:.1f} ms, busy {row['busy_ms']:.1f} ms, {row['kernels']} kernels"
        return f"profile     {row['model']:20s} {row['implementation']:16s} {figures}"
    if key == "triton":
        head = f"triton      {row['variant']:20s}"
    else:
        head = f"cost        {row['kind']:6s} {'compiled' if row['compiled'] else 'eager':8s} {row['variant']:20s}"
    if row.get("status", "ok") != "ok":
        return f"{head} {row['status']}: {row.get('reason') or row.get('error')}"
    if key == "cost":
        figures = (f"{k} {v['ratio']:.3f}" if "ratio" in v else f"{k} {v['status']}" for k, v in metrics(row).items())
        return " ".join([head, *figures])
    eager, triton = (row[f"train_{name}"]["ratio"] for name in TRITON_PAIR)
    launches = " -> ".join(str(row["launches"][name]["kernels"]) for name in TRITON_PAIR)
    return f"{head} eager {eager:.3f} triton {triton:.3f} (of the baseline), launches {launches}"


def _ratio_cell(record: dict | None) -> str:
    if not record:
        return "-"
    if "ratio" not in record:
        return record.get("status", "-")
    floor = record.get("aa_floor", {})
    spread = f"[{floor['ratio_min']:.2f}, {floor['ratio_max']:.2f}]" if "ratio_min" in floor else ""
    return f"{record['ratio']:.3f} (A/A {floor.get('ratio', float('nan')):.3f} {spread})".replace(" )", ")")


def table(header: list[str], rows: list[list]) -> list[str]:
    """A markdown table of `rows` under `header`, and a blank line."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(map(str, row)) + " |" for row in rows] + [""]


INTROS = {
    "cost": (
        "Cost",
        "Delta model against its baseline in one process (L{n_layer} D{n_embd}, GPT-2 vocabulary {vocab_size}, Llama"
        " {llama_vocab_size}). Ratio = Delta time per token / baseline's (> 1 is slower; memory: Delta / baseline),"
        " median of interleaved pairs; beside it the baseline timed against itself (A/A: median [min, max] pair)."
        " Training: batch {batch} × {seq}, bf16 autocast, AdamW, {train_pairs} pairs; decoding: {new_tokens} new"
        " tokens after a {prompt}-token prompt, {decode_pairs} pairs; compiled: `torch.compile(fullgraph=True,"
        " dynamic=False)`, backend {compile_backend}, static cache for decoding. Delta models:"
        ' `delta_implementation="auto"` (Triton\'s op on CUDA), and what it ran.',
    ),
    "profile": (
        "Where a training step's time goes",
        "One eager training step (bf16 autocast, AdamW) of GPT-2 and of Delta variants at the cost shape: wall time"
        " (median of 3, no profiler) beside the device's busy time and its kernel launches in one profiled step,"
        " split into matmul, attention and other kernels (by kernel name; memcpy and memset count as other). On the"
        " CPU a stand-in: the matmul and attention operators and the aten operators that call no other. Busy well"
        " below wall: the host's dispatch sets the pace.",
    ),
    "triton": (
        "Triton's Delta residual op against the tensor ops",
        'Each Delta variant with `delta_implementation="eager"` (the tensor ops) and `"triton"` (one'
        " `ddl_hf::delta_residual` op per Delta residual, forward and backward) at the cost shape (L{n_layer}"
        " D{n_embd}, batch {batch} × {seq}): one eager training step (bf16 autocast, AdamW), ratio = Delta time /"
        " baseline's, median of {train_pairs} interleaved pairs, with the baseline's A/A floor as in the cost section;"
        ' triton / eager: the two medians. delta-net: a DeltaNet DeltaGPT, whose "triton" also runs fla\'s delta rule'
        " where installed (fla: whether it ran). Launches: the device's kernels in one profiled step (on the CPU, the"
        " profile section's stand-in), baseline → eager → triton; op calls: the Triton op's forward calls per step."
        " Correctness of both routes: `python -m pytest -m gpu`.",
    ),
}


def _cost_rows(cost: dict) -> list[list]:
    """One row per (variant, eager / compiled): implementation, train step, peak memory, each decoding batch."""
    merged: dict[tuple[str, bool], dict] = {}
    for row in cost["rows"]:
        entry = merged.setdefault((row["variant"], row["compiled"]), {})
        entry.setdefault("implementation", row.get("implementation") or "-")
        if row["status"] == "ok":
            entry.update(metrics(row))
        else:
            entry[row["kind"]] = row["status"] + (f": {row['error']}" if row["status"] == "error" else "")
    rows = []
    for (variant, compiled), entry in merged.items():
        kind = "compiled" if compiled else "eager"
        train = [f"train_{kind}", f"peak_train_memory_{kind}"]
        decode = [f"decode_b{b}_{kind}" for b in cost["decode_batches"]]
        cells = [_ratio_cell(entry[m]) if m in entry else entry.get("train", "-") for m in train]
        cells += [_ratio_cell(entry[m]) if m in entry else entry.get("decode", "-") for m in decode]
        rows.append([variant, kind, entry["implementation"], *cells])
    return rows


def _section_lines(key: str, section: dict) -> list[str]:
    """The section's tables (the `INTROS` text above them), or the line that says why it did not run."""
    title, intro = INTROS[key]
    fields = {**section.get("shape", {}), **{k: v for k, v in section.items() if not isinstance(v, (dict, list))}}
    if section.get("status") in ("skipped", "error"):
        why = section.get("reason") or section.get("error")
        return [f"## {title}", "", f"{section['status'].capitalize()}: {why}.", ""]
    lines = [f"## {title}", "", intro.format_map(fields), ""]
    if section.get("note"):
        lines += [f"**{section['note']}.**", ""]
    rows = section.get("rows", [])
    if key == "cost":
        batches = [f"decode b={b}" for b in section["decode_batches"]]
        header = ["variant", "kind", "implementation", "train step", "peak train memory", *batches]
        lines += [*table(header, _cost_rows(section)), "Absolute tokens/s (memory: MiB), baseline → Delta:", ""]
        absolute = []
        for row in rows:
            for name, m in metrics(row).items():
                if "baseline_tokens_per_s" in m:
                    absolute.append(
                        [row["variant"], name, f"{m['baseline_tokens_per_s']:.0f}", f"{m['delta_tokens_per_s']:.0f}"]
                    )
                elif "baseline_bytes" in m:
                    absolute.append(
                        [row["variant"], name, f"{m['baseline_bytes'] / 2**20:.0f}", f"{m['delta_bytes'] / 2**20:.0f}"]
                    )
        return lines + table(["variant", "metric", "baseline", "Delta"], absolute)
    if key == "profile":
        header = ["model", "implementation", "wall ms", "busy ms", "kernels", "matmul ms", "attention ms"]
        cells = []
        for row in rows:
            c = row["by_class"]
            times = [f"{x:.1f}" for x in (row["wall_ms"], row["busy_ms"], c["matmul"]["ms"], c["attention"]["ms"])]
            other = f"{c['other']['ms']:.1f} ({c['other']['kernels']})"
            cells.append([row["model"], row.get("implementation", "-"), *times[:2], row["kernels"], *times[2:], other])
        lines += table([*header, "other ms (kernels)"], cells)
        for row in rows[1:]:
            top = [[f"`{k['name']}`", k["kernels"], f"{k['ms']:.2f}"] for k in row["top_other"]]
            lines += [f"Costliest other kernels, {row['model']}:", "", *table(["kernel", "launches", "ms"], top)]
        return lines
    cells = []
    for row in rows:
        if "train_triton" not in row:
            cells.append([row["variant"], f"**{row.get('status')}**: {row.get('error')}", "", "", "", ""])
            continue
        counts = row["launches"]
        timed = [_ratio_cell(row["train_eager"]), _ratio_cell(row["train_triton"]), f"{row['triton_vs_eager']:.3f}"]
        kernels = " → ".join(str(counts[name]["kernels"]) for name in ("baseline", *TRITON_PAIR))
        calls = " → ".join(str(counts[name]["triton_op_calls"]) for name in TRITON_PAIR)
        fla = f" (fla: {'yes' if row['fla'] else 'no'})" if "fla" in row else ""
        cells.append([row["variant"] + fla, *timed, kernels, calls])
    header = ["variant", "eager / baseline", "triton / baseline", "triton / eager", "launches", "op calls"]
    return lines + table(header, cells)


def markdown(results: dict) -> str:
    info, totals = results["device"], results["summary"]["counts"]
    cuda = f", CUDA {info['cuda']}, capability {info['capability']}" if info.get("cuda") else ""
    lines = [
        "# GPU check",
        "",
        f"Device: {info['name']} ({info['device']}{cuda}); mode: {'tiny' if results['tiny'] else 'full'}; wall"
        f" {results.get('wall_s', 0):.0f} s. Rows: "
        + ", ".join(f"{n} {s}" for s, n in sorted(totals.items()))
        + ". Correctness and host synchronisation: `python -m pytest -m gpu`.",
        "",
    ]
    for key in ("cost", "profile", "triton"):
        if results.get(key):
            lines += _section_lines(key, results[key])
    failures = results["summary"]["failures"]
    lines += ["## Failures", ""]
    lines += [f"- {f['section']}: {f['check']}: {f['status']} {_why(f)}" for f in failures] or ["None."]
    return "\n".join(lines) + "\n"
