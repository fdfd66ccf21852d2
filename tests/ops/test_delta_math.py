"""The Delta update against closed-form math: a dense A = I - beta k k^T reference and the paper's statements."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import ddl_hf
from ddl_hf.delta_fused import fused_delta_update
from ddl_hf.delta_ops import delta_update
from tests.builders import delta_config, open_gates

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)
EPS32 = torch.finfo(torch.float32).eps


def random_unit(d: int, seed: int) -> torch.Tensor:
    k = torch.randn(d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return k / k.norm()


def operator_matrix(k: torch.Tensor, beta: float, value_channels: int) -> torch.Tensor:
    """The lifted linear map vec(X) -> vec(A X) computed by `delta_update` with v = 0 (paper mode).

    Materialised column by column from the code under test, in float32, returned in float64.
    """
    d = k.shape[0]
    basis = torch.eye(d * value_channels).reshape(d * value_channels, d, value_channels)
    k32 = k.float().expand(d * value_channels, d)
    beta32 = torch.full((d * value_channels,), beta)
    zeros = torch.zeros(d * value_channels, value_channels)
    columns = delta_update(basis if value_channels > 1 else basis.squeeze(-1), k32, beta32, zeros)
    return columns.reshape(d * value_channels, d * value_channels).T.double()


@pytest.mark.parametrize("mode", ["additive", "paper"])
@pytest.mark.parametrize("value_channels", [1, 3])
def test_delta_residual_matches_dense_operator(mode: str, value_channels: int) -> None:
    """DeltaResidual == A X + beta k v^T (+ h 1^T), with A materialised as a d x d matrix."""
    config = delta_config(delta_mode=mode, delta_value_channels=value_channels)
    module = ddl_hf.DeltaResidual(config).double()
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn_like(param))
        module.beta_open.fill_(0.8)
    generator = torch.Generator().manual_seed(3)
    shape = (2, 5, config.n_embd) + ((value_channels,) if value_channels > 1 else ())
    state = torch.randn(shape, generator=generator, dtype=torch.float64)
    normed = torch.randn(2, 5, config.n_embd, generator=generator, dtype=torch.float64)
    branch = torch.randn(2, 5, config.n_embd, generator=generator, dtype=torch.float64)

    read = state if value_channels == 1 else state.mean(-1)  # x = read(X): only the sigmoid value uses it
    new_state, beta = module(state, read, normed, branch)  # X, x, c = norm(x), h = sublayer(c)

    # Independent reference in float64 from the definitions.
    c, h, x = normed.double(), branch.double(), state.double().reshape(2, 5, config.n_embd, value_channels)
    k = h / torch.sqrt((h * h).sum(-1, keepdim=True) + config.delta_eps**2)
    gate = module.beta_proj
    logit = c @ gate.weight.double().T + gate.bias.double()
    beta_ref = 2 * torch.sigmoid(logit.squeeze(-1)) * 0.8
    v = c @ module.v_proj.weight.double().T + module.v_proj.bias.double()
    eye = torch.eye(config.n_embd, dtype=torch.float64)
    a = eye - beta_ref[..., None, None] * k[..., :, None] * k[..., None, :]
    expected = a @ x + beta_ref[..., None, None] * k[..., :, None] * v[..., None, :]
    if mode == "additive":
        expected = expected + h[..., None]
    expected = expected.reshape(shape)

    assert new_state.dtype == torch.float64  # the Delta math never narrows a float64 model to float32
    assert (beta - beta_ref).abs().max().item() <= 1e-6
    assert (new_state - expected).abs().max().item() <= 1e-6


@SETTINGS
@given(d=st.integers(2, 12), beta=st.floats(0.0, 2.0), seed=st.integers(0, 10_000))
def test_theorem_3_1_spectrum(d: int, beta: float, seed: int) -> None:
    """sigma(A) = {1 (d-1 times), 1 - beta}; k is the eigenvector of 1 - beta; k-perp is fixed."""
    k = random_unit(d, seed)
    a = operator_matrix(k, beta, 1)
    eigenvalues = torch.linalg.eigvalsh((a + a.T) / 2)
    expected = torch.tensor(sorted([1.0] * (d - 1) + [1.0 - beta]), dtype=torch.float64)
    assert torch.allclose(eigenvalues, expected, atol=1e-5)
    assert torch.allclose(a @ k, (1 - beta) * k, atol=1e-5)
    u = torch.randn(d, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    u = u - (u @ k) * k
    assert torch.allclose(a @ u, u, atol=1e-5)


@SETTINGS
@given(d=st.integers(2, 8), value_channels=st.integers(1, 3), beta=st.floats(0.0, 2.0), seed=st.integers(0, 10_000))
def test_corollary_3_2_determinants(d: int, value_channels: int, beta: float, seed: int) -> None:
    """det A = 1 - beta, and the lifted map on R^{d x d_v} has det (1 - beta)^{d_v}."""
    k = random_unit(d, seed)
    assert torch.linalg.det(operator_matrix(k, beta, 1)).item() == pytest.approx(1 - beta, abs=1e-5)
    lifted = operator_matrix(k, beta, value_channels)
    assert torch.linalg.det(lifted).item() == pytest.approx((1 - beta) ** value_channels, abs=1e-5)


@SETTINGS
@given(d=st.integers(2, 10), beta=st.floats(0.0, 2.0), seed=st.integers(0, 10_000))
def test_orthogonal_iff_beta_is_0_or_2(d: int, beta: float, seed: int) -> None:
    a = operator_matrix(random_unit(d, seed), beta, 1)
    defect = (a.T @ a - torch.eye(d, dtype=torch.float64)).abs().max().item()
    # A^T A - I = ((1 - beta)^2 - 1) k k^T: largest entry |(1-beta)^2 - 1| max_i k_i^2, > 0 unless beta in {0, 2}.
    closed_form = abs((1 - beta) ** 2 - 1) * (random_unit(d, seed) ** 2).max().item()
    assert defect == pytest.approx(closed_form, abs=1e-5)
    for endpoint in (0.0, 2.0):
        a = operator_matrix(random_unit(d, seed), endpoint, 1)
        assert torch.allclose(a.T @ a, torch.eye(d, dtype=torch.float64), atol=1e-5)


@SETTINGS
@given(d=st.integers(2, 10), value_channels=st.integers(1, 4), beta=st.floats(0.0, 2.0), seed=st.integers(0, 10_000))
def test_eq_2_2_equals_eq_2_5(d: int, value_channels: int, beta: float, seed: int) -> None:
    """A X + beta k v^T (eq. 2.2, dense) equals X + beta k (v^T - k^T X) (eq. 2.5, as implemented)."""
    generator = torch.Generator().manual_seed(seed)
    k = random_unit(d, seed)
    x = torch.randn(d, value_channels, generator=generator, dtype=torch.float64)
    v = torch.randn(value_channels, generator=generator, dtype=torch.float64)
    a = torch.eye(d, dtype=torch.float64) - beta * torch.outer(k, k)
    dense = a @ x + beta * torch.outer(k, v)
    state = x.float() if value_channels > 1 else x.float().squeeze(-1)
    implemented = delta_update(state, k.float(), torch.tensor(beta), v.float())
    assert torch.allclose(implemented.double().reshape(d, value_channels), dense, atol=1e-5)


@SETTINGS
@given(d=st.integers(2, 10), beta=st.floats(0.0, 2.0), seed=st.integers(0, 10_000))
def test_eq_3_6_diagonal_state(d: int, beta: float, seed: int) -> None:
    """(A X)_ij = lambda_i delta_ij - beta lambda_j k_i k_j for X = diag(lambda)."""
    k = random_unit(d, seed)
    lambdas = torch.randn(d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    implemented = delta_update(torch.diag(lambdas).float(), k.float(), torch.tensor(beta), torch.zeros(d))
    closed_form = torch.diag(lambdas) - beta * lambdas[None, :] * k[:, None] * k[None, :]
    assert torch.allclose(implemented.double(), closed_form, atol=1e-5)


@SETTINGS
@given(d=st.integers(2, 10), beta=st.floats(0.0, 2.0), value=st.floats(-3, 3), seed=st.integers(0, 10_000))
def test_eq_3_7_scalar_value_limit(d: int, beta: float, value: float, seed: int) -> None:
    """d_v = 1: x' = x + beta (v - k^T x) k."""
    k = random_unit(d, seed)
    x = torch.randn(d, generator=torch.Generator().manual_seed(seed + 7), dtype=torch.float64)
    implemented = delta_update(x.float(), k.float(), torch.tensor(beta), torch.tensor([value]))
    closed_form = x + beta * (value - k @ x) * k
    assert torch.allclose(implemented.double(), closed_form, atol=1e-5)


