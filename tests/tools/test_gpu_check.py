"""ddl_lab/checks/gpu_check.py: its tiny CPU mode runs every section's code path and writes every result.

The run is a subprocess in which `datasets` cannot be imported, as on the GPU machine the check is written for.
Two variants keep it short and still cover both families, d_v = 4, paper mode, the TC read and a compiled training
step. About 40 s on 2 cores, most of it imports and the compiled step. Triton cannot run there (no interpreter): the
triton section's "eager" stand-in runs its code, and says so; the real Triton op's launch count is checked in a
subprocess under Triton's interpreter, at a tiny shape. Correctness and host synchronisation are tests/gpu now.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ddl_lab.checks import gpu_check, gpu_report
from tests.subprocesses import run_python

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "ddl_lab" / "checks" / "gpu_check.py"

VARIANTS = ("paper-dv4-tc", "llama-paper-dv4")
# sys.modules[name] = None makes `import name` fail, as where the package is not installed.
RUNNER = (
    "import runpy, sys; sys.modules['datasets'] = None; sys.argv = sys.argv[1:]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("gpu_check")
    command = [sys.executable, "-c", RUNNER, str(SCRIPT), "--device", "cpu", "--tiny", "--threads", "1"]
    # The compiled rows with dynamo's capture alone (fullgraph, so a graph break still fails): the default for --tiny,
    # aot_eager, adds ~20 s of AOT autograd tracing on 2 cores.
    command += ["--out", str(out), "--variants", *VARIANTS, "--compile-backend", "eager"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads((out / "gpu_check.json").read_text()), (out / "gpu_check.md").read_text()


def test_results_say_where_they_come_from(run):
    results, md = run
    provenance = results["provenance"]
    assert "python -m ddl_lab.checks.gpu_check --device cpu --tiny" in provenance["command"]
    assert "commit" in provenance["git"]
    assert provenance["versions"]["torch"] == torch.__version__ and provenance["versions"]["transformers"]
    assert results["device"]["device"] == "cpu" and results["device"]["name"]
    assert md.startswith("# GPU check\n") and "> Commit:" in md


def test_the_sections_that_became_tests_are_refused_with_where_they_went(capsys):
    for moved in gpu_check.MOVED:
        with pytest.raises(SystemExit):
            gpu_check.main(["--device", "cpu", "--tiny", "--sections", moved])
        assert f"{moved!r} is a test now" in capsys.readouterr().err and "python -m pytest -m gpu" in gpu_check.__doc__
    with pytest.raises(SystemExit):
        gpu_check.main(["--sections", "nonsense"])
    assert "invalid choice: 'nonsense' (choose from profile, triton, cost)" in capsys.readouterr().err


def test_every_ratio_comes_with_its_aa_floor(run):
    results, md = run
    rows = results["cost"]["rows"]
    measured = {(row["kind"], row["variant"], row["compiled"]): row for row in rows}
    expected = {(kind, v, False) for kind in ("train", "decode") for v in VARIANTS}
    expected |= {("train", "paper-dv4-tc", True), ("decode", "paper-dv4-tc", True)}
    assert set(measured) == expected
    ratios = 0
    for row in rows:
        assert row["status"] == "ok", row
        assert row["implementation"] == "auto → eager", row  # "auto" runs the tensor ops on the CPU
        for name, metric in gpu_report.metrics(row).items():
            ratios += 1
            assert metric["ratio"] > 0 and metric["aa_floor"]["ratio"] > 0, (row["variant"], name)
            if "baseline_tokens_per_s" in metric:  # timed: tokens/s of both and the A/A spread
                assert metric["baseline_tokens_per_s"] > 0 and metric["delta_tokens_per_s"] > 0
                assert metric["aa_floor"]["ratio_min"] <= metric["aa_floor"]["ratio_max"]
            else:
                assert metric["baseline_bytes"] > 0 and metric["delta_bytes"] > 0
    # eager: training time and memory, decoding at 2 batch sizes; compiled TC: the same (its static cache)
    assert ratios == len(VARIANTS) * 4 + 4
    assert {"train_eager", "memory_eager", "decode_b1_eager", "decode_b32_eager"} <= set(
        results["cost"]["floors"]["gpt2"]
    )
    assert "## Cost" in md and "(A/A " in md and "not supported" not in md and "| eager | auto → eager |" in md


def test_the_profile_splits_each_steps_kernels_and_the_delta_models_launch_more(run):
    """The profile section's accounting on the CPU stand-in: every launch and millisecond in exactly one class, the
    ten costliest "other" kernels within that class, and each Delta model launching more than GPT-2 (its residuals
    add operators: a profile that missed them would show the same count)."""
    results, md = run
    rows = results["profile"]["rows"]
    assert [row["model"] for row in rows] == ["gpt2", *gpu_check.PROFILE_VARIANTS]
    # "auto" is the tensor ops on the CPU, and the rows say so
    assert [row["implementation"] for row in rows] == ["-"] + ["auto → eager"] * len(gpu_check.PROFILE_VARIANTS)
    for row in rows:
        classes = row["by_class"].values()
        assert row["kernels"] == sum(c["kernels"] for c in classes) > 0
        assert row["busy_ms"] == pytest.approx(sum(c["ms"] for c in classes))
        assert row["wall_ms"] > 0 and row["by_class"]["matmul"]["kernels"] > 0
        top = row["top_other"]
        assert sum(k["kernels"] for k in top) <= row["by_class"]["other"]["kernels"]
        assert [k["ms"] for k in top] == sorted((k["ms"] for k in top), reverse=True)
    for row in rows[1:]:
        assert row["kernels"] > rows[0]["kernels"], row["model"]
    assert "## Where a training step's time goes" in md and "| additive-dv1 | auto → eager |" in md


def test_the_triton_section_times_both_implementations_beside_the_baseline_and_says_what_ran(run):
    """On the CPU without Triton's interpreter "eager" stands in for "triton": every row says so (no number is
    Triton's), and the section's code runs: both steps against the baseline with the cost section's A/A floor, and
    the launches of both (no Triton op ran); the DeltaNet row last, fla's rule not run."""
    results, md = run
    assert "triton" in gpu_check.SECTIONS and gpu_check.SECTIONS[-1] == "cost"
    section = results["triton"]
    assert section["triton_ran"] is False and "stands in" in section["note"] and "TRITON_INTERPRET" in section["note"]
    assert [row["variant"] for row in section["rows"]] == [*VARIANTS, gpu_check.DELTA_NET_ROW]
    assert section["rows"][-1]["fla"] is False
    for row in section["rows"]:
        assert row["implementations"] == {"eager": "eager", "triton": "eager"}, row
        for name in ("train_eager", "train_triton"):
            assert row[name]["ratio"] > 0 and row[name]["aa_floor"]["ratio"] > 0, name
        floor = section["floors"][row["family"]]["train_eager"]
        assert row["train_eager"]["aa_floor"] == gpu_check.aa_summary(floor)  # the cost section's floor, same method
        assert row["triton_vs_eager"] > 0
        counts = row["launches"]
        assert counts["eager"]["kernels"] > counts["baseline"]["kernels"] > 0
        assert counts["eager"]["triton_op_calls"] == counts["triton"]["triton_op_calls"] == 0
    assert "## Triton's Delta residual op against the tensor ops" in md and "no number below is Triton's" in md
    assert "| paper-dv4-tc | " in md.split("## Triton's")[1] and "| delta-net (fla: no) | " in md


