"""`ddl_hf::delta_residual`: a whole Delta residual after its sublayer (gate, value, write) as one op, forward and
backward, on the Triton kernels of `residual_kernels.py`.

The readable reference is `DeltaResidual`'s tensor ops (`delta_layers.py`, with the math in `delta_ops.py`); the
tests compare the two under Triton's interpreter on the CPU (tests/ops/test_triton_delta.py). The op is a
`torch.library` custom op with its autograd and fake implementations registered, so eager dispatch, `torch.compile`
(fullgraph) and `torch.export` see one node.
"""

from __future__ import annotations

import torch

from ..delta_ops import VALUE_CONSTANT, VALUE_SIGMOID, ResidualWeights
from . import launch
from .residual_kernels import _backward_kernel, _forward_kernel


def _layout(state: torch.Tensor, h: torch.Tensor) -> tuple[int, int, int, torch.Tensor]:
    """Tokens N, hidden D, value channels V, and the state as `[N, D, V]` (a view where the strides allow: an expanded
    X_0 keeps its stride 0 over V)."""
    dim = h.shape[-1]
    channels = 1 if state.dim() == h.dim() else state.shape[-1]
    tokens = h.numel() // dim if dim else 0
    return tokens, dim, channels, state.reshape(tokens, dim, channels)


def _rows(t: torch.Tensor | None, tokens: int, dim: int) -> torch.Tensor | None:
    return None if t is None else t.reshape(tokens, dim)


