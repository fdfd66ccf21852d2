"""Decoding cost in executed instructions (callgrind): DeltaGPT / GPT-2 without the noise of a shared machine.

bench_overhead.py's CPU-time ratios for decoding at batch 1 swing by ±0.1 while other jobs share the cores: each
token is ~1,000 small ops whose time depends on cache state. The number of instructions a decoding step executes
does not. One process per shape runs under `valgrind --tool=callgrind` with instrumentation off (so imports and
model building run at near native speed); it builds GPT-2 and the DeltaGPT rows (the same `build_pair` as
bench_overhead.py), warms each up, and then, for each model, generates greedily from a 16-token prompt with the KV
cache (batch 1) twice: `max_new_tokens=1` and 1 + N. This script counts each of those windows alone (it switches
instrumentation on, zeroes the counters before a window and dumps them after it, with `callgrind_control`); the
difference of the two windows divided by N is one decoding step, generate's own per-step work included as in
bench_overhead's gen/token (prefill cancels).

Instructions are not time: a cache miss or a large matmul costs more per instruction than dispatch code. The ratio
therefore measures the Delta blocks' dispatch and Python work against GPT-2's per-token work on one count, and
moves only when the code does; the CPU-time ratios of bench_overhead.py remain the measure of time.

    python benchmarks/bench_decode_instructions.py                 # shapes small and gpt2-small (the latter: over
                                                                   # half an hour, building its models under valgrind)
    python benchmarks/bench_decode_instructions.py --shapes small  # about 5 minutes
    python benchmarks/bench_decode_instructions.py --shapes tiny   # a minute or two
    python benchmarks/bench_decode_instructions.py --shapes tiny --attribution --name decode_instructions_tiny
                                            # + what each part of the native model's per-step work costs

Needs `valgrind` on PATH. Writes benchmarks/results/decode_instructions.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import provenance, write_results  # noqa: E402

DELTA_MODELS = ["d_v=1 additive", "d_v=1 paper", "d_v=4 additive", "d_v=4 paper"]
PROMPT_TOKENS = 16


# Attribution rows (`--attribution`): the d_v = 1 additive native model with one more part of its per-step work
# taken out in each row, so that the differences between rows say what each part costs. Their outputs are wrong
# (the residual updates are replaced by GPT-2's add): they are only counted.
ATTRIBUTION = [
    "native, residual updates stubbed",
    "native, stubbed, no input checks",
    "native, stubbed, no checks, not remote code",
]


# Fast-path row (`--attribution`): the default d_v = 1 additive model (Python path) with the fast path that needs
# torch's hook registries (delta_compat.is_unhooked) switched off, as it is where delta_compat cannot read them: the
# gate and value projections called through nn.Module, so no one-token host path. Its outputs are right.
# (`benchmarks/results/decode_instructions_fast_paths.md` also has a row that only put the residuals' own calls back
# on nn.Module's call machinery: +0.7% of GPT-2's instructions per token, which is why that shortcut was removed.)
FAST_PATH_ROWS = ["d_v=1 additive, no fast paths"]


def model_names(attribution: bool = False) -> list[str]:
    """GPT-2, the DeltaGPT rows, and the same rows with the native decoding kernel where it builds here (then the
    attribution and fast-path rows, if asked for)."""
    from ddl_hf.native import native_build_problem

    native = [] if native_build_problem() else [f"{name} native" for name in DELTA_MODELS]
    extra = [*(ATTRIBUTION if native else []), *FAST_PATH_ROWS] if attribution else []
    return ["gpt2", *DELTA_MODELS, *native, *extra]


def without_fast_paths(model):
    """The fast-path row's model: an instance `forward` on each residual's gate and value projections makes
    `is_unhooked` answer no, so they are called through nn.Module and the one-token host path is off, exactly as
    where delta_compat's hook probe failed."""
    for residual in model.delta_residuals().values():
        for linear in (residual.beta_proj, residual.v_proj):
            linear.forward = linear.forward
    return model


