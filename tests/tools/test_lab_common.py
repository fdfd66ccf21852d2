"""ddl_lab/common.py: the provenance block every lab tool writes, the path scrubbing of its results, and the timing."""

from __future__ import annotations

import json
import os
import subprocess
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ddl_lab import common

ROOT = Path(__file__).resolve().parents[2]

HOME = os.path.expanduser("~")


def test_provenance_fields():
    # `python -m` puts the module's file in argv[0]: the command is recorded as the module, run from the repo root
    argv = [str(ROOT / "ddl_lab" / "benchmarks" / "bench_overhead.py"), "--quick", "--out", str(ROOT / "x")]
    prov = common.provenance(argv)
    assert prov["command"] == "python -m ddl_lab.benchmarks.bench_overhead --quick --out x"
    assert set(prov) == {"command", "git", "machine", "versions", "date"}
    assert {"commit", "dirty"} <= set(prov["git"])
    if (ROOT / ".git").exists():
        assert prov["git"]["commit"] and isinstance(prov["git"]["dirty"], bool)
    machine = prov["machine"]
    assert machine["cpu"] and machine["logical_cpus"] == os.cpu_count()
    import torch

    assert machine["torch_threads"] == torch.get_num_threads()
    assert prov["versions"]["torch"] == torch.__version__
    assert prov["versions"]["python"] and prov["versions"]["transformers"]
    assert datetime.fromisoformat(prov["date"]).utcoffset().total_seconds() == 0
    json.dumps(prov)  # JSON-serialisable as is


def test_git_state_outside_a_checkout(tmp_path):
    state = common.git_state(tmp_path)
    if subprocess.run(["git", "-C", str(tmp_path), "rev-parse"], capture_output=True).returncode == 0:
        pytest.skip("the temporary folder is inside a git checkout")
    assert state["commit"] is None and state["dirty"] is None and state["error"]


@pytest.mark.skipif(HOME in ("", "/") or str(ROOT).startswith(HOME + "/"), reason="needs a home outside the repo")
def test_scrub_home_and_boundaries():
    assert common.scrub_text(f"cached at {HOME}/.cache/m (7M)") == "cached at ~/.cache/m (7M)"
    assert common.scrub_text(HOME) == "~"
    assert common.scrub_text(f"{HOME}fs/x") == f"{HOME}fs/x"  # only whole path components


def test_scrub_repo_root_and_nested_objects():
    data = {"out": str(ROOT / "benchmarks" / "results"), "root": str(ROOT), "rows": [ROOT / "a.json", 1.5, None]}
    assert common.scrub_paths(data) == {"out": "benchmarks/results", "root": ".", "rows": ["a.json", 1.5, None]}


def test_write_results_is_scrubbed_atomic_and_has_provenance(tmp_path):
    prov = common.provenance(["benchmarks/x.py"])
    paths = common.write_results(tmp_path, "r", {"value": f"{ROOT}/y", "provenance": prov}, "# Title\n\nbody\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.md"]  # no temporary file left behind
    written = json.loads(paths["json"].read_text())
    assert next(iter(written)) == "provenance" and written["value"] == "y"
    md = paths["md"].read_text()
    assert md.startswith("# Title\n\n> Command: `python benchmarks/x.py`")  # a script outside the lab: its path
    assert prov["git"]["commit"] is None or prov["git"]["commit"] in md
    for text in (paths["json"].read_text(), md):
        assert str(ROOT) not in text and (HOME in ("", "/") or HOME + "/" not in text)


def test_bench_overhead_pairs_share_every_baseline_weight_and_a_mismatch_is_refused():
    """`build_pair` loads the baseline's weights into its Delta model non-strictly, then checks what was missing (only
    Delta parameters may be) and unexpected (nothing may be)."""
    from ddl_lab.builders import SHAPES, build_pair

    base, delta = build_pair(SHAPES["tiny"], 4, "paper")
    shared = dict(delta.named_parameters())
    assert all(torch.equal(p, shared[name]) for name, p in base.named_parameters())
    with pytest.raises(RuntimeError, match=r"baseline weights do not map onto the Delta model: missing=.*c_attn"):
        build_pair(SHAPES["tiny"], 1, "additive", {"token_mixer": "delta_net"})


