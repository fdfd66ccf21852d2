"""The optional native kernels (`ddl_hf.native.enable_native_kernels`) against independent references.

The kernels stand in for the tensor ops of their entry points, so they are held to the same contracts. The Delta
update (`fused_delta_update`): the dense A = I - beta k k^T reference and the tensor ops in float64 (values,
gradients, `gradcheck`), GPT-2's bits at beta = 0, one decoded token against the float64 reference. The TC read
(`temporal_conv_read`): its definition `temporal_conv(cat([past or zeros, x]), w).sum(-1)` in float64 with a cached
window, in packed rows and both together. A residual's inference step (`residual_step`): its float64 reference and
GPT-2's bits at beta = 0. In models: the losses, every gradient and the generated tokens of the tensor ops, under
left padding, packed rows, the cache and bf16 autocast. They run only where they apply (CPU float32 / float64 of one
dtype, not compiling), are registered process-wide and reversibly, and attach nothing to a model. Built with the
machine's C++ compiler; where there is none, the tests that need it are skipped with the reason, and the error a user
gets is tested instead.
"""

from __future__ import annotations

import collections
import contextlib
import copy

import pytest
import torch
from builders import CLIENT_VARIANTS, VOCAB, delta_config, delta_model, scramble_delta_weights
from test_delta_llama import build_source, to_delta
from test_delta_llama import open_gates as llama_open_gates
from test_delta_net_clients import packed_row
from test_delta_residual import (
    VALUE_FIELDS,
    VIEW_CASES,
    assert_one_token_matches_the_float64_reference,
    inputs,
    read_of,
    reference,
    residual,
    step,
)
from test_fused_delta import EPS, dense_reference, make_inputs
from test_variants import variant_model

import ddl_hf.native as native
from ddl_hf.delta_layers import DeltaResidual
from ddl_hf.delta_ops import (
    DeltaKernel,
    fused_delta_update,
    register_kernel,
    registered_kernel,
    same_document_taps,
    temporal_conv,
    temporal_conv_read,
)
from ddl_hf.delta_reads import DeltaStateConv
from ddl_hf.modeling_delta_gpt import DeltaGPTBlock
from ddl_hf.native import NATIVE_OPS, NativeKernelUnavailable, disable_native_kernels, enable_native_kernels

TC = dict(delta_value_channels=4, delta_state_read="temporal_conv", delta_mode="paper")


@pytest.fixture(autouse=True)
def no_kernel_leaks():
    """Every test starts and ends with the tensor ops: a registration never leaks into another test."""
    assert all(registered_kernel(op) is None for op in NATIVE_OPS)
    yield
    assert all(registered_kernel(op) is None for op in NATIVE_OPS)


@pytest.fixture(scope="module")
def kernels():
    problem = native.native_build_problem()
    if problem is not None:
        pytest.skip(f"the native kernels cannot be built here: {problem}")
    return native.load_training_kernels()


class Counting:
    """Calls of the registered kernels, by op and direction: `calls["delta_update_forward"]`, ...; a residual step
    the kernel declined (returned None, the tensor ops ran) counts as `calls["residual_step_declined"]`."""

    def __init__(self):
        self.calls = collections.Counter()

    def wrap(self, op: str, kernel: DeltaKernel) -> DeltaKernel:
        def counted(direction, function):
            if function is None:
                return None

            def call(*args):
                result = function(*args)
                self.calls[f"{op}_{direction if result is not None else 'declined'}"] += 1
                return result

            return call

        return DeltaKernel(counted("forward", kernel.forward), counted("backward", kernel.backward), kernel.applies)


def count_registered_kernels() -> Counting:
    """Replace every registered kernel by a wrapper that counts its calls."""
    spy = Counting()
    for op in NATIVE_OPS:
        register_kernel(op, spy.wrap(op, registered_kernel(op)))
    return spy


@pytest.fixture
def spy(kernels):
    """The native kernels registered (`enable_native_kernels`) and counted; always unregistered after the test."""
    enable_native_kernels()
    try:
        yield count_registered_kernels()
    finally:
        disable_native_kernels()