def attribution_model(shape: dict, name: str):
    """An attribution row's model: `d_v=1 additive native`, then, cumulatively, residual updates that only add
    the sublayer output, no input validation (`_check_inputs` and the cache / placement checks), and a class that
    transformers does not treat as remote code (no per-step signature probe in `generate`)."""
    from bench_overhead import build_pair

    from ddl_hf.native import enable_native_decoding

    model = enable_native_decoding(build_pair(shape, 1, "additive")[1].eval())
    level = ATTRIBUTION.index(name)

    def add_only(self, state, normed_input=None, branch_output=None, read_from=None):
        return state + branch_output, None

    # A subclass, not an instance `forward`: the block calls it through nn.Module as it calls the real one.
    for block in model.transformer.h:
        for residual in (block.attn_delta, block.mlp_delta):
            residual.__class__ = type("AddOnlyResidual", (type(residual),), {"forward": add_only})
    if level >= 1:
        for check in ("_check_inputs", "check_window_cache", "_check_read_out_placement"):
            setattr(model.transformer, check, lambda *args, **kwargs: None)
    if level >= 2:
        model.__class__ = type("NotRemoteCode", (type(model),), {"_auto_class": None})
    return model


def build_model(shape: dict, name: str):
    """One row's model: GPT-2, or the DeltaGPT `d_v=D MODE [native]` sharing its weights (bench_overhead's
    `build_pair`; `native`: with `ddl_hf.native.enable_native_decoding`)."""
    from bench_overhead import build_pair

    if name == "gpt2":
        return build_pair(shape, 1, "additive")[0].eval()
    if name in ATTRIBUTION:
        return attribution_model(shape, name)
    if name in FAST_PATH_ROWS:
        return without_fast_paths(build_pair(shape, 1, "additive")[1].eval())
    d_v, mode, *native = name.removeprefix("d_v=").split()
    model = build_pair(shape, int(d_v), mode)[1].eval()
    if native:
        from ddl_hf.native import enable_native_decoding

        enable_native_decoding(model)
    return model


def generate(model, prompt, tokens: int) -> None:
    """Greedy decoding of exactly `tokens` new tokens with the KV cache, batch 1."""
    import torch

    with torch.inference_mode():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            pad_token_id=0,
        )
    assert out.shape[1] == prompt.shape[1] + tokens


def child(shape_name: str, new_tokens: int, attribution: bool) -> None:
    """Build every model of one shape and generate when told to: the process that callgrind counts.

    Protocol on stdout/stdin: `window MODEL TOKENS` (then waits for a line), generates, `done` (waits again)."""
    import torch
    from bench_overhead import SHAPES
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    shape = SHAPES[shape_name]
    models = {name: build_model(shape, name) for name in model_names(attribution)}
    prompt = torch.randint(1, shape["vocab_size"], (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))

    for model in models.values():  # lazy initialisation inside torch and transformers happens here
        generate(model, prompt, 2 + new_tokens)
    for name, model in models.items():
        for tokens in (1, 1 + new_tokens):
            print(f"window {name} {tokens}", flush=True)
            sys.stdin.readline()
            generate(model, prompt, tokens)
            print("done", flush=True)
            sys.stdin.readline()


def self_costs(dump: str) -> tuple[dict[str, int], dict[str, int]]:
    """Self instructions of one callgrind dump by shared object and by function (`object: function`).

    Reads callgrind's format: `ob=` / `fn=` set where the following cost lines go (`cob=` / `cfn=` only name
    callees; all four may define a compressed `(id) name`), and the cost line after `calls=` is the callee's
    inclusive cost, which is not the caller's own. The sums over objects equal the total of a finished run's dump.
    """
    import collections

    names: dict[str, dict[str, str]] = {"ob": {}, "fn": {}}
    current = {"ob": "?", "fn": "?"}
    by_object: collections.Counter = collections.Counter()
    by_function: collections.Counter = collections.Counter()
    callee_cost_next = False
    for line in dump.splitlines():
        if line[:1].isdigit() or line[:1] in ("+", "-", "*"):
            if callee_cost_next:
                callee_cost_next = False
                continue
            cost = int(line.split()[1])
            by_object[current["ob"]] += cost
            by_function[f"{current['ob']}: {current['fn']}"] += cost
            continue
        key, sep, rest = line.partition("=")
        if not sep:
            continue
        if key == "calls":
            callee_cost_next = True
        elif key in ("ob", "cob", "fn", "cfn"):
            table = names[key.removeprefix("c")]
            match = re.match(r"\((\d+)\)\s*(.*)", rest)
            if match:
                ident, name = match.groups()
                name = table.setdefault(ident, name) if name else table.get(ident, ident)
            else:
                name = rest
            if key in current:
                current[key] = Path(name).name if key == "ob" else name
    return dict(by_object), dict(by_function)


