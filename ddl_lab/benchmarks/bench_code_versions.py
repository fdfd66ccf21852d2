"""Another version of the model code against this one, side by side in one process: the same DeltaGPT (same config,
same weights), its training step and batch-1 decoding timed in interleaved pairs, with the A/A noise floor.

For a change that moved a ratio of `bench_overhead.py` between two runs on a shared machine: were the runs apart, or
the code? The other version's Hub files are loaded as transformers loads Hub custom code, from a checkout:

    git worktree add /tmp/before b72347a
    python -m ddl_lab.benchmarks.bench_code_versions --code /tmp/before --shape small --value-channels 4 --mode additive

Writes `results/code_versions.{json,md}` beside it (`--name`). Ratios are this code / the other code (below 1: this
code is faster), process CPU time, median of per-pair ratios; the A/A row times the other code against a copy of
itself.
"""

from __future__ import annotations

import argparse
import copy
import re
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers.dynamic_module_utils import get_class_from_dynamic_module
from transformers.utils import logging as hf_logging

from ddl_hf.delta_model import RENAMED_WEIGHTS
from ddl_lab.builders import SHAPES, build_pair
from ddl_lab.common import git_state, provenance, ratio_spread, train_and_decode, write_results

RESULTS = Path(__file__).resolve().parent / "results"


def old_name(name: str) -> str:
    """A parameter's name before the reads became modules of the block (`delta_model.RENAMED_WEIGHTS`, backwards):
    the names every version of the code loads (later versions rename them on load)."""
    for old, new in RENAMED_WEIGHTS:
        target = new.replace(".", r"\.")
        if re.search(target + "$", name):
            return re.sub(target + "$", old.replace("(?![_.])", ""), name)
    return name


def other_version(code: Path, model: torch.nn.Module) -> torch.nn.Module:
    """`model` rebuilt with the classes of the Hub files in `code`, with the same config and weights. The weights go
    through a saved directory, under the names every version of the code loads (`old_name`)."""
    config_class = get_class_from_dynamic_module("configuration_delta_gpt.DeltaGPTConfig", str(code))
    model_class = get_class_from_dynamic_module("modeling_delta_gpt.DeltaGPTForCausalLM", str(code))
    fields = {k: v for k, v in model.config.to_dict().items() if k not in ("auto_map", "architectures")}
    config = config_class(**fields)
    config._attn_implementation = model.config._attn_implementation
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        weights = Path(directory) / "model.safetensors"
        save_file({old_name(k): v for k, v in load_file(weights).items()}, weights, metadata={"format": "pt"})
        return model_class.from_pretrained(directory, config=config)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--code", type=Path, required=True, help="a checkout holding the other version's Hub files")
    parser.add_argument("--shape", choices=[s for s, v in SHAPES.items() if v.get("arch") != "llama"], default="small")
    parser.add_argument("--value-channels", type=int, default=4)
    parser.add_argument("--mode", choices=["additive", "paper"], default="additive")
    parser.add_argument("--pairs", type=int, default=9)
    parser.add_argument("--gen-pairs", type=int, default=5)
    parser.add_argument("--gen-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--name", default="code_versions")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    prov = provenance(None if argv is None else [__file__, *argv])

    shape = SHAPES[args.shape]
    mine = build_pair(shape, args.value_channels, args.mode)[1]
    theirs = other_version(args.code, mine)
    twin = copy.deepcopy(theirs)
    ids = torch.randint(
        0, shape["vocab_size"], (shape["batch"], shape["seq"]), generator=torch.Generator().manual_seed(1)
    )
    prompt = ids[:1, :16]
    rows = {}
    for label, a, b in (("other vs other (A/A)", theirs, twin), ("other vs this", theirs, mine)):
        row = rows[label] = train_and_decode(a, b, ids, prompt, args.pairs, args.gen_tokens, args.gen_pairs)
        print(
            f"{label}: train {ratio_spread(row['train_step'])}  gen1 {ratio_spread(row['generation_b1'])}", flush=True
        )
    results = {
        "provenance": prov,
        "other_commit": git_state(args.code)["commit"] or "unknown",
        "shape": args.shape,
        "value_channels": args.value_channels,
        "mode": args.mode,
        "rows": rows,
    }
    lines = [
        f"This commit against `{results['other_commit']}` (its Hub files, the same weights): shape {args.shape}, "
        f"d_v = {args.value_channels}, {args.mode}; {args.pairs} training pairs, {args.gen_pairs} decoding pairs. "
        "Ratio B / A of process CPU time, median [smallest, largest single pair]:",
        "",
        "| A | B | train step | gen/token b=1 |",
        "|---|---|---|---|",
    ]
    for label, row in rows.items():
        cells = [ratio_spread(r) for r in row.values()]
        lines.append(f"| {label.replace(' vs ', ' | ')} | {' | '.join(cells)} |")
    write_results(args.out, args.name, results, "\n".join(lines) + "\n")
    return results


if __name__ == "__main__":
    main()
