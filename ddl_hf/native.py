"""Optional native CPU kernels for the Delta ops (`csrc/training.cpp`): a whole Delta residual (gate, value, write) as
one op with its backward, the fused Delta update and the TC read, each in one pass over the state, forward and
backward, and a residual's inference step in one call, where the tensor ops make several (docs/performance.md has
what they save).

A model runs them when its config says `delta_implementation="native"` (`ddl_hf.kernels`), where they apply: CPU
float32 / float64 tensors outside compile, export and jit tracing; everywhere else the tensor ops run. A model gives
the same values with or without them (tests/ops/test_native_kernels.py):

    model = AutoModelForCausalLM.from_pretrained(path, delta_implementation="native")

The extension is compiled on first use with `torch.utils.cpp_extension` (a C++ compiler and ninja: `pip install
ninja`; ~30 s once, then cached by torch in `TORCH_EXTENSIONS_DIR`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch.nn.modules import module as _torch_module

from .delta_ops import DeltaKernel, DeltaKernels, ResidualWeights

_HALF_OR_FLOAT = (torch.float32, torch.bfloat16, torch.float16)

_SOURCE = Path(__file__).parent / "csrc" / "training.cpp"
_FLAGS = ["-O3", "-fopenmp-simd"]  # omp simd: vectorised loops, no OpenMP runtime
_kernels: Any = None


class NativeKernelUnavailable(RuntimeError):
    """The native kernels cannot be built here (no C++ compiler or ninja); the tensor ops still work."""


def native_build_problem() -> str | None:
    """Why the kernels cannot be built on this machine, or None if they can be tried."""
    from torch.utils.cpp_extension import is_ninja_available

    if shutil.which("c++") is None and shutil.which("g++") is None:
        return "no C++ compiler on PATH (install g++ or clang)"
    if not is_ninja_available():
        _put_pip_ninja_on_path()  # torch runs `ninja` from PATH; pip's ninja may sit outside it (a venv not activated)
        if not is_ninja_available():
            return "ninja is not installed (pip install ninja)"
    return None


def _put_pip_ninja_on_path() -> None:
    try:
        import ninja
    except ImportError:
        return
    bin_dir = getattr(ninja, "BIN_DIR", None)
    if bin_dir and Path(bin_dir, "ninja").exists():
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def load_training_kernels(verbose: bool = False) -> Any:
    """Build (first call; torch caches the build) and return the native kernels: an extension module with
    `delta_update_forward` / `delta_update_backward` and `tc_read_forward` / `tc_read_backward`."""
    global _kernels
    if _kernels is None:
        unavailable = "cannot build the native kernels: {}. Everything works without them (tensor ops)."
        _kernels = _build("ddl_hf_training", _SOURCE, unavailable, verbose)
    return _kernels


def _build(name: str, source: Path, unavailable: str, verbose: bool) -> Any:
    """Compile `source` as extension `name` (cached by torch); `unavailable` formats the error that names what is
    missing."""
    problem = native_build_problem()
    if problem is not None:
        raise NativeKernelUnavailable(unavailable.format(problem))
    from torch.utils.cpp_extension import load

    return load(name=name, sources=[str(source)], extra_cflags=_FLAGS, verbose=verbose)


def _applies(x: torch.Tensor) -> bool:
    """CPU float32 / float64, outside compile, export and jit tracing (an opaque extension call cannot be traced)."""
    return (
        x.is_cpu  # not `x.device.type == "cpu"`: the same answer without building a device object
        and x.dtype in (torch.float32, torch.float64)
        and not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
    )


def _global_hooks() -> bool:
    """Whether forward hooks are registered for every module (`torch.nn.modules.module.register_module_forward_hook`
    / `_pre_hook`; torch's module tracker and some profilers use them). torch has no public reader of them: these are
    the dicts `nn.Module.__call__` itself reads (this module is a backend outside the Hub files)."""
    return bool(_torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks)


def _step_applies(x: torch.Tensor) -> bool:
    """`_applies`, and no hooks on every module: the fused step would skip the gate's and value's calls."""
    return _applies(x) and not _global_hooks()


def _residual_step(
    state: torch.Tensor, x: torch.Tensor, c: torch.Tensor, h: torch.Tensor, weights: ResidualWeights
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The inference step (`DeltaKernels.residual_step`): `(new_state, beta)`, or None where it does not apply
    (`_step_applies`) or the tensors are not all on the CPU in the state's float32 / float64 dtype (checked in the
    kernel)."""
    if not _step_applies(state):
        return None
    return _kernels.residual_step(state, c, h, x, *weights)


class _Residual(torch.autograd.Function):
    """A whole Delta residual as one autograd node over the native forward and backward (one call each)."""

    @staticmethod
    def forward(ctx, state, read, c, h, gate_weight, gate_bias, beta_open, value_weight, value_bias, *settings):
        out, beta = _kernels.residual_forward(
            state, read, c, h, gate_weight, gate_bias, beta_open, value_weight, value_bias, *settings
        )
        erase = settings[-1]
        ctx.set_materialize_grads(False)  # beta's gradient is None unless beta is used
        ctx.settings, ctx.out_shape, ctx.out_dtype = settings, out.shape, out.dtype
        ctx.save_for_backward(state if erase else None, read, c, h, gate_weight, gate_bias, beta_open, value_weight,
                              value_bias)  # fmt: skip
        return out, beta

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_state, grad_beta):
        state, read, c, h, gate_weight, gate_bias, beta_open, value_weight, value_bias = ctx.saved_tensors
        if grad_state is None:  # only beta was used: the state's gradient is zero
            grad_state = h.new_zeros(ctx.out_shape, dtype=ctx.out_dtype)
        grads = _kernels.residual_backward(
            grad_state, grad_beta, state, read, c, h, gate_weight, gate_bias, beta_open, value_weight, value_bias,
            *ctx.settings,
        )  # fmt: skip
        return (*grads, *([None] * len(ctx.settings)))


