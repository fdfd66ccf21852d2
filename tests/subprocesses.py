"""Python run in a fresh interpreter, as some tests need it: Triton's interpreter is chosen by TRITON_INTERPRET when
Triton is imported (so a process of its own), and a benchmark runs as its command line does. The process starts at
the repository root with the root first on PYTHONPATH, so it imports `tests.builders`, the root modules and `ddl_hf`
as the tests do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_python(*args: str, triton_interpreter: bool, timeout: float = 600) -> str:
    """`python *args` (a script and its arguments, or `-c CODE ARG...`) at the repository root, with Triton's
    interpreter on (TRITON_INTERPRET=1) or off (unset): its stdout, or a failure with the end of its output."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    if triton_interpreter:
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def in_tritons_interpreter(script: str, *args: str, timeout: float = 600) -> Any:
    """Run `script` (its arguments: `sys.argv[1:]`) under Triton's interpreter; what it printed after "RESULT ", as
    JSON."""
    stdout = run_python("-c", script, *args, triton_interpreter=True, timeout=timeout)
    return json.loads(stdout.split("RESULT ", 1)[1])
