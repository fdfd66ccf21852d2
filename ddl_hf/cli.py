"""`ddl-hf` command line: `ddl-hf convert ...`, `ddl-hf inspect ...`."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddl-hf", description="Deep Delta Learning (DeltaGPT) tools.")
    subcommands = parser.add_subparsers(dest="command", required=True)
    from . import conversion

    conversion.add_cli(subcommands)
    try:
        from . import inspection
    except ImportError:  # pragma: no cover - the inspect subcommand ships with the workflows
        pass
    else:
        inspection.add_cli(subcommands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


def convert_main(argv: list[str] | None = None) -> int:
    """Console command `convert-gpt2-to-delta-gpt`: the same as `ddl-hf convert`."""
    return main(["convert", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
