"""Time and memory of the delta rule: chunkwise (WY/UT) vs the recurrent loop vs softmax attention (SDPA), on CPU.

    python -m ddl_lab.benchmarks.bench_delta_net            # full run, writes results/delta_net_bench.{json,md}
    python -m ddl_lab.benchmarks.bench_delta_net --quick    # short lengths; writes only with --out (*_quick.*)
    python -m ddl_lab.benchmarks.bench_delta_net --quick --methods chunkwise --passes forward  # one process: a check

Sizes: batch 1, 4 heads, d_k = d_v = 64 (one layer of a 256-wide model), float32, `--threads` CPU threads (default 1:
the numbers stay comparable on a shared machine). Every (method, pass) runs in a fresh subprocess (its own allocator
and peak-memory counter, untouched by the other methods), warmed up on T = 64; `--methods` and `--passes` pick some
of them (a selection, like `--quick`, writes only with --out, as *_selection.*). Time: the best of several runs.
Memory, measured after all timings: peak resident memory above the resident memory before one more call (VmHWM, reset
through /proc/self/clear_refs; glibc malloc is then told to mmap every block >= 64 KiB and to trim, so that freed
tensors leave RSS and every length starts from the same baseline).
Generation: a 2-layer DeltaGPT (n_embd 256, 4 heads) with each token mixer; after prefilling L tokens, the median
time of 16 single-token steps with the cache, and the size of the cache. Training: the same two models (same Delta
residuals, only the token mixer differs), one training step (forward, backward, AdamW) at batch 1 and T = 256 and
2048, as the ratio DeltaNet / softmax attention of process CPU time (median of interleaved pairs, as in
`bench_overhead.py`).

Goals: chunkwise >= 5x faster than the recurrent loop at T = 2048; chunkwise time at T = 8192 <= 9x T = 1024;
DeltaNet time per generated token flat in the context length.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from ddl_hf.delta_compat import cache_of
from ddl_lab.common import REPO_ROOT, interleaved, provenance, ratio_spread, train_step_fn, write_results

RESULTS = Path(__file__).resolve().parent / "results"
WORKER_MODULE = "ddl_lab.benchmarks.bench_delta_net"  # a worker runs `python -m WORKER_MODULE --worker ...`

BATCH, HEADS, HEAD_DIM, CHUNK = 1, 4, 64, 64
LENGTHS = (512, 1024, 2048, 4096, 8192)
METHODS = ("chunkwise", "recurrent", "sdpa")
METHOD_NAMES = {"chunkwise": "chunkwise", "recurrent": "recurrent loop", "sdpa": "SDPA (softmax)"}
PASSES = ("forward", "forward+backward")
GEN_CONTEXTS = (256, 1024, 2048, 4096, 8192)
GEN_STEPS = 16
TRAIN_LENGTHS = (256, 2048)
TRAIN_PAIRS = 5


def make_inputs(seq_len: int, requires_grad: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape = (BATCH, HEADS, seq_len, HEAD_DIM)
    q = torch.nn.functional.normalize(torch.randn(shape, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(shape, generator=g), dim=-1)
    v = torch.randn(shape, generator=g)
    beta = torch.rand(BATCH, HEADS, seq_len, generator=g)
    return [x.requires_grad_(requires_grad) for x in (q, k, v, beta)]


def run_method(method: str, inputs: list[torch.Tensor], backward: bool) -> None:
    from ddl_hf.delta_net_ops import delta_rule_chunkwise, delta_rule_recurrent

    q, k, v, beta = inputs
    with torch.set_grad_enabled(backward):
        if method == "chunkwise":
            out = delta_rule_chunkwise(q, k, v, beta, CHUNK)[0]
        elif method == "recurrent":
            out = delta_rule_recurrent(q, k, v, beta)[0]
        else:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        if backward:
            out.sum().backward()


def resident_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def worker(method: str, backward: bool, lengths: list[int]) -> list[dict]:
    """One (method, pass) in its own process: warm up on T = 64, time every length, then measure peak memory."""
    run_method(method, make_inputs(64, backward), backward)
    rows = []
    for seq_len in lengths:
        repeats = 5 if method != "recurrent" else 3 if seq_len < 4096 else 1
        inputs, times = make_inputs(seq_len, backward), []
        for _ in range(repeats):
            start = time.perf_counter()
            run_method(method, inputs, backward)
            times.append(time.perf_counter() - start)
        rows.append({"time_s": min(times), "times_s": times})
    libc = mmap_large_blocks()
    for seq_len, row in zip(lengths, rows):
        row["peak_mib"] = peak_memory_mib(method, seq_len, backward, libc)
    return rows


def mmap_large_blocks():
    """glibc: serve every block >= 64 KiB by mmap, so a freed tensor leaves RSS. None where that is unavailable."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        if libc.mallopt(-3, 65536) != 1:  # M_MMAP_THRESHOLD
            return None
        Path("/proc/self/clear_refs").write_text("5")  # can the peak-RSS counter be reset here?
        return libc
    except (OSError, AttributeError):
        return None


