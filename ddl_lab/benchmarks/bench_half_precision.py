"""How much fp16 / bf16 error the Delta residual adds, measured beside the family's own model.

    python -m ddl_lab.benchmarks.bench_half_precision     # 4 layers, hidden 128, 3 seeds (about two minutes on 2 cores)
    python -m ddl_lab.benchmarks.bench_half_precision --quick   # tiny, 1 seed: seconds

For each seed a random LlamaForCausalLM and GPT2LMHeadModel (the family models, the reference scale) and their Delta
conversions with the gates opened (so the Delta term moves the logits). Each model's logits in float32 are the
reference; then the same model cast to fp16, cast to bf16, and in float32 under `torch.autocast("cpu", bfloat16)`.
The error is max and mean |logits - float32 logits| over the float32 logits' std; the ratio is a Delta model's error
over its family model's error for the same seed and mode.

Then a tiny sublayer output h (one MLP's output projection scaled down): the direction k = h / sqrt(|h|^2 + eps^2)
from half-precision h against k from the float32 h, to separate the rounding of h itself (inherent) from the Delta
math (float32 in `delta_ops`), with k computed naively in half precision beside it.

Writes `ddl_lab/benchmarks/results/half_precision.{json,md}`.
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

import ddl_hf
from ddl_hf.delta_ops import unit_direction
from ddl_lab.common import provenance, write_results

#: (layers, hidden, heads, vocab, batch, sequence length, seeds)
SIZES = {
    "full": dict(layers=4, hidden=128, heads=4, vocab=256, batch=4, length=64, seeds=3),
    "quick": dict(layers=2, hidden=32, heads=4, vocab=97, batch=2, length=16, seeds=1),
}
#: The Delta models of each family: conversion overrides.
VARIANTS = {
    "llama": {
        "additive-dv1": dict(),
        "additive-dv4": dict(delta_value_channels=4),
        "paper-dv1": dict(delta_mode="paper"),
        "paper-dv4": dict(delta_mode="paper", delta_value_channels=4),
        "tc-paper-dv4": dict(delta_mode="paper", delta_value_channels=4, delta_state_read="temporal_conv"),
    },
    "gpt2": {
        "additive-dv1": dict(),
        "additive-dv4": dict(delta_value_channels=4),
        "paper-dv4": dict(delta_mode="paper", delta_value_channels=4),
    },
}
FAMILY_MODEL = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}
#: cast to fp16 / bf16; float32 weights under bf16 autocast; float32 with only the sublayer outputs h rounded
MODES = ("fp16", "bf16", "autocast-bf16", "h-rounded-fp16", "h-rounded-bf16")
HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}
#: weight std of the random models and of the opened value maps (transformers' default initializer_range)
INIT_STD = 0.02
#: the tiny-h case: which MLP's output projection is scaled, and by how much
TINY_LAYER = 1
TINY_SCALES = (1.0, 1e-2, 1e-3)


def build_family(family: str, size: dict, seed: int) -> torch.nn.Module:
    """A random family model in float32, eval mode, built right after `torch.manual_seed(seed)`."""
    torch.manual_seed(seed)
    if family == "llama":
        config = LlamaConfig(
            vocab_size=size["vocab"],
            hidden_size=size["hidden"],
            intermediate_size=2 * size["hidden"],
            num_hidden_layers=size["layers"],
            num_attention_heads=size["heads"],
            num_key_value_heads=size["heads"] // 2,
            max_position_embeddings=2 * size["length"],
            initializer_range=INIT_STD,
        )
        return LlamaForCausalLM(config).eval()
    config = GPT2Config(
        vocab_size=size["vocab"],
        n_embd=size["hidden"],
        n_layer=size["layers"],
        n_head=size["heads"],
        n_positions=2 * size["length"],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        initializer_range=INIT_STD,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config).eval()


def to_delta(family: str, source: torch.nn.Module, overrides: dict) -> torch.nn.Module:
    convert = ddl_hf.convert_llama if family == "llama" else ddl_hf.convert_gpt2
    return convert(source, **overrides).eval()


def open_delta(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Open every gate (logit std ~2 on the normalised input, so beta spreads over (0, 1.6) per token), give the
    value map the model's init scale (|v| ~ |X|), and perturb the read vectors and convolutions around their init."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for residual in model.delta_residuals().values():
            gate = residual.gate_output
            gate.weight.copy_(torch.randn(gate.weight.shape, generator=generator) * 2 / math.sqrt(gate.in_features))
            if gate.bias is not None:
                gate.bias.zero_()
            residual.beta_open.fill_(0.8)
            if residual.v_proj is not None:
                residual.v_proj.weight.copy_(torch.randn(residual.v_proj.weight.shape, generator=generator) * INIT_STD)
        for name, param in model.named_parameters():
            if name.endswith("read.weights") or name.endswith("read_out.weights") or "conv" in name:
                param.add_(0.1 * torch.randn(param.shape, generator=generator))
    return model


def rounding_sublayer_outputs(model: torch.nn.Module, dtype: torch.dtype) -> list:
    """Forward hooks that round every attention and MLP output (the h of each residual) to `dtype` and back."""

    def hook(module, args, out):
        if isinstance(out, tuple):
            return (out[0].to(dtype).float(), *out[1:])
        return out.to(dtype).float()

    sublayers = [m for m in model.modules() if type(m).__name__.endswith(("Attention", "MLP"))]
    assert len(sublayers) == 2 * model.config.num_hidden_layers, [type(m).__name__ for m in sublayers]
    return [m.register_forward_hook(hook) for m in sublayers]


def logits_in(model: torch.nn.Module, ids: torch.Tensor, mode: str) -> torch.Tensor:
    """float32 logits of `model` (float32) run in `mode` ("fp32" or one of MODES)."""
    with torch.no_grad():
        if mode == "fp32":
            return model(ids).logits.float()
        if mode == "autocast-bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return model(ids).logits.float()
        if mode.startswith("h-rounded-"):
            hooks = rounding_sublayer_outputs(model, HALF[mode.removeprefix("h-rounded-")])
            try:
                return model(ids).logits.float()
            finally:
                for hook in hooks:
                    hook.remove()
        return copy.deepcopy(model).to(HALF[mode])(ids).logits.float()


def logits_error(got: torch.Tensor, reference: torch.Tensor) -> dict:
    """max and mean |got - reference| over the reference's std."""
    diff, scale = (got - reference).abs(), reference.std().item()
    return {"max": diff.max().item() / scale, "mean": diff.mean().item() / scale}


