"""The native CPU kernels (`ddl_hf.native`, what `delta_implementation="native"` runs) against independent references.

The kernels stand in for the tensor ops of their entry points, so they are held to the same contracts. The Delta
update (`fused_delta_update(..., kernel=)`): the dense A = I - beta k k^T reference and the tensor ops in float64
(values, gradients, `gradcheck`), GPT-2's bits at beta = 0, one decoded token against the float64 reference. The TC
read (`temporal_conv_read(..., kernel=)`): its definition `temporal_conv(cat([past or zeros, x]), w).sum(-1)` in
float64 with a cached window, in packed rows and both together. A residual's inference step (`residual_step`): its
float64 reference and GPT-2's bits at beta = 0. In models built with `delta_implementation="native"`: the losses,
every gradient and the generated tokens of the same model set to "eager", under left padding, packed rows, the cache
and bf16 autocast. They run only where they apply (CPU float32 / float64 of one dtype, not compiling), only for the
models that ask for them (two models in one process run their own implementations), and attach nothing to a model
but its config's name. Built with the machine's C++ compiler; where there is none, the tests that need it are skipped
with the reason, and the error a user gets is tested instead.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import sys

import pytest
import torch

import ddl_hf.kernels as backends
import ddl_hf.native as native
from ddl_hf import delta_ops
from ddl_hf.delta_fused import fused_delta_update, temporal_conv_read
from ddl_hf.delta_layers import DeltaResidual
from ddl_hf.delta_ops import (
    TENSOR_OPS,
    DeltaKernel,
    DeltaKernels,
    delta_kernels,
    same_document_taps,
    temporal_conv,
)
from ddl_hf.delta_reads import DeltaStateConv
from ddl_hf.kernels import DeltaImplementationUnavailable
from ddl_hf.modeling_delta_gpt import DeltaGPTBlock
from ddl_hf.native import NativeKernelUnavailable
from tests.builders import (
    CLIENT_VARIANTS,
    VOCAB,
    build_source,
    delta_config,
    delta_model,
    packed_row,
    scramble_delta_weights,
    to_delta,
    variant_model,
)
from tests.builders import open_llama_gates as llama_open_gates
from tests.greedy import assert_generations_match
from tests.residual_references import (
    COMBINATIONS,
    EPS,
    VALUE_FIELDS,
    VIEW_CASES,
    assert_one_token_matches_the_float64_reference,
    combination_residual,
    dense_reference,
    inputs,
    make_inputs,
    read_of,
    reference,
    residual,
    step,
)
from tests.rounding import ROUNDING_FACTOR

TC = dict(delta_value_channels=4, delta_state_read="temporal_conv", delta_mode="paper")
NATIVE = dict(delta_implementation="native")


@pytest.fixture(scope="module")
def kernels():
    problem = native.native_build_problem()
    if problem is not None:
        pytest.skip(f"the native kernels cannot be built here: {problem}")
    return native.load_training_kernels()


class Counting:
    """The native kernels (`native_kernels()`) behind wrappers that count their calls, by op and direction:
    `calls["delta_update_forward"]`, ...; a call the kernel declined (it returned None, the tensor ops ran) counts as
    `calls["residual_step_declined"]`. `kernels` is the `DeltaKernels` a "native" model runs (the `spy` fixture)."""

    def __init__(self, kernels: DeltaKernels):
        self.calls = collections.Counter()
        self.kernels = kernels._replace(
            residual=self.counted("residual", "forward", kernels.residual),
            residual_step=self.counted("residual_step", "forward", kernels.residual_step),
            delta_update=self.wrap("delta_update", kernels.delta_update),
            tc_read=self.wrap("tc_read", kernels.tc_read),
        )

    def counted(self, op: str, direction: str, function):
        if function is None:
            return None

        def call(*args):
            result = function(*args)
            self.calls[f"{op}_{direction if result is not None else 'declined'}"] += 1
            return result

        return call

    def wrap(self, op: str, kernel: DeltaKernel) -> DeltaKernel:
        return kernel._replace(
            forward=self.counted(op, "forward", kernel.forward), backward=self.counted(op, "backward", kernel.backward)
        )


@pytest.fixture
def spy(kernels, monkeypatch):
    """A model with `delta_implementation="native"` on the CPU runs the counted native kernels: `kernels_for` answers
    with them (every other implementation as before), and the cache of chosen kernels starts empty and is put back
    after the test."""
    counting = Counting(native.native_kernels())
    chosen = backends.kernels_for

    def kernels_for(implementation: str, device_type: str) -> DeltaKernels:
        if (implementation, device_type) == ("native", "cpu"):
            return counting.kernels
        return chosen(implementation, device_type)

    monkeypatch.setattr(backends, "kernels_for", kernels_for)
    monkeypatch.setattr(delta_ops, "_CHOSEN", {})
    return counting


@contextlib.contextmanager
def eager(model):
    """`model` runs the tensor ops (`set_delta_implementation("eager")`), then its own implementation again."""
    implementation = model.config.delta_implementation
    model.set_delta_implementation("eager")
    try:
        yield
    finally:
        model.set_delta_implementation(implementation)


@contextlib.contextmanager
def replaced(spy: Counting, **kernels):
    """The "native" models run `spy.kernels` with `kernels` replaced (e.g. `residual_step=None`), then as before."""
    saved = spy.kernels
    spy.kernels = saved._replace(**kernels)
    delta_ops._CHOSEN.clear()
    try:
        yield
    finally:
        spy.kernels = saved
        delta_ops._CHOSEN.clear()


# ---- the Delta update ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d_v", [1, 4])
@pytest.mark.parametrize("mode", ["additive", "paper"])
@pytest.mark.parametrize("erase", [True, False], ids=["erase", "write-only"])
@pytest.mark.parametrize("beta_shape", ["[...]", "[..., 1]"])
def test_the_native_update_is_the_fused_update_and_the_dense_reference(spy, d_v, mode, erase, beta_shape):
    additive = mode == "additive"
    kernel = spy.kernels.delta_update
    state, h, beta, value = make_inputs(d_v, seed=d_v + 2 * erase)
    gate = beta.unsqueeze(-1) if beta_shape == "[..., 1]" else beta
    got = fused_delta_update(state, h, gate, value, EPS, additive, erase, kernel)
    assert spy.calls == {"delta_update_forward": 1}
    want = fused_delta_update(state, h, gate, value, EPS, additive, erase)  # no kernel: the tensor ops
    assert spy.calls == {"delta_update_forward": 1}
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    if erase:
        torch.testing.assert_close(got, dense_reference(state, h, beta, value, additive), rtol=0, atol=1e-12)
    grad_out = torch.randn(want.shape, generator=torch.Generator().manual_seed(5), dtype=want.dtype)
    inputs = (state, h, beta, value)
    for mine, theirs in zip(torch.autograd.grad(got, inputs, grad_out), torch.autograd.grad(want, inputs, grad_out)):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-11)
    assert spy.calls["delta_update_backward"] == 1
    assert torch.autograd.gradcheck(lambda *t: fused_delta_update(*t, EPS, additive, erase, kernel), inputs)


@pytest.mark.parametrize("d_v", [1, 4])
def test_the_native_update_at_beta_zero_is_gpt2_bit_for_bit(spy, d_v):
    kernel = spy.kernels.delta_update
    state, h, beta, value = (t.detach().float() for t in make_inputs(d_v, seed=7))
    h = h * 1e3  # large enough that any rounding of the write would show
    zero = torch.zeros_like(beta)
    x_plus_h = state + (h if d_v == 1 else h.unsqueeze(-1))
    assert torch.equal(fused_delta_update(state, h, zero, value, EPS, True, True, kernel), x_plus_h)
    assert torch.equal(fused_delta_update(state, h, zero, value, EPS, False, True, kernel), state)
    assert spy.calls == {"delta_update_forward": 2}


def test_the_native_update_runs_only_where_it_applies(spy, monkeypatch):
    state, h, beta, value = (t.detach().float() for t in make_inputs(4, seed=3))

    def runs(*tensors) -> bool:
        before = spy.calls["delta_update_forward"]
        fused_delta_update(*tensors, EPS, True, True, spy.kernels.delta_update)
        return spy.calls["delta_update_forward"] > before

    assert runs(state, h, beta, value) and runs(state.double(), h.double(), beta.double(), value.double())
    assert not runs(state, h.bfloat16(), beta, value)  # a bf16 sublayer output (autocast): tensor ops
    assert not runs(state.bfloat16(), h.bfloat16(), beta.bfloat16(), value.bfloat16())
    assert not runs(state, h[:1], beta[:1], value[:1])  # broadcasting over the batch: tensor ops
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not runs(state, h, beta, value)


@pytest.mark.parametrize(("d_v", "mode", "expanded_view"), VIEW_CASES)
@pytest.mark.parametrize("fields", VALUE_FIELDS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_decoding_one_token_with_the_native_update_matches_the_float64_reference(
    spy, d_v, mode, expanded_view, fields, dtype
):
    """What generation runs (one token, inference mode) through the kernel, with every value branch, the write-only
    ablation and the stride-0 first state of an expanded model."""
    module = residual(d_v, mode, dtype, **fields, **NATIVE)
    assert_one_token_matches_the_float64_reference(module, d_v, expanded_view, dtype)
    assert spy.calls == {"residual_step_forward": 1}  # the gate, the value and the update in one call


@pytest.mark.parametrize(("d_v", "mode"), [(1, "additive"), (1, "paper"), (4, "additive"), (4, "paper")])
@pytest.mark.parametrize("fields", VALUE_FIELDS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_residual_step_over_many_rows_matches_the_float64_reference(spy, d_v, mode, fields, dtype):
    """A prompt's residual without autograd (rows of two sequences) in one kernel call, against `reference`."""
    module = residual(d_v, mode, dtype, **fields, **NATIVE)
    state, normed, h = inputs(d_v, dtype, shape=(2, 5), seed=11)
    read = read_of(normed)
    with torch.no_grad():
        out, beta = step(module, state, normed, h, read)
    assert spy.calls == {"residual_step_forward": 1}
    expected, expected_beta = reference(module, state, normed, h, read)
    assert out.shape == state.shape and out.dtype == dtype and beta.shape == state.shape[:2] and beta.dtype == dtype
    tolerance = 1e-12 if dtype == torch.float64 else 2e-6  # the float32 rounding of the tensors' values
    torch.testing.assert_close(beta.double(), expected_beta, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(("d_v", "mode"), [(1, "additive"), (1, "paper"), (4, "additive"), (4, "paper")])
def test_the_residual_step_at_beta_zero_is_gpt2_bit_for_bit(spy, d_v, mode):
    module = residual(d_v, mode, **NATIVE)
    with torch.no_grad():
        module.beta_open.fill_(0.0)
    state, normed, h = inputs(d_v, shape=(1, 1), seed=8)
    h = h * 1e3  # large enough that any rounding of the write would show
    with torch.inference_mode():
        out, beta = step(module, state, normed, h)
    assert spy.calls == {"residual_step_forward": 1}
    assert torch.equal(beta, torch.zeros(1, 1))
    assert torch.equal(out, state + (h.unsqueeze(-1) if d_v > 1 else h) if mode == "additive" else state)


class QuantizedLinear(torch.nn.Linear):
    """A stand-in for a quantizer's or an adapter's layer: an nn.Linear subclass whose forward is its own."""

    def forward(self, x):
        return super().forward(x) + 1.0


# ---- a whole residual as one op (training) ------------------------------------------------------------------------

EPS64 = torch.finfo(torch.float64).eps
OP_DIM, OP_SHAPE = 24, (3, 7)


def op_run(use_op: bool, module: DeltaResidual, dtypes: tuple, weights_dtype: torch.dtype) -> list:
    """Outputs and every gradient under a random cotangent, inputs (state, x, c, h) in `dtypes`."""
    module = copy.deepcopy(module).to(weights_dtype)
    channels = module.value_channels
    g = torch.Generator().manual_seed(1)
    shapes = [(*OP_SHAPE, OP_DIM, *((channels,) if channels > 1 else ()))] + [(*OP_SHAPE, OP_DIM)] * 3
    tensors = [torch.randn(s, generator=g, dtype=torch.float64).to(d).requires_grad_() for s, d in zip(shapes, dtypes)]
    out, beta = native._residual(*tensors, module.step_weights()) if use_op else module(*tensors)
    loss = (out.double() * torch.randn(out.shape, generator=g, dtype=torch.float64)).sum()
    loss = loss + (beta.double() * torch.randn(beta.shape, generator=g, dtype=torch.float64)).sum()
    grads = torch.autograd.grad(loss, tensors + list(module.parameters()), allow_unused=True)
    return [out, beta, *grads]


def largest_error(result: list, reference: list) -> float:
    errors = [0.0]
    for a, b in zip(result, reference):
        assert (a is None) == (b is None) or float((a if b is None else b).abs().max()) == 0
        if a is not None and b is not None:
            errors.append(float((a.double() - b.double()).abs().max()) / (float(b.abs().max()) or 1.0))
    return max(errors)


@pytest.mark.parametrize("combination", COMBINATIONS, ids=["-".join(map(str, c)) for c in COMBINATIONS])
def test_the_residual_op_matches_the_tensor_ops(kernels, combination):
    """`ddl_hf::residual` on the CPU (gate, value, write as one op, its backward one call): every combination of the
    tensor ops, values and every gradient. float64: within a D = 24 dot product's rounding with a margin. float32 and
    autocast's mixed dtypes (a float32 state beside bf16 x, c and h): no further from the float64 result than 4 times
    the tensor ops in the same dtypes (at least a few roundings of float32 / bf16)."""
    module = combination_residual(*combination, dim=OP_DIM)
    f64 = (torch.float64,) * 4
    reference = op_run(False, module, f64, torch.float64)
    assert largest_error(op_run(True, module, f64, torch.float64), reference) <= 64 * OP_DIM * EPS64
    for dtypes, floor in (
        ((torch.float32,) * 4, 16 * torch.finfo(torch.float32).eps),
        ((torch.float32, torch.bfloat16, torch.bfloat16, torch.bfloat16), 4 * torch.finfo(torch.bfloat16).eps),
    ):
        own = largest_error(op_run(False, module, dtypes, torch.float32), reference)
        assert largest_error(op_run(True, module, dtypes, torch.float32), reference) <= 4 * max(own, floor)


@pytest.mark.parametrize("combination", [("paper", 4, "sigmoid", True), ("additive", 1, "linear", False),
                                         ("paper", 2, "constant", True)])  # fmt: skip
def test_the_residual_op_passes_gradcheck(kernels, combination):
    module = combination_residual(*combination, dim=OP_DIM)
    weights = module.step_weights()
    channels = module.value_channels
    g = torch.Generator().manual_seed(3)
    state = torch.randn(2, 3, OP_DIM, *((channels,) if channels > 1 else ()), generator=g, dtype=torch.float64)
    x, c, h = (torch.randn(2, 3, OP_DIM, generator=g, dtype=torch.float64) for _ in range(3))
    leaves = [state, x, c, h, weights.gate_weight, weights.gate_bias, weights.beta_open]
    leaves += [] if weights.value_weight is None else [weights.value_weight, weights.value_bias]
    leaves = [t.detach().clone().requires_grad_() for t in leaves]

    def op(state, x, c, h, gate_weight, gate_bias, beta_open, value_weight=None, value_bias=None):
        given = weights._replace(gate_weight=gate_weight, gate_bias=gate_bias, beta_open=beta_open,
                                 value_weight=value_weight, value_bias=value_bias)  # fmt: skip
        return native._residual(state, x, c, h, given)

    assert torch.autograd.gradcheck(op, leaves)


def test_the_residual_step_declines_what_it_cannot_take_and_the_tensor_ops_run(spy, monkeypatch):
    """Not a plain nn.Linear gate or value (the MLP gate, a quantized or LoRA layer), a hooked layer (its hooks must
    run), a bf16 sublayer output: declined, and the residual gives what it gives without the step kernel. With
    autograd recording it is not called at all; while compiling it declines (and the update's kernel does not
    apply)."""
    state, normed, h = inputs(4, shape=(1, 1), seed=9)

    def native_residual(**fields) -> DeltaResidual:
        return residual(4, "paper", **fields, **NATIVE)

    def runs(module, *tensors) -> bool:
        spy.calls.clear()
        with torch.no_grad():
            got = step(module, *tensors)
        if spy.calls["residual_step_forward"] == 1:
            return True
        with replaced(spy, residual_step=None, residual=None), torch.no_grad():
            want = step(module, *tensors)
        assert all(torch.equal(a, b) for a, b in zip(got, want))  # declined: exactly what runs without it
        return False

    assert runs(native_residual(), state, normed, h)
    assert not runs(native_residual(delta_gate="mlp"), state, normed, h)
    quantized = native_residual()
    quantized.v_proj.__class__ = QuantizedLinear
    assert not runs(quantized, state, normed, h)
    hooked = native_residual()
    fired = []
    hooked.beta_proj.register_forward_hook(lambda *args: fired.append(1))
    assert not runs(hooked, state, normed, h) and fired
    for register in (  # hooks on every module: they must fire on the gate and value Linears too
        torch.nn.modules.module.register_module_forward_hook,
        torch.nn.modules.module.register_module_forward_pre_hook,
    ):
        seen: list[type] = []

        def hook(module, *args, seen=seen) -> None:
            seen.append(type(module))

        handle = register(hook)
        try:
            assert not runs(native_residual(), state, normed, h)
        finally:
            handle.remove()
        assert seen.count(torch.nn.Linear) == 4  # gate and value, in the declined call and in its reference
    assert runs(native_residual(), state, normed, h)  # removed: taken again
    assert not runs(native_residual(), state, normed, h.bfloat16())
    spy.calls.clear()
    step(native_residual(), state, normed, h)  # autograd records: the whole residual's op (its own kernel) runs
    assert spy.calls == {"residual_forward": 1}
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with torch.no_grad():
        step(native_residual(), state, normed, h)
    assert spy.calls == {"residual_forward": 1, "residual_step_declined": 1}


# ---- the TC read --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d_v", [1, 3])
@pytest.mark.parametrize("steps", [1, 6])
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("cached", [False, True], ids=["no-cache", "cache"])
@pytest.mark.parametrize("packed", [False, True], ids=["one-document", "packed"])
def test_the_native_read_is_the_convolution_summed_over_channels(spy, d_v, steps, size, cached, packed):
    """In float64 to 1e-12 (values, gradients, `gradcheck`) and in float32 to float32's rounding; one token (a
    decoding step) or several, a cached window or zeros, one document or packed rows."""
    kernel = spy.kernels.tc_read
    g = torch.Generator().manual_seed(10 * size + 4 * steps + 2 * cached + packed + d_v)
    x = torch.randn(2, steps, 5, d_v, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, d_v, size, generator=g, dtype=torch.float64, requires_grad=True)
    past = torch.randn(2, size - 1, 5, d_v, generator=g, dtype=torch.float64) if cached else None
    taps = same_document_taps(torch.rand(2, steps, generator=g) < 0.4, size) if packed else None
    history = torch.cat([past if cached else x.new_zeros(2, size - 1, 5, d_v), x], dim=1)
    expected = temporal_conv(history, weight, taps).sum(-1)
    got = temporal_conv_read(x, weight, past, taps, kernel)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    grad_out = torch.randn(expected.shape, generator=g, dtype=torch.float64)
    for mine, want in zip(
        torch.autograd.grad(got, (x, weight), grad_out), torch.autograd.grad(expected, (x, weight), grad_out)
    ):
        torch.testing.assert_close(mine, want, rtol=0, atol=1e-12)
    assert spy.calls == {"tc_read_forward": 1, "tc_read_backward": 1}
    assert torch.autograd.gradcheck(lambda a, w: temporal_conv_read(a, w, past, taps, kernel), (x, weight))
    with torch.no_grad():
        single = temporal_conv_read(x.float(), weight.float(), None if past is None else past.float(), taps, kernel)
    assert single.dtype == torch.float32
    torch.testing.assert_close(single.double(), expected.detach(), rtol=1e-5, atol=1e-5)


def test_the_native_read_computes_only_the_gradients_asked_for(spy):
    kernel = spy.kernels.tc_read
    x = torch.randn(1, 5, 4, 2, dtype=torch.float64)
    weight = torch.randn(4, 2, 3, dtype=torch.float64)
    expected = torch.autograd.grad(temporal_conv_read(x, weight.requires_grad_()).sum(), weight)[0]
    expected_x = torch.autograd.grad(temporal_conv_read(x.requires_grad_(), weight.detach()).sum(), x)[0]
    assert not spy.calls  # no kernel given: the tensor ops
    (grad_weight,) = torch.autograd.grad(temporal_conv_read(x.detach(), weight, kernel=kernel).sum(), weight)
    (grad_x,) = torch.autograd.grad(temporal_conv_read(x, weight.detach(), kernel=kernel).sum(), x)
    assert spy.calls == {"tc_read_forward": 2, "tc_read_backward": 2}
    torch.testing.assert_close(grad_weight, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad_x, expected_x, rtol=0, atol=1e-12)


def test_the_native_read_runs_only_on_cpu_float32_and_float64_outside_compile(spy, monkeypatch):
    kernel = spy.kernels.tc_read
    x = torch.randn(1, 3, 4, 2)
    weight = torch.randn(4, 2, 3)
    temporal_conv_read(x, weight, kernel=kernel)
    temporal_conv_read(x.double(), weight.double(), kernel=kernel)
    assert spy.calls["tc_read_forward"] == 2
    temporal_conv_read(x.bfloat16(), weight, kernel=kernel)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    temporal_conv_read(x, weight, kernel=kernel)
    assert spy.calls["tc_read_forward"] == 2


def test_the_kernels_refuse_sizes_that_do_not_fit_together(kernels):
    """An error naming the mismatch, never a read out of bounds, for a caller that bypasses the Python checks."""
    x, w = torch.randn(2, 5, 4, 3), torch.randn(4, 3, 3)
    with pytest.raises(RuntimeError, match="past must be"):
        kernels.tc_read_forward(x, w, torch.randn(2, 1, 4, 3), None)
    with pytest.raises(RuntimeError, match="same_document must be"):
        kernels.tc_read_forward(x, w, None, torch.ones(2, 5, 2, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="grad_out must be"):
        kernels.tc_read_backward(torch.randn(2, 4, 4), x, w, None, None, True, True)
    state, h, beta, value = torch.randn(6, 4, 3), torch.randn(6, 4), torch.rand(6), torch.randn(6, 3)
    with pytest.raises(RuntimeError, match="sizes do not fit"):
        kernels.delta_update_forward(state, h[:5], beta, value, EPS, True, True)
    _, r, hx = kernels.delta_update_forward(state, h, beta, value, EPS, True, True)
    with pytest.raises(RuntimeError, match="do not fit the forward"):
        kernels.delta_update_backward(torch.randn(6, 4, 2), state, h, beta, value, r, hx, EPS, True, True, [True] * 4)


# ---- in models ----------------------------------------------------------------------------------------------------


def losses_and_grads(model, ids, **kwargs):
    model.zero_grad()
    loss = model(ids, labels=ids, **kwargs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def flat(grads: dict) -> torch.Tensor:
    return torch.cat([grads[name].flatten() for name in sorted(grads)])


def tc_reads(model) -> list[DeltaStateConv]:
    return [m for m in model.modules() if isinstance(m, DeltaStateConv) and m.kind == "temporal_conv"]


MODELS = {
    "d_v=1 additive": dict(delta_value_channels=1, delta_mode="additive"),
    "d_v=4 paper": dict(delta_value_channels=4, delta_mode="paper"),
    "d_v=4 write-only sigmoid value": dict(delta_value_channels=4, delta_erase=False, delta_value="sigmoid"),
    "TC": TC,
    "TC+EC": dict(TC, delta_embed_expand="conv"),
    "d_v=1 TC": dict(delta_state_read="temporal_conv"),
}


@pytest.mark.parametrize("fields", list(MODELS.values()), ids=list(MODELS))
def test_a_model_trains_with_the_native_kernels_as_with_tensor_ops(spy, fields):
    """Loss and every gradient, left-padded batch with the cache (Trainer's default) and without, "native" against
    the same model set to "eager": equal in float64; in float32 as close to the float64 gradients as the tensor ops
    are, to `ROUNDING_FACTOR` (the kernels sum in another order and in double precision, so their float32 results
    differ from the tensor ops' in the last bits, by a measured 0.04-2 times the tensor ops' error)."""
    model = variant_model(**fields, **NATIVE).train()
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    residuals = sum(isinstance(m, DeltaResidual) for m in model.modules())
    reads = len(tc_reads(model))
    expected_calls = {"residual_forward": residuals}  # one op per residual, its backward inside
    if reads:  # every TC read, the read-out's included
        expected_calls |= {"tc_read_forward": reads, "tc_read_backward": reads}
    for use_cache in (True, False):
        runs = {}
        for dtype in (torch.float64, torch.float32):
            model.to(dtype)
            with eager(model):
                runs["plain", dtype] = losses_and_grads(model, ids, attention_mask=mask, use_cache=use_cache)
            assert not spy.calls
            runs["native", dtype] = losses_and_grads(model, ids, attention_mask=mask, use_cache=use_cache)
            assert spy.calls == expected_calls
            spy.calls.clear()
        fast, plain = runs["native", torch.float64], runs["plain", torch.float64]
        torch.testing.assert_close(fast[0], plain[0], rtol=1e-12, atol=1e-12)
        assert fast[1].keys() == plain[1].keys()
        for name, grad in plain[1].items():
            torch.testing.assert_close(fast[1][name], grad, rtol=1e-9, atol=1e-9, msg=name)
        reference = flat(plain[1])
        errors = {
            path: (flat(runs[path, torch.float32][1]).double() - reference).norm() / reference.norm()
            for path in ("native", "plain")
        }
        # as close as kernels that sum in another order may be (tests/rounding.py), at least a few roundings
        assert errors["native"] <= ROUNDING_FACTOR * max(errors["plain"], 4 * torch.finfo(torch.float32).eps), errors


def test_a_packed_row_reads_each_document_alone_with_the_native_read(spy):
    model = variant_model(**TC, **NATIVE).eval()
    docs, ids, position_ids, _ = packed_row()
    with torch.no_grad():
        packed = model(ids, position_ids=position_ids, use_cache=False).logits[0]
        assert spy.calls["tc_read_forward"] == len(tc_reads(model))
        alone = torch.cat([model(doc[None]).logits[0] for doc in docs])
    assert (packed - alone).abs().max() <= 1e-5
    with torch.no_grad():
        leaked = model(ids, use_cache=False).logits[0]  # the same row read as one document
    assert (leaked - alone).abs().max() > 1e-2  # the test can fail: documents 2.. differ when not packed


def test_the_native_kernels_under_bf16_autocast_are_as_close_to_float32_as_the_tensor_ops(spy):
    """The state stays float32 under autocast, so the TC read's kernel runs, and the whole residual's op takes the
    bf16 sublayer output beside the float32 state (autocast's mixed dtypes). It computes the gate and value in float32
    where the tensor ops run them as bf16 matmuls, so the two differ by bf16 roundings downstream; each is measured
    against the float32 model without autocast: the kernels' loss and gradients no further from it than 4 times the
    tensor ops' (an elementwise bound between the two would test which bf16 roundings flip)."""
    model = variant_model(**TC, **NATIVE).train()
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
    with eager(model):
        reference = losses_and_grads(model, ids)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            plain = losses_and_grads(model, ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast = losses_and_grads(model, ids)
    assert spy.calls["tc_read_forward"] > 0 and spy.calls["tc_read_backward"] > 0
    assert spy.calls["residual_forward"] > 0 and spy.calls["delta_update_forward"] == 0

    def error(run) -> float:
        loss = float((run[0] - reference[0]).abs() / reference[0].abs())
        return max(loss, float((flat(run[1]) - flat(reference[1])).abs().max() / flat(reference[1]).abs().max()))

    assert error(fast) <= 4 * max(error(plain), torch.finfo(torch.bfloat16).eps), (error(fast), error(plain))


def test_the_kernels_save_what_the_tensor_ops_save(spy):
    """Training memory: the storages autograd keeps for the backward are no larger with the kernels than without
    (the peak-memory rows of bench_overhead are measured with tensor ops); the residual's op saves only its inputs."""
    model = variant_model(**dict(TC, delta_embed_expand="conv"), **NATIVE).train()
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))

    def saved_bytes() -> int:
        storages = {}

        def pack(tensor):
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model(ids, labels=ids)
        return sum(storages.values())

    with eager(model):
        plain = saved_bytes()
    assert saved_bytes() <= plain
    assert spy.calls["residual_forward"] > 0 and spy.calls["tc_read_forward"] > 0


GENERATION_VARIANTS = {
    name: CLIENT_VARIANTS[name]
    for name in ("additive-dv1", "paper-dv1", "additive-dv4", "paper-dv4", "tc-dv1", "tc-ec-paper-dv4")
}
GENERATION_VARIANTS |= {name: CLIENT_VARIANTS[name] for name in ("reference-tc-dv4", "cc-dv4")}
GENERATION_VARIANTS["cc-ec-paper-dv4"] = dict(
    CLIENT_VARIANTS["paper-dv4"], delta_state_read="channel_conv", delta_embed_expand="conv"
)


def count_forwards(modules: list) -> list:
    """Forward hooks on `modules`: the returned list grows by one per call."""
    calls = []
    for module in modules:
        module.register_forward_hook(lambda *args: calls.append(1))
    return calls


@pytest.mark.parametrize("variant", list(GENERATION_VARIANTS))
def test_a_model_generates_with_the_native_kernels_as_with_tensor_ops(spy, variant):
    """Greedy decoding with the cache, batch 1 and a left-padded batch of 2: every Delta update and every TC read of
    the prompt and of every decoding step goes through a kernel, and tokens and scores are those of the tensor ops."""
    model = delta_model(GENERATION_VARIANTS[variant], **NATIVE)
    scramble_delta_weights(model)
    updates = count_forwards([m for m in model.modules() if isinstance(m, DeltaResidual)])
    reads = count_forwards(tc_reads(model))
    prompt = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0
    settings = dict(max_new_tokens=7, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    for ids, attention_mask in ((prompt[:1], mask[:1]), (prompt, mask)):
        with torch.inference_mode():
            with eager(model):
                plain = model.generate(ids, attention_mask=attention_mask, **settings)
            assert not spy.calls
            for calls in (updates, reads):
                calls.clear()
            fast = model.generate(ids, attention_mask=attention_mask, **settings)
        assert len(updates) >= 2 * model.config.n_layer * 7  # the prefill and 6 one-token steps
        # every residual of the prompt and of each step as one call: gate, value and update
        assert spy.calls == {"residual_step_forward": len(updates)} | ({"tc_read_forward": len(reads)} if reads else {})
        spy.calls.clear()
        assert_generations_match(plain, fast, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fields", [{}, {"delta_state_read": "temporal_conv"}], ids=["linear", "TC"])
def test_delta_llama_decodes_with_the_native_kernels_as_with_tensor_ops(spy, fields):
    """A converted DeltaLlama set to "native" after it is built (`set_delta_implementation`)."""
    model = llama_open_gates(to_delta(build_source("llama"), delta_value_channels=4, **fields))
    model.set_delta_implementation("native")
    prompt = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(6))
    settings = dict(max_new_tokens=8, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.inference_mode():
        with eager(model):
            plain = model.generate(prompt, attention_mask=torch.ones_like(prompt), **settings)
        assert not spy.calls
        fast = model.generate(prompt, attention_mask=torch.ones_like(prompt), **settings)
    residuals = len(model.delta_residuals())
    assert spy.calls["residual_step_forward"] == 8 * residuals  # the prefill and 7 one-token steps
    assert spy.calls["delta_update_forward"] == 0
    assert spy.calls["tc_read_forward"] == (8 * len(tc_reads(model)) if fields else 0)
    assert_generations_match(plain, fast, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no-grad"])
def test_a_native_delta_block_traces_into_one_graph(spy, grad):
    """Under compilation the kernels do not apply (an opaque extension call would break the graph): no graph break,
    and no kernel runs while tracing (the inference step is asked, and declines). The kernels are chosen before
    (`delta_kernels`, as a model's first eager forward does): loading them imports modules, which dynamo does not
    trace (tests/models/test_delta_implementation.py has the first compiled forward)."""
    config = delta_config(**TC, delta_beta_init=0.5, **NATIVE)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    block = DeltaGPTBlock(config, layer_idx=0)
    x = torch.randn(2, 5, config.n_embd, 4)
    assert delta_kernels("native", x) == spy.kernels
    torch._dynamo.reset()
    with torch.set_grad_enabled(grad):
        explanation = torch._dynamo.explain(block)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    assert not {name for name in spy.calls if not name.endswith("_declined")}, spy.calls


# ---- per model ----------------------------------------------------------------------------------------------------


def module_attributes(model) -> dict[str, set[str]]:
    return {name: set(vars(module)) for name, module in model.named_modules()}


def test_two_models_in_one_process_each_run_their_own_implementation(spy):
    """Nothing is registered process-wide: a "native" model runs the kernels, an "eager" one run from inside its
    forward runs none (and gives its logits of alone), nor does an "auto" one (the tensor ops on the CPU);
    `set_delta_implementation` switches a built model at its next forward and attaches nothing to its modules."""
    fast = variant_model(**TC, **NATIVE).eval()
    plain = variant_model(seed=1, **TC, delta_implementation="eager").eval()
    auto = variant_model(seed=2, **TC).eval()
    assert auto.config.delta_implementation == "auto"
    ids = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(7))
    native_calls = {"residual_step_forward": len(fast.delta_residuals()), "tc_read_forward": len(tc_reads(fast))}
    with torch.no_grad():
        alone = plain(ids).logits
        assert not spy.calls
        inside = []

        def run_the_eager_model(module, args, output) -> None:
            before = spy.calls.copy()
            inside.append((plain(ids).logits, spy.calls == before))

        handle = fast.transformer.h[0].register_forward_hook(run_the_eager_model)
        fast(ids)
        handle.remove()
        assert spy.calls == native_calls and len(inside) == 1
        logits, no_kernel_ran = inside[0]
        assert no_kernel_ran and torch.equal(logits, alone)
        spy.calls.clear()
        auto(ids)
        assert not spy.calls
        attributes = module_attributes(fast)
        fast.set_delta_implementation("eager")
        fast(ids)
        assert not spy.calls
        fast.set_delta_implementation("native")
        fast(ids)
        assert spy.calls == native_calls
    assert module_attributes(fast) == attributes


def test_a_model_deep_copies_and_pickles_with_its_implementation(spy, tmp_path):
    """Nothing of the kernels is attached to a model but its config's name: `copy.deepcopy` and `torch.save` /
    `torch.load` work, and the copies decode the same tokens through the kernels."""
    model = delta_model(CLIENT_VARIANTS["tc-ec-paper-dv4"], **NATIVE)
    scramble_delta_weights(model)
    prompt = torch.tensor([[5, 9, 2]])
    expected = model.generate(prompt, max_new_tokens=6, do_sample=False)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    for twin in (loaded, copy.deepcopy(model)):
        assert twin.config.delta_implementation == "native"
        spy.calls.clear()
        assert torch.equal(twin.generate(prompt, max_new_tokens=6, do_sample=False), expected)
        assert spy.calls["residual_step_forward"] > 0 and spy.calls["tc_read_forward"] > 0


def test_a_model_loaded_as_hub_custom_code_runs_the_native_kernels(spy, tmp_path, monkeypatch):
    """The Hub copy of the model files (its own `delta_ops`) loaded with `delta_implementation="native"` takes the
    kernels from the `ddl_hf` package, in training."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    variant_model(**TC).save_pretrained(tmp_path)
    hub_class = get_class_from_dynamic_module("modeling_delta_gpt.DeltaGPTForCausalLM", tmp_path)
    hub_ops = sys.modules[hub_class.__module__.rsplit(".", 1)[0] + ".delta_ops"]
    assert hub_ops is not delta_ops
    monkeypatch.setattr(hub_ops, "_CHOSEN", {})  # the Hub copy's own cache of chosen kernels
    model = hub_class.from_pretrained(tmp_path, delta_implementation="native").train()
    residuals = [m for m in model.modules() if type(m).__name__ == "DeltaResidual"]
    reads = [m for m in model.modules() if type(m).__name__ == "DeltaStateConv"]
    assert residuals and all(type(m) is not DeltaResidual for m in residuals)  # the Hub copy of the class
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(8))
    model(ids, labels=ids).loss.backward()
    assert spy.calls == {
        "residual_forward": len(residuals),
        "tc_read_forward": len(reads),
        "tc_read_backward": len(reads),
    }


def test_native_is_the_cpu_kernels_and_an_error_on_another_device(kernels):
    """What "native" resolves to: the extension's whole-residual op (with autograd), update and read (forward and
    backward) and the inference step; no delta rule (DeltaNet runs its torch forms). On a GPU it is an error
    that says what to use; on the meta device (shapes only) the tensor ops."""
    chosen = backends.kernels_for("native", "cpu")
    update, read = chosen.delta_update, chosen.tc_read
    assert (update.forward, update.backward) == (kernels.delta_update_forward, kernels.delta_update_backward)
    assert (read.forward, read.backward) == (kernels.tc_read_forward, kernels.tc_read_backward)
    assert chosen.residual_step is not None and chosen.residual is not None and chosen.delta_rule is None
    with pytest.raises(DeltaImplementationUnavailable, match=r"runs CPU kernels.*'cuda'.*'auto' or 'triton'"):
        backends.kernels_for("native", "cuda")
    assert backends.kernels_for("native", "meta") == TENSOR_OPS
    assert delta_kernels("eager", torch.zeros(1)) == TENSOR_OPS


def test_a_machine_without_a_compiler_gets_an_error_that_names_it(monkeypatch):
    """At construction or `set_delta_implementation`, before any forward; a model that runs stays as it was."""
    monkeypatch.setattr(native, "_kernels", None)
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    monkeypatch.setattr(delta_ops, "_CHOSEN", {})
    with pytest.raises(NativeKernelUnavailable, match=r"no C\+\+ compiler .*works without them"):
        native.native_kernels()
    with pytest.raises(DeltaImplementationUnavailable, match=r"'native' cannot be built here: no C\+\+ compiler"):
        delta_model(**NATIVE)
    model = delta_model()
    with pytest.raises(DeltaImplementationUnavailable, match=r"'native' cannot be built here: no C\+\+ compiler"):
        model.set_delta_implementation("native")
    assert model.config.delta_implementation == "auto"
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))  # the tensor ops still run
    assert delta_ops._CHOSEN == {("auto", "cpu"): TENSOR_OPS}