def _residual_rows(read, c, h, tokens: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The read, c and h as `[N, D]` rows (views where the strides allow; c stands in for an absent read)."""
    c2, h2 = _rows(c, tokens, dim), _rows(h, tokens, dim)
    return (c2 if read is None else _rows(read, tokens, dim)), c2, h2


def _residual_weights(gate_weight, gate_bias, beta_open, value_weight, value_bias) -> tuple[torch.Tensor, ...]:
    """The weights as the kernels read them, contiguous (no-op for an `nn.Linear`'s); the gate's stand in for an
    absent value (the constant value reads none)."""
    gate_weight, gate_bias, beta_open = gate_weight.contiguous(), gate_bias.contiguous(), beta_open.contiguous()
    value_weight = gate_weight if value_weight is None else value_weight.contiguous()
    value_bias = gate_bias if value_bias is None else value_bias.contiguous()
    return gate_weight, gate_bias, beta_open, value_weight, value_bias


def _out_dtype(state: torch.Tensor, h: torch.Tensor, additive: bool) -> torch.dtype:
    """What the tensor ops return (`delta_fused._fused_delta_forward`): the state's dtype, promoted with h's in additive
    mode (X + h)."""
    return torch.promote_types(state.dtype, h.dtype) if additive else state.dtype


@launch.on_its_device
def _delta_residual(
    state: torch.Tensor, read: torch.Tensor | None, c: torch.Tensor, h: torch.Tensor,  # the inputs
    gate_weight: torch.Tensor, gate_bias: torch.Tensor, beta_open: torch.Tensor,  # the gate
    value_weight: torch.Tensor | None, value_bias: torch.Tensor | None,  # the value, and its settings:
    value_mode: int, value_scale: float, value_constant: float,
    eps: float, additive: bool, erase: bool,  # the update's settings
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A Delta residual after its sublayer: `(X', beta)`, X' shaped like the state (`[..., D]` or `[..., D, d_v]`),
    beta `[...]`. `read` is the read x (the sigmoid value's input; None otherwise)."""
    tokens, dim, channels, x3 = _layout(state, h)
    acc, tl_acc = launch.accumulator(state, h, c, gate_weight)
    out = torch.empty(state.shape, dtype=_out_dtype(state, h, additive), device=state.device)  # [N, D, V] rows
    beta = torch.empty(h.shape[:-1], dtype=acc, device=state.device)
    if tokens:
        r2, c2, h2 = _residual_rows(read, c, h, tokens, dim)
        gate_weight, gate_bias, beta_open, vw, vb = _residual_weights(
            gate_weight, gate_bias, beta_open, value_weight, value_bias
        )
        _forward_kernel[(launch.programs(tokens),)](
            x3, r2, c2, h2, gate_weight, gate_bias, beta_open, vw, vb, out, beta,
            tokens, dim, channels, value_scale, value_constant, eps,
            *x3.stride(), *r2.stride(), *c2.stride(), *h2.stride(),
            ACC=tl_acc, VALUE=value_mode, ADDITIVE=additive, ERASE=erase,
            **launch.blocks(dim, channels),
        )  # fmt: skip
    return out, beta


@launch.on_its_device
def _delta_residual_backward(
    grad_state: torch.Tensor, grad_beta: torch.Tensor | None,  # the outputs' gradients (beta's None where unused)
    state: torch.Tensor | None, read: torch.Tensor | None, c: torch.Tensor, h: torch.Tensor,  # as `_delta_residual`
    gate_weight: torch.Tensor, gate_bias: torch.Tensor, beta_open: torch.Tensor,
    value_weight: torch.Tensor | None, value_bias: torch.Tensor | None,
    value_mode: int, value_scale: float, value_constant: float, eps: float, additive: bool, erase: bool,
    state_dtype: torch.dtype,  # d_state's
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """`(d_state, d_read, d_c, d_h, d_weights)`: d_read is empty unless the value reads x (sigmoid); d_weights packs
    `[d gate_weight (D) | d gate_bias | d beta_open | d value_weight (d_v x D) | d value_bias (d_v)]` in the
    accumulation dtype. `state` is None without erase (the write-only backward never reads X)."""
    tokens, dim, channels, g3 = _layout(grad_state, h)
    acc, tl_acc = launch.accumulator(grad_state, h, c, gate_weight)
    programs = launch.programs(tokens)
    width = _weights_width(dim, channels, value_mode)
    d_state = torch.empty((tokens, dim, channels), dtype=state_dtype, device=h.device)
    d_c, d_h = c.new_empty(c.shape), h.new_empty(h.shape)  # row-major, as the kernel writes them
    d_read = read.new_empty(read.shape) if value_mode == VALUE_SIGMOID else h.new_empty(0)
    partial = torch.empty((programs, width), dtype=acc, device=h.device)  # every program writes its whole row
    if tokens:
        x3 = g3 if state is None else state.reshape(tokens, dim, channels)
        gb = g3 if grad_beta is None else grad_beta.reshape(tokens)  # a stride 0 where autograd expanded a scalar
        r2, c2, h2 = _residual_rows(read, c, h, tokens, dim)
        gate_weight, gate_bias, beta_open, vw, vb = _residual_weights(
            gate_weight, gate_bias, beta_open, value_weight, value_bias
        )
        _backward_kernel[(programs,)](
            x3, r2, c2, h2, gate_weight, gate_bias, beta_open, vw, vb, g3, gb,
            d_state, d_read if read is not None else d_c, d_c, d_h, partial, width,
            tokens, dim, channels, value_scale, value_constant, eps,
            *x3.stride(), *r2.stride(), *c2.stride(), *h2.stride(), *g3.stride(), gb.stride(0),
            ACC=tl_acc, VALUE=value_mode, ADDITIVE=additive, ERASE=erase, HAS_GBETA=grad_beta is not None,
            **launch.blocks(dim, channels),
        )  # fmt: skip
    return d_state.view(grad_state.shape), d_read, d_c, d_h, partial.sum(0)


def _weights_width(dim: int, channels: int, value_mode: int) -> int:
    """The packed weight gradients' length: the gate's `dim + 1`, rho's 1, the value's `channels * (dim + 1)`."""
    return dim + 2 + (0 if value_mode == VALUE_CONSTANT else channels * (dim + 1))


def _setup_context(ctx, inputs, output) -> None:
    state, read, c, h, gate_weight, gate_bias, beta_open, value_weight, value_bias, *settings = inputs
    ctx.set_materialize_grads(False)  # beta's gradient is None unless beta is used: no tensor of zeros for it
    ctx.settings = settings
    ctx.state_dtype = state.dtype
    ctx.out_shape, ctx.out_dtype = output[0].shape, output[0].dtype
    erase = settings[-1]
    ctx.save_for_backward(state if erase else None, read, c, h, gate_weight, gate_bias, beta_open, value_weight,
                          value_bias)  # fmt: skip


def _backward(ctx, grad_state, grad_beta, backward_op):
    state, read, c, h, gate_weight, gate_bias, beta_open, value_weight, value_bias = ctx.saved_tensors
    if grad_state is None:  # only beta was used (grads are not materialised): the state's gradient is zero
        grad_state = h.new_zeros(ctx.out_shape, dtype=ctx.out_dtype)
    d_state, d_read, d_c, d_h, d_weights = backward_op(
        grad_state, grad_beta, state, read, c, h, gate_weight, gate_bias, beta_open, value_weight, value_bias,
        *ctx.settings, ctx.state_dtype,
    )  # fmt: skip
    dim = h.shape[-1]
    d_weights = d_weights.to(gate_weight.dtype)
    d_gate_weight, d_gate_bias, d_open, d_value = d_weights.split([dim, 1, 1, d_weights.numel() - dim - 2])
    d_value_weight = d_value_bias = None
    if value_weight is not None:
        d_value_weight, d_value_bias = d_value.split([value_weight.numel(), value_bias.numel()])
        d_value_weight = d_value_weight.view(value_weight.shape)
    return (
        d_state,
        d_read if read is not None else None,
        d_c,
        d_h,
        d_gate_weight.view(gate_weight.shape),
        d_gate_bias,
        d_open,
        d_value_weight,
        d_value_bias,
        None,
        None,
        None,
        None,
        None,
        None,
    )


_RESIDUAL = launch.define_op(
    "ddl_hf::delta_residual", _delta_residual, _delta_residual_backward, _setup_context, _backward
)
delta_residual, delta_residual_backward = _RESIDUAL.op, _RESIDUAL.backward_op  # the custom ops, as tracing sees them


@delta_residual.register_fake
def _(state, read, c, h, gate_weight, gate_bias, beta_open, value_weight, value_bias, value_mode, value_scale,
      value_constant, eps, additive, erase):  # fmt: skip
    acc, _ = launch.accumulator(state, h, c, gate_weight)
    out = state.new_empty(state.shape, dtype=_out_dtype(state, h, additive))
    return out, h.new_empty(h.shape[:-1], dtype=acc)


@delta_residual_backward.register_fake
def _(grad_state, grad_beta, state, read, c, h, gate_weight, gate_bias, beta_open, value_weight, value_bias,
      value_mode, value_scale, value_constant, eps, additive, erase, state_dtype):  # fmt: skip
    acc, _ = launch.accumulator(grad_state, h, c, gate_weight)
    channels = 1 if grad_state.dim() == h.dim() else grad_state.shape[-1]
    dim = h.shape[-1]
    d_read = read.new_empty(read.shape) if value_mode == VALUE_SIGMOID else h.new_empty(0)
    width = _weights_width(dim, channels, value_mode)
    return (
        grad_state.new_empty(grad_state.shape, dtype=state_dtype),
        d_read,
        c.new_empty(c.shape),
        h.new_empty(h.shape),
        h.new_empty(width, dtype=acc),
    )


def residual(
    state: torch.Tensor, x: torch.Tensor, c: torch.Tensor, h: torch.Tensor, weights: ResidualWeights
) -> tuple[torch.Tensor, torch.Tensor]:
    """`DeltaResidual`'s `(X', beta)` as one `ddl_hf::delta_residual` call (training and inference alike)."""
    mode, read = weights.value_kind(x)
    return launch.call(
        _RESIDUAL,
        state, read, c, h, weights.gate_weight, weights.gate_bias, weights.beta_open, weights.value_weight,
        weights.value_bias, mode, 1.0 if weights.value_scale is None else weights.value_scale,
        weights.value_constant, weights.eps, weights.additive, weights.erase,
    )  # fmt: skip