def spread(values: list[float]) -> dict:
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return {"mean": mean, "std": std, "min": min(values), "max": max(values)}


def measure_models(size: dict, seeds: list[int]) -> list[dict]:
    """One row per (family, model, mode): the relative errors per seed, their spread, and the Delta / family ratios."""
    per_seed: dict[tuple[str, str, str], list[dict]] = {}
    for seed in seeds:
        ids = torch.randint(
            0, size["vocab"], (size["batch"], size["length"]), generator=torch.Generator().manual_seed(seed)
        )
        for family, variants in VARIANTS.items():
            source = build_family(family, size, seed)
            models = {FAMILY_MODEL[family]: source}
            models |= {name: open_delta(to_delta(family, source, o), seed) for name, o in variants.items()}
            family_reference = logits_in(source, ids, "fp32")
            for name, model in models.items():
                reference = logits_in(model, ids, "fp32")
                effect = (reference - family_reference).square().mean().sqrt().item() / family_reference.std().item()
                for mode in MODES:
                    record = {"seed": seed, "effect": effect, **logits_error(logits_in(model, ids, mode), reference)}
                    per_seed.setdefault((family, name, mode), []).append(record)
    rows = []
    for (family, name, mode), records in per_seed.items():
        row = {"family": family, "model": name, "mode": mode, "delta": name != FAMILY_MODEL[family]}
        row["per_seed"] = records
        for stat in ("max", "mean"):
            row[f"{stat}_error"] = spread([r[stat] for r in records])
        row["effect_of_delta"] = spread([r["effect"] for r in records])
        if row["delta"]:
            base = per_seed[(family, FAMILY_MODEL[family], mode)]
            for stat in ("max", "mean"):
                row[f"ratio_{stat}_error"] = spread([r[stat] / b[stat] for r, b in zip(records, base)])
        rows.append(row)
    return rows


def naive_half_direction(h: torch.Tensor, eps: float) -> torch.Tensor:
    """k formed in h's own half precision, what `unit_direction` would compute without its float32 upcast."""
    return h * torch.rsqrt(h.square().sum(-1, keepdim=True) + eps * eps)


