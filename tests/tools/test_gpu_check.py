"""checks/gpu_check.py: its tiny CPU mode runs every section's code path and writes every result.

The run is a subprocess in which `datasets` cannot be imported, as on the GPU machine the check is written for.
Two variants keep it short and still cover both families, d_v = 4, paper mode, the TC read (whose static cache is
refused) and a compiled training step. About 40 s on 2 cores, most of it imports and the compiled step.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "checks"))
import gpu_check

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "checks" / "gpu_check.py"

VARIANTS = ("paper-dv4-tc", "llama-paper-dv4")
# sys.modules[name] = None makes `import name` fail, as where the package is not installed.
RUNNER = (
    "import runpy, sys; sys.modules['datasets'] = None; sys.argv = sys.argv[1:]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)
CORRECTNESS = ("device_vs_cpu_fp32", "bf16_autocast", "generate_cache", "sdpa_vs_eager")


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
    assert "checks/gpu_check.py --device cpu --tiny" in provenance["command"]
    assert "commit" in provenance["git"]
    assert provenance["versions"]["torch"] == torch.__version__ and provenance["versions"]["transformers"]
    assert results["device"]["device"] == "cpu" and results["device"]["name"]
    assert md.startswith("# GPU check\n") and "> Commit:" in md


def test_every_correctness_check_of_every_variant_passes(run):
    results, md = run
    section = results["correctness"]
    assert [row["variant"] for row in section["rows"]] == list(VARIANTS)
    assert 0 < section["fp32_bound"] < 1e-3 and section["fp32_bound_formula"] and section["bf16_bound_formula"]
    for row in section["rows"]:
        for check in CORRECTNESS:
            assert row[check]["status"] == "pass", (row["variant"], check, row[check])
        assert row["bf16_autocast"]["error"] <= row["bf16_autocast"]["bound"]
        for flash, _ in gpu_check.FLASH:  # CUDA only: skipped, with the reason
            assert row[flash]["status"] == "skipped" and row[flash]["reason"]
    assert "## Correctness" in md and "| paper-dv4-tc | pass" in md


def test_sync_section_is_skipped_on_the_cpu_with_its_reason(run):
    results, md = run
    assert results["sync"]["status"] == "skipped" and "CUDA" in results["sync"]["reason"]
    assert "## No synchronisation" in md and "Skipped: torch.cuda.set_sync_debug_mode needs CUDA" in md


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
        for name, metric in gpu_check._metrics(row).items():
            if metric.get("status") == "not supported":  # TC: no static cache, so no compiled decoding
                assert (row["variant"], row["compiled"]) == ("paper-dv4-tc", True) and metric["reason"], name
                continue
            ratios += 1
            assert metric["ratio"] > 0 and metric["aa_floor"]["ratio"] > 0, (row["variant"], name)
            if "baseline_tokens_per_s" in metric:  # timed: tokens/s of both and the A/A spread
                assert metric["baseline_tokens_per_s"] > 0 and metric["delta_tokens_per_s"] > 0
                assert metric["aa_floor"]["ratio_min"] <= metric["aa_floor"]["ratio_max"]
            else:
                assert metric["baseline_bytes"] > 0 and metric["delta_bytes"] > 0
    # eager: training time and memory, decoding at 2 batch sizes; compiled TC: training time and memory
    assert ratios == len(VARIANTS) * 4 + 2
    assert {"train_eager", "memory_eager", "decode_b1_eager", "decode_b32_eager"} <= set(
        results["cost"]["floors"]["gpt2"]
    )
    assert "## Cost" in md and "(A/A " in md and "not supported" in md


def test_the_profile_splits_each_steps_kernels_and_the_delta_models_launch_more(run):
    """The profile section's accounting on the CPU stand-in: every launch and millisecond in exactly one class, the
    ten costliest "other" kernels within that class, and each Delta model launching more than GPT-2 (its residuals
    add operators: a profile that missed them would show the same count)."""
    results, md = run
    rows = results["profile"]["rows"]
    fused = f"{gpu_check.PROFILE_VARIANTS[0]} +compiled update"
    assert [row["model"] for row in rows] == ["gpt2", *gpu_check.PROFILE_VARIANTS, fused]
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
    assert "## Where a training step's time goes" in md and "| additive-dv1 |" in md


def test_the_compiled_update_is_checked_against_the_tensor_ops_and_timed_against_them_and_gpt2(run):
    results, md = run
    section = results["compiled_update"]
    assert [row["variant"] for row in section["rows"]] == list(gpu_check.PROFILE_VARIANTS)
    for row in section["rows"]:
        check = row["model_logits"]
        assert check["status"] == "pass" and check["fp32"]["status"] == "pass", row
        assert check["error"] <= check["bound"] and check["fp32"]["error"] <= check["fp32"]["bound"]
        step = row["train_step"]
        for key in ("update_vs_tensor_ops", "tensor_ops_vs_gpt2", "update_vs_gpt2"):
            assert step[key]["ratio"] > 0 and step[key]["aa_floor"]["ratio"] > 0, key
    assert "## The Delta update compiled on its own" in md and "| additive-dv1 | pass" in md


def test_memory_rows_keep_the_allocators_readings_beside_the_ratio(run):
    """On CUDA the allocator's own start and peak sit beside each memory ratio (empty on the CPU, which has none)."""
    results, _ = run
    for row in results["cost"]["rows"]:
        for name, metric in gpu_check._metrics(row).items():
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