def test_the_step_profile_attributes_the_tc_read_only_to_variants_that_have_one(tmp_path):
    """`profile_variant_step.py --quick`: the TC read's autograd Function holds time in the TC rows and none in the
    linear-read or CC rows; every row has the Delta update; the parts and 'other' add up to the extra time."""
    from ddl_hf.native import native_build_problem
    from ddl_lab.benchmarks.profile_variant_step import main

    rows = {row["variant"]: row for row in main(["--quick", "--out", str(tmp_path)])["rows"]}
    tensor_ops = {"linear read", "TC", "CC", "EC", "TC+EC"}
    native = {f"{name}, native" for name in tensor_ops} if native_build_problem() is None else set()
    assert set(rows) == tensor_ops | native
    for name, row in rows.items():
        parts = row["parts_ms"]
        assert parts["Delta update"] > 0, name
        assert (parts["TC read"] > 0) == name.startswith("TC"), name
        assert sum(parts.values()) == pytest.approx(row["delta_ms"] - row["gpt2_ms"])
    saved = json.loads((tmp_path / "variant_step_profile_quick.json").read_text())
    assert saved["provenance"]["command"].startswith("python -m ddl_lab.benchmarks.profile_variant_step --quick")
    table = (tmp_path / "variant_step_profile_quick.md").read_text()
    assert table.count("\n| ") == 1 + len(rows)  # the header, then one line per variant


class FakeClocks:
    """Process CPU time and wall time that move only when a timed call runs: each call adds its (CPU, wall) seconds
    and logs its name, so that what `interleaved` reports can be computed by hand."""

    def __init__(self) -> None:
        self.cpu = self.wall = 0.0
        self.log: list[str] = []

    def call(self, name: str, cpu: float, wall: float):
        def run() -> None:
            self.log.append(name)
            self.cpu += cpu
            self.wall += wall

        return run


def test_interleaved_alternates_the_order_and_reports_the_clock_of_its_caller(monkeypatch):
    """A costs (1 s CPU, 2 s wall) a call, B (3, 4) in odd pairs and (1.5, 6) in even ones: the CPU benchmarks' result
    (no device) reads process CPU time with wall beside it, a device's reads wall time alone, each the median of the
    per-pair ratios B / A with the smallest and largest; the order alternates AB, BA, ... after the warm-up calls, and
    the device is synchronised before and after each timed call."""
    clocks = FakeClocks()
    monkeypatch.setattr(common.time, "process_time", lambda: clocks.cpu)
    monkeypatch.setattr(common.time, "perf_counter", lambda: clocks.wall)
    costs = iter([(3.0, 4.0), (1.5, 6.0)] * 10)

    def fn_b() -> None:
        cpu, wall = next(costs)
        clocks.call("b", cpu, wall)()

    fn_a = clocks.call("a", 1.0, 2.0)
    result = common.interleaved(fn_a, fn_b, pairs=3, warmup=1)
    assert clocks.log == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-up, then AB BA AB
    # timed B calls: the warm-up took (3, 4); then (1.5, 6), (3, 4), (1.5, 6)
    assert result == {
        "gpt2_s": 1.0,
        "delta_s": 1.5,
        "ratio": 1.5,
        "ratio_min": 1.5,
        "ratio_max": 3.0,
        "gpt2_wall_s": 2.0,
        "delta_wall_s": 6.0,
        "wall_ratio": 3.0,
        "pairs": 3,
    }

    synchronised: list[str] = []
    monkeypatch.setattr(common, "synchronize", lambda device: synchronised.append(str(device)))
    clocks.log.clear()
    result = common.interleaved(fn_a, fn_b, pairs=2, warmup=0, device=torch.device("cpu"))
    assert clocks.log == ["a", "b", "b", "a"] and synchronised == ["cpu"] * 8  # before and after each of 4 calls
    # timed B calls: (3, 4), (1.5, 6): wall ratios 2 and 3
    assert result == {"baseline_s": 2.0, "delta_s": 5.0, "ratio": 2.5, "ratio_min": 2.0, "ratio_max": 3.0, "pairs": 2}


def test_a_training_step_runs_under_the_autocast_it_is_given():
    """`train_step_fn(autocast=torch.bfloat16)` runs the forward under bf16 autocast on the inputs' device, and
    without it under none; either way the step trains (AdamW moves the weights)."""
    seen = []

    class Probe(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(4, 4))

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor):
            seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
            loss = (input_ids.float() @ self.weight).square().mean()
            return SimpleNamespace(loss=loss)

    ids = torch.ones(2, 4, dtype=torch.long)
    for autocast in (torch.bfloat16, None):
        model = Probe()
        step, _ = common.train_step_fn(model, ids, autocast=autocast)
        step()
        assert seen.pop() == autocast and model.training
        assert not torch.equal(model.weight, torch.ones(4, 4))
