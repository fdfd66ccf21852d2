"""The delta rule over time: the recurrent reference against closed forms, the chunkwise form against the reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.functional import normalize

from ddl_hf.delta_net_ops import delta_rule_chunkwise, delta_rule_recurrent
from tests.builders import delta_net_inputs

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------------------------------------------------------
# The recurrent reference against independent forms of the same rule
# ---------------------------------------------------------------------------------------------------------------


def test_recurrent_equals_explicit_householder_products():
    """S_t = S_0 prod_{j<=t} A_j + sum_i beta_i v_i k_i^T prod_{i<j<=t} A_j, each A_j = I - beta_j k_j k_j^T dense."""
    q, k, v, beta, s0 = delta_net_inputs(batch=1, heads=2, seq_len=7, d_k=4, d_v=3, beta_max=2.0, dtype=torch.float64)
    k = k * 1.7  # the rule is exact for any k, not only unit k
    o, s_final = delta_rule_recurrent(q, k, v, beta, s0)

    eye = torch.eye(4, dtype=torch.float64)
    for b, h in [(0, 0), (0, 1)]:
        transitions = [eye - beta[b, h, j] * torch.outer(k[b, h, j], k[b, h, j]) for j in range(7)]
        for t in range(7):
            product = eye
            for j in range(t + 1):
                product = product @ transitions[j]
            s_t = s0[b, h] @ product
            for i in range(t + 1):
                tail = eye
                for j in range(i + 1, t + 1):
                    tail = tail @ transitions[j]
                s_t = s_t + beta[b, h, i] * torch.outer(v[b, h, i], k[b, h, i]) @ tail
            torch.testing.assert_close(o[b, h, t], s_t @ q[b, h, t], rtol=0, atol=1e-12)
        torch.testing.assert_close(s_final[b, h], s_t, rtol=0, atol=1e-12)


def test_recurrent_is_one_sgd_step_on_the_online_regression_loss():
    """S_t = S_{t-1} - beta_t grad_S 1/2 |S k_t - v_t|^2, with the gradient taken by autograd."""
    q, k, v, beta, s0 = delta_net_inputs(batch=1, heads=1, seq_len=6, d_k=4, d_v=3, dtype=torch.float64)
    _, s_final = delta_rule_recurrent(q, k, v, beta, s0)
    state = s0[0, 0]
    for t in range(6):
        state = state.detach().requires_grad_(True)
        loss = 0.5 * (state @ k[0, 0, t] - v[0, 0, t]).square().sum()
        (grad,) = torch.autograd.grad(loss, state)
        state = state - beta[0, 0, t] * grad
    torch.testing.assert_close(s_final[0, 0], state.detach(), rtol=0, atol=1e-12)


def test_beta_one_replaces_the_value_of_a_repeated_key():
    """Erase and replace: writing (k, v1) then (k, v2) with beta = 1 stores v2; additive attention stores v1 + v2."""
    k = normalize(torch.randn(1, 1, 1, 6, dtype=torch.float64), dim=-1).repeat(1, 1, 2, 1)
    v = torch.randn(1, 1, 2, 4, dtype=torch.float64)
    beta = torch.ones(1, 1, 2, dtype=torch.float64)
    query = k  # read back with the same key
    o_delta, _ = delta_rule_recurrent(query, k, v, beta)
    o_additive, _ = delta_rule_recurrent(query, k, v, beta, erase=False)
    torch.testing.assert_close(o_delta[0, 0, 1], v[0, 0, 1], rtol=0, atol=1e-12)
    torch.testing.assert_close(o_additive[0, 0, 1], v[0, 0, 0] + v[0, 0, 1], rtol=0, atol=1e-12)


def test_beta_zero_leaves_the_state_unchanged():
    q, k, v, beta, s0 = delta_net_inputs(seq_len=5)
    o, s_final = delta_rule_recurrent(q, k, v, torch.zeros_like(beta), s0)
    torch.testing.assert_close(s_final, s0, rtol=0, atol=0)
    torch.testing.assert_close(o, torch.einsum("bhvk,bhtk->bhtv", s0, q))


def test_additive_rule_equals_causal_linear_attention():
    """erase=False is linear attention: o = Q S_0^T + causal(Q K^T) diag(beta) V, computed here as one matmul."""
    q, k, v, beta, s0 = delta_net_inputs(seq_len=11, dtype=torch.float64)
    causal = torch.ones(11, 11, dtype=torch.bool).tril()
    expected = q @ s0.transpose(-1, -2) + ((q @ k.transpose(-1, -2)) * causal) @ (beta.unsqueeze(-1) * v)
    for o, _ in (
        delta_rule_recurrent(q, k, v, beta, s0, erase=False),
        delta_rule_chunkwise(q, k, v, beta, 4, s0, erase=False),
    ):
        torch.testing.assert_close(o, expected, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# Chunkwise (WY/UT transform) against the recurrent reference
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("beta_max", [1.0, 2.0], ids=["beta_in_0_1", "beta_in_0_2"])
@pytest.mark.parametrize("chunk_size", [1, 8, 16, 37, 64], ids=lambda c: f"chunk{c}")  # T = 37: divides or not
@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
def test_chunkwise_equals_recurrent_fp32(beta_max, chunk_size, with_state):
    q, k, v, beta, s0 = delta_net_inputs(seq_len=37, beta_max=beta_max)
    s0 = s0 if with_state else None
    o_ref, s_ref = delta_rule_recurrent(q, k, v, beta, s0)
    o, s = delta_rule_chunkwise(q, k, v, beta, chunk_size, s0)
    assert o.shape == (2, 3, 37, 5) and s.shape == (2, 3, 5, 8)
    assert (o - o_ref).abs().max() <= 1e-5
    assert (s - s_ref).abs().max() <= 1e-5


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 2),
    heads=st.integers(1, 3),
    seq_len=st.integers(1, 70),
    d_k=st.integers(1, 9),
    d_v=st.integers(1, 9),
    chunk_size=st.integers(1, 40),
    beta_max=st.sampled_from([1.0, 2.0]),
    erase=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_chunkwise_equals_recurrent_for_any_shape(batch, heads, seq_len, d_k, d_v, chunk_size, beta_max, erase, seed):
    q, k, v, beta, s0 = delta_net_inputs(batch, heads, seq_len, d_k, d_v, beta_max, seed=seed)
    o_ref, s_ref = delta_rule_recurrent(q, k, v, beta, s0, erase=erase)
    o, s = delta_rule_chunkwise(q, k, v, beta, chunk_size, s0, erase=erase)
    assert (o - o_ref).abs().max() <= 1e-5
    assert (s - s_ref).abs().max() <= 1e-5


@pytest.mark.parametrize("beta_max", [1.0, 2.0], ids=["beta_in_0_1", "beta_in_0_2"])
def test_chunkwise_gradients_equal_recurrent_gradients(beta_max):
    inputs = [x.requires_grad_(True) for x in delta_net_inputs(seq_len=29, beta_max=beta_max)]
    g = torch.Generator().manual_seed(1)
    o_weight, s_weight = torch.randn(2, 3, 29, 5, generator=g), torch.randn(2, 3, 5, 8, generator=g)

    def grads(fn):
        o, s = fn(*inputs)
        return torch.autograd.grad((o * o_weight).sum() + (s * s_weight).sum(), inputs)

    ref = grads(lambda q, k, v, b, s0: delta_rule_recurrent(q, k, v, b, s0))
    chunked = grads(lambda q, k, v, b, s0: delta_rule_chunkwise(q, k, v, b, 8, s0))  # 29 = 3 * 8 + 5: padded
    for name, a, b in zip(["q", "k", "v", "beta", "initial_state"], ref, chunked):
        assert (a - b).abs().max() <= 1e-5 * max(1.0, a.abs().max().item()), name  # 1e-5 of the gradient scale


def test_gradcheck_float64():
    inputs = tuple(x.requires_grad_(True) for x in delta_net_inputs(1, 2, 5, 3, 2, beta_max=2.0, dtype=torch.float64))
    assert torch.autograd.gradcheck(lambda *x: delta_rule_chunkwise(*x[:4], 2, x[4]), inputs)
    assert torch.autograd.gradcheck(lambda *x: delta_rule_recurrent(*x), inputs)


def test_initial_state_continues_a_sequence():
    """Splitting a sequence and handing the state over gives the unsplit result (the cache relies on it)."""
    q, k, v, beta, _ = delta_net_inputs(seq_len=40, beta_max=2.0)
    o_full, s_full = delta_rule_chunkwise(q, k, v, beta, 16)
    o_a, s_a = delta_rule_chunkwise(q[:, :, :23], k[:, :, :23], v[:, :, :23], beta[:, :, :23], 16)
    o_b, s_b = delta_rule_recurrent(q[:, :, 23:], k[:, :, 23:], v[:, :, 23:], beta[:, :, 23:], s_a)
    assert (torch.cat([o_a, o_b], dim=2) - o_full).abs().max() <= 1e-5
    assert (s_b - s_full).abs().max() <= 1e-5


def test_half_precision_inputs_keep_a_float32_state():
    q, k, v, beta, _ = delta_net_inputs(seq_len=20)
    o_ref, s_ref = delta_rule_chunkwise(q, k, v, beta, 8)
    o, s = delta_rule_chunkwise(*(x.bfloat16() for x in (q, k, v, beta)), 8)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert (o.float() - o_ref).abs().max() < 0.1 and (s - s_ref).abs().max() < 0.1