def peak_memory_mib(method: str, seq_len: int, backward: bool, libc) -> float | None:
    """Peak resident memory of one call above the resident memory before it (inputs included in the baseline)."""
    if libc is None:
        return None
    inputs = make_inputs(seq_len, backward)
    libc.malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = resident_kib("VmRSS")
    run_method(method, inputs, backward)
    return (resident_kib("VmHWM") - before) / 1024


def measure(method: str, backward: bool, lengths: tuple[int, ...], threads: int) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))  # ddl_lab, from anywhere
    args = [sys.executable, "-m", WORKER_MODULE, "--worker", method, str(int(backward)), ",".join(map(str, lengths))]
    output = subprocess.run(args, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def mixer_model(mixer: str, positions: int):
    """A 2-layer DeltaGPT (n_embd 256, 4 heads) with the given token mixer; the same seed for both mixers."""
    import ddl_hf  # noqa: F401
    from ddl_hf import DeltaGPTConfig, DeltaGPTForCausalLM

    torch.manual_seed(0)
    config = DeltaGPTConfig(
        vocab_size=1024, n_positions=positions, n_embd=HEADS * HEAD_DIM, n_layer=2, n_head=HEADS,
        token_mixer=mixer, delta_beta_init=0.5,
    )  # fmt: skip
    return DeltaGPTForCausalLM(config)


def training_step_ratio(lengths: tuple[int, ...], pairs: int) -> list[dict]:
    """DeltaNet / softmax attention: one training step of each model at batch 1, interleaved pairs."""
    rows = []
    for seq_len in lengths:
        ids = torch.randint(0, 1024, (1, seq_len), generator=torch.Generator().manual_seed(0))
        attention, delta_net = (mixer_model(mixer, seq_len) for mixer in ("attention", "delta_net"))
        timing = interleaved(train_step_fn(attention, ids)[0], train_step_fn(delta_net, ids)[0], pairs)
        rows.append(
            {
                "seq_len": seq_len,
                "attention_s": timing["gpt2_s"],
                "delta_net_s": timing["delta_s"],
                "ratio": timing["ratio"],
                "ratio_min": timing["ratio_min"],
                "ratio_max": timing["ratio_max"],
                "pairs": pairs,
            }
        )
        print(f"training step T={seq_len}: DeltaNet / attention {timing['ratio']:.3f}", flush=True)
    return rows


def generation_per_token(mixer: str, contexts: tuple[int, ...]) -> list[dict]:
    """Prefill `context` tokens, then time GEN_STEPS single-token steps with the cache."""
    model = mixer_model(mixer, max(contexts) + GEN_STEPS).eval()
    rows = []
    with torch.no_grad():
        model(torch.randint(0, 1024, (1, 64)), use_cache=True)  # warm-up
        for context in contexts:
            out = model(torch.randint(0, 1024, (1, context)), use_cache=True)
            cache, token = cache_of(out), out.logits[:, -1:].argmax(-1)
            times = []
            for _ in range(GEN_STEPS):
                start = time.perf_counter()
                out = model(token, cache=cache, use_cache=True)
                times.append(time.perf_counter() - start)
                token = out.logits[:, -1:].argmax(-1)
            ms = 1e3 * statistics.median(times)
            rows.append({"context": context, "ms_per_token": ms, "cache_mib": cache_bytes(cache) / 2**20})
    return rows


def cache_bytes(cache) -> int:
    """KV tensors of an attention cache, or conv windows and recurrent states of a DeltaNetCache."""
    tensors = []
    for layer in cache.layers:
        if hasattr(layer, "recurrent_states"):
            tensors += [*layer.conv_states.values(), *layer.recurrent_states.values()]
        else:
            tensors += [layer.keys, layer.values]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def markdown(results: dict) -> str:
    ops, methods = results["ops"], results["methods"]
    ratio = {"chunkwise", "recurrent"} <= set(methods)
    lines = [
        "# DeltaNet benchmark (CPU)",
        "",
        f"{results['threads']} CPU thread(s) per measurement. Sizes: batch {BATCH}, {HEADS} heads, "
        f"d_k = d_v = {HEAD_DIM}, float32, chunk size {CHUNK}. Time: best of 5 runs (recurrent: 3, 1 from T = 4096); "
        "memory: peak resident memory of one call above the inputs.",
        "",
    ]
    for pass_name in results["passes"]:
        lines += [f"## {pass_name}", ""]
        lines += ["| T | " + " | ".join(METHOD_NAMES[m] for m in methods) + " |" + " recurrent / chunkwise |" * ratio]
        lines += ["|---:|" + "---:|" * (len(methods) + ratio)]
        for seq_len in results["lengths"]:
            row = {m: ops[f"{m}/{pass_name}/{seq_len}"] for m in methods}

            def cell(r):
                memory = "" if r["peak_mib"] is None else f", {r['peak_mib']:.0f} MiB"
                return f"{1e3 * r['time_s']:.1f} ms{memory}"

            speedup = f" {row['recurrent']['time_s'] / row['chunkwise']['time_s']:.1f}x |" if ratio else ""
            lines.append(f"| {seq_len} | " + " | ".join(cell(row[m]) for m in methods) + " |" + speedup)
        lines.append("")
    lines += ["## Generation: time per new token after a context of L tokens (2-layer model, n_embd 256)", ""]
    lines += ["| L | DeltaNet ms/token | DeltaNet cache | attention ms/token | attention KV cache |"]
    lines += ["|---:|---:|---:|---:|---:|"]
    for d_row, a_row in zip(results["generation"]["delta_net"], results["generation"]["attention"]):
        lines.append(
            f"| {d_row['context']} | {d_row['ms_per_token']:.2f} | {d_row['cache_mib']:.2f} MiB "
            f"| {a_row['ms_per_token']:.2f} | {a_row['cache_mib']:.2f} MiB |"
        )
    lines += ["", "## Training step: DeltaNet mixer / softmax attention (2-layer model, n_embd 256, batch 1)", ""]
    lines += ["Process CPU time, median of interleaved pairs [smallest, largest pair].", ""]
    lines += ["| T | attention s | DeltaNet s | DeltaNet / attention |", "|---:|---:|---:|---:|"]
    for row in results["training"]:
        lines.append(
            f"| {row['seq_len']} | {row['attention_s']:.3f} | {row['delta_net_s']:.3f} | {ratio_spread(row)} |"
        )
    lines += ["", "## Goals", ""]
    lines += [f"- {name}: {value}" for name, value in results["goals"].items()]
    return "\n".join(lines) + "\n"


def goals(results: dict) -> dict:
    ops, methods, out = results["ops"], set(results["methods"]), {}
    if 2048 in results["lengths"] and {"chunkwise", "recurrent"} <= methods:
        for p in results["passes"]:
            s = ops[f"recurrent/{p}/2048"]["time_s"] / ops[f"chunkwise/{p}/2048"]["time_s"]
            out[f"chunkwise speed-up over the recurrent loop at T=2048 ({p}), goal >= 5x"] = f"{s:.1f}x"
    if {1024, 8192} <= set(results["lengths"]) and "chunkwise" in methods:
        for p in results["passes"]:
            r = ops[f"chunkwise/{p}/8192"]["time_s"] / ops[f"chunkwise/{p}/1024"]["time_s"]
            out[f"chunkwise time T=8192 / T=1024 ({p}), goal <= 9x (linear = 8x)"] = f"{r:.1f}x"
    per_token = [row["ms_per_token"] for row in results["generation"]["delta_net"]]
    out["DeltaNet ms/token, longest / shortest context, goal flat (~1x)"] = f"{per_token[-1] / per_token[0]:.2f}x"
    attn = [row["ms_per_token"] for row in results["generation"]["attention"]]
    out["softmax attention ms/token, longest / shortest context (for comparison)"] = f"{attn[-1] / attn[0]:.2f}x"
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short lengths only; write only where --out is given")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS, help="default: all three")
    parser.add_argument("--passes", nargs="+", choices=PASSES, default=PASSES, help="default: both")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: ddl_lab/benchmarks/results)")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        method, backward, lengths = args.worker
        print(json.dumps(worker(method, bool(int(backward)), [int(n) for n in lengths.split(",")])))
        return

    torch.set_num_threads(args.threads)
    methods, passes = [m for m in METHODS if m in args.methods], [p for p in PASSES if p in args.passes]
    lengths = (256, 512) if args.quick else LENGTHS
    contexts = (64, 256) if args.quick else GEN_CONTEXTS
    started = time.perf_counter()
    results = {
        "provenance": provenance(None if argv is None else [__file__, *argv]),
        "threads": args.threads,
        "sizes": {"batch": BATCH, "heads": HEADS, "head_dim": HEAD_DIM, "chunk_size": CHUNK},
        "lengths": list(lengths),
        "methods": methods,
        "passes": passes,
        "ops": {},
    }
    for pass_name in passes:
        for method in methods:
            for seq_len, row in zip(lengths, measure(method, pass_name != "forward", lengths, args.threads)):
                results["ops"][f"{method}/{pass_name}/{seq_len}"] = row
                print(f"{method}/{pass_name}/{seq_len}", f"{1e3 * row['time_s']:.1f} ms", row["peak_mib"], flush=True)
    results["generation"] = {mixer: generation_per_token(mixer, contexts) for mixer in ("delta_net", "attention")}
    results["training"] = training_step_ratio(
        (64, 128) if args.quick else TRAIN_LENGTHS, 1 if args.quick else TRAIN_PAIRS
    )
    results["goals"] = goals(results)
    results["wall_s"] = time.perf_counter() - started
    report = markdown(results)
    print(report)
    selection = (methods, passes) != (list(METHODS), list(PASSES))
    if not (args.quick or selection) or args.out is not None:  # a smoke run or a selection: only where asked,
        stem = "delta_net_bench" + "_quick" * args.quick + "_selection" * selection  # never over the results
        write_results(args.out or RESULTS, stem, results, report)


if __name__ == "__main__":
    main()