@contextlib.contextmanager
def tensor_ops():
    """The entry points' own tensor ops, whatever is registered; the registrations come back after."""
    registered = {op: registered_kernel(op) for op in NATIVE_OPS}
    for op in NATIVE_OPS:
        register_kernel(op, None)
    try:
        yield
    finally:
        for op, kernel in registered.items():
            register_kernel(op, kernel)


# ---- the Delta update ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d_v", [1, 4])
@pytest.mark.parametrize("mode", ["additive", "paper"])
@pytest.mark.parametrize("erase", [True, False], ids=["erase", "write-only"])
@pytest.mark.parametrize("beta_shape", ["[...]", "[..., 1]"])
def test_the_native_update_is_the_fused_update_and_the_dense_reference(spy, d_v, mode, erase, beta_shape):
    additive = mode == "additive"
    state, h, beta, value = make_inputs(d_v, seed=d_v + 2 * erase)
    gate = beta.unsqueeze(-1) if beta_shape == "[..., 1]" else beta
    got = fused_delta_update(state, h, gate, value, EPS, additive, erase)
    assert spy.calls == {"delta_update_forward": 1}
    with tensor_ops():
        want = fused_delta_update(state, h, gate, value, EPS, additive, erase)
    assert spy.calls == {"delta_update_forward": 1}
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    if erase:
        torch.testing.assert_close(got, dense_reference(state, h, beta, value, additive), rtol=0, atol=1e-12)
    grad_out = torch.randn(want.shape, generator=torch.Generator().manual_seed(5), dtype=want.dtype)
    inputs = (state, h, beta, value)
    for mine, theirs in zip(torch.autograd.grad(got, inputs, grad_out), torch.autograd.grad(want, inputs, grad_out)):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-11)
    assert spy.calls["delta_update_backward"] == 1
    assert torch.autograd.gradcheck(lambda *t: fused_delta_update(*t, EPS, additive, erase), inputs)


@pytest.mark.parametrize("d_v", [1, 4])
def test_the_native_update_at_beta_zero_is_gpt2_bit_for_bit(spy, d_v):
    state, h, beta, value = (t.detach().float() for t in make_inputs(d_v, seed=7))
    h = h * 1e3  # large enough that any rounding of the write would show
    zero = torch.zeros_like(beta)
    x_plus_h = state + (h if d_v == 1 else h.unsqueeze(-1))
    assert torch.equal(fused_delta_update(state, h, zero, value, EPS, True, True), x_plus_h)
    assert torch.equal(fused_delta_update(state, h, zero, value, EPS, False, True), state)
    assert spy.calls == {"delta_update_forward": 2}


def test_the_native_update_runs_only_where_it_applies(spy, monkeypatch):
    state, h, beta, value = (t.detach().float() for t in make_inputs(4, seed=3))

    def runs(*tensors) -> bool:
        before = spy.calls["delta_update_forward"]
        fused_delta_update(*tensors, EPS, True, True)
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
    module = residual(d_v, mode, dtype, **fields)
    assert_one_token_matches_the_float64_reference(module, d_v, expanded_view, dtype)
    assert spy.calls == {"residual_step_forward": 1}  # the gate, the value and the update in one call


