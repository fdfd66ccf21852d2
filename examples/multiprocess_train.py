"""Multi-process fine-tuning of DeltaGPT with Trainer: DDP on CPUs (gloo), DDP or FSDP2 on GPUs.

    torchrun --standalone --nproc_per_node 2 examples/multiprocess_train.py --output-dir outputs/ddp
    accelerate launch --cpu --num_processes 2 examples/multiprocess_train.py --output-dir outputs/ddp
    # GPUs, FSDP2 (every DeltaGPTBlock one shard group, bf16):
    accelerate launch --config_file examples/fsdp2/deltagpt.yaml examples/multiprocess_train.py --base gpt2
    torchrun --nproc_per_node 8 examples/multiprocess_train.py --base gpt2 --fsdp

Each process writes `rank{N}.json` with a SHA-256 of its final parameters (DDP keeps the replicas identical, so all
ranks report the same digest; under FSDP each rank digests its shards). accelerate runs FSDP only on GPUs: on a
CPU-only machine `DeltaTrainer` refuses an FSDP launch instead of silently training unsynchronised copies.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

import torch
from transformers import default_data_collator, set_seed

import ddl_hf
from ddl_hf.callbacks import DeltaStatsCallback
from ddl_hf.corpus import lm_datasets
from ddl_hf.distributed import block_classes, gather_full_state_dict
from ddl_hf.training import (
    DeltaTrainer,
    add_base_arguments,
    add_training_arguments,
    base_gpt2,
    training_arguments_from,
)


def parameter_digest(model: torch.nn.Module) -> str:
    """SHA-256 over every parameter's name and bytes: equal digests mean bit-identical models."""
    digest = hashlib.sha256()
    for name, param in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(param.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_base_arguments(parser)
    add_training_arguments(parser, output_dir="outputs/multiprocess", steps=20, batch_size=2, block_size=128, lr=5e-4)
    parser.add_argument("--ddp-backend", default=None, help="default: gloo on CPU, accelerate's choice on GPUs")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 through TrainingArguments (needs GPUs)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = Path(args.output_dir)
    set_seed(args.seed)
    gpt2, tokenizer, _ = base_gpt2(args.base, cache_dir=args.cache_dir)
    model = ddl_hf.convert_gpt2(gpt2).train()  # same seed on every rank; DDP broadcasts rank 0's weights anyway
    block_size = min(args.block_size, model.config.n_positions)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    data = lm_datasets(tokenizer, block_size, max_train_blocks=args.steps * args.batch_size * world, max_eval_blocks=4)
    sharding = {}
    if args.fsdp:
        wrap = sorted(cls.__name__ for cls in block_classes(model))
        sharding = dict(fsdp=True, fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": wrap})
    gpus = torch.cuda.is_available()
    training_args = training_arguments_from(
        args,
        logging_steps=max(1, args.steps // 4),
        ddp_backend=args.ddp_backend or (None if gpus else "gloo"),
        use_cpu=not gpus,
        bf16=gpus,
        **sharding,
    )
    trainer = DeltaTrainer(
        model=model,
        args=training_args,
        train_dataset=data["train"],
        eval_dataset=data["eval"],
        data_collator=default_data_collator,
        callbacks=[DeltaStatsCallback()],
    )
    initial = parameter_digest(model)
    trainer.train()
    metrics = trainer.evaluate()
    rank = training_args.process_index
    report = {
        "rank": rank,
        "world_size": training_args.world_size,
        "initial_digest": initial,
        "final_digest": parameter_digest(trainer.model),
        "global_step": trainer.state.global_step,
        "eval_loss": metrics["eval_loss"],
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=2))
    print(f"rank {rank}/{training_args.world_size}: params sha256 {report['final_digest'][:16]}...")
    if trainer.is_fsdp_enabled:  # gathered on every rank, written by the main process
        full = gather_full_state_dict(trainer.model)
        if trainer.is_world_process_zero():
            trainer.model.save_pretrained(out / "final", state_dict=full)
    else:
        trainer.save_model(str(out / "final"))  # written by the main process only


if __name__ == "__main__":
    main()