def test_memory_rows_keep_the_allocators_readings_beside_the_ratio(run):
    """On CUDA the allocator's own start and peak sit beside each memory ratio (empty on the CPU, which has none)."""
    results, _ = run
    for row in results["cost"]["rows"]:
        for name, metric in gpu_report.metrics(row).items():
            if "baseline_bytes" in metric:
                assert metric["baseline_allocator"] == {} and metric["delta_allocator"] == {}, name


def test_nothing_failed(run):
    results, md = run
    assert results["summary"]["failures"] == []
    assert "fail" not in results["summary"]["counts"] and "error" not in results["summary"]["counts"]
    assert md.rstrip().endswith("## Failures\n\nNone.")


def test_budget_guard_skips_the_rows_past_the_budget():
    plan = gpu_check.TINY
    section = gpu_check.cost_section(
        plan, torch.device("cpu"), "eager", (["additive-dv1"], ["additive-dv1"]), time.perf_counter() - 100, 60, dict
    )
    assert len(section["rows"]) == 4  # train and decode, eager and compiled
    assert all(row["status"] == "skipped" and "time budget" in row["reason"] for row in section["rows"])


# Under Triton's interpreter (set before Triton is imported: a fresh interpreter), the real op, tiny.
TRITON_SCRIPT = """
import json, sys, torch
from ddl_lab.checks import gpu_check, gpu_report
from ddl_lab.common import train_step_fn
device = torch.device("cpu")
assert gpu_check.triton_unavailable(device) is None
shape = dict(gpu_check.TINY["shape"], seq=16)
baseline = gpu_check.build_baseline("gpt2", shape)
delta = gpu_check.build_delta("paper-dv4", baseline, "eager").train()
delta.loss_type = "ForCausalLM"
ids = gpu_check.random_ids(delta.config.vocab_size, 2, shape["seq"], seed=2)
step, _ = train_step_fn(delta, ids, autocast=torch.bfloat16)
calls = {name: gpu_check.step_kernels(gpu_check.running(delta, name, step), device)["triton_op_calls"]
         for name in gpu_check.TRITON_PAIR}
print(json.dumps({"calls": calls, "layers": delta.config.n_layer}))
"""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (the dev extra)")
def test_the_triton_ops_calls_are_counted_under_the_interpreter():
    """The real `ddl_hf::delta_residual` op (Triton's interpreter on CPU tensors): the triton section's launch count
    sees one op call per Delta residual forward, none with "eager"."""
    stdout = run_python("-c", TRITON_SCRIPT, triton_interpreter=True)
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["calls"] == {"eager": 0, "triton": 2 * result["layers"]}


