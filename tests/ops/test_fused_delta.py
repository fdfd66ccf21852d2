"""The fused Delta update against independent references: the readable reference (`delta_update` of the unit
direction, autograd through it) and a dense A = I - beta k k^T."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import GPT2LMHeadModel

from ddl_hf import DeltaGPTForCausalLM
from ddl_hf.delta_fused import fused_delta_update
from ddl_hf.delta_layers import DeltaResidual
from ddl_hf.delta_ops import delta_update, straight_through_clamp, unit_direction
from tests.builders import VOCAB, delta_config, gpt2_config
from tests.residual_references import CASES, EPS, dense_reference, make_inputs, readable_residuals


@pytest.mark.parametrize(("d_v", "mode"), CASES)
def test_gradcheck_fused_float64(d_v, mode):
    additive = mode == "additive"
    inputs = make_inputs(d_v)
    assert torch.autograd.gradcheck(lambda *t: fused_delta_update(*t, EPS, additive), inputs)


@pytest.mark.parametrize(("d_v", "mode"), CASES)
def test_fused_matches_plain_and_dense(d_v, mode):
    additive = mode == "additive"
    inputs = make_inputs(d_v, seed=1)
    state, h, beta, value = inputs
    fused = fused_delta_update(state, h, beta, value, EPS, additive)
    plain = delta_update(state, unit_direction(h, EPS), beta, value, h if additive else None)
    dense = dense_reference(state, h, beta, value, additive)
    torch.testing.assert_close(fused, plain, rtol=0, atol=1e-12)
    torch.testing.assert_close(fused, dense, rtol=0, atol=1e-12)

    grad_out = torch.randn_like(fused)
    for reference in (plain, dense):
        expected = torch.autograd.grad(reference, inputs, grad_out, retain_graph=True)
        actual = torch.autograd.grad(fused, inputs, grad_out, retain_graph=True)
        for a, e in zip(actual, expected):
            torch.testing.assert_close(a, e, rtol=0, atol=1e-11)


@pytest.mark.parametrize(("d_v", "mode"), CASES)
def test_write_only_fused_gradcheck_and_matches_closed_form(d_v, mode):
    """erase=False is X + beta k v^T (+ h 1^T): the closed form, and the plain path's gradients, in float64."""
    additive = mode == "additive"
    inputs = make_inputs(d_v, seed=2)
    state, h, beta, value = inputs
    assert torch.autograd.gradcheck(lambda *t: fused_delta_update(*t, EPS, additive, erase=False), inputs)
    fused = fused_delta_update(state, h, beta, value, EPS, additive, erase=False)
    plain = delta_update(state, unit_direction(h, EPS), beta, value, h if additive else None, erase=False)
    k = h / torch.sqrt(h.square().sum(-1, keepdim=True) + EPS**2)
    x = state if d_v > 1 else state.unsqueeze(-1)
    closed = x + beta[..., None, None] * k.unsqueeze(-1) * value.unsqueeze(-2)
    if additive:
        closed = closed + h.unsqueeze(-1)
    closed = closed if d_v > 1 else closed.squeeze(-1)
    torch.testing.assert_close(fused, closed, rtol=0, atol=1e-12)
    torch.testing.assert_close(plain, closed, rtol=0, atol=1e-12)
    grad_out = torch.randn_like(fused)
    expected = torch.autograd.grad(plain, inputs, grad_out, retain_graph=True)
    actual = torch.autograd.grad(fused, inputs, grad_out)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=0, atol=1e-11)
    # Not vacuous: with erase the result differs by beta k (k^T X)^T.
    assert (fused_delta_update(state, h, beta, value, EPS, additive) - fused).abs().max() > 1e-3


@pytest.mark.parametrize("d_v", [1, 4])
def test_beta_zero_is_exactly_x_plus_h(d_v):
    """Additive mode at beta = 0: value and gradients are bit-exact GPT-2 (X + h, dX = dh = g)."""
    state, h, beta, value = make_inputs(d_v, dtype=torch.float32, shape=(4, 5), dim=32)
    beta = torch.zeros_like(beta).requires_grad_()
    out = fused_delta_update(state, h, beta, value, EPS, True)
    expected = state + (h.unsqueeze(-1) if d_v > 1 else h)
    assert torch.equal(out, expected)
    grad_out = torch.randn_like(out)
    grad_state, grad_h = torch.autograd.grad(out, (state, h), grad_out)
    assert torch.equal(grad_state, grad_out)
    assert torch.equal(grad_h, grad_out.sum(-1) if d_v > 1 else grad_out)


