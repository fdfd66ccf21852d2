"""LoRA (peft) on DeltaGPT's GPT-2 sublayers, with the Delta parameters trained in full alongside.

    python examples/peft_lora.py --output-dir outputs/lora

LoRA adapters go on GPT-2's `c_attn`, `c_proj` (attention and MLP) and `c_fc` (`Conv1D`, hence
`fan_in_fan_out=True`); the Delta blocks (`attn_delta`, `mlp_delta`: gate, opening, value map) are small, so they are
trained in full through `modules_to_save` and stored with the adapter. The adapter is saved, reloaded onto a fresh
copy of the base DeltaGPT, and merged with `merge_and_unload()`; the merged model computes the same logits.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, default_data_collator, set_seed

import ddl_hf
from ddl_hf.corpus import lm_datasets
from ddl_hf.training import (
    DeltaTrainer,
    add_base_arguments,
    add_training_arguments,
    base_gpt2,
    training_arguments_from,
)

LORA_TARGETS = ["c_attn", "c_proj", "c_fc"]
DELTA_MODULES = ["attn_delta", "mlp_delta"]


def lora_config(rank: int = 8) -> LoraConfig:
    """LoRA on GPT-2's Conv1D sublayers; the Delta blocks fully trainable and saved with the adapter."""
    return LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        lora_dropout=0.0,
        target_modules=LORA_TARGETS,
        fan_in_fan_out=True,  # GPT-2's Conv1D stores weights as [in, out]
        modules_to_save=DELTA_MODULES,
        task_type="CAUSAL_LM",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_base_arguments(parser)
    add_training_arguments(parser, output_dir="outputs/peft_lora", steps=30, batch_size=4, block_size=128, lr=2e-3)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = Path(args.output_dir)
    set_seed(args.seed)
    gpt2, tokenizer, _ = base_gpt2(args.base, cache_dir=args.cache_dir)
    # The base the adapter belongs to: save the converted DeltaGPT once, and load it fresh wherever needed.
    ddl_hf.convert_gpt2(gpt2).save_pretrained(out / "base-delta-gpt")
    tokenizer.save_pretrained(out / "base-delta-gpt")

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(out / "base-delta-gpt"), lora_config(args.rank))
    model.print_trainable_parameters()
    block_size = min(args.block_size, model.config.n_positions)
    data = lm_datasets(tokenizer, block_size, max_train_blocks=args.steps * args.batch_size, max_eval_blocks=8)
    trainer = DeltaTrainer(
        model=model,
        args=training_arguments_from(args),
        train_dataset=data["train"],
        eval_dataset=data["eval"],
        data_collator=default_data_collator,
    )
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    print(f"eval loss {before:.4f} -> {after:.4f} (LoRA + Delta parameters)")
    model.save_pretrained(out / "adapter")
    print(f"adapter saved: {sorted(p.name for p in (out / 'adapter').iterdir())}")

    # Reload onto a fresh base, compare, merge.
    ids = torch.tensor(data["eval"]["input_ids"][:2])
    with torch.no_grad():
        trained = model.eval()(ids).logits
        reloaded = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(out / "base-delta-gpt"), out / "adapter"
        )
        unmerged = reloaded.eval()(ids).logits
        merged_model = reloaded.merge_and_unload()
        merged = merged_model.eval()(ids).logits
    print(f"reloaded adapter vs trained model: max |logit diff| {(unmerged - trained).abs().max():.2e}")
    print(f"merged vs unmerged:                max |logit diff| {(merged - unmerged).abs().max():.2e}")
    merged_model.save_pretrained(out / "merged")
    tokenizer.save_pretrained(out / "merged")
    return {
        "eval_loss_before": before,
        "eval_loss_after": after,
        "trained": trained,
        "unmerged": unmerged,
        "merged": merged,
        "merged_model": merged_model,
        "output_dir": out,
    }


if __name__ == "__main__":
    main()
