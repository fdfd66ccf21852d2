"""flash-linear-attention's delta-rule kernels behind the DeltaNet mixer (`ddl_hf.fla_kernels`).

What a CPU can check: the argument mapping, numerically, through Triton's interpreter (`TRITON_INTERPRET=1`, set
before Triton is imported, hence a subprocess) for fla's recurrent kernel, against our recurrent reference; which
kernel is chosen and with what arguments (a stub fla); the entry point's dispatch and fallback; that "auto" and
"triton" on CUDA resolve fla's rule where fla is installed (`ddl_hf.kernels.kernels_for`) and that a DeltaNet model
hands its implementation's rule to the entry point. What it cannot: fla's chunked kernel (it needs a GPU driver even
under the interpreter: it is called with the recurrent kernel's arguments, checked here with the stub; on a
device tests/gpu/test_gpu_kernels.py checks it) and any speed (`ddl_lab/checks/gpu_check.py` on a device).
tests/models/test_fake_cuda.py runs a DeltaNet model on fake CUDA tensors.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch

import ddl_hf.kernels as backends
from ddl_hf import delta_net_ops, delta_ops, fla_kernels
from ddl_hf.delta_net_ops import delta_rule, delta_rule_chunkwise
from ddl_hf.delta_ops import TENSOR_OPS, DeltaKernels
from ddl_hf.fla_kernels import fla_available, fla_delta_rule
from tests.builders import delta_model, delta_rule_inputs
from tests.subprocesses import in_tritons_interpreter

HAVE_FLA = fla_available() and importlib.util.find_spec("triton") is not None


def auto_runs_rule(monkeypatch, rule) -> None:
    """A model with "auto" on the CPU hands `rule` to the delta rule, as "auto" on CUDA hands it fla's: `kernels_for`
    answers with it (every other implementation and device as before), and the cache of chosen kernels starts empty
    and is put back after the test."""
    chosen = backends.kernels_for

    def kernels_for(implementation: str, device_type: str) -> DeltaKernels:
        if (implementation, device_type) == ("auto", "cpu"):
            return DeltaKernels(delta_rule=rule)
        return chosen(implementation, device_type)

    monkeypatch.setattr(backends, "kernels_for", kernels_for)
    monkeypatch.setattr(delta_ops, "_CHOSEN", {})


PACKED_SCRIPT = """
import json, torch
from tests.builders import delta_rule_inputs
from ddl_hf.delta_net_ops import delta_rule_recurrent
from ddl_hf.fla_kernels import fla_delta_rule

x = {name: value[:1] for name, value in delta_rule_inputs(12).items()}
x["initial_state"] = None
starts = torch.zeros(1, 12, dtype=torch.bool)
starts[0, [0, 5, 9]] = True
cu_seqlens = torch.tensor([0, 5, 9, 12], dtype=torch.int32)
o, state = fla_delta_rule(**x, erase=True, document_starts=starts, cu_seqlens=cu_seqlens)
o32, state32 = delta_rule_recurrent(**x, document_starts=starts)
o64, state64 = delta_rule_recurrent(**{k: v.double() for k, v in x.items() if v is not None}, document_starts=starts)
print("RESULT", json.dumps({
    name: [float((a.double() - ref).abs().max()), float((b.double() - ref).abs().max()), float(ref.abs().max())]
    for name, a, b, ref in (("o", o, o32, o64), ("state", state, state32, state64))
}))
"""


SCRIPT = """
import json, torch
from tests.builders import delta_rule_inputs
from ddl_hf.delta_net_ops import delta_rule_recurrent
from ddl_hf.fla_kernels import fla_delta_rule

out = {}
for seq_len in (1, 12):
    x = delta_rule_inputs(seq_len)
    o, state = fla_delta_rule(**x, erase=True, document_starts=None)
    o32, state32 = delta_rule_recurrent(**x)
    o64, state64 = delta_rule_recurrent(**{k: v.double() for k, v in x.items()})
    out[seq_len] = {
        name: [float((a.double() - ref).abs().max()), float((b.double() - ref).abs().max()), float(ref.abs().max())]
        for name, a, b, ref in (("o", o, o32, o64), ("state", state, state32, state64))
    }
    out[seq_len]["shapes"] = [list(o.shape), list(state.shape), str(o.dtype), str(state.dtype)]
