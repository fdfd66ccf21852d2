"""The exact way back: a DeltaGPT whose every gate is closed is a GPT-2, so it can be saved as one.

Which blocks, parameters and bounds are Delta is asked of the model (`delta_residuals()`, `delta_parameters()`,
`beta_upper_bounds()`); this module only decides whether the export is exact and builds the GPT2LMHeadModel.
"""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from ..configuration_delta_gpt import DeltaGPTConfig
from ..delta_reads import DeltaRead
from ..modeling_delta_gpt import DeltaGPTForCausalLM
from .converting import CHECKPOINT_KEYS, delta_config_fields, from_state_dict


@torch.no_grad()
def beta_upper_bounds(model: DeltaGPTForCausalLM) -> dict[str, float]:
    """The largest beta each Delta block can produce, over every possible input, by module name. 0.0 means beta is
    exactly 0 for every input (rho == 0, or a gate so negative that even float64 sigmoid underflows).

    Same as `model.beta_upper_bounds()`; see `DeltaResidual.beta_upper_bound` for how the bound is computed (the
    least upper bound for a linear gate, an upper bound for an mlp gate).
    """
    return model.beta_upper_bounds()


def check_exportable(model, target: str) -> None:
    """Refuse (ValueError naming the reason) unless the Delta model computes exactly its source architecture's
    function: additive mode, every gate closed, identity state convolutions, read vectors summing to 1.

    Shared by `export_to_gpt2` and `export_to_llama`; `target` names the architecture in the messages."""
    config = model.config
    if config.delta_mode != "additive":
        raise ValueError(
            f"Cannot export a paper-mode Delta model to {target}: with delta_mode='paper' a block at beta = 0 is the "
            f"identity, not the residual x + F(x), so no {target} computes the same function."
        )
    bounds = model.beta_upper_bounds()
    open_blocks = {name: bound for name, bound in bounds.items() if bound > 0.0}
    if open_blocks:
        worst = max(open_blocks, key=open_blocks.get)
        rho = model.delta_residuals()[worst].opening()
        raise ValueError(
            f"Cannot export to {target} exactly: {len(open_blocks)} of {len(bounds)} Delta blocks have an open gate. "
            f"Largest beta found: {open_blocks[worst]:.6g} in {worst} (the supremum over all inputs; its opening "
            f"rho = clamp(beta_open, 0, 1) = {rho:.6g}). A {target} has no Delta term, so only a model with every "
            "beta_open <= 0 can be exported."
        )
    convolutions = {name: module for name, module in model.named_modules() if hasattr(module, "identity")}
    moved = [name for name, module in convolutions.items() if not torch.equal(module.weight, module.identity())]
    if moved:
        raise ValueError(
            f"Cannot export to {target} exactly: {len(moved)} state convolution(s) (delta_state_read / "
            f"delta_embed_expand variants) are not the identity: {moved}. {target} has no convolution over the "
            "residual state; only a model whose convolutions still have their identity weights can be exported."
        )
    if config.delta_value_channels > 1:
        reads = {
            f"{name}.weights": module.weights
            for name, module in model.named_modules()
            if isinstance(module, DeltaRead) and module.weights is not None
        }
        sums = {name: float(w.detach().float().sum()) for name, w in reads.items()}
        off = {name: total for name, total in sums.items() if abs(total - 1.0) > 1e-6}
        if off:
            raise ValueError(
                f"Cannot export to {target} exactly: with d_v > 1 every read vector must sum to 1 so that reading the "
                f"state x 1^T gives x back; these do not: {off}."
            )


def export_to_gpt2(model: DeltaGPTForCausalLM) -> GPT2LMHeadModel:
    """Return a plain GPT2LMHeadModel computing exactly the same function as `model`, or refuse.

    Exact only for an additive DeltaGPT whose every gate is closed (rho = clamp(beta_open, 0, 1) == 0, so beta is
    0 for every input) and, with d_v > 1, whose read vectors sum to 1 (then the expanded state is x 1^T and reading
    it gives x back), and whose state convolutions (TC/CC reads, EC expansion) still have their identity weights.
    Otherwise raises ValueError naming the largest beta found (see `beta_upper_bounds`).
    """
    config = model.config
    if getattr(config, "model_type", None) != DeltaGPTConfig.model_type or not hasattr(model, "lm_head"):
        raise ValueError(f"export_to_gpt2 needs a DeltaGPTForCausalLM, got {type(model).__name__}.")
    check_exportable(model, "GPT-2")

    dropped = {*CHECKPOINT_KEYS, *delta_config_fields()}
    fields = {k: v for k, v in config.to_dict().items() if k not in dropped}
    gpt2_config = GPT2Config(**fields)
    gpt2_config._attn_implementation = config._attn_implementation
    delta_parameters = set(model.delta_parameters())
    state_dict = {
        name: tensor.detach().clone() for name, tensor in model.state_dict().items() if name not in delta_parameters
    }
    gpt2, problems = from_state_dict(GPT2LMHeadModel, gpt2_config, state_dict, model.dtype, like=model)
    if problems:  # a DeltaGPT layout bug
        raise ValueError(f"DeltaGPT weights do not map onto GPT-2: {'; '.join(problems)}.")
    return gpt2


__all__ = ["beta_upper_bounds", "check_exportable", "export_to_gpt2"]
