"""The command-line flags the examples share and the `TrainingArguments` they stand for (re-exported by
`ddl_hf.training`, where the examples import them from).

- `training_arguments`: `TrainingArguments` with CPU-friendly, offline, reproducible defaults.
- `add_base_arguments`: `--base` / `--cache-dir`, how every example picks its base GPT-2 (`training.base_gpt2`).
- `add_training_arguments`, `training_arguments_from`: `--steps`, `--batch-size`, `--lr`, ... with each example's
  defaults, and the `TrainingArguments` of those flags.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from transformers import TrainingArguments


def training_arguments(output_dir: str | os.PathLike, **overrides: Any) -> TrainingArguments:
    """TrainingArguments with CPU-friendly, offline, reproducible defaults (no reporting integrations)."""
    defaults: dict[str, Any] = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_steps=10,
        per_device_train_batch_size=8,
        per_device_eval_batch_size=16,
        learning_rate=5e-4,
        lr_scheduler_type="cosine",
        warmup_steps=0,
        weight_decay=0.01,
        dataloader_num_workers=0,
        seed=0,
        data_seed=0,
    )
    defaults.update(overrides)
    return TrainingArguments(**defaults)


def add_base_arguments(parser: argparse.ArgumentParser) -> None:
    """`--base` / `--cache-dir`, the way every example picks its base GPT-2."""
    parser.add_argument("--base", default=None, help="GPT-2 Hub id or directory (default: small cached GPT-2)")
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="cache of the small base GPT-2 (default $DDL_HF_CACHE, else $XDG_CACHE_HOME/ddl_hf, else ~/.cache/ddl_hf)",
    )


def add_training_arguments(
    parser: argparse.ArgumentParser,
    *,
    output_dir: str,
    lr: float,
    steps: int | None = None,
    batch_size: int | None = None,
    block_size: int | None = None,
    seed: int = 0,
) -> None:
    """The training flags the examples share, with each example's defaults: `--output-dir`, `--lr`, `--seed`, and
    `--steps`, `--batch-size`, `--block-size` for each default given (an example whose defaults depend on other flags
    adds its own). `training_arguments_from` turns them into `TrainingArguments`."""
    parser.add_argument("--output-dir", default=output_dir)
    sizes = {
        "--steps": (steps, "optimizer steps"),
        "--batch-size": (batch_size, "examples per step, per process"),
        "--block-size": (block_size, "tokens per training block (at most the model's context)"),
    }
    for flag, (default, text) in sizes.items():
        if default is not None:
            parser.add_argument(flag, type=int, default=default, help=text)
    parser.add_argument("--lr", type=float, default=lr, help="learning rate")
    parser.add_argument("--seed", type=int, default=seed)


def training_arguments_from(
    flags: argparse.Namespace, output_dir: str | os.PathLike | None = None, **overrides: Any
) -> TrainingArguments:
    """`training_arguments` for the flags of `add_training_arguments`: `--steps` steps of `--batch-size` at `--lr`,
    seeded by `--seed`, logging five times a run, in `<--output-dir>/trainer` unless `output_dir` is given."""
    fields: dict[str, Any] = dict(
        max_steps=flags.steps,
        per_device_train_batch_size=flags.batch_size,
        learning_rate=flags.lr,
        logging_steps=max(1, flags.steps // 5),
        seed=flags.seed,
    )
    output_dir = Path(flags.output_dir) / "trainer" if output_dir is None else output_dir
    return training_arguments(output_dir, **(fields | overrides))


__all__ = ["add_base_arguments", "add_training_arguments", "training_arguments", "training_arguments_from"]