def measure_shape(shape_name: str, new_tokens: int, folder: Path, attribution: bool) -> dict[str, dict[int, dict]]:
    """{model: {new tokens: {"total", "by_object", "by_function"}}}: instructions of that generate call alone."""
    out = folder / f"callgrind-{shape_name}"
    command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]
    command += [sys.executable, __file__, "--child", shape_name, str(new_tokens)]
    command += ["--attribution"] if attribution else []
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0", TOKENIZERS_PARALLELISM="false")
    child_process = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )

    def control(*flags: str) -> None:
        subprocess.run(["callgrind_control", *flags, str(child_process.pid)], check=True, capture_output=True)

    counts: dict[str, dict[int, dict]] = {}
    dumps = 0
    try:
        for line in child_process.stdout:
            if not line.startswith("window "):
                continue
            name, tokens = line.removeprefix("window ").strip().rsplit(" ", 1)  # model names contain spaces
            if not dumps:  # the child is up and waiting: callgrind can take commands now
                control("--instr=on")
            control("--zero")
            child_process.stdin.write("go\n")
            child_process.stdin.flush()
            if child_process.stdout.readline().strip() != "done":
                raise RuntimeError("the child stopped in a window")
            control("--dump")
            dumps += 1
            text = Path(f"{out}.{dumps}").read_text()
            total = int(re.search(r"^(?:summary|totals):\s+(\d+)", text, re.M)[1])
            by_object, by_function = self_costs(text)
            # A dump of a finished run sums exactly; one taken mid-run (callgrind_control) differs by a few hundred
            # instructions in ~10^7 (the frames still on the stack); more means the format was misread.
            if abs(sum(by_object.values()) - total) > 1e-4 * total:
                raise RuntimeError(f"callgrind dump not understood: {sum(by_object.values())} != {total}")
            counts.setdefault(name, {})[int(tokens)] = dict(total=total, by_object=by_object, by_function=by_function)
            child_process.stdin.write("next\n")
            child_process.stdin.flush()
    finally:
        child_process.stdin.close()
        if child_process.wait() != 0:
            raise RuntimeError(f"callgrind child failed ({shape_name}):\n{child_process.stderr.read()[-2000:]}")
    return counts


