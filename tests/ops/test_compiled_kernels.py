"""The compiled Delta update (`ddl_hf.compiled_kernels`) against independent references.

On the CPU the kernel is compiled with `aot_eager`: dynamo's capture and AOT autograd's graphs, the ones inductor
would generate kernels from on a GPU, without a C++ build (`checks/gpu_check.py` runs inductor on a device). Held to
the tensor ops' contracts: the dense `A X + beta k v^T` reference in float64 (values and gradients, every mode), the
mixed dtypes of autocast, a model's loss, gradients and generated tokens, and where it applies.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from builders import delta_model, open_gates
from test_fused_delta import EPS, dense_reference, make_inputs

from ddl_hf.compiled_kernels import (
    compiled_delta_update_kernel,
    disable_compiled_delta_update,
    enable_compiled_delta_update,
)
from ddl_hf.delta_ops import DeltaKernel, fused_delta_update, register_kernel, registered_kernel

EPS32 = torch.finfo(torch.float32).eps
EPS_BF16 = torch.finfo(torch.bfloat16).eps


@pytest.fixture(autouse=True)
def no_silent_fallback():
    """Each test compiles afresh, and dynamo's recompile limit raises instead of quietly running the tensor ops (a
    kernel past its limit would still be called, and still be right: the tests could not tell)."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield
    torch._dynamo.reset()


@pytest.fixture
def counted_kernel():
    """The compiled kernel registered for CPU tensors (aot_eager), counting its forward and backward calls; the
    kernel registered before comes back afterwards."""
    before = registered_kernel("delta_update")
    kernel = compiled_delta_update_kernel(backend="aot_eager", devices=("cpu",))
    calls = {"forward": 0, "backward": 0}

    def forward(*args):
        calls["forward"] += 1
        return kernel.forward(*args)

    def backward(*args):
        calls["backward"] += 1
        return kernel.backward(*args)

    register_kernel("delta_update", kernel._replace(forward=forward, backward=backward))
    yield calls
    register_kernel("delta_update", before)


@pytest.mark.parametrize("d_v", [1, 4])
@pytest.mark.parametrize("mode", ["additive", "paper"])
def test_values_and_gradients_match_the_dense_reference_in_float64(counted_kernel, d_v, mode):
    additive = mode == "additive"
    inputs = make_inputs(d_v)
    out = fused_delta_update(*inputs, EPS, additive)
    expected = dense_reference(*inputs, additive)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    grads = torch.autograd.grad((out * weights).sum(), inputs)
    expected_grads = torch.autograd.grad((expected * weights).sum(), inputs)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert counted_kernel == {"forward": 1, "backward": 1}


@pytest.mark.parametrize("d_v", [1, 4])
def test_the_write_only_rule_matches_its_closed_form(counted_kernel, d_v):
    """erase=False: X + beta k v^T (+ h 1^T in additive mode), k = h / sqrt(|h|^2 + eps^2), no erase term."""
    state, h, beta, value = make_inputs(d_v)
    out = fused_delta_update(state, h, beta, value, EPS, True, erase=False)
    k = h / torch.sqrt(h.square().sum(-1, keepdim=True) + EPS**2)
    x = state if d_v > 1 else state.unsqueeze(-1)
    expected = x + beta[..., None, None] * k.unsqueeze(-1) * value.unsqueeze(-2) + h.unsqueeze(-1)
    torch.testing.assert_close(out, expected if d_v > 1 else expected.squeeze(-1), rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(out.sum(), (state, h, beta, value))
    expected_grads = torch.autograd.grad(expected.sum(), (state, h, beta, value))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert counted_kernel["forward"] == 1 and counted_kernel["backward"] == 1


def test_autocasts_mixed_dtypes_take_the_kernel_and_give_the_tensor_ops_result(counted_kernel):
    """A float32 state beside a bf16 h (what bf16 autocast gives the update) is taken, not sent to the tensor ops;
    the result and gradients are the tensor ops' within float32 rounding: the same ops, reordered at most, each
    rounding once per D-term reduction (sqrt(D) eps32 of the largest magnitude, 8x headroom)."""
    state, h, beta, value = (t.detach().float() for t in make_inputs(4, shape=(3, 5), dim=32))
    h = h.bfloat16()
    tensors = [t.requires_grad_() for t in (state, h, beta, value)]
    out = fused_delta_update(*tensors, EPS, False)
    grads = torch.autograd.grad(out.square().sum(), tensors)
    assert counted_kernel == {"forward": 1, "backward": 1}
    register_kernel("delta_update", None)
    expected = fused_delta_update(*tensors, EPS, False)
    expected_grads = torch.autograd.grad(expected.square().sum(), tensors)
    assert out.dtype == expected.dtype == torch.float32
    for got, want in zip((out, *grads), (expected, *expected_grads)):
        assert got.dtype == want.dtype
        bound = 8 * EPS32 * math.sqrt(32) * want.abs().max().item()
        if want.dtype == torch.bfloat16:  # h's gradient: float32 values within `bound` round to neighbouring bf16s
            bound = EPS_BF16 * want.abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=bound)


