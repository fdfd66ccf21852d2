"""`ddl-hf inspect`: which Delta blocks keep, forget or reflect, token by token.

    ddl-hf inspect outputs/demo/delta-gpt --text my.txt --output betas.png     # console command
    python -m ddl_hf_cli inspect outputs/demo/delta-gpt --text my.txt           # the same, without installing
    python examples/inspect_betas.py [--model outputs/demo/delta-gpt]          # this script: a bundled play

Prints a table per Delta block (mean/min/max beta, fraction of tokens with beta < 0.5 "keep", 0.5-1.5
"project/forget", > 1.5 "reflect") and writes a heat-map of beta by block and token.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from ddl_hf.corpus import load_text
from ddl_hf_cli import main as cli_main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="outputs/demo/delta-gpt", help="a saved DeltaGPT (run the demo first)")
    parser.add_argument("--output", default="outputs/betas.png")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    text = "\n\n".join(load_text("shakespeare-eval").select(range(40, 46))["text"])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sample.txt"
        path.write_text(text, encoding="utf-8")
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        return cli_main(
            ["inspect", args.model, "--text", str(path), "--output", args.output, "--max-tokens", str(args.max_tokens)]
        )


if __name__ == "__main__":
    raise SystemExit(main())
