"""`ddl-hf` command line: `ddl-hf convert ...`, `ddl-hf inspect ...`, `ddl-hf upgrade ...`.

The parsers live in the top-level module `ddl_hf_cli` (no torch import, so `--help` is instant); this module
keeps `python -m ddl_hf.cli` and `ddl_hf.cli.main` working.
"""

from __future__ import annotations

import sys

from ddl_hf_cli import build_convert_parser, build_parser, convert_main, main

__all__ = ["build_convert_parser", "build_parser", "convert_main", "main"]

if __name__ == "__main__":
    sys.exit(main())
