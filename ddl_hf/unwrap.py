"""Find the Delta model (DeltaGPT, DeltaLlama) inside whatever wraps it (peft, DDP, torch.compile), so tools can
ask the model itself.

The model is the one source of truth for what is Delta (`delta_residuals()`, `delta_parameters()`,
`beta_upper_bounds()`); `DeltaTrainer`, `DeltaStatsCallback` and `ddl-hf inspect` only need to find it.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel


def find_delta_model(model: torch.nn.Module) -> PreTrainedModel | None:
    """The outermost Delta `PreTrainedModel` (DeltaGPT, DeltaLlama) in `model` (itself, or inside a wrapper), or
    None if there is none.

    Works for a model from `ddl_hf` and for one loaded from Hub custom code (a different class object with the
    same methods).
    """
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and callable(getattr(module, "delta_residuals", None)):
            return module
    return None


__all__ = ["find_delta_model"]