def test_a_failing_section_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    def broken(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(gpu_check, "profile_section", broken)
    monkeypatch.setattr(gpu_check, "triton_unavailable", lambda device: "no Triton in this test")
    argv = ["--device", "cpu", "--tiny", "--out", str(tmp_path), "--sections", "profile", "triton"]
    results = gpu_check.main([*argv, "--variants", "additive-dv1"])
    assert results["profile"]["status"] == "error" and "boom" in results["profile"]["error"]
    assert [row["variant"] for row in results["triton"]["rows"]] == ["additive-dv1", gpu_check.DELTA_NET_ROW]
    assert [f["section"] for f in results["summary"]["failures"]] == ["profile"]
    written = json.loads((tmp_path / "gpu_check.json").read_text())
    assert written["profile"]["status"] == "error" and "triton" in written


def test_each_rows_printed_line_says_why_it_has_no_figures():
    """The line printed as a row finishes (outside the row's guard: it must not raise on any row a run can make)."""
    failed = {"variant": "paper-dv4", "status": "error", "error": "RuntimeError: boom", "wall_s": 1.0}
    assert gpu_report.progress_line("triton", failed).endswith(" paper-dv4            error: RuntimeError: boom")
    skipped = {"kind": "train", "variant": "paper-dv4", "compiled": True, "status": "skipped", "reason": "time budget"}
    assert (
        gpu_report.progress_line("cost", skipped)
        == "cost        train  compiled paper-dv4            skipped: time budget"
    )
    refused = {"kind": "decode", "variant": "paper-dv4-tc", "compiled": True, "status": "ok", "implementation": "auto"}
    refused.update(decode_b1_compiled={"status": "not supported", "reason": "..."}, decode_b32_compiled={"ratio": 1.25})
    line = gpu_report.progress_line("cost", refused)
    assert line.endswith("paper-dv4-tc         decode_b1_compiled not supported decode_b32_compiled 1.250"), line
