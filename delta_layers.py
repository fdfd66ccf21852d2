"""The Delta residual of Deep Delta Learning, shared by every Delta model family (DeltaGPT, DeltaLlama).

Deep Delta Learning (Zhang, Liu, Wang, Gu; arXiv 2601.00417) replaces the identity shortcut `X + F(X)` of a residual
block with the Delta Operator `A = I - beta k k^T` and a synchronous rank-1 write (eq. 2.5):

    X' = A X + beta k v^T = X + beta k (v^T - k^T X),    k = F(x) / |F(x)|,  beta = 2 sigmoid(g(x)) in [0, 2]

A block reads x = read(X) (`delta_reads.DeltaRead`), runs its norm and sublayer, c = norm(x) and h = F(c), and
`DeltaResidual` does the rest: the gate beta, the value v and one call of the update op
(`delta_fused.fused_delta_update`). This file also holds the Delta initialisations: the exact start of a conversion and
the authors' from-scratch start. The math itself lives in `delta_ops.py`.

Self-contained Hub custom-code file: it imports only torch, transformers and its sibling files, which
`save_pretrained` copies next to the weights.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

# First: below the supported transformers / torch it stops here with one clear error (delta_compat.py).
from .delta_compat import check_installed_versions  # noqa: F401

# isort: split
from transformers import initialization as init
from transformers.configuration_utils import PreTrainedConfig

from .delta_fused import fused_delta_update
from .delta_ops import (
    ResidualWeights,
    at_least_float32,
    delta_gate,
    delta_kernels,
    straight_through_clamp,
)


def _plain_linear(module: nn.Module) -> bool:
    """An `nn.Linear` itself (not a subclass) whose call runs nothing but its forward (no hooks, no forward replaced by
    a wrapper): what a fused kernel may compute from its weights instead."""
    hooks = module._forward_hooks or module._forward_pre_hooks  # torch has no public reader of a module's hooks
    return type(module) is nn.Linear and not hooks and "forward" not in vars(module)


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast switched off, so that beta, k, v and the delta rule run in float32 under fp16 / bf16 autocast."""
    if device_type != "meta" and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