print("RESULT", json.dumps(out))
"""


@pytest.mark.skipif(not HAVE_FLA, reason="fla-core and triton are not installed (the dev extra installs them)")
def test_the_mapping_through_tritons_interpreter_matches_the_recurrent_reference():
    """fla's recurrent kernel, our layout mapped to its own, against our reference in float64: within 4x the float32
    error of our own reference (the same rounding argument as tests/rounding.py), for T = 1 (a decoding step) and
    12, with an initial state and d_v != d_k."""
    result = in_tritons_interpreter(SCRIPT)
    eps = torch.finfo(torch.float32).eps
    for seq_len, errors in result.items():
        assert errors["shapes"] == [[2, 2, int(seq_len), 8], [2, 2, 8, 16], "torch.float32", "torch.float32"]
        for name in ("o", "state"):
            fla_error, our_error, scale = errors[name]
            assert fla_error <= 4 * max(our_error, 4 * eps * scale), (seq_len, name, errors[name])


@pytest.mark.skipif(not HAVE_FLA, reason="fla-core and triton are not installed (the dev extra installs them)")
def test_a_packed_row_through_tritons_interpreter_matches_the_recurrent_reference():
    """fla's varlen recurrent kernel on one row of three documents (`cu_seqlens`) against our reference with the
    same `document_starts`, within 4x our own float32 error, output and the last document's final state."""
    result = in_tritons_interpreter(PACKED_SCRIPT)
    eps = torch.finfo(torch.float32).eps
    for name, (fla_error, our_error, scale) in result.items():
        assert fla_error <= 4 * max(our_error, 4 * eps * scale), (name, result[name])