@SETTINGS
@given(d=st.integers(2, 10), value_channels=st.integers(1, 3), seed=st.integers(0, 10_000))
def test_beta_one_replaces_and_beta_two_reflects(d: int, value_channels: int, seed: int) -> None:
    """beta = 1: k^T X' = v^T and the k-perp part is kept; beta = 2: the k-component is mirrored, then 2 v written."""
    generator = torch.Generator().manual_seed(seed)
    k = random_unit(d, seed)
    x = torch.randn(d, value_channels, generator=generator, dtype=torch.float64)
    v = torch.randn(value_channels, generator=generator, dtype=torch.float64)
    squeeze = (lambda t: t.squeeze(-1)) if value_channels == 1 else (lambda t: t)

    def step(beta: float) -> torch.Tensor:
        out = delta_update(squeeze(x.float()), k.float(), torch.tensor(beta), v.float())
        return out.double().reshape(d, value_channels)

    perp = x - torch.outer(k, k @ x)
    replaced = step(1.0)
    assert torch.allclose(k @ replaced, v, atol=1e-5)
    assert torch.allclose(replaced - torch.outer(k, k @ replaced), perp, atol=1e-5)
    reflected = step(2.0)
    assert torch.allclose(reflected, perp - torch.outer(k, k @ x) + 2 * torch.outer(k, v), atol=1e-5)


