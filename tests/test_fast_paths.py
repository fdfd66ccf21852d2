"""The decode-speed shortcuts (issue 13) against the plain reference: same numbers, same behaviour, no graph breaks.

Each shortcut must be invisible: `delta_gate` and `constant` give the bits of the expressions they replace, the
no-grad path gives the bits of the autograd path, `_linear` is skipped whenever calling the module could differ
from `F.linear` (hooks, wrappers, quantization), betas recorded from the block are those of every Delta residual,
and the Delta block still traces into one graph.
"""

from __future__ import annotations

import pytest
import torch
from builders import VOCAB, delta_config, delta_model, open_gates

from ddl_hf.delta_ops import constant, delta_gate, delta_update, fused_delta_update, unit_direction
from ddl_hf.modeling_delta_gpt import DeltaGPTBlock, DeltaResidual, _linear

CASES = [(d_v, mode) for d_v in (1, 4) for mode in ("additive", "paper")]


def residual(d_v: int, mode: str, dtype=torch.float32, **fields) -> DeltaResidual:
    torch.manual_seed(0)
    module = DeltaResidual(delta_config(delta_mode=mode, delta_value_channels=d_v, **fields)).to(dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)
        module.beta_open.fill_(0.8)
    return module


def inputs(d_v: int, dtype=torch.float32, shape=(2, 5), dim=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    state = torch.randn(*shape, dim, *((d_v,) if d_v > 1 else ()), generator=g).to(dtype)
    normed = torch.randn(*shape, dim, generator=g).to(dtype)
    h = torch.randn(*shape, dim, generator=g).to(dtype)
    return state, normed, h


def test_delta_gate_is_two_sigmoid_rho_bit_for_bit_with_the_same_gradients():
    logit = torch.randn(3, 4, 1, generator=torch.Generator().manual_seed(0), requires_grad=True)
    rho = torch.tensor(0.37, requires_grad=True)
    beta = delta_gate(logit, rho)
    reference = torch.sigmoid(logit) * (rho + rho)
    assert torch.equal(beta, reference)
    grad = torch.randn_like(beta)
    for a, e in zip(torch.autograd.grad(beta, (logit, rho), grad), torch.autograd.grad(reference, (logit, rho), grad)):
        assert torch.equal(a, e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_constant_gives_the_bits_of_a_python_scalar_and_is_made_once(dtype):
    x = torch.randn(7, dtype=dtype)
    one, eps = constant(1.0, x), constant(1e-12, x)
    assert one is constant(1.0, x) and one.dtype == dtype and one.dim() == 0
    assert not one.is_inference() and not one.requires_grad  # usable by autograd later, never trained
    assert torch.equal(x + eps, x + 1e-12) and torch.equal(x * one, x * 1.0)
    with torch.inference_mode():  # made inside inference mode: still a normal tensor
        assert not constant(3.0, x).is_inference()


@pytest.mark.parametrize(("d_v", "mode"), CASES)
def test_fused_update_takes_beta_with_or_without_the_trailing_one(d_v, mode):
    g = torch.Generator().manual_seed(2)
    state = torch.randn(2, 3, 6, *((d_v,) if d_v > 1 else ()), generator=g, dtype=torch.float64, requires_grad=True)
    h = torch.randn(2, 3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    beta = (2 * torch.rand(2, 3, generator=g, dtype=torch.float64)).requires_grad_()
    value = torch.randn(2, 3, d_v, generator=g, dtype=torch.float64, requires_grad=True)
    additive = mode == "additive"
    flat = fused_delta_update(state, h, beta, value, 1e-6, additive)
    kept = fused_delta_update(state, h, beta.unsqueeze(-1), value, 1e-6, additive)
    assert torch.equal(flat, kept)
    grad = torch.randn_like(flat)
    grads_flat = torch.autograd.grad(flat, (state, h, beta, value), grad)
    grads_kept = torch.autograd.grad(kept, (state, h, beta, value), grad)
    for a, e in zip(grads_flat, grads_kept):
        assert a.shape == e.shape and torch.equal(a, e)
    # and the [..., 1] form against the plain reference
    plain = delta_update(state, unit_direction(h, 1e-6), beta, value, h if additive else None)
    torch.testing.assert_close(kept, plain, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("d_v", "mode"), CASES)
@pytest.mark.parametrize("fields", [{}, {"delta_erase": False}, {"delta_value": "constant"}], ids=str)
def test_no_grad_path_gives_the_autograd_path_bits_and_matches_the_reference(d_v, mode, fields):
    module = residual(d_v, mode, **fields)
    state, normed, h = inputs(d_v)
    with torch.inference_mode():
        fast_state, fast_beta = module(state, normed, h)
    with torch.no_grad():
        nograd_state, nograd_beta = module(state, normed, h)
    leaves = [t.clone().requires_grad_() for t in (state, normed, h)]
    grad_state, grad_beta = module(*leaves)
    assert torch.equal(fast_state, grad_state.detach()) and torch.equal(fast_beta, grad_beta.detach())
    assert torch.equal(nograd_state, fast_state) and torch.equal(nograd_beta, fast_beta)
    assert fast_beta.shape == state.shape[:2]
    module.fused = False  # the readable reference (delta_update)
    with torch.inference_mode():
        plain_state, plain_beta = module(state, normed, h)
    assert torch.equal(plain_beta, fast_beta)
    torch.testing.assert_close(fast_state, plain_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("d_v", "mode"), [(1, "additive"), (4, "paper")])
def test_decoding_one_token_matches_the_float64_reference(d_v, mode):
    """T = 1, batch 1, inference mode (what generation runs) against the plain path in float64."""
    module = residual(d_v, mode, dtype=torch.float64)
    state, normed, h = inputs(d_v, dtype=torch.float64, shape=(1, 1))
    with torch.inference_mode():
        fast, _ = module(state, normed, h)
        module.fused = False
        plain, _ = module(state, normed, h)
    torch.testing.assert_close(fast, plain, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("d_v", "mode"), CASES)
def test_no_grad_path_under_bf16_autocast_stays_float32(d_v, mode):
    module = residual(d_v, mode)
    state, normed, h = inputs(d_v)
    h_bf16 = h.bfloat16()
    with torch.inference_mode():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            new_state, beta = module(state, normed, h_bf16)
        reference, reference_beta = module(state, normed, h_bf16.float())
    assert new_state.dtype == beta.dtype == torch.float32
    assert torch.equal(beta, reference_beta)  # the gate matvecs ran in float32, not bf16
    torch.testing.assert_close(new_state, reference, rtol=1e-6, atol=1e-6)


class Doubled(torch.nn.Linear):
    """A Linear subclass: `_linear` must call it, not F.linear with its weights."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


def test_linear_shortcut_only_where_the_call_would_be_f_linear():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8)
    lin = torch.nn.Linear(8, 2)
    assert torch.equal(_linear(lin, x), lin(x))
    # a forward hook, a pre-hook, a patched forward, a global hook and a subclass are all honoured
    plain = torch.nn.functional.linear(x, lin.weight, lin.bias)
    handle = lin.register_forward_hook(lambda m, a, out: out + 1)
    assert torch.equal(_linear(lin, x), lin(x)) and torch.equal(_linear(lin, x), plain + 1)
    handle.remove()
    handle = lin.register_forward_pre_hook(lambda m, a: (a[0] * 0,))
    assert torch.equal(_linear(lin, x), lin.bias.expand(2, 3, 2))
    handle.remove()
    original = lin.forward
    lin.forward = lambda t: original(t) * 3  # what accelerate's offload hooks do
    assert torch.equal(_linear(lin, x), 3 * plain)
    del lin.forward
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, out: out - 1)
    try:
        assert torch.equal(_linear(lin, x), plain - 1)
    finally:
        handle.remove()
    doubled = Doubled(8, 2)
    assert torch.equal(_linear(doubled, x), doubled(x))


def test_a_hooked_gate_projection_changes_the_residual():
    """The shortcut must not bypass a hook that a tool put on `beta_proj` / `v_proj` (e.g. pruning, DeepSpeed)."""
    module = residual(1, "additive")
    state, normed, h = inputs(1)
    with torch.no_grad():
        plain_state, plain_beta = module(state, normed, h)
        handle = module.beta_proj.register_forward_hook(lambda m, a, out: torch.full_like(out, -50.0))
        _, hooked_beta = module(state, normed, h)
        handle.remove()
        handle = module.v_proj.register_forward_hook(lambda m, a, out: out * 0)
        zero_value_state, _ = module(state, normed, h)
        handle.remove()
    assert torch.all(hooked_beta < 1e-20) and not torch.equal(hooked_beta, plain_beta)
    assert not torch.equal(zero_value_state, plain_state)


@pytest.mark.parametrize("d_v", [1, 4])
def test_betas_recorded_from_the_block_are_every_residuals_beta_in_order(d_v):
    model = delta_model(delta_value_channels=d_v, delta_mode="paper").eval()
    open_gates(model)
    seen = []

    def record(module, args, output) -> None:
        if output[1] is not None:  # a read of the expanded state runs the residual too, and returns no beta
            seen.append(output[1])

    handles = [residual.register_forward_hook(record) for residual in model.delta_residuals().values()]
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        betas = model(ids, output_betas=True).betas
    for handle in handles:
        handle.remove()
    assert len(betas) == len(seen) == 2 * model.config.n_layer
    assert all(torch.equal(a, b) for a, b in zip(betas, seen))
    assert len({b.data_ptr() for b in betas}) > 1  # not one tensor recorded twice


def test_expanded_model_without_hidden_states_returns_no_expanded_state_and_tuples_work():
    model = delta_model(delta_value_channels=3).eval()
    ids = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = model(ids)
        as_tuple = model(ids, return_dict=False)
    assert out.expanded_states is None and out.hidden_states is None
    assert torch.equal(as_tuple[0], out.logits)


def test_single_token_input_checks_still_raise():
    model = delta_model().eval()
    with pytest.raises(ValueError, match="outside"):
        model(torch.tensor([[VOCAB]]))
    with pytest.raises(ValueError, match="position_ids reach"):
        model(torch.tensor([[1]]), position_ids=torch.tensor([[model.config.n_positions]]))


@pytest.mark.parametrize("d_v", [1, 4])
@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("warm", [True, False], ids=["after-eager", "fresh"])
def test_delta_block_traces_into_one_graph(d_v, grad, warm):
    """No graph break in a Delta block (dynamo only, no inductor: cheap), with the 0-dim constants already made by
    an eager call or not yet."""
    config = delta_config(delta_value_channels=d_v, delta_beta_init=0.5, delta_eps=1.2345e-6 if warm else 2.3456e-6)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    block = DeltaGPTBlock(config, layer_idx=0)
    x = torch.randn(2, 5, config.n_embd, *((d_v,) if d_v > 1 else ()))
    torch._dynamo.reset()
    with torch.set_grad_enabled(grad):
        if warm:
            block(x)
        explanation = torch._dynamo.explain(block)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