def test_straight_through_clamp_value_and_gradient():
    """The opening: exactly clamp(x) in the forward (so the no-grad path may use a plain clamp), gradient 1."""
    x = torch.tensor([-0.7, 0.0, 0.3, 1.0, 1.3], requires_grad=True)
    y = straight_through_clamp(x, 0.0, 1.0)
    assert torch.equal(y, x.detach().clamp(0.0, 1.0))
    (grad,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(grad, torch.ones_like(x))


@pytest.mark.parametrize(("d_v", "mode"), CASES)
def test_model_fused_equals_plain(d_v, mode):
    """The whole model, logits and every parameter gradient, fused vs the readable reference."""
    torch.manual_seed(0)
    config = delta_config(delta_mode=mode, delta_value_channels=d_v, delta_beta_init=0.7)  # dropout off
    model = DeltaGPTForCausalLM(config).double()
    with torch.no_grad():  # make the gates token-dependent, not just their initial constant
        for module in model.modules():
            if isinstance(module, DeltaResidual):
                module.beta_proj.weight.normal_(0, 0.3)
    ids = torch.randint(0, config.vocab_size, (2, 9))
    results = []
    for path in (contextlib.nullcontext, readable_residuals):
        model.zero_grad()
        with path():
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        results.append((out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (logits_f, grads_f), (logits_p, grads_p) = results
    torch.testing.assert_close(logits_f, logits_p, rtol=0, atol=1e-10)
    for name, grad in grads_f.items():
        torch.testing.assert_close(grad, grads_p[name], rtol=1e-9, atol=1e-10, msg=name)


@pytest.mark.parametrize("d_v", [1, 4])
def test_beta_zero_model_equals_gpt2(d_v):
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(gpt2_config()).eval()
    model = DeltaGPTForCausalLM(delta_config(delta_value_channels=d_v, delta_init="exact")).eval()
    model.load_state_dict(gpt2.state_dict(), strict=False)
    ids = torch.randint(0, VOCAB, (2, 11))
    with torch.no_grad():
        expected, actual = gpt2(ids).logits, model(ids).logits
    if d_v == 1:
        assert torch.equal(actual, expected)
    else:
        torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


def residual_and_inputs(d_v: int, mode: str, dtype=torch.float32, **fields):
    torch.manual_seed(0)
    module = DeltaResidual(delta_config(delta_mode=mode, delta_value_channels=d_v, **fields))
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)
        module.beta_open.fill_(0.8)
    state, h, _, _ = make_inputs(d_v, dtype=dtype, shape=(2, 7), dim=32, seed=3)
    normed = torch.randn(2, 7, 32, dtype=dtype, requires_grad=True)
    return module, state, normed, h


def step(module: DeltaResidual, state, normed, h, read=None):
    """The residual's forward with its sublayer's input c = `normed` and output `h` given; `read` stands for the read
    x of the state (None: a stand-in that only the sigmoid value uses)."""
    return module(state, 3 * normed.flip(-1) + 1 if read is None else read, normed, h)


@pytest.mark.parametrize(  # compiling is slow: three cases
    ("d_v", "mode", "value"), [(1, "additive", "linear"), (4, "paper", "linear"), (4, "paper", "sigmoid")]
)
def test_compiled_forward_matches_eager(d_v, mode, value):
    module, state, normed, h = residual_and_inputs(d_v, mode, delta_value=value)
    read = (2 * normed.detach().flip(-1) + 1).requires_grad_()  # the un-normalised read ("sigmoid" reads it)
    eager_state, eager_beta = step(module, state, normed, h, read)
    compiled = torch.compile(module, backend="inductor", fullgraph=True)
    compiled_state, compiled_beta = step(compiled, state, normed, h, read)
    torch.testing.assert_close(compiled_state, eager_state, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(compiled_beta, eager_beta, rtol=1e-5, atol=1e-6)
    # The compiled graph keeps the hand-written backward.
    grad_out = torch.randn_like(eager_state)
    inputs = (state, normed, h, read) if value == "sigmoid" else (state, normed, h)
    expected = torch.autograd.grad(eager_state, inputs, grad_out)
    actual = torch.autograd.grad(compiled_state, inputs, grad_out)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("d_v", "mode"), CASES)
def test_bf16_autocast_keeps_delta_math_in_float32(d_v, mode):
    """Under bf16 autocast the sublayer output h is bf16; beta, v, r and h^T X must still be float32."""
    module, state, normed, h = residual_and_inputs(d_v, mode)
    h_bf16 = h.detach().bfloat16().requires_grad_()
    saved: list[torch.Tensor] = []
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t),
    ):
        new_state, beta = step(module, state, normed, h_bf16)
    assert beta.dtype == torch.float32
    assert new_state.dtype == torch.float32
    per_token = [t for t in saved if t.shape[:2] == (2, 7) and t.dim() == 3 and t.shape[-1] in (1, d_v)]
    assert per_token and all(t.dtype == torch.float32 for t in per_token)  # r, h^T X, v
    # Same result as the float32 readable reference computed from the (exactly representable) bf16 h.
    with torch.no_grad():
        value = module.v_proj(normed)
        h32 = h_bf16.float()
        reference = delta_update(state, unit_direction(h32, module.eps), beta, value, h32 if module.additive else None)
    torch.testing.assert_close(new_state, reference, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(new_state.sum(), (state, normed, h_bf16))
    assert [g.dtype for g in grads] == [torch.float32, torch.float32, torch.bfloat16]
    assert all(torch.isfinite(g.float()).all() for g in grads)


def saved_storages(module: DeltaResidual, state, normed, h) -> dict[int, int]:
    """data_ptr -> nbytes of every distinct storage autograd saves for the backward of one Delta residual."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step(module, state, normed, h)
    return saved


@pytest.mark.parametrize(("d_v", "mode"), CASES)
def test_fused_saves_less_for_backward(d_v, mode):
    """The fused node keeps X and h plus per-token scalars; the readable reference also keeps k (size D per token)."""
    module, state, normed, h = residual_and_inputs(d_v, mode)
    fused = saved_storages(module, state, normed, h)
    with readable_residuals():
        plain = saved_storages(module, state, normed, h)
    assert sum(fused.values()) < sum(plain.values())
    known = {t.untyped_storage().data_ptr() for t in (state, normed, h, *module.parameters())}
    per_token_bytes = 2 * 7 * d_v * 4  # [batch, seq, d_v] float32
    new_fused = [n for ptr, n in fused.items() if ptr not in known]
    new_plain = [n for ptr, n in plain.items() if ptr not in known]
    assert new_fused and max(new_fused) <= per_token_bytes  # beta, v, r, h^T X: nothing of size D
    assert max(new_plain) > per_token_bytes  # the reference does save a full-size k
