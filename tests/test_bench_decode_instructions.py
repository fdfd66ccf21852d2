"""benchmarks/bench_decode_instructions.py: its reading of callgrind's output format, on a dump written by hand."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_decode_instructions

# Two objects, three functions. `main` costs 10 + 5 itself and calls `work` (inclusive 100, not main's own);
# `work` costs 60 + 40 itself; `helper` (libc, first named as a callee) costs 7. Compressed names: `(1)` etc.
DUMP = """\
version: 1
creator: callgrind-3.19.0
events: Ir
summary: 122

ob=(1) /usr/lib/libtorch_cpu.so
fl=(1) ???
fn=(1) main
0 10
+1 5
cob=(2) /lib/x86_64-linux-gnu/libc.so.6
cfi=(1)
cfn=(2) helper
calls=1 0
* 7
cfn=(3) work
calls=2 0
* 100
fn=(3)
0 60
-1 40
ob=(2)
fn=(2)
0 7
totals: 122
"""


def test_self_costs_split_the_total_by_object_and_function_without_callee_costs():
    by_object, by_function = bench_decode_instructions.self_costs(DUMP)
    # main's own 15, work's 100 (its callers' inclusive lines are not counted again), helper's 7: 122 in all.
    assert by_object == {"libtorch_cpu.so": 115, "libc.so.6": 7}
    assert by_function == {"libtorch_cpu.so: main": 15, "libtorch_cpu.so: work": 100, "libc.so.6: helper": 7}
    assert sum(by_object.values()) == 122


def test_self_costs_of_a_real_dump_sum_to_its_total(tmp_path):
    """valgrind on a short Python program: the split covers every instruction callgrind counted."""
    if shutil.which("valgrind") is None:
        pytest.skip("valgrind is not installed (the benchmark needs it; the format test above does not)")
    out = tmp_path / "callgrind.out"
    command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, "-c", "sum(range(999))"]
    subprocess.run(command, check=True, capture_output=True)
    dump = out.read_text()
    total = int(re.search(r"^(?:summary|totals):\s+(\d+)", dump, re.M)[1])
    by_object, by_function = bench_decode_instructions.self_costs(dump)
    assert sum(by_object.values()) == sum(by_function.values()) == total
    assert any(name.startswith(("libpython", "python")) for name in by_object)  # the interpreter is one of them


def test_the_fast_path_row_switches_off_what_the_hook_registries_allow_and_keeps_the_tokens(monkeypatch):
    """The row that prices the hook-registry fast path: the same tokens as the default model, with the gate and value
    projections called through nn.Module, as where delta_compat cannot read torch's hooks, so no update takes the
    one-token host path (the default model: one per block and decoding step)."""
    import torch
    from bench_overhead import SHAPES

    from ddl_hf import modeling_delta_gpt as modeling
    from ddl_hf.delta_compat import is_unhooked

    calls = []
    original = modeling.one_token_delta_update

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(modeling, "one_token_delta_update", counted)
    shape = SHAPES["tiny"]
    prompt = torch.randint(1, shape["vocab_size"], (1, 5), generator=torch.Generator().manual_seed(0))
    greedy = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    tokens = {}
    rows = [("d_v=1 additive", True), *((row, False) for row in bench_decode_instructions.FAST_PATH_ROWS)]
    for name, host_path in rows:
        model = bench_decode_instructions.build_model(shape, name)
        assert is_unhooked(model.transformer.h[0].attn_delta.beta_proj) is host_path
        calls.clear()
        with torch.inference_mode():
            tokens[name] = model.generate(prompt, **greedy)
        assert len(calls) == (2 * 2 * shape["n_layer"] if host_path else 0), name  # 2 decoding steps
    assert all(torch.equal(t, tokens["d_v=1 additive"]) for t in tokens.values())
