"""The Delta residual (`delta_layers.DeltaResidual`) against independent references: same numbers, same behaviour, no
graph breaks.

Its forward reads the state, runs `sublayer(norm(read))`, gates and writes through the one update op
(`delta_fused.fused_delta_update`). It is held to the readable reference (`delta_update` of `unit_direction(h)`) and to
the float64 update computed here from its parameters; the no-grad path gives the bits of the autograd path, a hook a
tool puts on a projection is honoured, betas recorded from the block are those of every Delta residual, and the Delta
block traces into one graph.
"""

from __future__ import annotations

import pytest
import torch

from ddl_hf.delta_fused import fused_delta_update
from ddl_hf.delta_layers import DeltaResidual
from ddl_hf.delta_ops import delta_gate, delta_update, unit_direction
from ddl_hf.delta_reads import DeltaRead
from ddl_hf.modeling_delta_gpt import DeltaGPTBlock
from tests.builders import VOCAB, delta_config, delta_model, open_gates
from tests.greedy import assert_generations_match
from tests.residual_references import (
    CASES,
    VALUE_FIELDS,
    VIEW_CASES,
    assert_one_token_matches_the_float64_reference,
    inputs,
    read_of,
    readable_residuals,
    reference,
    residual,
    step,
)


def gate_and_value(module: DeltaResidual, normed, read) -> tuple[torch.Tensor, torch.Tensor]:
    """beta `[...]` and v `[..., d_v]` from the module's parameters, as the module's dtype computes them."""
    rho = module.beta_open.detach().clamp(0.0, 1.0)
    beta = delta_gate(module.beta_proj(normed), rho).squeeze(-1)
    if module.v_proj is None:
        value = beta.new_full((*beta.shape, module.value_channels), module.value_constant)
    elif module.value_scale is None:
        value = module.v_proj(normed)
    else:
        value = torch.sigmoid(module.v_proj(read)) * module.value_scale
    return beta, value


def test_delta_gate_is_two_sigmoid_rho_bit_for_bit_with_the_same_gradients():
    logit = torch.randn(3, 4, 1, generator=torch.Generator().manual_seed(0), requires_grad=True)
    rho = torch.tensor(0.37, requires_grad=True)
    beta = delta_gate(logit, rho)
    reference_beta = torch.sigmoid(logit) * (rho + rho)
    assert torch.equal(beta, reference_beta)
    grad = torch.randn_like(beta)
    expected = torch.autograd.grad(reference_beta, (logit, rho), grad)
    for a, e in zip(torch.autograd.grad(beta, (logit, rho), grad), expected):
        assert torch.equal(a, e)


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
    # and the [..., 1] form against the readable reference
    plain = delta_update(state, unit_direction(h, 1e-6), beta, value, h if additive else None)
    torch.testing.assert_close(kept, plain, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("d_v", "mode"), CASES)
@pytest.mark.parametrize("fields", VALUE_FIELDS, ids=str)
def test_no_grad_path_gives_the_autograd_path_bits_and_matches_the_reference(d_v, mode, fields):
    module = residual(d_v, mode, **fields)
    state, normed, h = inputs(d_v)
    read = read_of(normed)
    with torch.inference_mode():
        fast_state, fast_beta = step(module, state, normed, h, read)
    with torch.no_grad():
        nograd_state, nograd_beta = step(module, state, normed, h, read)
    leaves = [t.clone().requires_grad_() for t in (state, normed, h, read)]
    grad_state, grad_beta = step(module, *leaves)
    assert torch.equal(fast_state, grad_state.detach()) and torch.equal(fast_beta, grad_beta.detach())
    assert torch.equal(nograd_state, fast_state) and torch.equal(nograd_beta, fast_beta)
    assert fast_beta.shape == state.shape[:2]
    with torch.no_grad():  # the readable reference: delta_update of the unit direction
        beta, value = gate_and_value(module, normed, read)
        plain_state = delta_update(
            state, unit_direction(h, module.eps), beta, value, h if module.additive else None, module.erase
        )
    assert torch.equal(beta, fast_beta)
    torch.testing.assert_close(fast_state, plain_state, rtol=1e-5, atol=1e-5)


