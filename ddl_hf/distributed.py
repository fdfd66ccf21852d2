"""Sharded training with torch's FSDP2 (`torch.distributed.fsdp.fully_shard`), the engine that accelerate and
`Trainer` use for FSDP version 2: every decoder block (the model's `_no_split_modules`: `DeltaGPTBlock`,
`DeltaLlamaDecoderLayer`) is one shard group, the rest of the model (embeddings, read-out, final norm, head) the root
group. docs/workflows.md, "Scaling out", has the commands; tests/integrations/test_fsdp.py runs them on 2 CPU processes.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn


def block_classes(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The classes that one shard group wraps: those named in the model's `_no_split_modules` (what transformers'
    device maps and accelerate's FSDP auto-wrap policy use too)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    classes = tuple({type(m) for m in model.modules() if type(m).__name__ in names})
    if not classes:
        raise ValueError(
            f"{type(model).__name__} names no block class in `_no_split_modules`, so there is nothing to shard "
            "block by block; pass a DeltaGPT or DeltaLlama model (or one that sets `_no_split_modules`)."
        )
    return classes


def fully_shard_model(model: nn.Module, **fully_shard_kwargs: Any) -> nn.Module:
    """Apply FSDP2 to `model` in place: `fully_shard` on every block, then on the whole model; returns the model.

    `fully_shard_kwargs` go to every call (`mesh`, `mp_policy`, `reshard_after_forward`, `offload_policy`). Call it
    after `activation_checkpointing_enable()` if you want both (checkpointing wraps each block's forward), and build
    the optimizer afterwards, from the sharded parameters. Every parameter must be at least 1-D (FSDP2 shards along
    dim 0): the Delta parameters are, since ddl-hf 0.2."""
    from torch.distributed.fsdp import fully_shard

    scalars = [name for name, p in model.named_parameters() if p.dim() == 0]
    if scalars:
        raise ValueError(f"fully_shard refuses 0-dim parameters: {', '.join(scalars)}. Reshape them to [1].")
    classes = block_classes(model)
    for module in list(model.modules()):
        if isinstance(module, classes):
            fully_shard(module, **fully_shard_kwargs)
    fully_shard(model, **fully_shard_kwargs)
    return model


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full, unsharded state dict of a sharded model, on the CPU of rank 0 (empty on the other ranks): what
    `model.save_pretrained(path, state_dict=...)` on rank 0 writes. Every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def check_launch(accelerator: Any, fsdp_requested: bool = False) -> None:
    """Refuse a launch that accelerate would silently run as something else.

    accelerate sets up FSDP only on GPUs (and similar accelerators). On a CPU-only machine (accelerate 1.15), a
    process started by `accelerate launch` with an FSDP config gets `DistributedType.NO`, so every process trains its
    own unsynchronised copy; with `TrainingArguments(use_cpu=True, fsdp=True)` it gets DDP instead of FSDP. Neither
    says a word. `DeltaTrainer` calls this at construction; call it after building your own `Accelerator`.
    """
    from accelerate.utils import DistributedType

    fsdp_requested = fsdp_requested or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    chose = accelerator.distributed_type
    if launched > 1 and accelerator.num_processes == 1:
        raise RuntimeError(
            f"{launched} processes were launched, but accelerate set up {chose.value} in each (no device it can "
            "shard or synchronise over; on a CPU-only machine an FSDP config is dropped): every process would train "
            "its own copy. On CPU use `ddl_hf.distributed.fully_shard_model` under torchrun, or plain DDP "
            "(`accelerate launch --cpu`); docs/workflows.md, 'Scaling out'."
        )
    if fsdp_requested and chose != DistributedType.FSDP:
        raise RuntimeError(
            f"FSDP was requested, but accelerate set up {chose.value} (accelerate runs FSDP only on GPUs and similar "
            "devices). On CPU use `ddl_hf.distributed.fully_shard_model` under torchrun; docs/workflows.md, "
            "'Scaling out'."
        )


__all__ = ["block_classes", "check_launch", "fully_shard_model", "gather_full_state_dict"]
