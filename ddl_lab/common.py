"""What every benchmark, study and check of the lab shares: provenance, the results writer, and timing with the A/A
floor.

    from ddl_lab.common import provenance, write_results, interleaved

    prov = provenance()                          # call once at start, after torch.set_num_threads
    row = interleaved(step_a, step_b, pairs=9)   # B / A in alternating pairs; time A against a copy of A for the floor
    ...
    write_results(out_dir, "name", {"provenance": prov, ...}, markdown_body)
    save_figure(fig, out_dir / "name.png")          # a figure drawn with pyplot(): laid out, 120 dpi, closed

Every results JSON gets a `provenance` block (the exact command, as `python -m ddl_lab.<folder>.<tool> ...`, the git
commit, the machine, the versions, the date in UTC) and every Markdown results file a short header made from the
same block. Everything written is passed through `scrub_paths` first, so no absolute path of this machine (the repo
root, the home folder, the temporary folder) ends up in committed results. Files are written atomically (a temporary
file in the same folder, then `os.replace`), so an interrupted run never leaves a half-written result behind.

Timing is process CPU time of interleaved A/B pairs (ABBA...: slow drift of a noisy machine cancels), reported as the
median of the per-pair ratios B / A with the smallest and largest pair; on an accelerator (`device=`) wall time, the
device synchronised around each call. A ratio means something only next to the A/A floor: the baseline timed the
same way against a copy of itself, how far a ratio strays from 1.0 when nothing differs (`ratio_spread` prints
either). What is timed is built here too: a training step (`train_step_fn`), greedy decoding (`generate_fn`), and
the peak memory of a training step (`peak_step_memory`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext, suppress
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

REPO_ROOT = Path(__file__).resolve().parents[1]


# --- path scrubbing --------------------------------------------------------------------------------------------


def _prefixes() -> list[tuple[str, str]]:
    """(absolute prefix, replacement), most specific first: repo root -> relative, home -> ~, temp dir -> $TMPDIR."""
    pairs: list[tuple[str, str]] = []

    def add(path: str | os.PathLike | None, replacement: str) -> None:
        if not path:
            return
        for variant in {str(Path(path)), os.path.realpath(path)}:
            if variant not in ("/", "") and all(variant != p for p, _ in pairs):
                pairs.append((variant.rstrip("/"), replacement))

    add(REPO_ROOT, "")
    add(os.path.expanduser("~"), "~")
    add(tempfile.gettempdir(), "$TMPDIR")
    return sorted(pairs, key=lambda pair: len(pair[0]), reverse=True)  # a longer prefix wins (repo under home)


def scrub_text(text: str) -> str:
    """Replace absolute paths under the repo root (-> relative), home (-> ~) or temp dir (-> $TMPDIR) in `text`."""
    for prefix, replacement in _prefixes():
        # the prefix must end at a path boundary: "/root" matches "/root/x" and "/root", not "/rootfs"
        pattern = re.compile(re.escape(prefix) + r"(/|(?![\w.\-]))")
        if replacement:
            text = pattern.sub(lambda m, r=replacement: r + m.group(1), text)
        else:  # the repo root: "<root>/a/b" -> "a/b", "<root>" alone -> "."
            text = pattern.sub(lambda m: "" if m.group(1) == "/" else ".", text)
    return text


def scrub_paths(obj: Any) -> Any:
    """A copy of a JSON-like object (dict / list / tuple / str / Path / scalars) with every string scrubbed."""
    if isinstance(obj, dict):
        return {scrub_paths(k) if isinstance(k, str) else k: scrub_paths(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [scrub_paths(v) for v in obj]
    if isinstance(obj, (str, os.PathLike)):
        return scrub_text(os.fspath(obj))
    return obj


# --- provenance --------------------------------------------------------------------------------------------------


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that ran, quoted so that it can be pasted into a shell at the repo root: a module of the lab as
    `python -m ddl_lab.<folder>.<tool> <args>` (`argv[0]`, as `python -m` sets it, is the module's file), any
    other script as `python <its path relative to the repo root> <args>`."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]) if argv else Path("?")
    with suppress(ValueError):  # a script outside the repo keeps its own (scrubbed) path
        script = script.resolve().relative_to(REPO_ROOT)
    if script.parts[:1] == ("ddl_lab",) and script.suffix == ".py":
        return scrub_text(shlex.join(["python", "-m", ".".join(script.with_suffix("").parts), *argv[1:]]))
    return scrub_text(shlex.join(["python", script.as_posix(), *argv[1:]]))


def git_state(root: Path = REPO_ROOT) -> dict:
    """{"commit": short hash, "dirty": bool}; commit None (and an "error") where this is not a git checkout."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None, "error": "not a git checkout"}
    return {"commit": commit, "dirty": dirty}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "?"


