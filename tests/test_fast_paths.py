"""The decode-speed shortcuts against the plain reference: same numbers, same behaviour, no graph breaks.

Each shortcut must be invisible: `delta_gate` and `constant` give the bits of the expressions they replace, the
no-grad path gives the bits of the autograd path, `_linear` is skipped whenever calling the module could differ
from `F.linear` (hooks, wrappers, quantization), betas recorded from the block are those of every Delta residual,
and the Delta block still traces into one graph. The one-token host path (scalars as Python floats) matches the
float64 reference, gives GPT-2's bits at beta = 0, and runs only where it applies.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from builders import VOCAB, delta_config, delta_model, open_gates

import ddl_hf.modeling_delta_gpt as modeling
from ddl_hf import DeltaGPTForCausalLM, DeltaLlamaForCausalLM
from ddl_hf.delta_ops import (
    constant,
    delta_gate,
    delta_update,
    fused_delta_update,
    one_token_delta_update,
    sigmoid,
    unit_direction,
)
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


# The value branches and the write-only ablation; "sigmoid" reads the un-normalised read (`read_of`).
VALUE_FIELDS = [{}, {"delta_erase": False}, {"delta_value": "constant"}, {"delta_value": "sigmoid"}]


def read_of(normed: torch.Tensor) -> torch.Tensor:
    """A stand-in for the un-normalised read of the state: another tensor than the normalised one."""
    return 3 * normed.flip(-1) + 1


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
@pytest.mark.parametrize("fields", VALUE_FIELDS, ids=str)
def test_no_grad_path_gives_the_autograd_path_bits_and_matches_the_reference(d_v, mode, fields):
    module = residual(d_v, mode, **fields)
    state, normed, h = inputs(d_v)
    read = read_of(normed)
    with torch.inference_mode():
        fast_state, fast_beta = module(state, normed, h, read=read)
    with torch.no_grad():
        nograd_state, nograd_beta = module(state, normed, h, read=read)
    leaves = [t.clone().requires_grad_() for t in (state, normed, h, read)]
    grad_state, grad_beta = module(*leaves[:3], read=leaves[3])
    assert torch.equal(fast_state, grad_state.detach()) and torch.equal(fast_beta, grad_beta.detach())
    assert torch.equal(nograd_state, fast_state) and torch.equal(nograd_beta, fast_beta)
    assert fast_beta.shape == state.shape[:2]
    module.fused = False  # the readable reference (delta_update)
    with torch.inference_mode():
        plain_state, plain_beta = module(state, normed, h, read=read)
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


def test_host_sigmoid_is_the_logistic_function_everywhere():
    points = [-1e4, -800.0, -40.0, -1.5, -1e-8, 0.0, 1e-8, 2.5, 40.0, 800.0, 1e4]
    expected = torch.sigmoid(torch.tensor(points, dtype=torch.float64)).tolist()
    for x, e in zip(points, expected):
        assert sigmoid(x) == pytest.approx(e, rel=1e-15, abs=1e-300)
    assert math.isnan(sigmoid(math.nan))


@pytest.mark.parametrize(
    ("d_v", "mode", "expanded_view"),
    # the first state of an expanded model (d_v > 1) is an expand view of the embedding
    [(d_v, mode, False) for d_v, mode in CASES] + [(4, mode, True) for mode in ("additive", "paper")],
)
@pytest.mark.parametrize("erase", [True, False], ids=["erase", "write-only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_token_update_matches_the_float64_reference(d_v, mode, expanded_view, erase, dtype):
    g = torch.Generator().manual_seed(4)
    dim, beta, eps = 24, 1.37, 1e-6
    if expanded_view:  # the embedding repeated over d_v, stride 0
        state = torch.randn(1, 1, dim, 1, generator=g, dtype=torch.float64).expand(1, 1, dim, d_v)
    else:
        state = torch.randn(1, 1, dim, *((d_v,) if d_v > 1 else ()), generator=g, dtype=torch.float64)
    h = torch.randn(1, 1, dim, generator=g, dtype=torch.float64)
    value = torch.randn(1, 1, d_v, generator=g, dtype=torch.float64)
    additive = mode == "additive"
    out = one_token_delta_update(state.to(dtype), h.to(dtype), beta, value.flatten().to(dtype), eps, additive, erase)
    expected = delta_update(
        state,
        unit_direction(h, eps),
        torch.full((1, 1), beta, dtype=torch.float64),
        value,
        h if additive else None,
        erase,
    )
    assert out.shape == state.shape and out.dtype == dtype
    tolerance = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(("d_v", "mode"), CASES)
def test_one_token_update_at_beta_zero_is_gpt2_bit_for_bit(d_v, mode):
    g = torch.Generator().manual_seed(5)
    state = torch.randn(1, 1, 16, *((d_v,) if d_v > 1 else ()), generator=g)
    h = torch.randn(1, 1, 16, generator=g)
    out = one_token_delta_update(state, h, 0.0, torch.full((d_v,), 0.7), 1e-6, mode == "additive")
    expected = state + (h.unsqueeze(-1) if d_v > 1 else h) if mode == "additive" else state
    assert torch.equal(out, expected)


def _spy_host_path(monkeypatch) -> list[int]:
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return one_token_delta_update(*args, **kwargs)

    monkeypatch.setattr(modeling, "one_token_delta_update", counted)
    return calls


@pytest.mark.parametrize(("d_v", "mode"), CASES)
@pytest.mark.parametrize("fields", VALUE_FIELDS, ids=str)
def test_one_decoded_token_takes_the_host_path_and_matches_the_tensor_path(monkeypatch, d_v, mode, fields):
    """The host path's token against the same token decoded by the tensor path (a batch of two rows runs it)."""
    calls = _spy_host_path(monkeypatch)
    module = residual(d_v, mode, **fields)
    state, normed, h = inputs(d_v, shape=(2, 1))
    read = read_of(normed)
    with torch.inference_mode():
        tensor_state, tensor_beta = module(state, normed, h, read=read)
        assert not calls
        host_state, host_beta = module(state[:1], normed[:1], h[:1], read=read[:1])
    assert len(calls) == 1
    assert host_state.shape == state[:1].shape and host_beta.shape == (1, 1)
    assert host_state.dtype == tensor_state.dtype and host_beta.dtype == tensor_beta.dtype
    torch.testing.assert_close(host_beta, tensor_beta[:1], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(host_state, tensor_state[:1], rtol=1e-5, atol=1e-6)
    assert not torch.equal(host_state, state[:1] + (h[:1].unsqueeze(-1) if d_v > 1 else h[:1]))  # gates open


def test_the_host_path_runs_only_where_it_applies(monkeypatch):
    """Autograd, autocast, several tokens, half precision, a hooked or wrapped projection, the MLP gate, the plain
    reference and compilation all keep the tensor path."""
    calls = _spy_host_path(monkeypatch)
    module = residual(1, "additive")
    state, normed, h = inputs(1, shape=(1, 1))

    def host_path_runs(module=module, args=(state, normed, h), context=torch.no_grad) -> bool:
        calls.clear()
        with context():
            module(*args)
        return bool(calls)

    assert host_path_runs()
    assert host_path_runs(context=torch.inference_mode)
    assert host_path_runs(
        module=residual(1, "additive", dtype=torch.float64), args=[t.double() for t in (state, normed, h)]
    )
    assert not host_path_runs(context=torch.enable_grad)
    assert not host_path_runs(context=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    assert not host_path_runs(args=inputs(1, shape=(1, 2)))
    assert not host_path_runs(args=inputs(1, shape=(2, 1)))
    half = residual(1, "additive", dtype=torch.bfloat16)
    assert not host_path_runs(module=half, args=[t.bfloat16() for t in (state, normed, h)])
    handle = module.beta_proj.register_forward_hook(lambda m, a, out: out)
    assert not host_path_runs()
    handle.remove()
    wrapped = residual(1, "additive")
    wrapped.v_proj = Doubled(*wrapped.v_proj.weight.shape[::-1])
    assert not host_path_runs(module=wrapped)
    assert not host_path_runs(module=residual(1, "additive", delta_gate="mlp"))
    plain = residual(1, "additive")
    plain.fused = False
    assert not host_path_runs(module=plain)
    assert host_path_runs()  # and back on once nothing stands in the way
    compiled = torch.compile(residual(1, "additive"), backend="eager", fullgraph=True)
    torch._dynamo.reset()
    assert not host_path_runs(module=compiled)


@pytest.mark.parametrize(("d_v", "mode"), CASES)
def test_greedy_decoding_on_the_host_path_matches_the_plain_reference(monkeypatch, d_v, mode):
    """Generation end to end (batch 1, KV cache: every step after the prompt is one token) against the readable
    reference path, with the gates open so that the Delta terms matter."""
    model = delta_model(delta_value_channels=d_v, delta_mode=mode).eval()
    open_gates(model)
    assert_greedy_decoding_matches_the_plain_reference(model, _spy_host_path(monkeypatch))


def assert_greedy_decoding_matches_the_plain_reference(model, calls: list, new_tokens: int = 12) -> None:
    """Greedy `generate` (batch 1, KV cache) on the decoding shortcut whose `calls` spy counts its use, against the
    same model on the readable reference path (`DeltaResidual.fused = False`): the same tokens, scores within 1e-5."""
    prompt = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(6))
    settings = dict(max_new_tokens=new_tokens, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.inference_mode():
        fast = model.generate(prompt, attention_mask=torch.ones_like(prompt), **settings)
        assert len(calls) == 2 * model.config.num_hidden_layers * (new_tokens - 1)  # every decoding step
        DeltaResidual.fused = False
        try:
            plain = model.generate(prompt, attention_mask=torch.ones_like(prompt), **settings)
        finally:
            DeltaResidual.fused = True
    assert torch.equal(fast.sequences, plain.sequences)
    torch.testing.assert_close(torch.stack(fast.scores), torch.stack(plain.scores), rtol=1e-5, atol=1e-5)


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
@pytest.mark.parametrize(
    ("grad", "tokens"), [(True, (2, 5)), (False, (2, 5)), (False, (1, 1))], ids=["grad", "no-grad", "decoding"]
)
@pytest.mark.parametrize("warm", [True, False], ids=["after-eager", "fresh"])
def test_delta_block_traces_into_one_graph(d_v, grad, tokens, warm):
    """No graph break in a Delta block (dynamo only, no inductor: cheap), with the 0-dim constants already made by
    an eager call or not yet; a decoding step keeps the tensor path (no host read-back) under compilation."""
    config = delta_config(delta_value_channels=d_v, delta_beta_init=0.5, delta_eps=1.2345e-6 if warm else 2.3456e-6)
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


@pytest.mark.parametrize("model_class", [DeltaGPTForCausalLM, DeltaLlamaForCausalLM])
def test_the_forward_signature_that_generate_probes_each_step_is_stored_and_exact(model_class):
    """transformers inspects a custom-code model's `forward` signature on every decoding step: it is stored once
    (`__signature__`), and it is the signature of the undecorated forward."""
    stored = model_class.forward.__signature__
    assert stored == inspect.signature(inspect.unwrap(model_class.forward))
    assert "input_ids" in stored.parameters and "kwargs" in stored.parameters
