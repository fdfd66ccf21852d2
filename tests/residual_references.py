"""Independent references for the Delta update and the Delta residual, shared by the tests of the op
(tests/ops/test_fused_delta.py), of the residual (tests/layers/test_delta_residual.py) and of the kernels that stand in
for them (tests/ops/test_native_kernels.py): the dense A = I - beta k k^T update, the readable reference
(`delta_update` of the unit direction) in the update op's place, and a residual's update in float64 from its
parameters, with the inputs they are checked on."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch

from ddl_hf import delta_layers
from ddl_hf.delta_layers import DeltaResidual
from ddl_hf.delta_ops import delta_update, unit_direction
from tests.builders import delta_config

EPS = 1e-6
CASES = [(d_v, mode) for d_v in (1, 4) for mode in ("additive", "paper")]


def make_inputs(d_v: int, dtype=torch.float64, shape=(2, 3), dim=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    state_shape = (*shape, dim, d_v) if d_v > 1 else (*shape, dim)
    state = torch.randn(state_shape, generator=g, dtype=dtype)
    h = torch.randn(*shape, dim, generator=g, dtype=dtype)
    beta = 2 * torch.rand(*shape, generator=g, dtype=dtype)
    value = torch.randn(*shape, d_v, generator=g, dtype=dtype)
    return [t.requires_grad_() for t in (state, h, beta, value)]


def dense_reference(state, h, beta, value, additive):
    """A X + beta k v^T (+ h 1^T) with the Delta Operator A = I - beta k k^T materialised."""
    k = h / torch.sqrt(h.square().sum(-1, keepdim=True) + EPS**2)
    x = state if state.dim() == h.dim() + 1 else state.unsqueeze(-1)
    eye = torch.eye(h.shape[-1], dtype=h.dtype)
    a = eye - beta[..., None, None] * k.unsqueeze(-1) * k.unsqueeze(-2)
    out = a @ x + beta[..., None, None] * k.unsqueeze(-1) * value.unsqueeze(-2)
    if additive:
        out = out + h.unsqueeze(-1)
    return out if state.dim() == h.dim() + 1 else out.squeeze(-1)


def readable_update(state, h, beta, value, eps, additive, erase=True, kernel=None):
    """`fused_delta_update`'s readable reference: `delta_update(state, unit_direction(h, eps), ...)` (a kernel, which
    the models given here never choose, is not run)."""
    beta = beta.squeeze(-1) if beta.dim() == h.dim() else beta  # [..., 1] -> [...]
    return delta_update(state, unit_direction(h, eps), beta, value, h if additive else None, erase)


@contextlib.contextmanager
def readable_residuals():
    """Every Delta residual writes with the readable reference in the update op's place (autograd through it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(delta_layers, "fused_delta_update", readable_update)
        yield


# The first state of an expanded model (d_v > 1) is an expand view of the embedding (stride 0): its own cases.
VIEW_CASES = [(d_v, mode, False) for d_v, mode in CASES] + [(4, mode, True) for mode in ("additive", "paper")]


def residual(d_v: int, mode: str, dtype=torch.float32, beta_open: float = 0.8, **fields) -> DeltaResidual:
    """A DeltaResidual of `fields` in `dtype` with random weights (std 0.3, from seed 0), its gate opened to
    `beta_open`."""
    torch.manual_seed(0)
    module = DeltaResidual(delta_config(delta_mode=mode, delta_value_channels=d_v, **fields)).to(dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)
        module.beta_open.fill_(beta_open)
    return module


#: Every combination a whole residual's op takes: (mode, d_v, value, erase).
COMBINATIONS = list(
    itertools.product(("paper", "additive"), (1, 2, 4, 8), ("linear", "sigmoid", "constant"), (True, False))
)


def combination_residual(mode: str, channels: int, value: str, erase: bool, dim: int) -> DeltaResidual:
    """`residual` of one of COMBINATIONS, `dim` wide, in float64, with a value scale, constant and epsilon away from
    their defaults (so that an op that ignores one is seen) and its gate at 0.7."""
    fields = dict(delta_value=value, delta_erase=erase, delta_value_scale=2.0, delta_value_constant=0.7, delta_eps=1e-3)
    return residual(channels, mode, torch.float64, beta_open=0.7, n_embd=dim, **fields)


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


def step(module: DeltaResidual, state, normed, h, read=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual's forward with its sublayer's input c = `normed` and output `h` given; `read` stands for the read
    x of the state (None: `read_of(normed)`, which only the sigmoid value uses)."""
    return module(state, read_of(normed) if read is None else read, normed, h)


def reference(module: DeltaResidual, state, normed, h, read=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's update in float64 from its parameters, with `delta_update` (the readable reference)."""
    p = {name: t.detach().double() for name, t in module.named_parameters()}
    state, normed, h = state.double(), normed.double(), h.double()
    logit = normed @ p["beta_proj.weight"].T + p["beta_proj.bias"]
    beta = (2 * torch.sigmoid(logit) * p["beta_open"].clamp(0, 1)).squeeze(-1)
    if module.v_proj is None:  # the constant value, as the tensors of the module's dtype hold it
        constant = torch.tensor(module.value_constant, dtype=module.beta_open.dtype).double()
        value = constant.expand(*beta.shape, module.value_channels)
    elif module.value_scale is None:
        value = normed @ p["v_proj.weight"].T + p["v_proj.bias"]
    else:  # the authors' value: scale * sigmoid(W_v r + b) of the un-normalised read
        value = module.value_scale * torch.sigmoid(read.double() @ p["v_proj.weight"].T + p["v_proj.bias"])
    additive = module.additive
    out = delta_update(state, unit_direction(h, module.eps), beta, value, h if additive else None, module.erase)
    return out, beta


def assert_one_token_matches_the_float64_reference(module, d_v, expanded_view, dtype) -> None:
    """T = 1, batch 1, inference mode (what generation runs) against `reference`."""
    state, normed, h = inputs(d_v, dtype, shape=(1, 1), seed=7)
    read = read_of(normed)
    if expanded_view:  # the first state of an expanded model: the embedding repeated over d_v, stride 0
        state = state[..., :1].expand(state.shape)
    with torch.inference_mode():
        out, beta = step(module, state, normed, h, read)
    expected, expected_beta = reference(module, state, normed, h, read)
    assert out.shape == state.shape and out.dtype == dtype and beta.shape == (1, 1) and beta.dtype == dtype
    tolerance = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(beta.double(), expected_beta, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)
    assert not torch.equal(out, state + (h.unsqueeze(-1) if d_v > 1 else h))  # the gate is open: a real update