def direction_error(k: torch.Tensor, k_ref: torch.Tensor) -> dict:
    """max and mean over tokens of |k - k_ref| (~ the angle between them, for unit k); None where k is not finite."""
    k = k.float()
    if not torch.isfinite(k).all():
        return {"max": None, "mean": None, "finite": False}
    per_token = (k - k_ref).norm(dim=-1)
    return {"max": per_token.max().item(), "mean": per_token.mean().item(), "finite": True}


def mlp_output(model: torch.nn.Module, layer: int, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The output of layer `layer`'s MLP (its residual's h) when `model` runs in `dtype`."""
    model = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
    captured = {}
    hook = model.model.layers[layer].mlp.register_forward_hook(lambda module, args, out: captured.update(h=out))
    with torch.no_grad():
        model(ids)
    hook.remove()
    return captured["h"]


def measure_tiny_h(size: dict, seed: int) -> list[dict]:
    """DeltaLlama (additive, d_v 1, gates open) with layer TINY_LAYER's MLP output projection scaled: the error of
    that MLP's output h, and of k from it, in fp16 and bf16, against the float32 model's h and k."""
    ids = torch.randint(
        0, size["vocab"], (size["batch"], size["length"]), generator=torch.Generator().manual_seed(seed)
    )
    base = open_delta(to_delta("llama", build_family("llama", size, seed), {}), seed)
    eps = base.config.delta_eps
    layer = min(TINY_LAYER, size["layers"] - 1)
    rows = []
    for scale in TINY_SCALES:
        model = copy.deepcopy(base)
        with torch.no_grad():
            model.model.layers[layer].mlp.down_proj.weight.mul_(scale)
        h32 = mlp_output(model, layer, ids, torch.float32)
        k32 = unit_direction(h32, eps)
        for dtype, mode in ((torch.float16, "fp16"), (torch.bfloat16, "bf16")):
            rounded = h32.to(dtype)  # the float32 h, only rounded: the part no Delta math can undo
            h_model = mlp_output(
                model, layer, ids, dtype
            )  # h as the half-precision model computes it (its inputs rounded too)
            relative = (rounded.float() - h32).norm(dim=-1) / h32.norm(dim=-1)
            rows.append({
                "scale": scale,
                "mode": mode,
                "h_rms": h32.square().mean().sqrt().item(),
                "h_norm_over_eps": h32.norm(dim=-1).min().item() / eps,
                "h_rounding_relative_error": {"max": relative.max().item(), "mean": relative.mean().item()},
                "k_from_rounded_h": direction_error(unit_direction(rounded, eps), k32),
                "k_from_half_model": direction_error(unit_direction(h_model, eps), k32),
                "k_in_half_math": direction_error(naive_half_direction(rounded, eps), k32),
            })  # fmt: skip
    return rows


def fmt(value: float | None, digits: int = 2) -> str:
    return "non-finite" if value is None else f"{value:.{digits}e}"


def markdown(results: dict) -> str:
    size, rows = results["size"], results["rows"]
    lines = [
        "# Half-precision error of the Delta residual, beside the family's own model",
        "",
        f"Random models of {size['layers']} layers, hidden {size['hidden']}, {size['heads']} heads, vocab "
        f"{size['vocab']}, batch {size['batch']} x {size['length']} tokens; seeds {results['seeds']}. Delta models "
        "are conversions of the family model with the gates opened (beta per token in (0, 1.6), value at the "
        "model's init scale). Error: |logits - float32 logits| over the float32 logits' std, max and mean over all "
        "logits; ratio: Delta model's error / family model's error, same seed and mode. Modes: the model cast to "
        "fp16 / bf16 (`model.to(dtype)`: weights, activations and the residual state in half precision), float32 "
        "weights under `torch.autocast('cpu', bfloat16)`, and `h-rounded-*`: float32 throughout except every "
        "attention and MLP output h, rounded to half precision and back (h's own rounding, nothing else). "
        "Mean over seeds (min–max). `effect` is the rms of (Delta logits − family logits) over the family logits' "
        "std in float32: how far the opened Delta term moves the model.",
        "",
        "| family | model | mode | max error | mean error | ratio (max) | ratio (mean) | effect |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def cell(s: dict, digits: int = 2, sci: bool = True) -> str:
        f = (lambda v: f"{v:.{digits}e}") if sci else (lambda v: f"{v:.{digits}f}")
        return f(s["mean"]) + (f" ({f(s['min'])}–{f(s['max'])})" if s["min"] != s["max"] else "")

    for row in rows:
        ratio_max = cell(row["ratio_max_error"], sci=False) if row["delta"] else "–"
        ratio_mean = cell(row["ratio_mean_error"], sci=False) if row["delta"] else "–"
        effect = f"{row['effect_of_delta']['mean']:.2f}" if row["delta"] else "–"
        lines.append(
            f"| {row['family']} | {row['model']} | {row['mode']} | {cell(row['max_error'])} | "
            f"{cell(row['mean_error'])} | {ratio_max} | {ratio_mean} | {effect} |"
        )
    lines += ["", "Headline: Delta / family error ratio over every Delta model and seed, mean (min–max):", ""]
    lines += ["| mode | ratio (max error) | ratio (mean error) |", "|---|---|---|"]
    for mode, head in results["headline"].items():
        lines.append(f"| {mode} | {cell(head['ratio_max_error'], sci=False)} | "
                     f"{cell(head['ratio_mean_error'], sci=False)} |")  # fmt: skip
    lines += [
        "",
        f"## A tiny sublayer output h (DeltaLlama additive d_v 1, layer {results['tiny_h']['layer']}'s MLP output "
        "projection scaled)",
        "",
        "Relative error of h rounded from float32 (per token |round(h) − h| / |h|), and |k − k_float32| (≈ the angle, "
        "per token; max over tokens) for k = unit_direction(h) from: the rounded float32 h (h's rounding alone), h "
        "as the half-precision model computes it (its input rounded too), and k formed in half precision (what "
        "`unit_direction`'s float32 upcast avoids).",
        "",
        "| scale | mode | h rms | min \\|h\\| / eps | h rounding (max) | k from rounded h | k from the half model "
        "| k in half math |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in results["tiny_h"]["rows"]:
        lines.append(
            f"| {row['scale']:g} | {row['mode']} | {row['h_rms']:.1e} | {row['h_norm_over_eps']:.0f} | "
            f"{fmt(row['h_rounding_relative_error']['max'])} | {fmt(row['k_from_rounded_h']['max'])} | "
            f"{fmt(row['k_from_half_model']['max'])} | {fmt(row['k_in_half_math']['max'])} |"
        )
    lines += ["", f"Runtime: {results['runtime_s']:.0f} s.", ""]
    return "\n".join(lines)


def headline(rows: list[dict]) -> dict:
    """Per mode, the ratios of every Delta model and seed pooled."""
    out = {}
    for mode in MODES:
        delta_rows = [row for row in rows if row["delta"] and row["mode"] == mode]
        out[mode] = {}
        for stat in ("max", "mean"):
            ratios = []
            for row in delta_rows:
                base = next(r for r in rows if r["family"] == row["family"] and not r["delta"] and r["mode"] == mode)
                ratios += [d[stat] / b[stat] for d, b in zip(row["per_seed"], base["per_seed"])]
            out[mode][f"ratio_{stat}_error"] = spread(ratios)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny models, 1 seed: seconds")
    parser.add_argument("--seeds", type=int, default=None, help="number of seeds (default: 3, --quick 1)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    size = SIZES["quick" if args.quick else "full"]
    seeds = list(range(args.seeds or size["seeds"]))
    results = {
        "provenance": provenance(None if argv is None else [__file__, *argv]),
        "size": size,
        "seeds": seeds,
        "modes": list(MODES),
    }
    start = time.perf_counter()
    results["rows"] = measure_models(size, seeds)
    results["headline"] = headline(results["rows"])
    layer = min(TINY_LAYER, size["layers"] - 1)
    results["tiny_h"] = {"layer": layer, "rows": measure_tiny_h(size, seeds[0])}
    results["runtime_s"] = time.perf_counter() - start
    for mode, head in results["headline"].items():
        r_max, r_mean = head["ratio_max_error"], head["ratio_mean_error"]
        print(f"{mode:14s} Delta/family error ratio: max {r_max['mean']:.2f} ({r_max['min']:.2f}–{r_max['max']:.2f}), "
              f"mean {r_mean['mean']:.2f} ({r_mean['min']:.2f}–{r_mean['max']:.2f})")  # fmt: skip
    write_results(args.out, "half_precision", results, markdown(results))
    print(f"wrote {args.out / 'half_precision.json'} in {results['runtime_s']:.0f} s")
    return results


if __name__ == "__main__":
    main()