class DeltaResidual(nn.Module):
    """The Delta update of one sublayer's residual (eq. 2.5): `X' = X + beta k (v^T - k^T X)` with k = h / |h| from
    the sublayer's output h (+ `h 1^T` in additive mode).

    The gate `beta = 2 sigmoid(beta_proj(c)) rho` with its opening `rho = clamp(beta_open, 0, 1)`, and the value
    `v_proj` (of c, or of the read x for the sigmoid value). The read x = read(X) and c = norm(x) come from the block.
    """

    def __init__(self, config: PreTrainedConfig):
        super().__init__()
        self.config = config  # its `delta_implementation` names the kernels, read at each call as attention's
        hidden_size = config.hidden_size
        self.additive = config.delta_mode == "additive"
        self.eps = config.delta_eps
        self.value_channels = config.delta_value_channels
        self.erase = config.delta_erase
        if config.delta_gate == "linear":
            self.beta_proj = nn.Linear(hidden_size, 1)
        else:  # the paper's eq. A.2: w^T tanh(W_in c)
            self.beta_proj = nn.Sequential(
                nn.Linear(hidden_size, config.delta_gate_hidden_size, bias=False),
                nn.Tanh(),
                nn.Linear(config.delta_gate_hidden_size, 1),
            )
        # [1], not a 0-dim scalar: FSDP2's fully_shard shards along dim 0 and refuses 0-dim parameters.
        self.beta_open = nn.Parameter(torch.empty(1))
        # v = W_v c ("linear"), scale * sigmoid(W_v x + b) from the un-normalised read x ("sigmoid", the authors'
        # default), or a constant in every channel ("constant", no parameters).
        self.value_scale = float(config.delta_value_scale) if config.delta_value == "sigmoid" else None
        self.value_constant = float(config.delta_value_constant)
        self.v_proj = nn.Linear(hidden_size, self.value_channels) if config.delta_value != "constant" else None

    def forward(
        self, state: torch.Tensor, x: torch.Tensor, c: torch.Tensor, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Eq. 2.5 after the sublayer: the state X, its read x, the sublayer's input c = norm(x) and output h = F(c).
        Returns the new state and beta `[...]`."""
        kernels = delta_kernels(self.config.delta_implementation, state)
        # without autograd the model's inference step where it has one (generation), else its whole-residual op
        step_only = kernels.residual_step is not None and not torch.is_grad_enabled()
        whole = kernels.residual_step if step_only else kernels.residual
        weights = None if whole is None else self.step_weights()
        if weights is not None:  # the model's kernel takes the whole residual: one op
            step = whole(state, x, c, h, weights)
            if step is not None:
                return step
        with autocast_off(state.device.type):  # beta, k, v and the update in float32 under fp16 / bf16 autocast
            dtype = self.beta_open.dtype  # the model's float dtype, also when a quantizer replaced the Linears
            opening = at_least_float32(self.beta_open)
            rho = straight_through_clamp(opening, 0.0, 1.0) if opening.requires_grad else opening.clamp(0.0, 1.0)
            beta = delta_gate(at_least_float32(self.beta_proj(c.to(dtype))), rho)  # [..., 1]
            if self.v_proj is None:
                value = beta.new_full((*beta.shape[:-1], self.value_channels), self.value_constant)
            elif self.value_scale is None:
                value = at_least_float32(self.v_proj(c.to(dtype)))
            else:
                value = torch.sigmoid(at_least_float32(self.v_proj(x.to(dtype)))) * self.value_scale
            state = fused_delta_update(state, h, beta, value, self.eps, self.additive, self.erase, kernels.delta_update)
        # beta `[...]` as a tensor of its own, not a view of `[..., 1]` (a sum over one element: exact): FSDP2 warns
        # about views among a sharded block's outputs.
        return state, beta.sum(-1)

    def step_weights(self) -> ResidualWeights | None:
        """This residual's weights as a whole-residual kernel takes them (`DeltaKernels.residual`), or None where a
        kernel must not take its place: a gate or value that is not one plain `nn.Linear` (the MLP gate, a quantized
        or LoRA-wrapped layer), or one with hooks that a fused call would skip (accelerate's offload hooks replace
        `forward`)."""
        gate, value = self.beta_proj, self.v_proj
        if not _plain_linear(gate) or (value is not None and not _plain_linear(value)):
            return None
        return ResidualWeights(
            gate.weight,
            gate.bias,
            self.beta_open,
            None if value is None else value.weight,
            None if value is None else value.bias,
            self.value_scale,
            self.value_constant,
            self.eps,
            self.additive,
            self.erase,
        )

    @property
    def gate_output(self) -> nn.Linear:
        """The gate's last linear layer: its output is the logit g of beta = 2 sigmoid(g) rho."""
        return self.beta_proj if isinstance(self.beta_proj, nn.Linear) else self.beta_proj[-1]

    def opening(self) -> float:
        """rho = clamp(beta_open, 0, 1); 0 means beta is exactly 0 for every input (the gate is closed)."""
        return float(self.beta_open.detach().float().clamp(0.0, 1.0))


def _sigmoid(x: float) -> float:
    """The logistic function of a Python float, without overflow for any input (`math.exp` raises above ~709)."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)


@torch.no_grad()
def beta_upper_bound(residual: DeltaResidual, norm: nn.Module) -> float:
    """The largest beta `residual` can produce over every input, given the norm that feeds its gate; 0.0 means beta
    is exactly 0 for every input (rho == 0, or a gate so negative that sigmoid underflows).

    beta = 2 sigmoid(g(c)) rho with c = norm(x) = gamma * n (+ b):
    - LayerNorm: n is zero-mean with |n| < sqrt(D); a linear gate g = w.c + b is at most
      w.b_ln + b + sqrt(D) |center(w * gamma)| (the least upper bound: the best n points along the centred w * gamma);
    - RMSNorm: |n| < sqrt(D), not zero-mean; a linear gate is at most b + sqrt(D) |w * gamma| (the least upper bound);
    - an mlp gate g = w.tanh(W c) + b is at most |w|_1 + b (an upper bound that may not be reached).
    """
    rho = residual.opening()
    if rho == 0.0:
        return 0.0
    out = residual.gate_output
    w, b = out.weight.float()[0], float(out.bias.float()[0])
    if not isinstance(residual.beta_proj, nn.Linear):
        g_max = float(w.abs().sum()) + b
    elif isinstance(norm, nn.LayerNorm):
        scaled = w * norm.weight.float()
        centred = scaled - scaled.mean()
        g_max = float(w @ norm.bias.float()) + b + math.sqrt(w.numel()) * float(centred.norm())
    else:
        g_max = b + math.sqrt(w.numel()) * float((w * norm.weight.float()).norm())
    return 2.0 * rho * _sigmoid(g_max)  # float64 sigmoid is 0.0 only below g = -745, where float32 beta is 0 too


# ----------------------------------------------------------------------------------------------------------------
# Initialisation: the exact start of a conversion and the authors' from-scratch start
# ----------------------------------------------------------------------------------------------------------------


def init_delta_residual_exactly(module: DeltaResidual, beta0: float, std: float) -> None:
    """beta = 2 sigmoid(w^T c + b) rho. The last gate layer starts at w = 0, so beta is the same for every token;
    rho (the opening) and b are set so that beta == beta0 exactly. v_proj: GPT-2's N(0, std)."""
    gate_out = module.gate_output
    init.zeros_(gate_out.weight)
    if beta0 <= 1.0:
        init.constant_(module.beta_open, beta0)
        init.zeros_(gate_out.bias)  # 2 sigmoid(0) = 1 exactly
    else:
        half = min(beta0 / 2.0, 1.0 - 1e-9)
        init.constant_(module.beta_open, 1.0)
        init.constant_(gate_out.bias, math.log(half / (1.0 - half)))
    if module.v_proj is not None:
        init.normal_(module.v_proj.weight, mean=0.0, std=std)
        init.zeros_(module.v_proj.bias)


# The authors' initialisation at commit d1f7621 of github.com/yifanzhang-pro/deep-delta-learning
# (`model/init_utils.py::init_gpt_weights`, `model/modules/initialization.py::spectral_std`): every matrix
# N(0, spectral_std) with their `hidden_init_std_factor` 0.5; biases other than the gate's keep nn.Linear's default.
REFERENCE_COMMIT = "d1f76215c999be3089fe3132fe30e7a63dc8bbcb"
REFERENCE_STD_FACTOR = 0.5


def spectral_std(fan_in: int, fan_out: int, factor: float = REFERENCE_STD_FACTOR) -> float:
    """The reference's std of an `[fan_out, fan_in]` matrix: factor / sqrt(fan_in) * min(1, sqrt(fan_out / fan_in))."""
    return factor / math.sqrt(fan_in) * min(1.0, math.sqrt(fan_out / fan_in))


def init_delta_residual_as_reference(module: DeltaResidual, beta0: float) -> None:
    """The reference's Delta residual at `REFERENCE_COMMIT`: gate matrices N(0, spectral_std), the gate's bias
    logit(beta0 / 2) (p clamped to [1e-6, 1 - 1e-6]) with the opening rho = 1 (they have none), v_proj's weight
    N(0, spectral_std) and its bias nn.Linear's U(-1/sqrt(D), 1/sqrt(D)).

    beta0 == 0 (their gate cannot be shut): rho = 0 and the bias 0, so that beta is exactly 0 for every input, as the
    config's `delta_beta_init=0.0` says, and rho still receives a gradient (`straight_through_clamp`)."""
    for layer in module.beta_proj.modules() if isinstance(module.beta_proj, nn.Sequential) else [module.beta_proj]:
        if isinstance(layer, nn.Linear):
            init.normal_(layer.weight, mean=0.0, std=spectral_std(layer.in_features, layer.out_features))
    shut = beta0 <= 0.0
    p = 0.5 if shut else min(max(min(beta0, 2.0) / 2.0, 1e-6), 1.0 - 1e-6)
    init.constant_(module.gate_output.bias, math.log(p / (1.0 - p)))
    init.constant_(module.beta_open, 0.0 if shut else 1.0)
    v_proj = module.v_proj
    if v_proj is not None:
        init.normal_(v_proj.weight, mean=0.0, std=spectral_std(v_proj.in_features, v_proj.out_features))
        bound = 1.0 / math.sqrt(v_proj.in_features)
        init.uniform_(v_proj.bias, -bound, bound)


def resolve_delta_init(config, loading: bool) -> None:
    """Fill `delta_init=None` (auto) and `delta_beta_init=None` in the config with what the model uses.

    auto = "exact" for Delta parameters a loaded checkpoint lacks (conversion), "reference" for a model built from
    its config; `delta_beta_init=None` = 0.0 under "exact", 1.0 (the reference code's value) under "reference".
    Written back so that a saved config says how the model started.
    """
    if config.delta_init is None:
        config.delta_init = "exact" if loading else "reference"
    if config.delta_beta_init is None:
        config.delta_beta_init = 0.0 if config.delta_init == "exact" else 1.0


__all__ = [
    "REFERENCE_COMMIT",
    "DeltaResidual",
    "autocast_off",
    "beta_upper_bound",
    "init_delta_residual_as_reference",
    "init_delta_residual_exactly",
    "resolve_delta_init",
    "spectral_std",
]
