"""vLLM's two routes for a Delta model, side by side: ddl-hf's native models against vLLM's Transformers backend.

    # in an environment with vLLM and ddl-hf (CI's vLLM venv: .ci/run); minutes on 2 CPU cores
    python -m ddl_lab.benchmarks.bench_vllm_routes               # eager engines (enforce_eager=True)
    python -m ddl_lab.benchmarks.bench_vllm_routes --compiled    # vLLM's default mode (torch.compile)

One stateless model, which both routes serve exactly: DeltaGPT converted from a GPT-2-small-sized GPT-2 (random
weights, d_v = 1, additive, gates open around beta = 1), float32. In one process, three offline engines over the same
saved directory: the native route (`model_impl="auto"`, ddl-hf's plugin loaded), the Transformers backend
(`model_impl="transformers"`), a second native engine (the A/A twin: what two identical engines differ by here), and
vLLM's own GPT-2 on the source model (what the Delta residuals cost a served token); and, native, the source converted
at d_v = 4 (paper mode) with a linear read and with the TC read (what the windows cost).
Each round times `generate` of the same prompts (greedy, a fixed number of new tokens) on every engine in turn;
the ratios of throughputs are taken per round, and the median and range over rounds are reported. Both routes' tokens
must be equal (checked). Writes ddl_lab/benchmarks/results/vllm_routes[_compiled].{json,md}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engines in this process: one process, side by side

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import ddl_hf
from ddl_lab.builders import open_gates
from ddl_lab.common import provenance, write_results

ROUTES = {"native": "auto", "transformers": "transformers", "native (A/A)": "auto"}
SOURCE = "GPT-2 (vLLM's own model)"
#: What the TC windows cost a served token: the same source at d_v = 4 (paper mode), read linearly or through TC.
WINDOWS = {
    "d_v = 4, linear read (native)": dict(delta_mode="paper", delta_value_channels=4),
    "d_v = 4, TC read (native)": dict(delta_mode="paper", delta_value_channels=4, delta_state_read="temporal_conv"),
}


def build_models(directory: Path) -> None:
    """GPT-2 small's shape (12 layers, width 768, vocabulary 50257) with random weights (`source`), and converted to
    DeltaGPT with its gates opened (`delta`, with the Hub code files)."""
    torch.manual_seed(0)
    source = GPT2LMHeadModel(GPT2Config()).eval()
    source.save_pretrained(directory / "source")
    model = ddl_hf.convert_gpt2(source)
    open_gates(model, seed=0)
    model.save_pretrained(directory / "delta")
    for i, fields in enumerate(WINDOWS.values()):
        variant = ddl_hf.convert_gpt2(source, **fields)
        open_gates(variant, seed=0)
        variant.save_pretrained(directory / f"windows{i}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compiled", action="store_true", help="vLLM's default compiled mode instead of eager")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    generator = torch.Generator().manual_seed(0)
    prompts = [
        TokensPrompt(prompt_token_ids=torch.randint(0, 50257, (args.prompt_tokens,), generator=generator).tolist())
        for _ in range(args.prompts)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, min_tokens=args.new_tokens)
    with tempfile.TemporaryDirectory() as directory:
        directory = Path(directory)
        build_models(directory)
        engine_args = dict(
            trust_remote_code=True,
            dtype="float32",
            enforce_eager=not args.compiled,
            max_model_len=args.prompt_tokens + args.new_tokens,
            kv_cache_memory_bytes=256 * 2**20,
            skip_tokenizer_init=True,
            seed=0,
        )
        engines = {
            route: LLM(model=str(directory / "delta"), model_impl=impl, **engine_args) for route, impl in ROUTES.items()
        }
        engines[SOURCE] = LLM(model=str(directory / "source"), **engine_args)  # the baseline: what Delta costs
        for i, name in enumerate(WINDOWS):
            engines[name] = LLM(model=str(directory / f"windows{i}"), **engine_args)
        prov = provenance(None if argv is None else [__file__, *argv])
        tokens, seconds = {}, {route: [] for route in engines}
        for route, llm in engines.items():  # warm-up, and the tokens each route generates
            tokens[route] = [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]
        for _ in range(args.rounds):
            for route, llm in engines.items():
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                seconds[route].append(time.perf_counter() - start)
        for llm in engines.values():
            llm.llm_engine.engine_core.shutdown()
    if not (tokens["native"] == tokens["transformers"] == tokens["native (A/A)"]):
        raise AssertionError("the routes generated different tokens")

    generated = args.prompts * args.new_tokens

    def ratios(a: str, b: str) -> dict:
        """Throughput of `a` over `b` per round (b's seconds / a's seconds): median and range."""
        per_round = [tb / ta for ta, tb in zip(seconds[a], seconds[b])]
        return dict(median=statistics.median(per_round), low=min(per_round), high=max(per_round), rounds=per_round)

    result = {
        "provenance": prov,
        "mode": "compiled" if args.compiled else "eager",
        "model": "DeltaGPT (GPT-2 small shape, random weights), d_v = 1, additive, gates open; float32",
        "workload": dict(prompts=args.prompts, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens),
        "tokens_per_second": {route: generated / statistics.median(s) for route, s in seconds.items()},
        "seconds": seconds,
        "native_over_transformers": ratios("native", "transformers"),
        "native_over_gpt2": ratios("native", SOURCE),
        "tc_over_linear_read": ratios(*list(WINDOWS)[::-1]),
        "a_a": ratios("native (A/A)", "native"),
        "tokens_equal": True,
    }
    native, aa, gpt2 = result["native_over_transformers"], result["a_a"], result["native_over_gpt2"]
    tc = result["tc_over_linear_read"]
    rows = "\n".join(f"| {route} | {rate:.1f} |" for route, rate in result["tokens_per_second"].items())
    body = (
        f"# vLLM: native route vs Transformers backend ({result['mode']})\n\n"
        f"{result['model']}; {args.prompts} prompts of {args.prompt_tokens} tokens, {args.new_tokens} new tokens "
        f"each (greedy), {args.rounds} rounds; the same tokens on both routes.\n\n"
        "| engine | generated tokens / s (median round) |\n|---|---|\n"
        f"{rows}\n\n"
        f"Throughput native / Transformers backend: **{native['median']:.3f}** (rounds {native['low']:.3f} to "
        f"{native['high']:.3f}); A/A (native twin / native): {aa['median']:.3f} "
        f"({aa['low']:.3f} to {aa['high']:.3f}). Native DeltaGPT / vLLM's GPT-2 (the source, whose tokens differ: "
        f"the gates are open): {gpt2['median']:.3f} ({gpt2['low']:.3f} to {gpt2['high']:.3f}). At d_v = 4, paper "
        f"mode, TC read / linear read (native, 25 windows per sequence): {tc['median']:.3f} ({tc['low']:.3f} to "
        f"{tc['high']:.3f}).\n"
    )
    name = "vllm_routes_compiled" if args.compiled else "vllm_routes"
    write_results(args.out, name, result, body)
    print(body)
    return result


if __name__ == "__main__":
    main()
