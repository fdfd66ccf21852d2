"""checks/gpu_check.py: its tiny CPU mode runs every section's code path and writes every result.

The run is a subprocess in which `datasets` cannot be imported, as on the GPU machine the check is written for.
Two variants keep it short and still cover both families, d_v = 4, paper mode, the TC read (whose static cache is
refused) and a compiled training step. About 40 s on 2 cores, most of it imports and the compiled step. Triton cannot
run there (no interpreter): the triton section's "eager" stand-in runs its code, and says so; the real Triton op is
checked by the section's comparison in a subprocess under Triton's interpreter, at a tiny shape.
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

from tests.subprocesses import run_python

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
        assert row["implementation"] == "auto → eager", row  # "auto" runs the tensor ops on the CPU
        for name, metric in gpu_check._metrics(row).items():
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
    Triton's), and the section's code runs: both steps against the baseline with the cost section's A/A floor, the
    bf16 loss and gradients within their bounds, the launches of both (no Triton op ran)."""
    results, md = run
    assert "triton" in gpu_check.SECTIONS and gpu_check.SECTIONS[-1] == "cost"
    section = results["triton"]
    assert section["triton_ran"] is False and "stands in" in section["note"] and "TRITON_INTERPRET" in section["note"]
    assert [row["variant"] for row in section["rows"]] == list(VARIANTS)
    for row in section["rows"]:
        assert row["implementations"] == {"eager": "eager", "triton": "eager"}, row
        check = row["bf16_loss_and_grads"]
        assert check["status"] == "pass" and check["implementation"] == "eager", check
        for part in ("loss", "grads"):
            assert 0 < check[part]["error"] <= check[part]["bound"], (part, check)
        assert check["grads"]["parameters"] > 0 and "missing" not in check["grads"]
        for name in ("train_eager", "train_triton"):
            assert row[name]["ratio"] > 0 and row[name]["aa_floor"]["ratio"] > 0, name
        floor = section["floors"][row["family"]]["train_eager"]
        assert row["train_eager"]["aa_floor"] == gpu_check.aa_summary(floor)  # the cost section's floor, same method
        assert row["triton_vs_eager"] > 0
        counts = row["launches"]
        assert counts["eager"]["kernels"] > counts["baseline"]["kernels"] > 0
        assert counts["eager"]["triton_op_calls"] == counts["triton"]["triton_op_calls"] == 0
    assert "## Triton's Delta residual op against the tensor ops" in md and "no number below is Triton's" in md
    assert "| paper-dv4-tc | " in md.split("## Triton's")[1]


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


@pytest.fixture
def stand_in_triton(monkeypatch):
    """`delta_implementation="triton"` on CPU tensors with a stand-in delta rule (`install(kernel)`): the library's
    own path from a model's implementation to its kernels (`ddl_hf.kernels.kernels_for`), the kernel chosen here.
    The chosen kernels are cached per process (`delta_ops._CHOSEN`): a fresh cache for the test, the real one back
    afterwards, so that no stand-in outlives it."""
    import ddl_hf.kernels as backends
    from ddl_hf import delta_ops

    def install(kernel):
        monkeypatch.setattr(delta_ops, "_CHOSEN", {})
        monkeypatch.setattr(backends, "check_available", lambda implementation: None)
        chosen = delta_ops.DeltaKernels(delta_rule=kernel)
        others = delta_ops.TENSOR_OPS
        monkeypatch.setattr(backends, "kernels_for", lambda name, device: chosen if name == "triton" else others)

    return install


def delta_net_model():
    from ddl_hf import DeltaGPTConfig, DeltaGPTForCausalLM

    shape = gpu_check.TINY["check"]
    config = gpu_check.base_config("gpt2", shape).to_dict()
    fields = {k: v for k, v in config.items() if k not in ("model_type", "transformers_version")}
    torch.manual_seed(0)
    config = DeltaGPTConfig(**fields, **gpu_check._COMMON, token_mixer="delta_net", delta_implementation="eager")
    model = DeltaGPTForCausalLM(config).eval()
    return model, gpu_check.random_ids(model.config.vocab_size, 2, shape["seq"], seed=3)


def chunkwise_rule(calls, shift=0):
    """A stand-in delta-rule kernel for CPU tensors: the torch chunkwise form, its outputs `shift` tokens late (a
    scale would vanish in o_norm); `calls` gets each call's dtype."""
    from ddl_hf.delta_ops import delta_rule_chunkwise

    def rule(q, k, v, beta, initial_state, erase, document_starts, cu_seqlens):
        calls.append(v.dtype)
        o, state = delta_rule_chunkwise(q, k, v, beta, initial_state=initial_state, erase=erase)
        return o.roll(shift, dims=2), state

    return rule