def count_ops(shape_name: str, new_tokens: int, attribution: bool) -> dict[str, dict]:
    """{model: {"per_token": aten ops per decoding step, "by_op": {op: calls per step}}}, counted by torch.profiler.

    The same windows as the instruction count (1 and 1 + N new tokens after a warm-up), in this process: every
    aten operator call is one trip through the dispatcher, the fixed cost that dominates decoding at batch 1."""
    import collections

    import torch
    from bench_overhead import SHAPES
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    shape = SHAPES[shape_name]
    prompt = torch.randint(1, shape["vocab_size"], (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
    results = {}
    for name in model_names(attribution):
        model = build_model(shape, name)
        counts = {}
        for tokens in (2 + new_tokens, 1, 1 + new_tokens):  # the first is the warm-up
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                generate(model, prompt, tokens)
            counts[tokens] = collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::"))
        by_op = {op: (counts[1 + new_tokens][op] - counts[1][op]) / new_tokens for op in counts[1 + new_tokens]}
        by_op = {op: n for op, n in sorted(by_op.items(), key=lambda item: -item[1]) if n}
        results[name] = {"per_token": sum(by_op.values()), "by_op": by_op}
    return results


def attribution_lines(rows: list[dict]) -> list[str]:
    """What each part of the native d_v = 1 model's per-step work costs: the instructions per token that each
    attribution row (one more part taken out) saves over the row before it, and what is left over GPT-2."""
    lines = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        per_token = {r["model"]: r["per_token"] for r in rows if r["shape"] == shape}
        if not all(name in per_token for name in ATTRIBUTION):
            continue
        chain = ["d_v=1 additive native", *ATTRIBUTION]
        added = per_token[chain[0]] - per_token["gpt2"]
        parts = [
            (
                "the residual updates beyond an add (the native kernel's call and the Python around it)",
                chain[0],
                chain[1],
            ),
            ("input validation (`_check_inputs`, cache and placement checks)", chain[1], chain[2]),
            ("transformers' per-step signature probe of remote-code models", chain[2], chain[3]),
        ]
        lines += [
            "",
            f"Where `d_v=1 additive native` spends its {added:,.0f} added instructions per token ({shape}): each "
            "attribution row takes one more part out (its outputs are then wrong; it is only counted):",
            "",
            "| part | instructions per token | share |",
            "|---|---|---|",
        ]
        for label, before, after in parts:
            cost = per_token[before] - per_token[after]
            lines.append(f"| {label} | {cost:,.0f} | {cost / added:.0%} |")
        rest = per_token[chain[-1]] - per_token["gpt2"]
        lines.append(f"| the rest of the model's per-step Python over GPT-2's | {rest:,.0f} | {rest / added:.0%} |")
    for shape in dict.fromkeys(r["shape"] for r in rows):
        per_token = {r["model"]: r["per_token"] for r in rows if r["shape"] == shape}
        if not all(name in per_token for name in FAST_PATH_ROWS):
            continue
        base, gpt2 = per_token["d_v=1 additive"], per_token["gpt2"]
        lines += [
            "",
            f"What the fast path that reads torch's hook registries saves ({shape}, d_v=1 additive, Python path): the "
            "row with it off, as where `delta_compat` cannot read the registries:",
            "",
            "| row | instructions per token | over the default | ratio to GPT-2 |",
            "|---|---|---|---|",
            f"| default | {base:,.0f} | | {base / gpt2:.3f} |",
        ]
        for name in FAST_PATH_ROWS:
            cost = per_token[name]
            lines.append(f"| {name.split(', ')[1]} | {cost:,.0f} | +{cost - base:,.0f} | {cost / gpt2:.3f} |")
    return lines


def markdown(results: dict) -> str:
    lines = [
        f"Instructions per decoding step at batch 1 (greedy `generate`, KV cache, {PROMPT_TOKENS}-token prompt), "
        f"counted by callgrind: (run with 1 + N new tokens − run with 1) / N, N = {results['new_tokens']}. Ratio = "
        "DeltaGPT / GPT-2 of the same shape. Deterministic: it does not depend on other jobs on the machine.",
        "",
        "| shape | model | instructions per token | ratio to GPT-2 | aten ops per token | ratio to GPT-2 |",
        "|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        base = row["model"] == "gpt2"
        lines.append(
            f"| {row['shape']} | {row['model']} | {row['per_token']:,.0f} | "
            f"{'' if base else format(row['ratio'], '.3f')} | {row['ops_per_token']:,.0f} | "
            f"{'' if base else format(row['ops_ratio'], '.3f')} |"
        )
    lines += attribution_lines(results["rows"])
    lines += [
        "",
        "Aten operator calls per decoding step that each DeltaGPT adds to GPT-2's (torch.profiler, same windows; "
        "per Delta block = added / (2 x layers)):",
        "",
        "| shape | model | added ops per Delta block | largest additions (calls per block) |",
        "|---|---|---|---|",
    ]
    for row in results["rows"]:
        if row["model"] != "gpt2" and row["model"] not in ATTRIBUTION:
            added = ", ".join(f"{op.removeprefix('aten::')} {n:g}" for op, n in row["added_ops_per_block"][:8])
            lines.append(f"| {row['shape']} | {row['model']} | {row['added_per_block']:.1f} | {added} |")
    lines += [
        "",
        "Where each Delta block's added instructions go (callgrind self cost, DeltaGPT − GPT-2 per decoding step, "
        "divided by 2 x layers), by shared object, then the functions that add most:",
        "",
        "| shape | model | added instructions per Delta block | by object (share) | top functions (instructions) |",
        "|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        if row["model"] in ("gpt2", *ATTRIBUTION) or "added_instructions_by_object" not in row:
            continue
        total = sum(n for _, n in row["added_instructions_by_object"])
        objects = ", ".join(
            f"{name} {n / total:.0%}" for name, n in row["added_instructions_by_object"][:5] if n / total >= 0.01
        )
        functions = "; ".join(
            f"`{name.split(': ', 1)[-1][:60]}` {n:,.0f}" for name, n in row["added_instructions_by_function"][:6]
        )
        lines.append(f"| {row['shape']} | {row['model']} | {total:,.0f} | {objects} | {functions} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["small", "gpt2-small"], help="shapes of bench_overhead.py")
    parser.add_argument("--new-tokens", type=int, default=8, help="N: decoding steps in the difference")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="output folder")
    parser.add_argument("--name", default="decode_instructions", help="basename of the result files")
    parser.add_argument(
        "--attribution",
        action="store_true",
        help="also count rows that take the native model's per-step work apart (residual, input checks, ...) and "
        "rows without the fast paths that read torch's hook registries",
    )
    parser.add_argument("--child", nargs=2, metavar=("SHAPE", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child[0], int(args.child[1]), args.attribution)
    if shutil.which("valgrind") is None:
        sys.exit("error: valgrind is not on PATH; install it (e.g. `apt-get install valgrind`) to count instructions")
    import torch
    from bench_overhead import SHAPES
    from tqdm.auto import tqdm

    torch.set_num_threads(1)  # as in the counted processes, so that the provenance says so
    prov = provenance()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in tqdm(args.shapes, desc="callgrind", unit="shape"):
            counts = measure_shape(shape, args.new_tokens, Path(tmp), args.attribution)
            ops = count_ops(shape, args.new_tokens, args.attribution)
            for model in model_names(args.attribution):
                first, last = counts[model][1], counts[model][1 + args.new_tokens]

                def per_token(key: str, first=first, last=last) -> dict[str, float]:
                    names = set(first[key]) | set(last[key])
                    diff = {n: (last[key].get(n, 0) - first[key].get(n, 0)) / args.new_tokens for n in names}
                    return {n: v for n, v in diff.items() if v}

                rows.append(
                    {
                        "shape": shape,
                        "model": model,
                        "per_token": (last["total"] - first["total"]) / args.new_tokens,
                        "windows": {tokens: window["total"] for tokens, window in counts[model].items()},
                        "by_object": per_token("by_object"),
                        "by_function": per_token("by_function"),
                        "ops_per_token": ops[model]["per_token"],
                        "ops_by_op": ops[model]["by_op"],
                    }
                )
    for row in rows:
        base = next(r for r in rows if r["shape"] == row["shape"] and r["model"] == "gpt2")
        row["ratio"] = row["per_token"] / base["per_token"]
        row["ops_ratio"] = row["ops_per_token"] / base["ops_per_token"]
        blocks = 2 * SHAPES[row["shape"]]["n_layer"]
        row["added_per_block"] = (row["ops_per_token"] - base["ops_per_token"]) / blocks
        added = {op: (n - base["ops_by_op"].get(op, 0)) / blocks for op, n in row["ops_by_op"].items()}
        row["added_ops_per_block"] = sorted(((op, n) for op, n in added.items() if n > 0), key=lambda x: -x[1])
        for key in ("by_object", "by_function"):  # instructions per Delta block, by where they are spent
            names = set(row[key]) | set(base[key])
            added = {n: (row[key].get(n, 0) - base[key].get(n, 0)) / blocks for n in names}
            row[f"added_instructions_{key}"] = sorted(added.items(), key=lambda x: -x[1])[:25]
    for row in rows:  # the per-function tables are only kept as the added top 25
        row.pop("by_function")
    results = {"provenance": prov, "new_tokens": args.new_tokens, "rows": rows}
    write_results(args.out, args.name, results, markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
