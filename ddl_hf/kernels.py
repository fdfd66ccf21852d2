"""The kernels behind each `delta_implementation`, per device type (what `delta_ops.delta_kernels` loads).

A model's config names its implementation, as `attn_implementation` names its attention; the model's layers hand
the chosen kernels to the ops in `delta_ops`, and nothing is registered process-wide, so two models in one process
may run different kernels:

- "eager": the tensor ops everywhere.
- "triton": on CUDA one Triton op per Delta residual and one per read (linear, CC, TC: `triton_delta`), and fla's
  delta rule; on the CPU the same under Triton's interpreter (`TRITON_INTERPRET=1`), else an error.
- "native": on the CPU the native kernels (`native`: the write, the TC read, the inference step); elsewhere an error.
- "auto": on CUDA as "triton" where Triton imports and the GPU is one Triton runs on (compute capability 7.0+), else
  the tensor ops (and fla's delta rule where installed); on the CPU the tensor ops.

"auto" takes the native CPU kernels only when asked for by name: they are compiled on first use (~30 s, a C++
compiler and ninja), which a model's first forward should not do unasked.
"""

from __future__ import annotations

import importlib.util
import os
import warnings

import torch

from .delta_ops import DELTA_IMPLEMENTATIONS, TENSOR_OPS, DeltaKernels


class DeltaImplementationUnavailable(RuntimeError):
    """A model asked for a `delta_implementation` that cannot run here; the message names what is missing."""


def triton_problem() -> str | None:
    """Why the Triton kernels cannot run here, or None."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (a CUDA build of torch brings it; or pip install triton)"
    return None


def interpreting_triton() -> bool:
    """Whether Triton runs its kernels on the CPU through its interpreter (set before Triton is imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_available(implementation: str) -> None:
    """A ValueError for an unknown name, `DeltaImplementationUnavailable` naming what is missing for "triton" or
    "native"; "auto" and "eager" always run."""
    if implementation not in DELTA_IMPLEMENTATIONS:
        raise ValueError(
            f"delta_implementation={implementation!r} is invalid: expected one of {DELTA_IMPLEMENTATIONS}."
        )
    if implementation == "triton" and (problem := triton_problem()):
        raise DeltaImplementationUnavailable(f"delta_implementation='triton' cannot run here: {problem}.")
    if implementation == "native":
        from .native import native_build_problem

        if problem := native_build_problem():
            raise DeltaImplementationUnavailable(f"delta_implementation='native' cannot be built here: {problem}.")


def kernels_for(implementation: str, device_type: str) -> DeltaKernels:
    """The kernels `implementation` runs on `device_type` (the table above)."""
    check_available(implementation)
    if implementation == "eager" or device_type == "meta":
        return TENSOR_OPS
    if implementation == "native":
        if device_type != "cpu":
            raise DeltaImplementationUnavailable(
                f"delta_implementation='native' runs CPU kernels; this model's tensors are on {device_type!r}. Use "
                "'auto' or 'triton' on a GPU."
            )
        from .native import native_kernels

        return native_kernels()
    cuda = device_type == "cuda"
    if implementation == "auto":
        triton_ops = _triton_ops() if cuda else None  # None where Triton cannot run here: the tensor ops
        fla = _fla_only() if cuda else TENSOR_OPS
        return fla if triton_ops is None else fla._replace(**triton_ops)
    if not cuda and not (device_type == "cpu" and interpreting_triton()):
        raise DeltaImplementationUnavailable(
            f"delta_implementation='triton' runs on CUDA tensors (or CPU tensors under Triton's interpreter, "
            f"TRITON_INTERPRET=1 set before Triton is imported); this model's tensors are on {device_type!r}. Use "
            "'auto' or 'eager'."
        )
    triton_ops = _triton_ops() if cuda else _import_triton_ops()
    if triton_ops is None:
        raise DeltaImplementationUnavailable(
            "delta_implementation='triton' cannot run on this GPU (Triton needs compute capability 7.0 or newer, "
            "and an importable Triton). Use 'auto' or 'eager'."
        )
    return (_fla_only() if cuda else TENSOR_OPS)._replace(**triton_ops)


def _import_triton_ops() -> dict:
    """`triton_delta`'s ops by `DeltaKernels` field (importing Triton)."""
    from .triton_delta import channel_conv_read, read, residual, temporal_conv_read

    return dict(residual=residual, read=read, channel_read=channel_conv_read, temporal_read=temporal_conv_read)


def _triton_ops() -> dict | None:
    """The Triton ops by `DeltaKernels` field, or None where "auto" must not take them: Triton missing or failing to
    import, or a GPU older than Triton's (compute capability below 7.0)."""
    too_old = torch.cuda.is_available() and torch.cuda.get_device_capability() < (7, 0)
    if triton_problem() is not None or too_old:
        return None
    try:
        return _import_triton_ops()
    except Exception as error:  # a Triton or torch too old for these ops: "auto" runs the tensor ops, and says why
        warnings.warn(
            f"delta_implementation='auto' runs the tensor ops: the Triton ops do not load ({error!r}).", stacklevel=2
        )
        return None


def prepare(implementation: str) -> dict[str, DeltaKernels]:
    """The kernels of `implementation` for each device type it can run on here: the CPU ("auto", "eager", "native";
    "triton" under Triton's interpreter) and CUDA where torch sees a GPU ("auto", "triton")."""
    check_available(implementation)
    devices = []
    if implementation != "triton" or interpreting_triton():
        devices.append("cpu")
    if implementation in ("auto", "triton") and torch.cuda.is_available():
        devices.append("cuda")
    return {device: kernels_for(implementation, device) for device in devices}


def _fla_only() -> DeltaKernels:
    """fla's delta rule for DeltaNet where fla is installed (CUDA), the tensor ops for the rest."""
    from .fla_kernels import fla_available, fla_delta_rule

    return DeltaKernels(delta_rule=fla_delta_rule) if fla_available() else TENSOR_OPS


__all__ = [
    "DeltaImplementationUnavailable",
    "check_available",
    "interpreting_triton",
    "kernels_for",
    "prepare",
    "triton_problem",
]