def test_the_model_check_compares_an_implementations_logits_with_float32_eager(stand_in_triton):
    """The model-level check (the fla section's) on the CPU, "triton" given stand-in delta-rule kernels: the torch
    chunkwise form passes (the eager bf16 error is the bound's base), one whose outputs come a token late fails, the
    kernel is what the model ran, and the model runs its own implementation again afterwards."""
    model, ids = delta_net_model()
    calls = []
    stand_in_triton(chunkwise_rule(calls))
    record = gpu_check.implementation_model_check(model, ids, "triton")
    assert record["status"] == "pass" and 0 < record["torch_error"] <= record["bound"], record
    assert record["fp32"]["status"] == "pass" and record["implementation"] == "triton", record
    assert len(calls) == 2 * model.config.n_layer  # bf16 and float32 forwards with the kernel, a call per layer
    assert model.config.delta_implementation == "eager"  # put back
    stand_in_triton(chunkwise_rule(calls, shift=1))
    record = gpu_check.implementation_model_check(model, ids, "triton")
    assert record["status"] == "fail" and record["fp32"]["status"] == "fail"


def test_the_loss_and_gradient_check_bounds_each_by_eagers_own_bf16_error(stand_in_triton):
    """The triton section's correctness check, "triton" given stand-in kernels: the same math passes, loss and every
    parameter's gradient; a kernel a token late fails the gradients, the worst parameter named (a random model's
    loss is about log(vocab) whatever its mixer computes: the loss alone barely sees it)."""
    model, ids = delta_net_model()
    model.train()
    calls = []
    stand_in_triton(chunkwise_rule(calls))
    record = gpu_check.loss_and_grads_check(model, ids, "triton")
    assert record["status"] == "pass" and calls, record
    assert record["grads"]["parameters"] == len([p for p in model.parameters() if p.requires_grad])
    for part in ("loss", "grads"):
        assert 0 < record[part]["error"] <= record[part]["bound"], (part, record)
    stand_in_triton(chunkwise_rule(calls, shift=1))
    record = gpu_check.loss_and_grads_check(model, ids, "triton")
    assert record["status"] == "fail" and record["grads"]["status"] == "fail", record
    assert record["grads"]["error"] > record["grads"]["bound"] and record["loss"]["error"] > 0
    assert record["grads"]["worst_parameter"] in dict(model.named_parameters())
    assert model.config.delta_implementation == "eager" and all(p.grad is None for p in model.parameters())


# Under Triton's interpreter (set before Triton is imported: a fresh interpreter), the real op, tiny.
TRITON_SCRIPT = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import gpu_check
device = torch.device("cpu")
assert gpu_check.triton_unavailable(device) is None
shape = dict(gpu_check.TINY["check"], seq=16)
baseline = gpu_check.build_baseline("gpt2", shape)
delta = gpu_check.build_delta("paper-dv4", baseline, "eager").train()
delta.loss_type = "ForCausalLM"
ids = gpu_check.random_ids(delta.config.vocab_size, 2, shape["seq"], seed=2)
record = gpu_check.loss_and_grads_check(delta, ids, "triton")
step = gpu_check.train_step_fn(delta, ids, torch.optim.AdamW(delta.parameters(), lr=1e-4))
calls = {name: gpu_check.step_kernels(gpu_check.running(delta, name, step), device)["triton_op_calls"]
         for name in gpu_check.TRITON_PAIR}
print(json.dumps({"record": record, "calls": calls, "layers": delta.config.n_layer}))
"""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (the dev extra)")
def test_the_triton_models_loss_and_gradients_pass_and_its_op_is_counted_under_the_interpreter():
    """The real `ddl_hf::delta_residual` op (Triton's interpreter on CPU tensors): the triton section's bf16 loss and
    gradient check passes, and its launch count sees one op call per Delta residual forward, none with "eager"."""
    stdout = run_python("-c", TRITON_SCRIPT, str(ROOT / "checks"), triton_interpreter=True)
    result = json.loads(stdout.strip().splitlines()[-1])
    record = result["record"]
    assert record["status"] == "pass" and record["implementation"] == "triton", record
    assert record["grads"]["parameters"] > 0 and "missing" not in record["grads"], record
    assert result["calls"] == {"eager": 0, "triton": 2 * result["layers"]}


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


def test_the_fla_rows_compare_the_kernel_with_the_float64_reference():
    """The fla section's comparison, on the CPU: a stand-in kernel (the torch chunkwise form) passes every case and
    is the one called; a kernel 5% off fails every case. On a GPU the kernel is `delta_implementation="triton"`'s
    delta rule, fla's (`ddl_hf.fla_kernels`)."""
    from ddl_hf.delta_ops import delta_rule_chunkwise

    calls = []

    def chunkwise(q, k, v, beta, initial_state, erase, document_starts, cu_seqlens, scale=1.0):
        calls.append(q.shape[2])
        o, state = delta_rule_chunkwise(q, k, v, beta, initial_state=initial_state, erase=erase)
        return o * scale, state

    rows = gpu_check.fla_rule_errors(torch.device("cpu"), chunkwise, heads=2, d=16)
    assert [row["check"]["status"] for row in rows] == ["pass"] * len(gpu_check.FLA_CASES)
    assert sorted(set(calls)) == sorted({tokens for tokens, _ in gpu_check.FLA_CASES})  # the kernel ran
    rows = gpu_check.fla_rule_errors(torch.device("cpu"), lambda *args: chunkwise(*args, scale=1.05), heads=2, d=16)
    assert [row["check"]["status"] for row in rows] == ["fail"] * len(gpu_check.FLA_CASES)
