"""What every Triton op of this package shares: the block sizes and launch sizes, the accumulation dtype, the device
guard, and the plumbing that makes one op of a forward and a backward function.

Each op is defined twice over the same functions: a `torch.library` custom op (what torch.compile, export and fake
tensors see: one node) and, in eager mode, a plain autograd.Function. The custom op's Python dispatch costs ~0.3 ms of
host time a residual on a 2-core CPU (forward and backward, kernels stubbed; ddl_lab/benchmarks/bench_launches.py),
more than the tensor ops it replaces.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

BLOCK_TOKENS = 16  # tokens a program takes: the backward's partial weight gradients are one row per program
BLOCK_HIDDEN = 128  # the hidden dim is walked in chunks of this many (a power of two)


def accumulator(*tensors: torch.Tensor) -> tuple[torch.dtype, tl.dtype]:
    """float64 where an input is float64 (gradcheck, the tests' tight reference), float32 otherwise."""
    if any(t.dtype == torch.float64 for t in tensors):
        return torch.float64, tl.float64
    return torch.float32, tl.float32


# Launch sizes in plain Python: `triton.cdiv` and `triton.next_power_of_2` are constexpr functions, whose host-side
# calls cost microseconds each, on every op. Read at each launch, so that the tests can shrink the blocks.


def programs(tokens: int) -> int:
    """The programs a launch over `tokens` tokens takes: one per block of `BLOCK_TOKENS`."""
    return -(-tokens // BLOCK_TOKENS)


def blocks(dim: int, channels: int) -> dict[str, int]:
    """A kernel's block sizes over the tokens, the hidden dim and the value channels (powers of two)."""
    return {
        "BLOCK_N": BLOCK_TOKENS,
        "BLOCK_D": min(BLOCK_HIDDEN, 1 << (dim - 1).bit_length()),
        "BLOCK_V": max(2, 1 << (channels - 1).bit_length()),
    }


# What every kernel's program covers: a block of tokens, walked over the hidden dim in tiles, with all value channels.


@triton.jit
def token_block(pid, N, V, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """Program `pid`'s token rows (int64: offsets past 2**31 elements) and the value channels, and their masks."""
    rows = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    chans = tl.arange(0, BLOCK_V)
    return rows, chans, rows < N, chans < V


@triton.jit
def hidden_tile(d0, D, rmask, vmask, BLOCK_D: tl.constexpr):
    """The hidden units `d0 .. d0 + BLOCK_D - 1` and their mask, and the masks of the `[rows, units]` and
    `[rows, units, channels]` tiles."""
    cols = d0 + tl.arange(0, BLOCK_D)
    dmask = cols < D
    m2 = rmask[:, None] & dmask[None, :]
    return cols, dmask, m2, m2[:, :, None] & vmask[None, None, :]


def state_rows(state: torch.Tensor) -> tuple[int, int, int, torch.Tensor]:
    """Tokens N, hidden D, value channels V of an expanded state `[..., D, d_v]`, and the state as `[N, D, V]` (a view
    where the strides allow)."""
    dim, channels = state.shape[-2], state.shape[-1]
    tokens = state.numel() // (dim * channels) if dim * channels else 0
    return tokens, dim, channels, state.reshape(tokens, dim, channels)


def on_its_device(function: Callable) -> Callable:
    """Run `function` with its first argument's CUDA device current: Triton launches on the current device and stream,
    not on the tensors' (a model spread over GPUs, a process that never called `torch.cuda.set_device`)."""

    @functools.wraps(function)
    def guarded(first: torch.Tensor, *args, **kwargs):  # every op's first argument is a tensor
        if not first.is_cuda:
            return function(first, *args, **kwargs)
        with torch.cuda.device(first.device):
            return function(first, *args, **kwargs)

    return guarded


class Spec(NamedTuple):
    """An op's forward (the custom op's function), its autograd `setup_context` and `backward`, and its eager
    autograd node (an `_Eager` named after the op: profiles count it under the op's name)."""

    forward: Callable
    setup_context: Callable
    backward: Callable
    function: type


class _Eager(torch.autograd.Function):
    """`spec`'s forward and backward as one autograd node, outside torch.compile (real tensors only: tracing takes
    the custom op)."""

    @staticmethod
    def forward(ctx, spec: Spec, *args):
        out = spec.forward(*args)
        spec.setup_context(ctx, args, out)
        ctx.spec = spec
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        return None, *ctx.spec.backward(ctx, *grads)


def save_inputs(ctx, inputs, output) -> None:
    """An op's autograd `setup_context` that saves its inputs, all tensors, for its backward."""
    ctx.save_for_backward(*inputs)


class Op(NamedTuple):
    """An op of this package: its custom op and its backward's (what tracing sees; give each its fake), and its
    eager spec (`call`)."""

    op: Callable
    backward_op: Callable
    spec: Spec


def define_op(name: str, forward: Callable, backward: Callable, setup_context: Callable, chain: Callable) -> Op:
    """The custom ops `name` (of `forward`) and `name + "_backward"` (of `backward`), the first's autograd registered
    (`setup_context`, and `chain(ctx, *grads, backward_op)`: the chain rule through the backward custom op, which
    tracing sees), and the eager spec: the same chain rule through the backward function, in a node named `name`."""
    op = torch.library.custom_op(name, forward, mutates_args=())
    backward_op = torch.library.custom_op(name + "_backward", backward, mutates_args=())
    op.register_autograd(functools.partial(chain, backward_op=backward_op), setup_context=setup_context)
    eager = type(name, (_Eager,), {"__module__": __name__})
    return Op(op, backward_op, Spec(forward, setup_context, functools.partial(chain, backward_op=backward), eager))


def call(op: Op, *args):
    """Run `op`: its custom op under torch.compile, else its eager autograd node."""
    return op.op(*args) if torch.compiler.is_compiling() else op.spec.function.apply(op.spec, *args)
