"""A bound for comparing float32 outputs with ones computed elsewhere (another machine, torch build or process).

Another machine's float32 kernels may sum in another order (another vector width, BLAS path), so its outputs are
not ours bit for bit. The bound is measured, not guessed: the same model in float64 is the exact answer to within
float32's rounding, and the error this machine's float32 run makes against it is the scale of any machine's.
"""

from __future__ import annotations

import copy
import hashlib
import platform
from pathlib import Path

import torch

#: How many times this machine's float32 error another machine's may be: kernels that sum in another order round
#: about as much, not orders of magnitude more (measured 0.8-1.4 times on the saved fixtures).
ROUNDING_FACTOR = 4.0


def float64_logits_and_bound(model: torch.nn.Module, *args, **kwargs) -> tuple[torch.Tensor, float]:
    """`model`'s logits in float64 (a float64 copy; `model` is float32 and unchanged) and the largest distance any
    machine's float32 logits may have from them: `ROUNDING_FACTOR` times this machine's, at least a few roundings of
    the largest logit."""
    with torch.no_grad():
        logits32 = model(*args, **kwargs).logits
        logits64 = copy.deepcopy(model).double()(*args, **kwargs).logits
    measured = float((logits32.double() - logits64).abs().max())
    floor = 4 * torch.finfo(torch.float32).eps * float(logits64.abs().max())
    return logits64, ROUNDING_FACTOR * max(measured, floor)


def assert_close_to_saved(model: torch.nn.Module, saved: torch.Tensor, *args, **kwargs) -> float:
    """`model`'s logits agree with `saved` (float32 logits computed elsewhere) to within float32 rounding: the saved
    ones within the bound of the float64 logits, today's float32 ones within twice it (each side within the bound).
    Returns the bound."""
    logits64, bound = float64_logits_and_bound(model, *args, **kwargs)
    torch.testing.assert_close(saved.double(), logits64, rtol=0, atol=bound)
    with torch.no_grad():
        logits = model(*args, **kwargs).logits
    torch.testing.assert_close(logits, saved, rtol=0, atol=2 * bound)
    return bound


def machine() -> str:
    """This CPU: its model name and a digest of its feature flags (which vector units the kernels may take). Outputs
    are bit-identical across runs only where the machine and the torch build are the same."""
    cpuinfo = Path("/proc/cpuinfo")
    fields = {}
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or platform.processor() or platform.machine()
    flags = hashlib.sha256(fields.get("flags", "").encode()).hexdigest()[:12]
    return f"{name} (flags {flags})"
