"""An optional native kernel for decoding: the Delta residual update of one token on the CPU in one C++ call.

Decoding one token at batch 1 is all per-call overhead: the Python host path (`DeltaResidual._update_one_token`)
makes ~14 tensor calls per Delta block, which cost more than the block's arithmetic. `csrc/one_token_delta.cpp` does
the same math in one call. It is compiled on first use with `torch.utils.cpp_extension` (a C++ compiler and ninja:
`pip install ninja`; ~30 s once, then cached by torch in `TORCH_EXTENSIONS_DIR`) and is opt-in per model:

    from ddl_hf.native import enable_native_decoding
    enable_native_decoding(model)   # every Delta residual (and TC read) of `model` decodes one token natively
    model.generate(...)

It runs exactly where the host path runs (one token at batch 1, CPU, float32/float64, no autograd, plain linear
gate and value, not while compiling or tracing); everything else keeps the tensor path. The same file holds the TC
read (`delta_state_read="temporal_conv"`) of a forward with a cache and without autograd, the prompt's and each
decoded token's: the new window and the read in one call instead of ~10 tensor calls, at any batch size; and the CC
read (`"channel_conv"`) of a forward without autograd, likewise. Nothing else depends on it:
the Hub model files import only torch and transformers, and a model without it gives the same tokens.
`torch.save(model)` and `copy.deepcopy(model)` leave the kernel out (a compiled function cannot be pickled): the copy
decodes on the Python host path until `enable_native_decoding` is called on it.

Training kernels, `csrc/training.cpp`, serve training and full-sequence forwards: the fused Delta update and the TC
read (`delta_state_read="temporal_conv"`), each in one pass over the state, forward and backward, where
the tensor ops make several (docs/performance.md has the cost of both):

    from ddl_hf.native import enable_native_training
    enable_native_training(model)   # every Delta update and TC read of `model`

They run on CPU float32 / float64 tensors outside compile, export and jit tracing; elsewhere the tensor ops run.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

_SOURCE = Path(__file__).parent / "csrc" / "one_token_delta.cpp"
_TRAINING_SOURCE = Path(__file__).parent / "csrc" / "training.cpp"
_FLAGS = ["-O3", "-fopenmp-simd"]  # omp simd: vectorised loops, no OpenMP runtime
_decoding: Any = None
_training: Any = None


class NativeKernelUnavailable(RuntimeError):
    """The native kernel cannot be built here (no C++ compiler or ninja); the Python host path still works."""


def native_build_problem() -> str | None:
    """Why the kernel cannot be built on this machine, or None if it can be tried."""
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


def load_one_token_kernel(verbose: bool = False) -> Callable:
    """Build (first call; torch caches the build) and return the native one-token Delta update."""
    return _decoding_kernels(verbose).one_token_delta_update


def load_cc_read(verbose: bool = False) -> Callable:
    """Build (first call; torch caches the build) and return the native CC read of a forward without autograd."""
    return _decoding_kernels(verbose).cc_read


def load_cached_tc_read(verbose: bool = False) -> Callable:
    """Build (first call; torch caches the build) and return the native TC read of a forward with a cache and without
    autograd (`DeltaConvContext.read_cached` calls it)."""
    return _decoding_kernels(verbose).cached_tc_read


def _decoding_kernels(verbose: bool) -> Any:
    global _decoding
    if _decoding is None:
        unavailable = "cannot build the native decoding kernel: {}. Decoding works without it (the Python path)."
        _decoding = _build("ddl_hf_one_token_delta", _SOURCE, unavailable, verbose)
    return _decoding


def load_training_kernels(verbose: bool = False) -> Any:
    """Build (first call; torch caches the build) and return the native training kernels: an extension module with
    `delta_update_forward` / `delta_update_backward` (`delta_ops.fused_delta_update` calls them) and
    `tc_read_forward` / `tc_read_backward` (`delta_ops.temporal_conv_read`)."""
    global _training
    if _training is None:
        unavailable = "cannot build the native training kernels: {}. Training works without them (tensor ops)."
        _training = _build("ddl_hf_training", _TRAINING_SOURCE, unavailable, verbose)
    return _training


def _build(name: str, source: Path, unavailable: str, verbose: bool) -> Any:
    """Compile `source` as extension `name` (cached by torch); `unavailable` formats the error that names what is
    missing."""
    problem = native_build_problem()
    if problem is not None:
        raise NativeKernelUnavailable(unavailable.format(problem))
    from torch.utils.cpp_extension import load

    return load(name=name, sources=[str(source)], extra_cflags=_FLAGS, verbose=verbose)


def _delta_residuals(model: nn.Module, required: bool = False) -> list[nn.Module]:
    """The Delta residuals of `model`; `required`: a ValueError if it has none. Duck-typed, so that a model loaded as
    Hub custom code (its own copy of the classes) is found too."""
    residuals = [module for module in model.modules() if hasattr(type(module), "one_token_kernel")]
    if required and not residuals:
        raise ValueError(f"{type(model).__name__} has no Delta residuals (DeltaGPT / DeltaLlama models have).")
    return residuals


def enable_native_decoding(model: nn.Module, verbose: bool = False) -> nn.Module:
    """Make every Delta residual of `model` decode one token with the native kernel, and every TC and CC read (the
    read-out's included) of a forward without autograd run natively (TC's where a cache keeps its window); returns
    `model`.

    Raises `NativeKernelUnavailable` (naming what is missing) where it cannot be built, and ValueError for a model
    without Delta residuals."""
    residuals = _delta_residuals(model, required=True)
    kernels = _decoding_kernels(verbose)
    for residual in residuals:
        residual.one_token_kernel = kernels.one_token_delta_update
    for read in _conv_reads(model):
        read.inference_read = kernels.cached_tc_read if read.kind == "temporal_conv" else kernels.cc_read
    return model


def disable_native_decoding(model: nn.Module) -> nn.Module:
    """Back to the Python host path for every Delta residual and TC / CC read of `model`; returns `model`."""
    for residual in _delta_residuals(model):
        residual.__dict__.pop("one_token_kernel", None)
    for read in _conv_reads(model):
        read.__dict__.pop("inference_read", None)
    return model


def _conv_reads(model: nn.Module) -> list[nn.Module]:
    # Duck-typed like `_delta_residuals`: the TC and CC reads (DeltaStateConv).
    return [module for module in model.modules() if hasattr(type(module), "native_read")]


def _tc_reads(model: nn.Module) -> list[nn.Module]:
    return [module for module in _conv_reads(model) if module.kind == "temporal_conv"]


def enable_native_training(model: nn.Module, verbose: bool = False) -> nn.Module:
    """Make every Delta update of `model`, and every TC read (the TC read-out's included), run
    the native kernels, forward and backward, where they apply (CPU float32 / float64, not compiling); returns
    `model`. Losses and gradients are those of the tensor ops (tests/test_native_training.py).

    Raises `NativeKernelUnavailable` (naming what is missing) where they cannot be built, and ValueError for a model
    without Delta residuals."""
    residuals = _delta_residuals(model, required=True)
    kernels = load_training_kernels(verbose)
    for residual in residuals:
        residual.native_update = kernels
    for read in _tc_reads(model):
        read.native_read = kernels
    return model


def disable_native_training(model: nn.Module) -> nn.Module:
    """Back to the tensor ops for every Delta update and TC read of `model`; returns `model`."""
    for module in _delta_residuals(model):
        module.__dict__.pop("native_update", None)
    for read in _tc_reads(model):
        read.__dict__.pop("native_read", None)
    return model
