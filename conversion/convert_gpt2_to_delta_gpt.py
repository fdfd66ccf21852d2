"""Convert a GPT-2 checkpoint into a DeltaGPT Hub repository (same as `ddl-hf convert` / `convert-gpt2-to-delta-gpt`).

    python conversion/convert_gpt2_to_delta_gpt.py --source gpt2 --output gpt2-delta

Run `--help` for the options. All the work is in `ddl_hf.conversion`; this file only makes it runnable from a
checkout where the package is not installed.
"""

import sys
from pathlib import Path

try:
    from ddl_hf_cli import convert_main
except ImportError:  # a plain checkout: the package lives one directory up
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from ddl_hf_cli import convert_main

if __name__ == "__main__":
    sys.exit(convert_main())
