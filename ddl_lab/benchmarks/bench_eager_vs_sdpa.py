"""How far fp16 eager and SDPA attention disagree, Llama against DeltaLlama: the measurement behind
docs/performance.md's "How far, as a bound" (transformers' `test_eager_matches_sdpa_inference` asks for a mean
relative difference of the hidden states under 5e-3 in fp16).

    python -m ddl_lab.benchmarks.bench_eager_vs_sdpa      # seconds; writes results/eager_vs_sdpa.{json,md}

The tiny test Llama (tests/models/test_delta_llama.py's TINY: 2 layers, hidden 32) and DeltaLlama built from the
same config (gates at the reference start), the same seed; 4 x 9 random tokens, plain and with the first two rows
left-padded without a mask. Per model: the mean relative difference |a - b| / |b| of the last hidden state between
fp16 eager and fp16 SDPA attention, and between fp16 SDPA and float32 SDPA.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import ddl_hf
from ddl_lab.builders import LLAMA_TINY as TINY
from ddl_lab.common import provenance, write_results

MODELS = {"Llama": None, "DeltaLlama additive": {}, "DeltaLlama paper": {"delta_mode": "paper"}}


def build(fields: dict | None) -> torch.nn.Module:
    torch.manual_seed(0)
    if fields is None:
        return LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    config = ddl_hf.DeltaLlamaConfig(source_model_type="llama", **TINY, **fields)
    return ddl_hf.DeltaLlamaForCausalLM(config).eval()


def last_hidden(model: torch.nn.Module, ids: torch.Tensor, attention: str, dtype: torch.dtype) -> torch.Tensor:
    copied = copy.deepcopy(model).to(dtype)
    copied.set_attn_implementation(attention)
    with torch.no_grad():
        return copied(ids, output_hidden_states=True).hidden_states[-1].float()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().mean() / b.abs().mean())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    ids = torch.randint(1, TINY["vocab_size"], (4, 9), generator=torch.Generator().manual_seed(1))
    padded = ids.clone()
    padded[:2, :4] = TINY["pad_token_id"]
    rows = []
    for name, fields in MODELS.items():
        model = build(fields)
        for inputs, tokens in (("plain", ids), ("left-padded, no mask", padded)):
            sdpa16 = last_hidden(model, tokens, "sdpa", torch.float16)
            rows.append(
                {
                    "model": name,
                    "inputs": inputs,
                    "eager_vs_sdpa_fp16": relative(last_hidden(model, tokens, "eager", torch.float16), sdpa16),
                    "fp16_vs_fp32": relative(sdpa16, last_hidden(model, tokens, "sdpa", torch.float32)),
                }
            )
    lines = [
        "Mean relative difference of the last hidden state (|a - b| / |b|), the tiny test Llama and DeltaLlama built",
        "from its config (reference start), 4 x 9 tokens.",
        "",
        "| model | inputs | fp16 eager vs fp16 SDPA | fp16 vs float32 (SDPA) |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r['model']} | {r['inputs']} | {r['eager_vs_sdpa_fp16']:.2e} | {r['fp16_vs_fp32']:.2e} |" for r in rows
    ]
    results = {"provenance": provenance(None if argv is None else [__file__, *argv]), "rows": rows}
    write_results(args.out, "eager_vs_sdpa", results, "\n".join(lines) + "\n")
    return results


if __name__ == "__main__":
    main()
