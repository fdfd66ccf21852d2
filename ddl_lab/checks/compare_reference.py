"""Our Delta residual against the authors' own modules, on the same weights and inputs.

    git clone https://github.com/yifanzhang-pro/deep-delta-learning ddl-reference   # needs the network
    git -C ddl-reference checkout 2b55f25
    python -m ddl_lab.checks.compare_reference --reference ddl-reference/model

For each of their model files (d_v = 1; TC; TC + EC; CC; CC + EC) it builds their block's compressor and Delta
residual (`compress`, `ddl_attn`) and, for EC, their embedding expander, from their `GPTConfig` at a small width;
copies those weights into our `DeltaGPTConfig.reference(variant)` residual; and feeds both the same unit-scale state,
sublayer output and normalised read. It reports the largest difference of the read, the value-branch input path and
the updated state in float32, and of the update in float64 (their modules run in float64 too). Their code is only
imported from the directory given, never copied; their TC convolution calls the CUDA package `causal_conv1d`, which
this script stands in for with the same causal depthwise convolution through `torch.nn.functional.conv1d`.
Writes `ddl_lab/checks/results/reference_agreement.{json,md}`.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F

from ddl_hf import DeltaGPTConfig
from ddl_hf.delta_layers import DeltaResidual
from ddl_hf.delta_reads import DeltaEmbedExpand, DeltaRead
from ddl_lab.common import provenance, write_results

FILES = {
    "dv1": "DDL-vdim1-gpt-mha-rope.py",
    "tc": "DDL-gpt-mha-rope.py",
    "tc_ec": "DDL-gpt-mha-rope-EC.py",
    "cc": "DDL-gpt-mha-rope-CC.py",
    "cc_ec": "DDL-gpt-mha-rope-CC-EC.py",
}
WIDTH, CHANNELS, BATCH, TOKENS = 64, 4, 2, 9
RESULTS = Path(__file__).parent / "results"


def causal_conv1d_fn(x, weight, bias=None, activation=None, **_):
    """Stand-in for `causal_conv1d.causal_conv1d_fn` ([B, C, T] input, [C, K] weight): a causal depthwise conv."""
    out = F.conv1d(F.pad(x, (weight.shape[-1] - 1, 0)), weight.unsqueeze(1), bias, groups=weight.shape[0])
    return F.silu(out) if activation in ("silu", "swish") else out


def load_reference(directory: Path, file: str) -> types.ModuleType:
    """Import one of their model files as a module of a package rooted at `directory` (they import relatively)."""
    # Their config validation evaluates every annotation of transformers' PreTrainedConfig, some of which name
    # `torch` only under TYPE_CHECKING in transformers >= 5: make the name resolvable there.
    import transformers.configuration_utils as configuration_utils

    configuration_utils.__dict__.setdefault("torch", torch)
    if "causal_conv1d" not in sys.modules:
        stand_in = types.ModuleType("causal_conv1d")
        stand_in.causal_conv1d_fn = causal_conv1d_fn
        sys.modules["causal_conv1d"] = stand_in
    if "ddl_reference" not in sys.modules:
        package = types.ModuleType("ddl_reference")
        package.__path__ = [str(directory)]
        sys.modules["ddl_reference"] = package
    name = "ddl_reference." + file.removesuffix(".py").replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, directory / file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def our_residual(variant: str, dtype: torch.dtype) -> tuple[DeltaResidual, DeltaRead]:
    """Our Delta residual and the read before it, as the reference preset builds them."""
    config = DeltaGPTConfig.reference(
        variant, None if variant == "dv1" else CHANNELS, n_embd=WIDTH, n_head=2, n_layer=1, vocab_size=61
    )
    return DeltaResidual(config).to(dtype), DeltaRead(config).to(dtype)


def copy_weights(theirs: dict[str, torch.nn.Module], ours: DeltaResidual, read: DeltaRead, variant: str) -> None:
    """Their parameters into ours (only the layout differs)."""
    residual = theirs["residual"]
    with torch.no_grad():
        ours.beta_proj.weight.copy_(residual.beta.weight)
        ours.beta_proj.bias.copy_(residual.beta.bias)
        ours.beta_open.fill_(1.0)  # their beta has no opening
        ours.v_proj.weight.copy_(residual.v_proj.weight)
        ours.v_proj.bias.copy_(residual.v_proj.bias)
        if variant == "dv1":
            return
        compress = theirs["compress"]
        read.weights.copy_(compress.read)
        if variant.startswith("tc"):  # their (d * d_v, K) depthwise conv, channel i * d_v + j
            read.conv.weight.copy_(compress.shortconv.weight.reshape(WIDTH, CHANNELS, -1))
        else:  # their CC kernel (d, K)
            read.conv.weight.copy_(compress.weight)


def randomise(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Every parameter of their modules at unit scale, so that no term of the update is negligible."""
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * 0.5)


