"""QLoRA on a Delta model: a 4-bit (nf4) base, LoRA adapters on the attention and MLP, the Delta blocks trained in full
precision beside them, with transformers' Trainer.

    python examples/qlora_finetune.py --output-dir outputs/qlora                 # the demo's small cached GPT-2
    python examples/qlora_finetune.py --base gpt2 --output-dir outputs/qlora     # any GPT-2 Hub id or directory
    python examples/qlora_finetune.py --delta path/to/converted                   # a DeltaGPT or DeltaLlama directory
    python examples/qlora_finetune.py --tiny                                      # seconds: a tiny random GPT-2

A GPT-2 base is converted to DeltaGPT and saved first (`--delta` takes a converted directory as it is). The saved model
is loaded through `from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...))`: the
attention and MLP Linears become bitsandbytes `Linear4bit` (`--bits 8`: `Linear8bitLt`), while the Delta modules (gate,
opening, value, read and convolution parameters) stay plain full-precision modules, because the models list them in
`_keep_in_fp32_modules` (docs/quantization.md). `peft.prepare_model_for_kbit_training` freezes the base and turns on
activation checkpointing; LoRA goes on the attention and MLP projections and the Delta blocks train in full through
`modules_to_save` (`--freeze-delta`: adapters only). The adapter is saved, reloaded onto a freshly quantized base and
checked against the trained model; a short greedy sample ends the run.

bitsandbytes runs on the CPU too (slowly); on a GPU the base loads on it and computes in bfloat16.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    GPT2LMHeadModel,
    PreTrainedModel,
    Trainer,
    default_data_collator,
    set_seed,
)

import ddl_hf
from ddl_hf.corpus import gpt2_tokenizer, lm_datasets
from ddl_hf.peft_targets import DELTA_NET_ATTENTION_TARGETS, LLAMA_PROJECTION_SUBLAYERS
from ddl_hf.training import (
    add_base_arguments,
    add_training_arguments,
    base_gpt2,
    random_gpt2,
    training_arguments_from,
)

DELTA_MODULES = ["attn_delta", "mlp_delta"]  # every Delta residual of both families


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_base_arguments(parser)
    parser.add_argument("--delta", default=None, help="an already converted DeltaGPT / DeltaLlama directory")
    parser.add_argument("--tiny", action="store_true", help="a tiny random GPT-2 (2 layers, width 64): a quick run")
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4)
    add_training_arguments(parser, output_dir="outputs/qlora", lr=2e-3)
    # The sizes' defaults depend on --tiny, so they are filled in after parsing.
    parser.add_argument("--steps", type=int, default=None, help="default 30 (--tiny: 8)")
    parser.add_argument("--batch-size", type=int, default=None, help="default 4 (--tiny: 2)")
    parser.add_argument("--block-size", type=int, default=None, help="default 128 (--tiny: 32)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--freeze-delta", action="store_true", help="train the LoRA adapters only")
    args = parser.parse_args(argv)
    if (args.base is not None) + (args.delta is not None) + args.tiny > 1:
        parser.error("pass at most one of --base, --delta and --tiny")
    defaults = dict(steps=8, batch_size=2, block_size=32) if args.tiny else dict(steps=30, batch_size=4, block_size=128)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def tiny_gpt2(seed: int) -> GPT2LMHeadModel:
    """A random 2-layer GPT-2 of width 64 with GPT-2's vocabulary. bitsandbytes' 4-bit CPU kernel for AVX512-BF16
    processors needs every quantized Linear's outputs to be a multiple of 32 and its inputs a multiple of 64 (the
    quantization block); width 32 fails there (docs/quantization.md)."""
    return random_gpt2(seed=seed, n_positions=128, n_embd=64, n_layer=2, n_head=2).eval()


def delta_base(args: argparse.Namespace, out: Path) -> Path:
    """The directory of the full-precision Delta model to quantize: `--delta`, or a GPT-2 converted and saved."""
    if args.delta is not None:
        model_type = AutoConfig.from_pretrained(args.delta).model_type
        if model_type not in ("delta_gpt", "delta_llama"):
            raise SystemExit(
                f"--delta {args.delta} is a {model_type!r} model, not a converted Delta model; convert it first "
                "(`ddl-hf convert`) or pass a GPT-2 as --base."
            )
        return Path(args.delta)
    if args.tiny:
        gpt2, tokenizer = tiny_gpt2(args.seed), gpt2_tokenizer()
    else:
        gpt2, tokenizer, _ = base_gpt2(args.base, cache_dir=args.cache_dir)
    directory = out / "base-delta"
    ddl_hf.convert_gpt2(gpt2).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def quantization_config(bits: int) -> BitsAndBytesConfig:
    """nf4 with double quantization (the QLoRA recipe), computing in bfloat16 on a GPU and float32 on the CPU."""
    if bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16 if torch.cuda.is_available() else torch.float32,
    )


def load_quantized(directory: Path, bits: int) -> PreTrainedModel:
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return AutoModelForCausalLM.from_pretrained(directory, quantization_config=quantization_config(bits), dtype=dtype)


def quantization_summary(model: PreTrainedModel) -> dict[str, list[str]]:
    """Module names by what they became: bitsandbytes layers, and the Linears of the Delta residuals (kept)."""
    quantized = [name for name, module in model.named_modules() if type(module).__module__.startswith("bitsandbytes")]
    kept = [
        f"{site}.{name}" if name else site
        for site, residual in model.delta_residuals().items()
        for name, module in residual.named_modules()
        if type(module) is torch.nn.Linear
    ]
    return {"quantized": quantized, "kept": kept}


def lora_targets(config) -> list[str]:
    """The attention and MLP projections, qualified by their sublayer so that no Delta module's own `v_proj` or
    `beta_proj` matches (peft matches a target by name suffix)."""
    if config.model_type == "delta_llama":
        return [f"{sublayer}.{name}" for name, sublayer in LLAMA_PROJECTION_SUBLAYERS.items()]
    if config.token_mixer == "delta_net":
        attention = [*DELTA_NET_ATTENTION_TARGETS, "attn.o_proj"]  # not `attn.b_proj`: DeltaNet's beta, kept
    else:
        attention = ["attn.c_attn", "attn.c_proj"]
    return [*attention, "mlp.c_fc", "mlp.c_proj"]


def qlora_model(model: PreTrainedModel, args: argparse.Namespace) -> PeftModel:
    """The quantized base ready to train: frozen, activation checkpointing on, LoRA adapters on the attention and MLP
    projections, and the Delta residuals as trainable full-precision copies (unless `--freeze-delta`)."""
    model = prepare_model_for_kbit_training(model, gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(
        r=args.rank,
        lora_alpha=2 * args.rank,
        lora_dropout=0.0,
        target_modules=lora_targets(model.config),
        modules_to_save=None if args.freeze_delta else DELTA_MODULES,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = Path(args.output_dir)
    set_seed(args.seed)
    base_dir = delta_base(args, out)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    model = load_quantized(base_dir, args.bits)
    summary = quantization_summary(model)
    residuals = model.delta_residuals().values()
    kept_dtypes = {str(p.dtype).removeprefix("torch.") for residual in residuals for p in residual.parameters()}
    print(
        f"{args.bits}-bit: {len(summary['quantized'])} attention/MLP Linears quantized, the {len(summary['kept'])} "
        f"Linears of the Delta residuals kept ({', '.join(sorted(kept_dtypes))})"
    )
    block_size = min(args.block_size, model.config.max_position_embeddings)
    data = lm_datasets(tokenizer, block_size, max_train_blocks=args.steps * args.batch_size, max_eval_blocks=8)

    def trainer_for(model: PreTrainedModel) -> Trainer:
        return Trainer(
            model=qlora_model(model, args),
            args=training_arguments_from(args, use_cpu=not torch.cuda.is_available()),
            train_dataset=data["train"],
            eval_dataset=data["eval"],
            data_collator=default_data_collator,
        )

    # The loss before training, on this load (LoRA starts as the identity); then training on a fresh load: on CPUs
    # with AVX512-BF16, bitsandbytes repacks 4-bit weights at the first inference call into a layout it cannot train.
    before = trainer_for(model).evaluate()["eval_loss"]
    trainer = trainer_for(load_quantized(base_dir, args.bits))
    model = trainer.model
    model.print_trainable_parameters()
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    trained_parts = "LoRA" if args.freeze_delta else "LoRA + Delta"
    print(f"eval loss {before:.4f} -> {after:.4f} ({args.bits}-bit base, {trained_parts})")
    # The adapter on a freshly quantized base computes what the trained model computes. The trained model's logits
    # come first: on CPUs with AVX512-BF16, saving a 4-bit model that has run inference re-quantizes its
    # double-quantized scales (bitsandbytes 0.50.2 unpacks its inference layout in place), which moves its logits.
    ids = torch.tensor(data["eval"]["input_ids"][:2], device=model.device)
    with torch.no_grad():
        trained = model.eval()(ids).logits
    model.save_pretrained(out / "adapter")
    with torch.no_grad():
        reloaded = PeftModel.from_pretrained(load_quantized(base_dir, args.bits), out / "adapter").eval()
        unmerged = reloaded(ids).logits
    reload_diff = float((unmerged - trained).abs().max())
    print(f"adapter reloaded onto a fresh {args.bits}-bit base: max |logit diff| {reload_diff:.2e}")

    prompt = tokenizer("It is a truth universally acknowledged", return_tensors="pt").to(model.device)
    with torch.no_grad():
        generated = reloaded.generate(**prompt, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    sample = tokenizer.decode(generated[0], skip_special_tokens=True)
    print(f"sample: {sample!r}")
    return {
        "eval_loss_before": before,
        "eval_loss_after": after,
        "quantized": summary["quantized"],
        "kept": summary["kept"],
        "reload_max_abs_diff": reload_diff,
        "sample": sample,
        "generated": generated,
        "model": model,
        "output_dir": out,
    }


if __name__ == "__main__":
    main()
