"""Sequence classification with DeltaGPTForSequenceClassification and Trainer: who wrote this paragraph?

    python examples/sequence_classification.py

A two-class task built from the bundled corpora (Austen's *Persuasion* vs Shakespeare), so it runs offline.
The pretrained GPT-2 is converted to DeltaGPT and saved once; `DeltaGPTForSequenceClassification.from_pretrained`
then adds a fresh classification head (`score`) on the last non-padding token, as GPT-2's class does.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from datasets import concatenate_datasets
from transformers import DataCollatorWithPadding, set_seed

import ddl_hf
from ddl_hf.corpus import load_text
from ddl_hf.training import (
    DeltaTrainer,
    add_base_arguments,
    add_training_arguments,
    base_gpt2,
    training_arguments_from,
)

LABELS = ["Austen", "Shakespeare"]


def author_dataset(tokenizer, per_class: int, max_length: int, seed: int = 0):
    """Paragraphs of at least 40 characters from each author, labelled, shuffled, tokenized; 80/20 split."""
    parts = []
    for label, corpus in enumerate(("austen-heldout", "shakespeare-eval")):
        text = load_text(corpus).filter(lambda row: len(row["text"]) >= 40)
        text = text.shuffle(seed=seed).select(range(min(per_class, len(text))))
        parts.append(text.map(lambda row, label=label: {"label": label}))
    data = concatenate_datasets(parts).shuffle(seed=seed)
    data = data.map(lambda b: tokenizer(b["text"], truncation=True, max_length=max_length), batched=True)
    return data.remove_columns(["text"]).train_test_split(test_size=0.2, seed=seed)


def accuracy(eval_pred) -> dict[str, float]:
    logits, labels = eval_pred
    return {"accuracy": float((np.argmax(logits, axis=-1) == labels).mean())}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_base_arguments(parser)
    add_training_arguments(parser, output_dir="outputs/sequence_classification", steps=60, batch_size=8, lr=1e-3)
    parser.add_argument("--per-class", type=int, default=200, help="paragraphs per author")
    parser.add_argument("--max-length", type=int, default=64, help="tokens per paragraph (truncated)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = Path(args.output_dir)
    set_seed(args.seed)
    gpt2, tokenizer, _ = base_gpt2(args.base, cache_dir=args.cache_dir)
    ddl_hf.convert_gpt2(gpt2).save_pretrained(out / "delta-gpt-lm")
    model = ddl_hf.DeltaGPTForSequenceClassification.from_pretrained(
        out / "delta-gpt-lm",
        num_labels=len(LABELS),
        id2label=dict(enumerate(LABELS)),
        label2id={name: i for i, name in enumerate(LABELS)},
        pad_token_id=tokenizer.pad_token_id,
    )
    data = author_dataset(tokenizer, args.per_class, min(args.max_length, model.config.n_positions), args.seed)
    trainer = DeltaTrainer(
        model=model,
        args=training_arguments_from(args),
        train_dataset=data["train"],
        eval_dataset=data["test"],
        data_collator=DataCollatorWithPadding(tokenizer),
        processing_class=tokenizer,
        compute_metrics=accuracy,
    )
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    print(
        f"author classification ({len(data['train'])} train / {len(data['test'])} test paragraphs): accuracy "
        f"{before['eval_accuracy']:.3f} -> {after['eval_accuracy']:.3f}, loss {before['eval_loss']:.3f} -> "
        f"{after['eval_loss']:.3f}"
    )
    trainer.save_model(str(out / "final"))
    return {"before": before, "after": after, "trainer": trainer, "data": data, "tokenizer": tokenizer}


if __name__ == "__main__":
    main()
