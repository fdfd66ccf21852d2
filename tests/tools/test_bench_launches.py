"""ddl_lab/benchmarks/bench_launches.py: launches per step on the GPU's route, the compiled step's GEMMs, host time.

The script switches Triton's interpreter on before Triton is imported, so it runs in a process of its own (`--quick`:
two variants, two timed steps). The counts are exact, not timed: the launch goals of the one-op issue are held here
(d_v = 1 <= 1.15x GPT-2's training step, d_v = 4 <= 1.25x; decoding <= 1.25x / 1.35x), and so are the counter's
own checks: the eager route launches no Triton kernel, the Triton route does, and the tensor ops' GEMMs show in the
compiled graphs while the op's do not. The host-time ratios are recorded, not asserted (timing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.subprocesses import run_python

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    __import__("importlib").util.find_spec("triton") is None, reason="triton is not installed (the dev extra has it)"
)
GOALS = {"paper-dv1": (1.15, 1.25), "paper-dv4": (1.25, 1.35)}  # (training, decoding), Delta / GPT-2


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("launches")
    run_python(
        "-m",
        "ddl_lab.benchmarks.bench_launches",
        "--quick",
        "--steps",
        "2",
        "--out",
        str(out),
        triton_interpreter=False,
    )
    assert (out / "launches.md").read_text().count("|") > 20
    return json.loads((out / "launches.json").read_text())


def test_the_triton_route_meets_the_launch_goals(results):
    counts = results["launches"]
    base = counts["gpt2"]["eager"]
    assert set(counts) == {"gpt2", *GOALS}
    for variant, (train_goal, decode_goal) in GOALS.items():
        row = counts[variant]
        assert row["eager"]["train"]["triton"] == row["eager"]["decode"]["triton"] == 0  # the tensor ops
        assert row["triton"]["train"]["triton"] > 0 and row["triton"]["decode"]["triton"] > 0
        assert row["triton"]["train"]["launches"] < row["eager"]["train"]["launches"]
        assert row["triton"]["train"]["launches"] <= train_goal * base["train"]["launches"], (variant, row)
        assert row["triton"]["decode"]["launches"] <= decode_goal * base["decode"]["launches"], (variant, row)


def test_the_compiled_step_has_no_gemm_inside_a_residual(results):
    gemms = results["gemms"]
    assert gemms["gpt2"]["gemms"] > 0
    for variant in GOALS:
        assert gemms[variant]["eager"]["extra_per_residual"] > 0  # the gate and value GEMVs, seen by the counter
        assert gemms[variant]["triton"]["extra_per_residual"] == 0


def test_host_time_rows_and_provenance_are_recorded(results):
    assert results["provenance"]["command"].startswith("python -m ddl_lab.benchmarks.bench_launches")
    host = results["host_time"]
    assert set(host) == {"A/A (gpt2 / gpt2)", *GOALS}
    assert all(ratio > 0 for row in host.values() for ratio in row.values())