@pytest.mark.parametrize(("d_v", "mode"), [(1, "additive"), (1, "paper"), (4, "additive"), (4, "paper")])
@pytest.mark.parametrize("fields", VALUE_FIELDS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_residual_step_over_many_rows_matches_the_float64_reference(spy, d_v, mode, fields, dtype):
    """A prompt's residual without autograd (rows of two sequences) in one kernel call, against `reference`."""
    module = residual(d_v, mode, dtype, **fields)
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
    module = residual(d_v, mode)
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


def test_the_residual_step_declines_what_it_cannot_take_and_the_tensor_ops_run(spy, monkeypatch):
    """Not a plain nn.Linear gate or value (the MLP gate, a quantized or LoRA layer), a hooked layer (its hooks must
    run), a bf16 sublayer output: declined, and the residual gives the tensor ops' result. With autograd recording or
    while compiling it is not called at all."""
    state, normed, h = inputs(4, shape=(1, 1), seed=9)

    def runs(module, *tensors) -> bool:
        spy.calls.clear()
        with torch.no_grad():
            got = step(module, *tensors)
        if spy.calls["residual_step_forward"] == 1:
            return True
        kernel = registered_kernel("residual_step")
        register_kernel("residual_step", None)
        try:
            with torch.no_grad():
                want = step(module, *tensors)
        finally:
            register_kernel("residual_step", kernel)
        assert all(torch.equal(a, b) for a, b in zip(got, want))  # declined: exactly what runs without it
        return False

    assert runs(residual(4, "paper"), state, normed, h)
    assert not runs(residual(4, "paper", delta_gate="mlp"), state, normed, h)
    quantized = residual(4, "paper")
    quantized.v_proj.__class__ = QuantizedLinear
    assert not runs(quantized, state, normed, h)
    hooked = residual(4, "paper")
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
            assert not runs(residual(4, "paper"), state, normed, h)
        finally:
            handle.remove()
        assert seen.count(torch.nn.Linear) == 4  # gate and value, in the declined call and in its reference
    assert runs(residual(4, "paper"), state, normed, h)  # removed: taken again
    assert not runs(residual(4, "paper"), state, normed, h.bfloat16())
    spy.calls.clear()
    step(residual(4, "paper"), state, normed, h)  # autograd records: the update op (its own kernel) runs
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with torch.no_grad():
        step(residual(4, "paper"), state, normed, h)
    assert spy.calls == {"delta_update_forward": 1}


# ---- the TC read --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d_v", [1, 3])
@pytest.mark.parametrize("steps", [1, 6])
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("cached", [False, True], ids=["no-cache", "cache"])
@pytest.mark.parametrize("packed", [False, True], ids=["one-document", "packed"])
def test_the_native_read_is_the_convolution_summed_over_channels(spy, d_v, steps, size, cached, packed):
    """In float64 to 1e-12 (values, gradients, `gradcheck`) and in float32 to float32's rounding; one token (a
    decoding step) or several, a cached window or zeros, one document or packed rows."""
    g = torch.Generator().manual_seed(10 * size + 4 * steps + 2 * cached + packed + d_v)
    x = torch.randn(2, steps, 5, d_v, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, d_v, size, generator=g, dtype=torch.float64, requires_grad=True)
    past = torch.randn(2, size - 1, 5, d_v, generator=g, dtype=torch.float64) if cached else None
    taps = same_document_taps(torch.rand(2, steps, generator=g) < 0.4, size) if packed else None
    history = torch.cat([past if cached else x.new_zeros(2, size - 1, 5, d_v), x], dim=1)
    expected = temporal_conv(history, weight, taps).sum(-1)
    got = temporal_conv_read(x, weight, past, taps)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    grad_out = torch.randn(expected.shape, generator=g, dtype=torch.float64)
    for mine, want in zip(
        torch.autograd.grad(got, (x, weight), grad_out), torch.autograd.grad(expected, (x, weight), grad_out)
    ):
        torch.testing.assert_close(mine, want, rtol=0, atol=1e-12)
    assert spy.calls == {"tc_read_forward": 1, "tc_read_backward": 1}
    assert torch.autograd.gradcheck(lambda a, w: temporal_conv_read(a, w, past, taps), (x, weight))
    with torch.no_grad():
        single = temporal_conv_read(x.float(), weight.float(), None if past is None else past.float(), taps)
    assert single.dtype == torch.float32
    torch.testing.assert_close(single.double(), expected.detach(), rtol=1e-5, atol=1e-5)


def test_the_native_read_computes_only_the_gradients_asked_for(spy):
    x = torch.randn(1, 5, 4, 2, dtype=torch.float64)
    weight = torch.randn(4, 2, 3, dtype=torch.float64)
    with tensor_ops():
        expected = torch.autograd.grad(temporal_conv_read(x, weight.requires_grad_()).sum(), weight)[0]
        expected_x = torch.autograd.grad(temporal_conv_read(x.requires_grad_(), weight.detach()).sum(), x)[0]
    (grad_weight,) = torch.autograd.grad(temporal_conv_read(x.detach(), weight).sum(), weight)
    (grad_x,) = torch.autograd.grad(temporal_conv_read(x, weight.detach()).sum(), x)
    assert spy.calls == {"tc_read_forward": 2, "tc_read_backward": 2}
    torch.testing.assert_close(grad_weight, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad_x, expected_x, rtol=0, atol=1e-12)


def test_the_native_read_runs_only_on_cpu_float32_and_float64_outside_compile(spy, monkeypatch):
    x = torch.randn(1, 3, 4, 2)
    weight = torch.randn(4, 2, 3)
    temporal_conv_read(x, weight)
    temporal_conv_read(x.double(), weight.double())
    assert spy.calls["tc_read_forward"] == 2
    temporal_conv_read(x.bfloat16(), weight)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    temporal_conv_read(x, weight)
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
    """Loss and every gradient, left-padded batch with the cache (Trainer's default) and without: equal in float64;
    in float32 as close to the float64 gradients as the tensor ops are (the kernels sum in double precision, so
    their float32 results differ from the tensor ops' in the last bits)."""
    model = variant_model(**fields).train()
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    residuals = sum(isinstance(m, DeltaResidual) for m in model.modules())
    reads = len(tc_reads(model))
    expected_calls = {"delta_update_forward": residuals, "delta_update_backward": residuals}
    if reads:  # every TC read, the read-out's included
        expected_calls |= {"tc_read_forward": reads, "tc_read_backward": reads}
    for use_cache in (True, False):
        runs = {}
        for dtype in (torch.float64, torch.float32):
            model.to(dtype)
            with tensor_ops():
                runs["plain", dtype] = losses_and_grads(model, ids, attention_mask=mask, use_cache=use_cache)
            spy.calls.clear()
            runs["native", dtype] = losses_and_grads(model, ids, attention_mask=mask, use_cache=use_cache)
            assert spy.calls == expected_calls
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
        assert errors["native"] <= 1.25 * errors["plain"] + 1e-7, errors


def test_a_packed_row_reads_each_document_alone_with_the_native_read(spy):
    model = variant_model(**TC).eval()
    docs, ids, position_ids, _ = packed_row()
    with torch.no_grad():
        packed = model(ids, position_ids=position_ids, use_cache=False).logits[0]
        assert spy.calls["tc_read_forward"] == len(tc_reads(model))
        alone = torch.cat([model(doc[None]).logits[0] for doc in docs])
    assert (packed - alone).abs().max() <= 1e-5
    with torch.no_grad():
        leaked = model(ids, use_cache=False).logits[0]  # the same row read as one document
    assert (leaked - alone).abs().max() > 1e-2  # the test can fail: documents 2.. differ when not packed


def test_the_native_read_under_bf16_autocast_matches_tensor_ops(spy):
    """The state stays float32 under autocast, so the TC read's kernel runs (the update's does not: the sublayer
    output is bf16); the loss and gradients are those of tensor ops."""
    model = variant_model(**TC).train()
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with tensor_ops():
            plain = losses_and_grads(model, ids)
        fast = losses_and_grads(model, ids)
    assert spy.calls["tc_read_forward"] > 0 and spy.calls["tc_read_backward"] > 0
    assert spy.calls["delta_update_forward"] == 0
    torch.testing.assert_close(fast[0], plain[0], rtol=1e-5, atol=1e-5)
    for name, grad in plain[1].items():
        torch.testing.assert_close(fast[1][name], grad, rtol=1e-3, atol=1e-4, msg=name)


def test_the_kernels_save_what_the_tensor_ops_save(spy):
    """Training memory: the storages autograd keeps for the backward are the same size with and without the kernels
    (the peak-memory rows of bench_overhead are measured with tensor ops)."""
    model = variant_model(**dict(TC, delta_embed_expand="conv")).train()
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))

    def saved_bytes() -> int:
        storages = {}

        def pack(tensor):
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model(ids, labels=ids)
        return sum(storages.values())

    with tensor_ops():
        plain = saved_bytes()
    assert saved_bytes() == plain
    assert spy.calls["delta_update_forward"] > 0 and spy.calls["tc_read_forward"] > 0


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
    model = delta_model(GENERATION_VARIANTS[variant])
    scramble_delta_weights(model)
    updates = count_forwards([m for m in model.modules() if isinstance(m, DeltaResidual)])
    reads = count_forwards(tc_reads(model))
    prompt = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0
    settings = dict(max_new_tokens=7, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    for ids, attention_mask in ((prompt[:1], mask[:1]), (prompt, mask)):
        with torch.inference_mode():
            with tensor_ops():
                plain = model.generate(ids, attention_mask=attention_mask, **settings)
            for calls in (spy.calls, updates, reads):
                calls.clear()
            fast = model.generate(ids, attention_mask=attention_mask, **settings)
        assert len(updates) >= 2 * model.config.n_layer * 7  # the prefill and 6 one-token steps
        # every residual of the prompt and of each step as one call: gate, value and update
        assert spy.calls == {"residual_step_forward": len(updates)} | ({"tc_read_forward": len(reads)} if reads else {})
        assert torch.equal(fast.sequences, plain.sequences)
        torch.testing.assert_close(torch.stack(fast.scores), torch.stack(plain.scores), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fields", [{}, {"delta_state_read": "temporal_conv"}], ids=["linear", "TC"])
def test_delta_llama_decodes_with_the_native_kernels_as_with_tensor_ops(spy, fields):
    model = llama_open_gates(to_delta(build_source("llama"), delta_value_channels=4, **fields))
    prompt = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(6))
    settings = dict(max_new_tokens=8, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.inference_mode():
        with tensor_ops():
            plain = model.generate(prompt, attention_mask=torch.ones_like(prompt), **settings)
        fast = model.generate(prompt, attention_mask=torch.ones_like(prompt), **settings)
    residuals = len(model.delta_residuals())
    assert spy.calls["residual_step_forward"] == 8 * residuals  # the prefill and 7 one-token steps
    assert spy.calls["delta_update_forward"] == 0
    assert spy.calls["tc_read_forward"] == (8 * len(tc_reads(model)) if fields else 0)
    assert torch.equal(fast.sequences, plain.sequences)
    torch.testing.assert_close(torch.stack(fast.scores), torch.stack(plain.scores), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no-grad"])
def test_a_delta_block_traces_into_one_graph_with_the_kernels_registered(spy, grad):
    """Under compilation the kernels do not apply (an opaque extension call would break the graph): no graph break,
    and no kernel call while tracing."""
    config = delta_config(**TC, delta_beta_init=0.5)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    block = DeltaGPTBlock(config, layer_idx=0)
    x = torch.randn(2, 5, config.n_embd, 4)
    torch._dynamo.reset()
    with torch.set_grad_enabled(grad):
        explanation = torch._dynamo.explain(block)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    assert not spy.calls


# ---- registration -------------------------------------------------------------------------------------------------


def module_attributes(model) -> dict[str, set[str]]:
    return {name: set(vars(module)) for name, module in model.named_modules()}


def test_registration_is_process_wide_reversible_and_attaches_nothing_to_a_model(kernels):
    built_before = variant_model(**TC)
    attributes = module_attributes(built_before)
    ids = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(7))
    enable_native_kernels()
    try:
        update, read = registered_kernel("delta_update"), registered_kernel("tc_read")
        assert (update.forward, update.backward) == (kernels.delta_update_forward, kernels.delta_update_backward)
        assert (read.forward, read.backward) == (kernels.tc_read_forward, kernels.tc_read_backward)
        assert registered_kernel("residual_step").backward is None  # inference only
        spy = count_registered_kernels()
        built_after = variant_model(seed=1, **TC)
        with torch.no_grad():
            for model in (built_before, built_after):  # a model built before enabling uses them too
                spy.calls.clear()
                model(ids)
                assert spy.calls == {
                    "residual_step_forward": len(model.delta_residuals()),
                    "tc_read_forward": len(tc_reads(model)),
                }
        assert module_attributes(built_before) == attributes
    finally:
        disable_native_kernels()
    assert all(registered_kernel(op) is None for op in NATIVE_OPS)
    disable_native_kernels()  # twice: still the tensor ops, no error
    spy.calls.clear()
    with torch.no_grad():
        built_before(ids)
    assert not spy.calls


def test_a_model_deep_copies_and_pickles_with_the_kernels_registered(spy, tmp_path):
    """Nothing of the kernels is attached to a model: `copy.deepcopy` and `torch.save` / `torch.load` work, and the
    copies decode the same tokens through the kernels."""
    model = delta_model(CLIENT_VARIANTS["tc-ec-paper-dv4"])
    scramble_delta_weights(model)
    prompt = torch.tensor([[5, 9, 2]])
    expected = model.generate(prompt, max_new_tokens=6, do_sample=False)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    for twin in (loaded, copy.deepcopy(model)):
        spy.calls.clear()
        assert torch.equal(twin.generate(prompt, max_new_tokens=6, do_sample=False), expected)
        assert spy.calls["residual_step_forward"] > 0 and spy.calls["tc_read_forward"] > 0


def test_a_model_loaded_as_hub_custom_code_uses_the_registered_kernels(spy, tmp_path):
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    variant_model(**TC).save_pretrained(tmp_path)
    hub_class = get_class_from_dynamic_module("modeling_delta_gpt.DeltaGPTForCausalLM", tmp_path)
    model = hub_class.from_pretrained(tmp_path).train()
    residuals = [m for m in model.modules() if type(m).__name__ == "DeltaResidual"]
    reads = [m for m in model.modules() if type(m).__name__ == "DeltaStateConv"]
    assert residuals and all(type(m) is not DeltaResidual for m in residuals)  # the Hub copy of the class
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(8))
    model(ids, labels=ids).loss.backward()
    assert spy.calls == {
        "delta_update_forward": len(residuals),
        "delta_update_backward": len(residuals),
        "tc_read_forward": len(reads),
        "tc_read_backward": len(reads),
    }


def test_register_kernel_refuses_unknown_ops_and_other_objects():
    def forward(*args):
        raise AssertionError("never called")

    with pytest.raises(
        ValueError, match=r"unknown op 'cc_read'.*\('delta_update', 'tc_read', 'residual_step', 'delta_rule'\)"
    ):
        register_kernel("cc_read", DeltaKernel(forward, forward, lambda x: True))
    with pytest.raises(TypeError, match="expected a DeltaKernel"):  # only an inference or autograd op has no backward
        register_kernel("delta_update", DeltaKernel(forward, None, lambda x: True))
    with pytest.raises(TypeError, match="expected a DeltaKernel"):
        register_kernel("delta_update", (forward, forward, lambda x: True))  # a plain tuple
    with pytest.raises(TypeError, match="expected a DeltaKernel"):
        register_kernel("tc_read", forward)
    assert all(registered_kernel(op) is None for op in NATIVE_OPS)


def test_a_machine_without_a_compiler_gets_an_error_that_names_it(monkeypatch):
    monkeypatch.setattr(native, "_kernels", None)
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    with pytest.raises(NativeKernelUnavailable, match=r"no C\+\+ compiler .*works without them"):
        enable_native_kernels()
    assert all(registered_kernel(op) is None for op in NATIVE_OPS)  # nothing registered: the tensor ops run