# ---- the gate parameterisation ------------------------------------------------------------------------------------


@pytest.mark.parametrize("beta_init", [0.0, 0.25, 1.0, 1.5, 2.0])
@pytest.mark.parametrize("gate", ["linear", "mlp"])
def test_beta_starts_exactly_at_delta_beta_init(beta_init: float, gate: str, token_batch: torch.Tensor) -> None:
    torch.manual_seed(0)
    model = ddl_hf.DeltaGPTForCausalLM(delta_config(delta_beta_init=beta_init, delta_gate=gate, delta_init="exact"))
    betas = model(token_batch, output_betas=True).betas
    assert len(betas) == 2 * model.config.n_layer
    for beta in betas:
        assert beta.shape == token_batch.shape and beta.dtype == torch.float32
        if beta_init <= 1.0 or beta_init == 2.0:  # exact (see DeltaGPTConfig.delta_beta_init)
            assert torch.equal(beta, torch.full_like(beta, beta_init))
        else:
            # a few roundings of beta: the vectorised sigmoid differs with the CPU's vector width
            assert torch.allclose(beta, torch.full_like(beta, beta_init), rtol=0, atol=4 * EPS32 * 2)


@pytest.mark.parametrize("mode", ["additive", "paper"])
def test_closed_gate_still_gets_a_gradient(mode: str, token_batch: torch.Tensor) -> None:
    """beta == 0 exactly, yet dL/d(opening) != 0 in every block: a gate can open when training wants it."""
    torch.manual_seed(0)
    model = ddl_hf.DeltaGPTForCausalLM(delta_config(delta_mode=mode, delta_beta_init=0.0, delta_init="exact")).train()
    out = model(token_batch, labels=token_batch, output_betas=True)
    assert all(torch.count_nonzero(beta) == 0 for beta in out.betas)
    out.loss.backward()
    blocks = [m for m in model.modules() if isinstance(m, ddl_hf.DeltaResidual)]
    assert len(blocks) == 2 * model.config.n_layer
    assert all(block.beta_open.grad is not None and block.beta_open.grad.abs() > 0 for block in blocks)


def test_one_optimizer_step_opens_the_gates(token_batch: torch.Tensor) -> None:
    torch.manual_seed(0)
    model = ddl_hf.DeltaGPTForCausalLM(delta_config(delta_beta_init=0.0)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        optimizer.zero_grad()
        model(token_batch, labels=token_batch).loss.backward()
        optimizer.step()
    betas = model(token_batch, output_betas=True).betas
    assert max(beta.max().item() for beta in betas) > 0
    assert all(beta.min().item() >= 0.0 and beta.max().item() <= 2.0 for beta in betas)


def test_beta_stays_in_range_for_any_parameters(token_batch: torch.Tensor) -> None:
    model = ddl_hf.DeltaGPTForCausalLM(delta_config())
    open_gates(model)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, ddl_hf.DeltaResidual):
                module.beta_open.fill_(5.0)  # outside [0, 1]: clamped
                module.beta_proj.bias.fill_(30.0)
    betas = torch.stack(model(token_batch, output_betas=True).betas)
    assert betas.min() >= 0 and betas.max() <= 2.0 and betas.max() > 1.99