def test_the_kernel_model_check_compares_the_kernels_logits_with_float32_torch():
    """The model-level kernel check (fla's section, the compiled update's) on the CPU with stand-in delta-rule kernels
    for CPU tensors: the torch chunkwise form
    passes (its own error is the bound's base), one whose outputs come a token late fails, and the kernel is what the
    model ran."""
    from ddl_hf import DeltaGPTConfig, DeltaGPTForCausalLM
    from ddl_hf.delta_ops import DeltaKernel, delta_rule_chunkwise, register_kernel, registered_kernel

    shape = gpu_check.TINY["check"]
    config = gpu_check.base_config("gpt2", shape).to_dict()
    fields = {k: v for k, v in config.items() if k not in ("model_type", "transformers_version")}
    torch.manual_seed(0)
    model = DeltaGPTForCausalLM(DeltaGPTConfig(**fields, **gpu_check._COMMON, token_mixer="delta_net")).eval()
    ids = gpu_check.random_ids(model.config.vocab_size, 2, shape["seq"], seed=3)
    calls = []

    def chunkwise(q, k, v, beta, initial_state, erase, document_starts, cu_seqlens, shift=0):
        calls.append(v.dtype)
        o, state = delta_rule_chunkwise(q, k, v, beta, initial_state=initial_state, erase=erase)
        return o.roll(shift, dims=2), state  # shift: outputs one token late (a scale would vanish in o_norm)

    before = registered_kernel("delta_rule")
    try:
        record = gpu_check.kernel_model_check(model, ids, "delta_rule", DeltaKernel(chunkwise, None, lambda x: True))
        assert record["status"] == "pass" and 0 < record["torch_error"] <= record["bound"], record
        assert record["fp32"]["status"] == "pass", record
        assert len(calls) == 2 * model.config.n_layer  # bf16 and float32 forwards with the kernel, a call per layer
        assert registered_kernel("delta_rule") is before  # put back
        late = DeltaKernel(lambda *a: chunkwise(*a, shift=1), None, lambda x: True)
        record = gpu_check.kernel_model_check(model, ids, "delta_rule", late)
        assert record["status"] == "fail" and record["fp32"]["status"] == "fail"
    finally:
        register_kernel("delta_rule", before)


def test_a_failing_section_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    def broken(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(gpu_check, "correctness_section", broken)
    results = gpu_check.main(["--device", "cpu", "--tiny", "--out", str(tmp_path), "--sections", "correctness", "sync"])
    assert results["correctness"]["status"] == "error" and "boom" in results["correctness"]["error"]
    assert results["sync"]["status"] == "skipped"
    assert results["summary"]["failures"][0]["section"] == "correctness"
    written = json.loads((tmp_path / "gpu_check.json").read_text())
    assert written["correctness"]["status"] == "error" and "sync" in written


def test_the_fla_rows_compare_the_registered_kernel_with_the_float64_reference():
    """The fla section's comparison, on the CPU: a stand-in kernel registered for CPU tensors (the torch chunkwise
    form) passes every case and is the one called; a kernel 5% off fails every case. On a GPU the registered kernel
    is fla's (`ddl_hf.fla_kernels`)."""
    from ddl_hf.delta_ops import DeltaKernel, delta_rule_chunkwise, register_kernel, registered_kernel

    calls = []

    def chunkwise(q, k, v, beta, initial_state, erase, document_starts, cu_seqlens, scale=1.0):
        calls.append(q.shape[2])
        o, state = delta_rule_chunkwise(q, k, v, beta, initial_state=initial_state, erase=erase)
        return o * scale, state

    before = registered_kernel("delta_rule")
    try:
        register_kernel("delta_rule", DeltaKernel(chunkwise, None, lambda x: True))
        rows = gpu_check.fla_rule_errors(torch.device("cpu"), heads=2, d=16)
        assert [row["check"]["status"] for row in rows] == ["pass"] * len(gpu_check.FLA_CASES)
        assert sorted(set(calls)) == sorted({tokens for tokens, _ in gpu_check.FLA_CASES})  # the kernel ran
        off = DeltaKernel(lambda *args: chunkwise(*args, scale=1.05), None, lambda x: True)
        register_kernel("delta_rule", off)
        rows = gpu_check.fla_rule_errors(torch.device("cpu"), heads=2, d=16)
        assert [row["check"]["status"] for row in rows] == ["fail"] * len(gpu_check.FLA_CASES)
    finally:
        register_kernel("delta_rule", before)
