"""The command line `ddl-hf` (convert, inspect, upgrade) and `convert-gpt2-to-delta-gpt`: its parsers and dispatch,
importable without torch or transformers (`python -m ddl_hf_cli ...` runs it without installing).

A module beside the `ddl_hf` package, not in it: importing anything under `ddl_hf` runs `ddl_hf/__init__.py`,
which imports transformers (seconds). Building the parser and printing `--help` must stay instant, so the choice
tuples are repeated here (a test checks them against `configuration_delta_gpt`) and each command imports its
heavy module only when it runs. The dependency goes one way: this module calls into the package
(`ddl_hf.conversion.cli.run_cli`, `ddl_hf.inspection.run_inspect`), which never imports it back.
"""

from __future__ import annotations

import argparse
import sys

# Mirrors of configuration_delta_gpt's DELTA_* tuples and conversion.converting.DTYPES (checked by tests).
DELTA_MODES = ("additive", "paper")
DELTA_GATES = ("linear", "mlp")
DELTA_STATE_READS = ("linear", "temporal_conv", "channel_conv")
DELTA_EMBED_EXPANDS = ("repeat", "conv")
DELTA_VALUES = ("linear", "constant", "sigmoid")
DTYPE_NAMES = ("float32", "float16", "bfloat16")
DEFAULT_MAX_SHARD_SIZE = "2GB"

DELTA_MODE_HELP = (
    "additive (default): keep the source's x + F(x) and add the Delta term, so beta = 0 is exactly the source; "
    "paper: the paper's eq. 2.5, where beta = 0 makes every block the identity"
)
CONVERT_DESCRIPTION = (
    "Convert a GPT-2 checkpoint (into a DeltaGPT) or a Llama, Mistral, Qwen2 or Qwen3 checkpoint (into a DeltaLlama), "
    "a Hub id or a directory, into a Delta model that starts equivalent to it, write a complete Hub repository to OUT, "
    "and print a verification report. The family is read from the source's config."
)

UPGRADE_DESCRIPTION = (
    "Rewrite a checkpoint directory saved by ddl-hf 0.1 (a model, a peft adapter, a Trainer checkpoint, or a "
    "directory holding several) for this release, which refuses to load it as it is: its 0-dim beta_open weights "
    "and their optimizer state become [1], a model's custom-code files this release's; every other file is copied "
    "unchanged. OUT is written atomically: after a failure it is as it was."
)


def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `convert`, shared by `ddl-hf convert` and `convert-gpt2-to-delta-gpt`."""
    parser.add_argument(
        "--source",
        required=True,
        help="Hub id (gpt2, Qwen/Qwen2.5-0.5B, ...) or directory of a GPT-2, Llama, Mistral, Qwen2 or Qwen3 model",
    )
    parser.add_argument("--output", required=True, help="output directory (a complete Hub repository)")
    parser.add_argument("--delta-mode", choices=DELTA_MODES, default=DELTA_MODES[0], help=DELTA_MODE_HELP)
    parser.add_argument("--value-channels", type=int, default=1, help="d_v, value channels of the state (default 1)")
    parser.add_argument("--beta-init", type=float, default=0.0, help="initial beta in [0, 2] (default 0: exact)")
    parser.add_argument(
        "--gate", choices=DELTA_GATES, default=DELTA_GATES[0], help="gate of each Delta block (default linear)"
    )
    variants = parser.add_argument_group("the paper's variants (docs/variants.md; every one converts exactly)")
    variants.add_argument(
        "--state-read",
        choices=DELTA_STATE_READS,
        default=DELTA_STATE_READS[0],
        help="how a d_v > 1 state is read: linear (read vector), temporal_conv (TC), channel_conv (CC)",
    )
    variants.add_argument(
        "--embed-expand",
        choices=DELTA_EMBED_EXPANDS,
        default=DELTA_EMBED_EXPANDS[0],
        help="how the embedding becomes the d_v > 1 state: repeat, or conv (EC)",
    )
    variants.add_argument("--conv-size", type=int, default=4, help="kernel size of the TC/CC/EC convolutions (4)")
    variants.add_argument(
        "--value",
        choices=DELTA_VALUES,
        default=DELTA_VALUES[0],
        help="value v: linear projection of the normalised read, a constant, or the authors' scale*sigmoid of the read",
    )
    variants.add_argument("--value-scale", type=float, default=4.0, help="range (0, scale) of --value sigmoid (4)")
    variants.add_argument(
        "--shared-read", action="store_true", help="one read (compressor) per block, shared by its two residuals"
    )
    variants.add_argument("--no-erase", action="store_true", help="write-only ablation X + beta k v^T (no erase term)")
    parser.add_argument("--dtype", choices=("auto", *DTYPE_NAMES), default="auto", help="auto = the source's dtype")
    parser.add_argument("--force", action="store_true", help="replace a non-empty OUT")
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE, help="safetensors shard size (2GB)")
    parser.add_argument("--base-model", help="Hub id written as base_model in the model card (default: --source)")
    parser.add_argument("--push-to-hub", metavar="REPO_ID", help="upload OUT to this Hub repository afterwards")
    parser.add_argument("--private", action="store_true", help="with --push-to-hub: create a private repository")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=_run_convert)


def add_inspect_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `inspect`."""
    parser.add_argument("model", help="DeltaGPT or DeltaLlama Hub id or directory")
    parser.add_argument("--text", required=True, help="UTF-8 text file to run the model on")
    parser.add_argument("--output", default=None, help="heat-map PNG path (default: <text stem>_betas.png)")
    parser.add_argument("--max-tokens", type=int, default=64, help="number of leading tokens to inspect")
    parser.set_defaults(func=_run_inspect)


