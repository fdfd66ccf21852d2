"""Every lab tool runs as its documentation says, `python -m ddl_lab.<folder>.<tool>`, from the repository root.

COMMANDS holds the documented commands that no other test runs end to end, each at its `--quick` (or its smallest
documented arguments) and writing into a temporary folder: each one runs in a subprocess exactly as a reader would
type it, and its results record that same command. ELSEWHERE names, for every other tool, the test that runs its
documented command (in this process through `main(argv)`, the function `python -m` calls, or as a subprocess).
Together they cover every tool in the package: a new tool without a row fails here.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: id -> (module, arguments before `--out DIR`, the results file's stem, what it needs that may be missing)
COMMANDS = {
    "bench_fast_paths": ("ddl_lab.benchmarks.bench_fast_paths", ["--quick"], "fast_paths_quick", None),
    "bench_overhead": (
        "ddl_lab.benchmarks.bench_overhead",
        ["--quick", "--pairs", "2", "--no-native"],  # --quick alone times 25 pairs: the same code, 12 times over
        "overhead_quick",
        None,
    ),
    "bench_delta_net": (
        "ddl_lab.benchmarks.bench_delta_net",
        # --quick alone starts a process per method and pass, six of them (a minute): one of them, the same code
        ["--quick", "--methods", "chunkwise", "--passes", "forward"],
        "delta_net_bench_quick_selection",
        None,
    ),
    "bench_vllm_routes": ("ddl_lab.benchmarks.bench_vllm_routes", ["--rounds", "1"], "vllm_routes", "vllm"),
    "assoc_recall": ("ddl_lab.studies.assoc_recall", ["--quick"], "assoc_recall_quick", None),
}

#: tool -> the test that runs its documented command
ELSEWHERE = {
    "ddl_lab.benchmarks.bench_code_versions": "test_bench_code_versions.py (--code: this checkout)",
    "ddl_lab.benchmarks.bench_decode_step": "test_bench_decode_step.py (--quick)",
    "ddl_lab.benchmarks.bench_eager_vs_sdpa": "test_bench_eager_vs_sdpa.py",
    "ddl_lab.benchmarks.bench_half_precision": "test_bench_half_precision.py (--quick)",
    "ddl_lab.benchmarks.bench_launches": "test_bench_launches.py (--quick, a subprocess: it sets Triton's interpreter)",
    "ddl_lab.benchmarks.bench_memory": "test_bench_memory.py (--quick)",
    "ddl_lab.benchmarks.profile_variant_step": "test_lab_common.py (--quick)",
    "ddl_lab.studies.bench_pretrain": "test_bench_pretrain.py (the --quick pipeline at toy size, workers 0)",
    "ddl_lab.studies.bench_pretrain_controls": "test_bench_pretrain_controls.py (--quick)",
    "ddl_lab.studies.bench_pretrain_length": "test_bench_pretrain_length.py (--quick)",
    "ddl_lab.studies.bench_pretrain_scaling": "test_bench_pretrain_scaling.py (--quick plan, synthetic runs)",
    "ddl_lab.studies.bench_finetune": "test_bench_finetune.py (--base: a tiny GPT-2 the test saves, 2 steps)",
    "ddl_lab.studies.diagnose_averaging_init": "test_diagnose_averaging_init.py (--quick)",
    "ddl_lab.checks.gpu_check": "test_gpu_check.py (--device cpu --tiny, a subprocess)",
    "ddl_lab.checks.gpu_report": "not a command: gpu_check's report, written by test_gpu_check.py's runs",
    # Not run by the suite, with the reason:
    "ddl_lab.checks.compare_reference": "not run: needs the authors' checkout (network)",
}


def test_every_tool_of_the_lab_is_run_by_a_test_or_says_why_not():
    tools = {
        ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for folder in ("benchmarks", "studies", "checks")
        for path in (ROOT / "ddl_lab" / folder).glob("*.py")
        if path.name != "__init__.py"
    }
    listed = {module for module, *_ in COMMANDS.values()}
    assert not listed & set(ELSEWHERE), listed & set(ELSEWHERE)
    assert tools == listed | set(ELSEWHERE), (tools - listed - set(ELSEWHERE), listed | set(ELSEWHERE) - tools)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMMANDS))
def test_the_documented_command_runs_as_a_module_and_records_itself(name, tmp_path):
    module, args, stem, needs = COMMANDS[name]
    if needs is not None and importlib.util.find_spec(needs) is None:
        pytest.skip(f"{needs} is not installed")
    command = [sys.executable, "-m", module, *args, "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    typed = " ".join(["python", "-m", module, *args, "--out"])  # then the (scrubbed) temporary folder
    assert json.loads((tmp_path / f"{stem}.json").read_text())["provenance"]["command"].startswith(typed + " ")
    assert f"> Command: `{typed} " in (tmp_path / f"{stem}.md").read_text()