def _residual(
    state: torch.Tensor, x: torch.Tensor, c: torch.Tensor, h: torch.Tensor, weights: ResidualWeights
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`DeltaKernels.residual`: `(new_state, beta)` as one autograd node, or None where it does not apply
    (`_step_applies`: the fused call skips the gate's and value's module calls) or does not take these dtypes: a
    float64 state with float64 h and c, or a float32 state with float32, bf16 or fp16 h and c (autocast's mixed
    dtypes); the new state keeps the state's dtype."""
    if not _step_applies(state):
        return None
    if state.dtype == torch.float64:
        if c.dtype != torch.float64 or h.dtype != torch.float64:
            return None
    elif state.dtype != torch.float32 or c.dtype not in _HALF_OR_FLOAT or h.dtype not in _HALF_OR_FLOAT:
        return None
    additive = weights.additive
    mode, read = weights.value_kind(x)
    return _Residual.apply(
        state, read, c, h, weights.gate_weight, weights.gate_bias, weights.beta_open, weights.value_weight,
        weights.value_bias, mode, 1.0 if weights.value_scale is None else weights.value_scale,
        weights.value_constant, weights.eps, additive, weights.erase,
    )  # fmt: skip


def native_kernels(verbose: bool = False) -> DeltaKernels:
    """The native kernels as `delta_implementation="native"` runs them: each Delta residual (gate, value, write) as
    one op with its backward (`residual`, training), or without autograd as one call (`residual_step`, generation);
    the Delta write and the TC read where those do not apply (`_applies`).

    Raises `NativeKernelUnavailable` (naming what is missing) where they cannot be built."""
    kernels = load_training_kernels(verbose)
    return DeltaKernels(
        residual=_residual,
        residual_step=_residual_step,
        delta_update=DeltaKernel(kernels.delta_update_forward, kernels.delta_update_backward, _applies),
        tc_read=DeltaKernel(kernels.tc_read_forward, kernels.tc_read_backward, _applies),
    )