@torch.no_grad()
def compare(directory: Path, variant: str, dtype: torch.dtype) -> dict[str, float]:
    reference = load_reference(directory, FILES[variant])
    extra = {} if variant == "dv1" else {"ddl_value_channels": CHANNELS}
    config = reference.GPTConfig(
        hidden_size=WIDTH, num_attention_heads=2, head_dim=32, num_hidden_layers=1, vocab_size=61, **extra
    )
    block = reference.Block(config).to(dtype)
    generator = torch.Generator().manual_seed(0)
    theirs = {"residual": block.ddl_attn}
    if variant != "dv1":
        theirs["compress"] = block.compress
    for module in theirs.values():
        randomise(module, generator)
    ours, our_read = our_residual(variant, dtype)
    copy_weights(theirs, ours, our_read, variant)

    shape = (BATCH, TOKENS, WIDTH) if variant == "dv1" else (BATCH, TOKENS, WIDTH, CHANNELS)
    state = torch.randn(shape, generator=generator, dtype=dtype)
    k_in = torch.randn(BATCH, TOKENS, WIDTH, generator=generator, dtype=dtype)
    if variant == "dv1":  # their v reads the raw residual x; their beta the normalised one
        read_theirs = state
        context = F.rms_norm(state, [WIDTH], eps=1e-5)
        updated_theirs = block.ddl_attn(state, k_in=k_in, context=context)
    else:
        read_theirs = block.compress(state)
        context = F.rms_norm(read_theirs, [WIDTH], eps=1e-5)
        updated_theirs = block.ddl_attn(state, k_in=k_in, v_in=read_theirs, context=context)
    read_ours = our_read(state)
    updated_ours, _ = ours(state, read_ours, context, k_in)  # X, x = read(X), c (their normalised read), h
    result = {
        "read": float((read_ours - read_theirs).abs().max()),
        "update": float(((updated_ours - state) - (updated_theirs - state)).abs().max()),
        "state": float((updated_ours - updated_theirs).abs().max()),
        "update_scale": float((updated_theirs - state).abs().max()),
    }
    if variant.endswith("_ec"):
        result["embed_expand"] = compare_embed_expand(block_module=reference, config=config, dtype=dtype)
    return result


def compare_embed_expand(block_module: types.ModuleType, config, dtype: torch.dtype) -> float:
    """Their EC expander against our `DeltaEmbedExpand` on the same random kernel and embeddings."""
    theirs = block_module.InputEmbedShortConvExpander(config).to(dtype)
    generator = torch.Generator().manual_seed(1)
    randomise(theirs, generator)
    kernel = next(theirs.parameters())  # (d * d_v, 1, K): channel i * d_v + j
    ours = DeltaEmbedExpand(WIDTH, CHANNELS, kernel.shape[-1]).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(kernel.reshape(WIDTH, CHANNELS, -1))
        embeddings = torch.randn(BATCH, TOKENS, WIDTH, generator=generator, dtype=dtype)
        expanded = theirs(embeddings)
        return float((ours(embeddings, None) - expanded.reshape(ours(embeddings, None).shape)).abs().max())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", type=Path, required=True, help="their `model/` directory")
    parser.add_argument("--out", type=Path, default=RESULTS / "reference_agreement")
    args = parser.parse_args(argv)
    prov = provenance(None if argv is None else [__file__, *argv])
    try:
        commit = subprocess.run(
            ["git", "-C", str(args.reference), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        commit = "unknown (not a git checkout)"
    rows = {
        f"{variant} {torch.finfo(dtype).dtype}": compare(args.reference, variant, dtype)
        for variant in FILES
        for dtype in (torch.float32, torch.float64)
    }
    report = {"provenance": prov, "reference_commit": commit, "width": WIDTH, "value_channels": CHANNELS, "rows": rows}
    lines = [
        "# Our Delta residual vs the authors' modules (same weights, same inputs)",
        "",
        f"Reference commit `{commit}`; width {WIDTH}, d_v {CHANNELS} (1 for dv1), batch {BATCH} x {TOKENS} tokens, "
        "every weight and input N(0, 0.25) or N(0, 1).",
        "",
        "| file (variant, dtype) | max abs diff: read | update | new state | update scale | EC expansion |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        expansion = f"{row['embed_expand']:.2e}" if "embed_expand" in row else ""
        lines.append(
            f"| `{FILES[name.split()[0]]}` ({name}) | {row['read']:.2e} | {row['update']:.2e} | {row['state']:.2e} | "
            f"{row['update_scale']:.2f} | {expansion} |"
        )
    write_results(args.out.parent, args.out.name, report, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