def test_a_read_then_the_sublayer_on_the_normed_read_then_the_residual_is_eq_2_5():
    """x = read(X) (`DeltaRead`: X w), c = norm(x), h = sublayer(c), then the residual: eq. 2.5 with the gate and
    value of c (float64 reference, the read vector taken from the read module's parameter)."""
    module = residual(4, "paper", dtype=torch.float64, delta_value="sigmoid")
    read = DeltaRead(delta_config(delta_value_channels=4)).double()
    norm = torch.nn.LayerNorm(32, dtype=torch.float64)
    sublayer = torch.nn.Linear(32, 32, dtype=torch.float64)
    state = torch.randn(2, 5, 32, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    with torch.no_grad():
        read.weights.normal_(0, 1, generator=torch.Generator().manual_seed(4))
        x = read(state)
        out, beta = module(state, x, norm(x), sublayer(norm(x)))
        manual = (state * read.weights).sum(-1)
        expected, expected_beta = reference(module, state, norm(manual), sublayer(norm(manual)), manual)
    torch.testing.assert_close(beta, expected_beta, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("d_v", "mode", "expanded_view"), VIEW_CASES)
@pytest.mark.parametrize("fields", VALUE_FIELDS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_decoding_one_token_matches_the_float64_reference(d_v, mode, expanded_view, fields, dtype):
    module = residual(d_v, mode, dtype, **fields)
    assert_one_token_matches_the_float64_reference(module, d_v, expanded_view, dtype)


@pytest.mark.parametrize(("d_v", "mode"), CASES)
def test_decoding_one_token_at_beta_zero_is_gpt2_bit_for_bit(d_v, mode):
    module = residual(d_v, mode)
    with torch.no_grad():
        module.beta_open.fill_(0.0)
    state, normed, h = inputs(d_v, shape=(1, 1), seed=8)
    with torch.inference_mode():
        out, beta = step(module, state, normed, h)
    assert torch.equal(beta, torch.zeros(1, 1))
    assert torch.equal(out, state + (h.unsqueeze(-1) if d_v > 1 else h) if mode == "additive" else state)


@pytest.mark.parametrize(("d_v", "mode"), CASES)
def test_greedy_decoding_matches_the_readable_reference(d_v, mode):
    """Generation end to end (batch 1, KV cache: every step after the prompt is one token) against the same model
    with `delta_update` in the update op's place, with the gates open so that the Delta terms matter."""
    model = delta_model(delta_value_channels=d_v, delta_mode=mode).eval()
    open_gates(model)
    prompt = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(6))
    settings = dict(max_new_tokens=12, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.inference_mode():
        fast = model.generate(prompt, attention_mask=torch.ones_like(prompt), **settings)
        with readable_residuals():
            plain = model.generate(prompt, attention_mask=torch.ones_like(prompt), **settings)
    assert_generations_match(plain, fast, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("d_v", "mode"), CASES)
def test_no_grad_path_under_bf16_autocast_stays_float32(d_v, mode):
    module = residual(d_v, mode)
    state, normed, h = inputs(d_v)
    h_bf16 = h.bfloat16()
    with torch.inference_mode():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            new_state, beta = step(module, state, normed, h_bf16)
        reference_state, reference_beta = step(module, state, normed, h_bf16.float())
    assert new_state.dtype == beta.dtype == torch.float32
    assert torch.equal(beta, reference_beta)  # the gate matvecs ran in float32, not bf16
    torch.testing.assert_close(new_state, reference_state, rtol=1e-6, atol=1e-6)


def test_a_hook_on_a_gate_or_value_projection_is_honoured():
    """A hook that a tool put on `beta_proj` / `v_proj` (e.g. pruning, DeepSpeed) changes the residual."""
    module = residual(1, "additive")
    state, normed, h = inputs(1)
    with torch.no_grad():
        plain_state, plain_beta = step(module, state, normed, h)
        handle = module.beta_proj.register_forward_hook(lambda m, a, out: torch.full_like(out, -50.0))
        _, hooked_beta = step(module, state, normed, h)
        handle.remove()
        handle = module.v_proj.register_forward_hook(lambda m, a, out: out * 0)
        zero_value_state, _ = step(module, state, normed, h)
        handle.remove()
    assert torch.all(hooked_beta < 1e-20) and not torch.equal(hooked_beta, plain_beta)
    assert not torch.equal(zero_value_state, plain_state)


@pytest.mark.parametrize("d_v", [1, 4])
def test_betas_recorded_from_the_block_are_every_residuals_beta_in_order(d_v):
    model = delta_model(delta_value_channels=d_v, delta_mode="paper").eval()
    open_gates(model)
    seen = []
    handles = [
        residual.register_forward_hook(lambda module, args, output: seen.append(output[1]))
        for residual in model.delta_residuals().values()
    ]
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
    """Checked on the device (`torch._assert_async`): a RuntimeError that names the problem."""
    model = delta_model().eval()
    with pytest.raises(RuntimeError, match=r"token ids outside \[0, vocab_size=97\)"):
        model(torch.tensor([[VOCAB]]))
    with pytest.raises(RuntimeError, match="position_ids reach"):
        model(torch.tensor([[1]]), position_ids=torch.tensor([[model.config.n_positions]]))


@pytest.mark.parametrize("d_v", [1, 4])
@pytest.mark.parametrize(
    ("grad", "tokens"), [(True, (2, 5)), (False, (2, 5)), (False, (1, 1))], ids=["grad", "no-grad", "decoding"]
)
@pytest.mark.parametrize("warm", [True, False], ids=["after-eager", "fresh"])
def test_delta_block_traces_into_one_graph(d_v, grad, tokens, warm):
    """No graph break in a Delta block (dynamo only, no inductor: cheap), after an eager call or before any; a decoding
    step too (no host read-back)."""
    config = delta_config(delta_value_channels=d_v, delta_beta_init=0.5)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    block = DeltaGPTBlock(config, layer_idx=0)
    x = torch.randn(*tokens, config.n_embd, *((d_v,) if d_v > 1 else ()))
    torch._dynamo.reset()
    with torch.set_grad_enabled(grad):
        if warm:
            block(x)
        explanation = torch._dynamo.explain(block)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