def add_upgrade_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `upgrade`."""
    parser.add_argument("source", help="directory (or Hub id) of the ddl-hf 0.1 checkpoint; it is left unchanged")
    parser.add_argument("--output", required=True, metavar="OUT", help="directory to write the upgraded checkpoint to")
    parser.add_argument("--force", action="store_true", help="replace a non-empty OUT (OUT = SOURCE: in place)")
    parser.set_defaults(func=_run_upgrade)


def _run_convert(args: argparse.Namespace) -> int:
    from ddl_hf.conversion.cli import run_cli

    return run_cli(args)


def _run_inspect(args: argparse.Namespace) -> int:
    from ddl_hf.inspection import run_inspect

    return run_inspect(args)


def _run_upgrade(args: argparse.Namespace) -> int:
    from ddl_hf.conversion.cli import run_upgrade_cli

    return run_upgrade_cli(args)


#: `ddl-hf`'s subcommands: name -> (one-line help, description, the function adding its arguments).
SUBCOMMANDS = {
    "convert": (
        "convert a GPT-2 or Llama-family checkpoint into a Delta model Hub repository",
        CONVERT_DESCRIPTION,
        add_convert_arguments,
    ),
    "inspect": (
        "per-layer beta report and heat-map of a DeltaGPT or DeltaLlama model on a text",
        "Show which Delta blocks keep (beta<0.5), forget/project (0.5-1.5) or reflect (>1.5).",
        add_inspect_arguments,
    ),
    "upgrade": (
        "rewrite a checkpoint saved by ddl-hf 0.1 so that this release loads it",
        UPGRADE_DESCRIPTION,
        add_upgrade_arguments,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """The `ddl-hf` parser (light: no torch, no transformers)."""
    parser = argparse.ArgumentParser(prog="ddl-hf", description="Deep Delta Learning (DeltaGPT, DeltaLlama) tools.")
    subcommands = parser.add_subparsers(dest="command", required=True)
    for name, (summary, description, add_arguments) in SUBCOMMANDS.items():
        add_arguments(subcommands.add_parser(name, help=summary, description=description))
    return parser


def build_convert_parser() -> argparse.ArgumentParser:
    """The `convert-gpt2-to-delta-gpt` parser: the flags of `ddl-hf convert` under its own name."""
    parser = argparse.ArgumentParser(prog="convert-gpt2-to-delta-gpt", description=CONVERT_DESCRIPTION)
    add_convert_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console command `ddl-hf`."""
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


def convert_main(argv: list[str] | None = None) -> int:
    """Console command `convert-gpt2-to-delta-gpt`: the same as `ddl-hf convert`."""
    args = build_convert_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