def machine() -> dict:
    import torch

    return {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }


def versions() -> dict:
    import torch

    try:
        import transformers

        transformers_version = transformers.__version__
    except ImportError:
        transformers_version = None
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers_version}


def provenance(argv: Sequence[str] | None = None) -> dict:
    """Where a result comes from. Call it after `torch.set_num_threads`, so that the thread count is the one used."""
    return {
        "command": command_line(argv),
        "git": git_state(),
        "machine": machine(),
        "versions": versions(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def markdown_header(prov: dict) -> str:
    """A short block quote naming command, commit, machine, versions and date, for the top of a results file."""
    git, m, v = prov["git"], prov["machine"], prov["versions"]
    if git.get("commit"):
        commit = f"`{git['commit']}`" + (" (with uncommitted changes)" if git.get("dirty") else "")
    else:
        commit = "unknown (not a git checkout)"
    return (
        f"> Command: `{prov['command']}`  \n"
        f"> Commit: {commit}; date: {prov['date']}  \n"
        f"> Machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, {m['torch_threads']} torch thread(s)  \n"
        f"> Versions: Python {v['python']}, torch {v['torch']}, transformers {v['transformers']}\n"
    )


# --- timing with the A/A floor, and memory --------------------------------------------------------------------


def synchronize(device: torch.device | None) -> None:
    """Wait for the work queued on `device` (CUDA); the CPU (or no device) has none queued."""
    if device is not None and device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device | None = None) -> tuple[float, float]:
    """(process CPU seconds, wall seconds) of one call; `device` synchronised before and after, so that the wall time
    holds the work the call queued there."""
    synchronize(device)
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    synchronize(device)
    return time.process_time() - cpu, time.perf_counter() - wall


def _medians(a: list[float], b: list[float]) -> tuple[float, float, dict]:
    """Median of A, median of B, and the per-pair ratios B / A: median, smallest, largest."""
    ratios = [tb / ta for ta, tb in zip(a, b)]
    spread = {"ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
    return statistics.median(a), statistics.median(b), spread


def interleaved(
    fn_a: Callable[[], object],
    fn_b: Callable[[], object],
    pairs: int,
    warmup: int = 1,
    device: torch.device | None = None,
) -> dict:
    """Median times of A and B and the median of the per-pair ratios B / A, order alternating per pair, after
    `warmup` calls of each.

    Without `device` (the lab's CPU benchmarks) the times are process CPU seconds (`gpt2_s`, `delta_s`, `ratio`,
    `ratio_min`, `ratio_max`), wall seconds beside them (`gpt2_wall_s`, `delta_wall_s`, `wall_ratio`). With `device`,
    the one the calls run on, they are wall seconds alone, `device` synchronised around each call (an accelerator's
    work is no CPU time of this process): `baseline_s`, `delta_s`, `ratio`, `ratio_min`, `ratio_max`."""
    for _ in range(warmup):
        fn_a()
        fn_b()
    a, b = [], []
    for i in range(pairs):
        for fn, times in ((fn_a, a), (fn_b, b)) if i % 2 == 0 else ((fn_b, b), (fn_a, a)):
            times.append(timed(fn, device))
    wall_a, wall_b, wall = _medians([t[1] for t in a], [t[1] for t in b])
    if device is not None:
        return {"baseline_s": wall_a, "delta_s": wall_b, **wall, "pairs": pairs}
    cpu_a, cpu_b, cpu = _medians([t[0] for t in a], [t[0] for t in b])
    return {
        "gpt2_s": cpu_a,
        "delta_s": cpu_b,
        **cpu,
        "gpt2_wall_s": wall_a,
        "delta_wall_s": wall_b,
        "wall_ratio": wall["ratio"],
        "pairs": pairs,
    }


def ratio_spread(timing: dict) -> str:
    """`median [smallest, largest pair]` of an `interleaved` result's ratios, as every report prints them."""
    return f"{timing['ratio']:.3f} [{timing['ratio_min']:.3f}, {timing['ratio_max']:.3f}]"


def train_step_fn(
    model: torch.nn.Module,
    ids: torch.Tensor,
    optimizer: torch.optim.Optimizer | None = None,
    autocast: torch.dtype | None = None,
) -> tuple[Callable[[], None], torch.optim.Optimizer]:
    """One training step (forward with the inputs as labels, under autocast to `autocast` where given; backward,
    AdamW) as a callable, and its optimizer."""
    import torch

    model.train()
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        with torch.autocast(ids.device.type, dtype=autocast) if autocast else nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, optimizer


def live_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages of parameters, buffers and optimizer state."""
    import torch

    tensors = [*model.parameters(), *model.buffers()]
    for state in optimizer.state.values():
        tensors += [t for t in state.values() if torch.is_tensor(t)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def peak_train_bytes(step: Callable[[], None], model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Peak tensor bytes of one training step on the CPU (run after a warm-up step, so AdamW state already exists):
    what lives before it plus the running sum of the allocations torch.profiler records."""
    from torch.profiler import ProfilerActivity, profile

    before = live_bytes(model, optimizer)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return before + peak


def peak_step_memory(step: Callable[[], None], model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Peak tensor bytes of one training step (`bytes`), on the model's device: the model's parameters, buffers and
    AdamW state, plus the most the step allocates on top (CUDA: the caching allocator's peak above what was allocated
    when the step began; CPU: `peak_train_bytes`). On CUDA also the allocator's own readings, everything in the
    process counted: `allocated_at_start` and `peak_allocated` (what a graph keeps between steps shows there)."""
    import torch

    device = next(model.parameters()).device
    if device.type != "cuda":
        return {"bytes": peak_train_bytes(step, model, optimizer)}
    before = live_bytes(model, optimizer)
    synchronize(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return {"bytes": before + peak - start, "allocated_at_start": start, "peak_allocated": peak}


def generate_fn(
    model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int, compiled: bool = False, **compile_options: Any
) -> Callable[[], None]:
    """Greedy `generate` of exactly `new_tokens` with the KV cache; `compiled`: the static cache and transformers'
    compiled decoding step (`fullgraph=True`; `compile_options`: CompileConfig's others, e.g. `backend`, `dynamic`)."""
    import torch
    from transformers import CompileConfig

    mask = torch.ones_like(prompt)
    extra = {}
    if compiled:
        compile_config = CompileConfig(fullgraph=True, mode="default", **compile_options)
        compile_config._compile_all_devices = True  # transformers compiles on CUDA only unless asked
        extra = dict(cache_implementation="static", compile_config=compile_config)

    def run() -> None:
        with torch.inference_mode():
            out = model.generate(
                prompt,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
                **extra,
            )
        assert out.shape[1] == prompt.shape[1] + new_tokens

    return run


def train_and_decode(
    model_a: torch.nn.Module,
    model_b: torch.nn.Module,
    ids: torch.Tensor,
    prompt: torch.Tensor,
    pairs: int,
    new_tokens: int,
    decode_pairs: int | None = None,
) -> dict:
    """B / A of a training step on `ids` and of batch-1 greedy decoding of `new_tokens` after `prompt`, interleaved
    pairs each (`decode_pairs`, default `pairs`, for the decoding); both models are left in eval mode. With B a copy
    of A this is the A/A floor."""
    step_a, _ = train_step_fn(model_a, ids)
    step_b, _ = train_step_fn(model_b, ids)
    train = interleaved(step_a, step_b, pairs)
    for model in (model_a, model_b):
        model.eval()
    decode = interleaved(
        generate_fn(model_a, prompt, new_tokens), generate_fn(model_b, prompt, new_tokens), decode_pairs or pairs
    )
    return {"train_step": train, "generation_b1": decode}


# --- the studies' command line ------------------------------------------------------------------------------------


def study_parser(description: str | None, quick: str, output_dir: str | os.PathLike) -> argparse.ArgumentParser:
    """The options every resumable study shares (study 2's pipeline and those built on it): `--quick` (`quick` says
    what it runs), `--report-only`, `--cache-dir`, `--output-dir` (default `output_dir`) and `--workers`."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--report-only", action="store_true", help="write the report from the finished runs")
    parser.add_argument("--cache-dir", default=None, help="default: $DDL_HF_CACHE or ~/.cache/ddl_hf, /pretrain")
    parser.add_argument("--output-dir", default=str(output_dir), help="results (default: results/ beside the study)")
    parser.add_argument("--workers", type=int, default=None, help="runs at a time (default: the plan's)")
    return parser


def study_plan(plans: dict[str, Any], args: argparse.Namespace) -> Any:
    """The plan of a `study_parser` study's command line: `plans["quick"]` with `--quick`, else `plans["full"]`; its
    `workers` replaced by `--workers` where given."""
    plan = plans["quick" if args.quick else "full"]
    return plan if args.workers is None else dataclasses.replace(plan, workers=args.workers)


# --- figures -----------------------------------------------------------------------------------------------------


def pyplot() -> Any:
    """`matplotlib.pyplot` on the Agg backend (files only, no display needed), as every results figure is drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | os.PathLike) -> Path:
    """Lay `fig` out (unless it has a layout engine of its own), write it to `path` at 120 dpi and close it."""
    plt = pyplot()
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


# --- writing -----------------------------------------------------------------------------------------------------


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `path`; once the block succeeds it replaces `path` in one step."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes the file private; give it the mode a plain open() would
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Scrubbed, indented JSON, written atomically."""
    return atomic_write_text(path, json.dumps(scrub_paths(obj), indent=2) + "\n")


def write_markdown(path: str | os.PathLike, body: str, prov: dict | None) -> Path:
    """`body` with the provenance header (after the first `# title` line if there is one), scrubbed, atomically."""
    if prov is not None:
        header = markdown_header(prov)
        if body.startswith("# "):
            title, _, rest = body.partition("\n")
            body = f"{title}\n\n{header}\n{rest.lstrip(chr(10))}"
        else:
            body = f"{header}\n{body}"
    return atomic_write_text(path, scrub_text(body))


def write_results(out_dir: str | os.PathLike, name: str, results: dict, markdown: str | None = None) -> dict:
    """Write `<out_dir>/<name>.json` (and `<name>.md` when `markdown` is given), provenance first.

    `results["provenance"]` is used if present (take it at the start of the run), else taken now. Returns the
    paths written, by suffix.
    """
    out_dir = Path(out_dir)
    prov = results.get("provenance") or provenance()
    results = {"provenance": prov, **{k: v for k, v in results.items() if k != "provenance"}}
    written = {"json": write_json(out_dir / f"{name}.json", results)}
    if markdown is not None:
        written["md"] = write_markdown(out_dir / f"{name}.md", markdown, prov)
    return written