def test_autocast_keeps_delta_math_in_float32(token_batch: torch.Tensor) -> None:
    model = ddl_hf.DeltaGPTForCausalLM(delta_config(delta_value_channels=2))
    open_gates(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(token_batch, output_betas=True)
    assert all(beta.dtype == torch.float32 for beta in out.betas)
    with torch.no_grad():
        reference = model(token_batch).logits
    assert torch.isfinite(out.logits).all()
    assert (out.logits.float() - reference).abs().max().item() < 0.1 * reference.abs().max().item()


def sublayer_rounding_bound(state, h, beta, value, dh, eps):
    """First-order bound on how much the Delta write moves when the sublayer output h is off by dh (its rounding in
    half precision): X' = X + h 1^T + beta k (v^T - k^T X), k = h / rho, rho = sqrt(|h|^2 + eps^2), so
    dk = (I - h h^T / rho^2) dh / rho (|dk| <= |dh| / rho), and dX' = dh 1^T + beta (dk (v - X^T k)^T - k dk^T X),
    two terms orthogonal where dk is orthogonal to k: |dX'| <= |dh| sqrt(d_v) + beta |dh| / rho sqrt(|v - X^T k|^2 +
    |X|_F^2). Against the additive residual's |dh| sqrt(d_v): amplified about beta |X| / |h| where |h| << |X|."""
    rho = torch.sqrt(h.square().sum() + eps**2)
    k = h / rho
    spread = torch.sqrt((value - state.T @ k).square().sum() + state.square().sum())
    return dh.norm() * state.shape[1] ** 0.5 + beta * dh.norm() / rho * spread


def additive_write(state, h, beta, value, eps):
    """The model's write (`fused_delta_update`, additive) of one token: state `[D, d_v]`, h `[D]`, value `[d_v]`."""
    beta = torch.tensor([beta], dtype=state.dtype)
    return fused_delta_update(state[None], h[None], beta, value[None], eps, True, True)[0]


@pytest.mark.parametrize("case", ["random", "worst"])
@pytest.mark.parametrize("value_channels", [1, 4])
def test_sublayer_rounding_moves_the_state_within_the_first_order_bound(case, value_channels):
    """The derivation behind the half-precision figures (docs/performance.md): a relative error r in h moves the
    Delta write by up to beta r sqrt(|v - X^T k|^2 + |X|^2) (k's direction carries h's relative error whole), which
    the float64 write respects on random draws, and nearly reaches for the worst direction (dh orthogonal to h, X
    along dh): the bound is tight, so a mutant that drops a term of it fails."""
    d, eps, beta = 64, 1e-6, 1.3
    g = torch.Generator().manual_seed(value_channels)
    worst = []
    for trial in range(20):
        state = torch.randn(d, value_channels, generator=g, dtype=torch.float64) * 3
        h = torch.randn(d, generator=g, dtype=torch.float64) * 0.1  # a small sublayer output on a large state
        value = torch.randn(value_channels, generator=g, dtype=torch.float64)
        dh = torch.randn(d, generator=g, dtype=torch.float64)
        if case == "worst":  # dh orthogonal to h, the state along it and orthogonal to k
            dh = dh - (dh @ h) / (h @ h) * h
            state = torch.outer(dh / dh.norm(), state.norm(dim=0))
        dh = dh * 1e-7 * h.norm() / dh.norm()

        moved = (additive_write(state, h + dh, beta, value, eps) - additive_write(state, h, beta, value, eps)).norm()
        bound = sublayer_rounding_bound(state, h, beta, value, dh, eps)
        assert moved <= bound * (1 + 1e-5), (trial, float(moved), float(bound))
        worst.append(float(moved / bound))
        if case == "worst":  # amplified over the additive residual's |dh| by about beta |X| / |h| (here ~40)
            assert moved > 0.5 * beta * state.norm() / h.norm() * dh.norm()
    if case == "worst":
        assert min(worst) > 0.9