@pytest.mark.parametrize(
    "fields",
    [
        dict(delta_mode="additive", delta_value_channels=1),
        dict(delta_mode="paper", delta_value_channels=4),
        dict(delta_mode="paper", delta_value_channels=1, delta_erase=False),
    ],
    ids=["additive-dv1", "paper-dv4", "write-only"],
)
@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_a_models_training_step_is_the_tensor_ops(counted_kernel, fields, autocast):
    """A DeltaGPT with open gates: loss and every gradient with the kernel against the tensor ops, one forward and
    one backward call per Delta residual. The same ops in another order: float32 rounding, once per D-term
    reduction, carried through two layers (64x eps32 of the largest gradient; under bf16 autocast the sublayers see
    the same bf16 inputs, so the same bound)."""
    model = delta_model(n_layer=2, **fields).train()
    open_gates(model)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))

    def step(m):
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {name: p.grad for name, p in m.named_parameters()}

    loss, grads = step(model)
    residuals = 2 * model.config.n_layer
    assert counted_kernel == {"forward": residuals, "backward": residuals}
    register_kernel("delta_update", None)
    expected_loss, expected_grads = step(reference)
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=64 * EPS32 * expected_loss.abs().item())
    for name, grad in grads.items():
        want = expected_grads[name]
        torch.testing.assert_close(grad, want, rtol=0, atol=64 * EPS32 * want.abs().max().item(), msg=name)


def test_generation_decodes_the_tensor_ops_tokens(counted_kernel):
    model = delta_model(n_layer=2, delta_mode="paper", delta_value_channels=4)
    open_gates(model)
    prompt = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(4))
    tokens = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert counted_kernel["forward"] > 0 and counted_kernel["backward"] == 0
    register_kernel("delta_update", None)
    assert torch.equal(tokens, model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0))


def test_it_applies_on_its_devices_outside_compiled_regions_only():
    kernel = compiled_delta_update_kernel(backend="aot_eager")  # CUDA by default
    assert kernel.mixed_dtypes and not kernel.applies(torch.zeros(1))
    assert not torch.compile(lambda x: kernel.applies(x), backend="eager", fullgraph=True)(torch.zeros(1))
    cpu = compiled_delta_update_kernel(backend="aot_eager", devices=("cpu",))
    assert cpu.applies(torch.zeros(1))
    assert not torch.compile(lambda x: cpu.applies(x), backend="eager", fullgraph=True)(torch.zeros(1))


def test_enable_and_disable_put_back_the_kernel_they_replaced():
    before = registered_kernel("delta_update")
    other = DeltaKernel(lambda *a: None, lambda *a: None, lambda x: False)
    try:
        register_kernel("delta_update", other)
        undo = enable_compiled_delta_update(backend="aot_eager", devices=("cpu",))
        assert registered_kernel("delta_update").mixed_dtypes
        undo()
        assert registered_kernel("delta_update") is other
        enable_compiled_delta_update(backend="aot_eager")
        disable_compiled_delta_update()
        disable_compiled_delta_update()  # nothing left to put back: a no-op
        assert registered_kernel("delta_update") is other
    finally:
        register_kernel("delta_update", before)
