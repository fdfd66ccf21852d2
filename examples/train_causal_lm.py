"""Causal-LM fine-tuning of DeltaGPT with Trainer: eval, checkpoints, resume, beta statistics in the logs.

    python examples/train_causal_lm.py --output-dir outputs/clm                      # train, checkpoint every 20
    python examples/train_causal_lm.py --output-dir outputs/clm --resume latest      # continue from the last one

Every checkpoint directory holds the weights, the optimizer/scheduler/RNG state, `trainer_state.json` (with the
`beta/...` statistics of DeltaStatsCallback) and the two Hub custom-code files, so
`AutoModelForCausalLM.from_pretrained("outputs/clm/checkpoint-20", trust_remote_code=True)` works on its own.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from transformers import default_data_collator, set_seed
from transformers.trainer_utils import get_last_checkpoint

import ddl_hf
from ddl_hf.callbacks import DeltaStatsCallback
from ddl_hf.corpus import lm_datasets
from ddl_hf.training import (
    DeltaTrainer,
    add_base_arguments,
    add_training_arguments,
    base_gpt2,
    training_arguments_from,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_base_arguments(parser)
    add_training_arguments(
        parser, output_dir="outputs/train_causal_lm", steps=40, batch_size=4, block_size=128, lr=5e-4
    )
    parser.add_argument("--save-steps", type=int, default=20)
    parser.add_argument("--delta-lr-scale", type=float, default=1.0)
    parser.add_argument("--eval-blocks", type=int, default=32)
    parser.add_argument("--resume", default=None, help="checkpoint directory, or 'latest' in --output-dir")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> DeltaTrainer:
    args = parse_args(argv)
    set_seed(args.seed)
    gpt2, tokenizer, origin = base_gpt2(args.base, cache_dir=args.cache_dir)
    model = ddl_hf.convert_gpt2(gpt2).train()
    block_size = min(args.block_size, model.config.n_positions)
    data = lm_datasets(
        tokenizer, block_size, max_train_blocks=args.steps * args.batch_size, max_eval_blocks=args.eval_blocks
    )
    # Checkpoints go straight into --output-dir (not a trainer/ subfolder), where --resume latest looks for them.
    training_args = training_arguments_from(
        args,
        args.output_dir,
        warmup_steps=max(1, args.steps // 10),
        logging_steps=max(1, args.save_steps // 2),
        eval_strategy="steps",
        eval_steps=args.save_steps,
        save_strategy="steps",
        save_steps=args.save_steps,
        data_seed=args.seed,
    )
    trainer = DeltaTrainer(
        model=model,
        args=training_args,
        train_dataset=data["train"],
        eval_dataset=data["eval"],
        data_collator=default_data_collator,
        processing_class=tokenizer,
        callbacks=[DeltaStatsCallback()],
        delta_lr_scale=args.delta_lr_scale,
    )
    resume = get_last_checkpoint(args.output_dir) if args.resume == "latest" else args.resume
    print(f"base: {origin}; resume from: {resume}")
    trainer.train(resume_from_checkpoint=resume)
    metrics = trainer.evaluate()
    print(f"eval loss {metrics['eval_loss']:.4f}, perplexity {math.exp(metrics['eval_loss']):.2f}")
    last = [e for e in trainer.state.log_history if "beta/L0.attn/mean" in e]
    if last:
        print("beta statistics of the last logged steps:")
        for key, value in sorted(last[-1].items()):
            if key.startswith("beta/") and key.endswith("/mean"):
                print(f"  {key:<22} {value:.4f}")
    trainer.save_model(str(Path(args.output_dir) / "final"))
    return trainer


if __name__ == "__main__":
    main()