class StubRule:
    """Records what the kernel is called with; answers with tensors of fla's output layout."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, beta, *, scale, initial_state, output_final_state, cu_seqlens=None):
        assert q.dtype == k.dtype == v.dtype, "fla's kernels take q, k and v in one dtype (chunk_delta_rule asserts it)"
        call = dict(q=q, k=k, v=v, beta=beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens)
        self.calls.append(call)
        b, t, h, d_k = k.shape
        states = b if cu_seqlens is None else len(cu_seqlens) - 1  # varlen: one final state per document
        return torch.zeros(b, t, h, v.shape[-1], dtype=v.dtype), torch.arange(float(states)).view(-1, 1, 1, 1).expand(
            states, h, d_k, v.shape[-1]
        )


@pytest.fixture
def stub_fla(monkeypatch):
    chunk, recurrent = StubRule(), StubRule()
    module = types.ModuleType("fla.ops.delta_rule")
    module.chunk_delta_rule, module.fused_recurrent_delta_rule = chunk, recurrent
    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.delta_rule", module)
    return chunk, recurrent


@pytest.mark.parametrize(
    ("dtype", "seq_len", "chosen"),
    [
        (torch.bfloat16, 12, "chunk"),
        (torch.float16, 12, "chunk"),
        (torch.bfloat16, 1, "recurrent"),
        (torch.float32, 12, "recurrent"),
    ],
)
def test_the_chunked_kernel_takes_half_precision_sequences_with_the_same_arguments(stub_fla, dtype, seq_len, chosen):
    chunk, recurrent = stub_fla
    x = delta_rule_inputs(seq_len, dtype)
    o, state = fla_delta_rule(**x, erase=True, document_starts=None)
    called, other = (chunk, recurrent) if chosen == "chunk" else (recurrent, chunk)
    assert len(called.calls) == 1 and not other.calls
    call = called.calls[0]
    assert call["scale"] == 1.0  # DeltaNet reads S q unscaled; fla's default is 1 / sqrt(d_k)
    for name in ("q", "k", "v"):
        assert torch.equal(call[name], x[name].transpose(1, 2))  # [B, T, H, d]
    assert torch.equal(call["beta"], x["beta"].transpose(1, 2).to(dtype))  # [B, T, H]
    assert torch.equal(call["initial_state"], x["initial_state"].transpose(-1, -2).float())  # fla's [B, H, d_k, d_v]
    assert o.shape == x["v"].shape and state.shape == x["initial_state"].shape  # back in our layout


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_q_and_k_in_float32_beside_a_half_precision_v_reach_fla_in_vs_dtype(stub_fla, dtype):
    """What DeltaNet gives under CUDA autocast: `normalize` takes its norm in float32 there (autocast's float32 list),
    so q and k arrive in float32 while v is the projection's half precision. fla's chunked kernel asserts one dtype
    (found on an H200); the mapping hands it all three in v's, rounding nothing beyond v's own precision."""
    chunk, _ = stub_fla
    x = delta_rule_inputs(12, torch.float32)
    x["v"] = x["v"].to(dtype)
    o, _ = fla_delta_rule(**x, erase=True, document_starts=None)
    call = chunk.calls[0]
    for name in ("q", "k", "v"):
        assert torch.equal(call[name], x[name].transpose(1, 2).to(dtype))
    assert o.dtype == dtype


def test_the_write_only_rule_and_packed_rows_without_boundaries_take_the_torch_forms(stub_fla):
    x = delta_rule_inputs(5)
    starts = torch.zeros(2, 5, dtype=torch.bool)
    assert fla_delta_rule(**x, erase=False, document_starts=None) is None  # fla has no write-only kernel
    assert fla_delta_rule(**x, erase=True, document_starts=starts) is None  # finding boundaries reads the mask
    one_row = {name: value[:1] for name, value in x.items()}
    cu_seqlens = torch.tensor([0, 2, 5], dtype=torch.int32)
    assert fla_delta_rule(**one_row, erase=True, document_starts=starts[:1], cu_seqlens=cu_seqlens) is None  # a state
    assert not stub_fla[0].calls and not stub_fla[1].calls


def test_one_packed_row_with_its_boundaries_takes_flas_varlen_recurrent_form(stub_fla):
    """flash-attention's packed batch (one row, `cu_seq_lens_q`) in float32 goes to fla's recurrent kernel with
    `cu_seqlens`; the row's final state is its last document's (fla returns one per document), as
    `delta_rule_recurrent` hands on. In bf16 the chunked form would count chunks on the host: declined."""
    x = {name: value[:1] for name, value in delta_rule_inputs(5, torch.bfloat16).items()}
    x["initial_state"] = None
    starts = torch.tensor([[True, False, True, False, False]])
    cu_seqlens = torch.tensor([0, 2, 5], dtype=torch.int32)
    assert fla_delta_rule(**x, erase=True, document_starts=starts, cu_seqlens=cu_seqlens) is None
    chosen = 1
    x = {name: value[:1] for name, value in delta_rule_inputs(5).items()}
    x["initial_state"] = None
    starts = torch.tensor([[True, False, True, False, False]])
    cu_seqlens = torch.tensor([0, 2, 5], dtype=torch.int32)
    o, state = fla_delta_rule(**x, erase=True, document_starts=starts, cu_seqlens=cu_seqlens)
    assert o.shape == x["v"].shape
    (call,) = stub_fla[chosen].calls
    assert torch.equal(call["cu_seqlens"], cu_seqlens.long()) and call["initial_state"] is None
    assert state.shape == (1, 2, 8, 16) and bool((state == 1).all())  # the second (last) document's state


def test_the_entry_point_runs_the_kernel_it_is_given_and_falls_back_when_it_declines():
    x = delta_rule_inputs(7)
    state = x.pop("initial_state")
    calls = []

    def declining(*args):
        calls.append(len(args))
        return None

    expected = delta_rule_chunkwise(**x, chunk_size=4, initial_state=state)
    result = delta_rule(**x, chunk_size=4, initial_state=state, kernel=declining)
    assert calls == [8] and all(torch.equal(a, b) for a, b in zip(result, expected))  # the 8 arguments of the kernel
    answer = (torch.zeros(1), torch.ones(1))
    assert delta_rule(**x, chunk_size=4, initial_state=state, kernel=lambda *args: answer) is answer
    assert all(torch.equal(a, b) for a, b in zip(delta_rule(**x, chunk_size=4, initial_state=state), expected))


def test_the_delta_net_mixer_hands_its_models_rule_to_the_entry_point_once_per_layer(monkeypatch):
    """The rule of the model's implementation ("auto" here) is called once per layer; a kernel that declines leaves
    the logits as they were. Set to "eager", the model never asks for one."""
    counted = []

    def spy(*args):
        counted.append(args[0].shape)
        return None  # the torch forms then run

    model = delta_model(token_mixer="delta_net", delta_net_chunk_size=4)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        model.set_delta_implementation("eager")
        expected = model(ids).logits
        auto_runs_rule(monkeypatch, spy)
        assert torch.equal(model(ids).logits, expected) and not counted  # "eager": no kernel asked
        model.set_delta_implementation("auto")
        logits = model(ids).logits
    assert len(counted) == model.config.n_layer and torch.equal(logits, expected)


def test_without_a_kernel_cuda_warns_once(monkeypatch):
    monkeypatch.setattr(delta_net_ops, "_warned_no_gpu_kernel", False)
    with pytest.warns(UserWarning, match=r"fla-core") as seen:
        delta_net_ops._warn_no_gpu_kernel()
        delta_net_ops._warn_no_gpu_kernel()
    assert len(seen) == 1


@pytest.mark.parametrize("fla", [True, False], ids=["fla", "no-fla"])
@pytest.mark.parametrize("triton", [True, False], ids=["triton", "no-triton"])
def test_auto_and_triton_on_cuda_run_flas_rule_where_it_is_installed(monkeypatch, fla, triton):
    """What a DeltaNet model on a GPU runs (`kernels_for`, which a model's first forward on a device type asks):
    fla's rule under "auto" and "triton" where fla is installed, none without it; never under "eager" or on the CPU
    ("auto" there is the tensor ops). Where Triton imports, "auto" on CUDA is "triton" (with Triton's op for the
    Delta residuals); without it "triton" is an error and "auto" keeps fla's rule alone. Whether each is installed
    is what `fla_available` and `triton_problem` say (set here)."""
    if triton and backends.triton_problem() is not None:
        pytest.skip(backends.triton_problem())
    monkeypatch.setattr(fla_kernels, "fla_available", lambda: fla)
    if not triton:
        monkeypatch.setattr(backends, "triton_problem", lambda: "Triton is not installed")
    auto = backends.kernels_for("auto", "cuda")
    assert auto.delta_rule is (fla_delta_rule if fla else None)
    if triton:
        assert backends.kernels_for("triton", "cuda") == auto and auto.residual is not None
    else:
        assert auto.residual is None
        with pytest.raises(backends.DeltaImplementationUnavailable, match="'triton' cannot run here: Triton is not"):
            backends.kernels_for("triton", "cuda")
    assert backends.kernels_for("eager", "cuda") == TENSOR_OPS
    assert backends.kernels_for("auto", "cpu") == TENSOR_OPS


def test_a_packed_batch_hands_its_boundaries_to_the_kernel(monkeypatch):
    """`DataCollatorWithFlattening`'s row: position_ids restarting per document and `cu_seq_lens_q`; the mixer passes
    the boundaries on with the starts (a kernel that declines leaves the logits as they were)."""
    seen = []

    def spy(*args):
        seen.append((args[6], args[7]))  # document_starts, cu_seqlens
        return None

    model = delta_model(token_mixer="delta_net", delta_net_chunk_size=4).eval()
    ids = torch.randint(1, model.config.vocab_size, (1, 9))
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2]])
    cu_seqlens = torch.tensor([0, 4, 6, 9], dtype=torch.int32)
    packed = dict(position_ids=position_ids, cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, use_cache=False)
    with torch.no_grad():
        model.set_delta_implementation("eager")
        expected = model(ids, **packed).logits
        auto_runs_rule(monkeypatch, spy)
        model.set_delta_implementation("auto")
        logits = model(ids, **packed).logits
    assert torch.equal(logits, expected) and len(seen) == model.config.n_layer
    for starts, boundaries in seen:
        assert starts[0].nonzero().flatten().tolist() == [0, 4, 6] and boundaries is cu_seqlens
