"""From scratch at equal budget: GPT-2 against DeltaGPT variants of the same shape, several seeds, paired statistics.

    python -m ddl_lab.studies.bench_pretrain --quick      # CI-sized check of the whole pipeline, a few minutes
    python -m ddl_lab.studies.bench_pretrain              # the CPU study (bundled corpus, ~1M-parameter models)
    python -m ddl_lab.studies.bench_pretrain --arch llama # the same on the reference code's backbone, vs DeltaLlama
    accelerate launch -m ddl_lab.studies.bench_pretrain --preset gpt2-small --dataset NAME_OR_PATH   # GPUs, 124M

Every variant is trained with `Trainer` (`DeltaTrainer` for DeltaGPT, Delta learning rate x1) on the same blocks in
the same order (`data_seed` = seed), with the same optimizer, schedule and number of steps; at each seed the weights
DeltaGPT shares with GPT-2 start from the very same values (the GPT-2 baseline's initial state dict is loaded into
the DeltaGPT before training), so a per-seed difference is a paired comparison. DeltaGPT's own parameters start as
the authors' reference code starts them from scratch (`delta_init="reference"`: beta = 1, averaging convolutions).

Data (CPU preset): a byte-level BPE trained on five Austen novels (the bundled public-domain corpus), validation on
a sixth novel, *Persuasion*, never seen in training (a split by book). The report gives the validation set's unigram
entropy, the loss of the best model that ignores context, so that "learned real structure" is a number.

Outputs `ddl_lab/studies/results/pretrain.{json,md,png}` (`--name` changes the stem): validation-loss curves with seed
bands; final validation loss mean +- std; each variant's paired difference to GPT-2 with a 95% t-interval, at equal
steps and at equal compute (each variant's measured train-step CPU time); and the share of validation tokens in each
beta regime (keep < 0.5, project 0.5-1.5, reflect > 1.5) per layer and sublayer of the trained models.

Runs are independent processes (one torch thread each, `--workers` at a time); each writes its own JSON under
`<cache>/pretrain/<preset key>/runs/`, so an interrupted study resumes where it stopped.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ddl_lab.common import REPO_ROOT, git_state, provenance, pyplot, save_figure, write_results

RESULTS = Path(__file__).resolve().parent / "results"
#: What a worker process runs (`python -m WORKER_MODULE ... --worker VARIANT SEED`); a study built on this one
#: points it at its own module so that its workers know its variants (`bench_pretrain_controls`).
WORKER_MODULE = "ddl_lab.studies.bench_pretrain"

#: name -> (label, Delta config fields; None = the baseline: transformers' GPT2LMHeadModel, or Qwen3ForCausalLM for
#: --arch llama). "{base}" in a label is the baseline's name (BASE_NAMES).
VARIANTS: dict[str, tuple[str, dict | None]] = {
    "gpt2": ("{base} (baseline)", None),
    "paper_dv1": ("paper d_v=1", dict(delta_mode="paper")),
    "additive_dv1": ("additive d_v=1", dict(delta_mode="additive")),
    "paper_dv4": ("paper d_v=4 linear read", dict(delta_mode="paper", delta_value_channels=4)),
    "paper_dv4_tc": (
        "paper d_v=4 TC",
        dict(delta_mode="paper", delta_value_channels=4, delta_state_read="temporal_conv"),
    ),
    "paper_dv4_cc": (
        "paper d_v=4 CC",
        dict(delta_mode="paper", delta_value_channels=4, delta_state_read="channel_conv"),
    ),
    "paper_dv1_write_only": ("paper d_v=1 write-only", dict(delta_mode="paper", delta_erase=False)),
    "delta_net": ("DeltaNet mixer (additive d_v=1)", dict(token_mixer="delta_net")),
    # Ablations: the two large gains come with a short causal convolution over tokens. The same convolution with the
    # Delta gate shut (beta = 0 exactly: GPT-2 whose sublayers read a convolved stream) or trainable, and DeltaNet
    # without its convolution, say how much of each gain is the convolution's.
    "gpt2_tc": ("{base} + TC read (gate shut, β ≡ 0)", dict(delta_mode="additive", delta_state_read="temporal_conv")),
    "additive_dv1_tc": ("additive d_v=1 TC", dict(delta_mode="additive", delta_state_read="temporal_conv")),
    "delta_net_noconv": ("DeltaNet mixer, no short conv", dict(token_mixer="delta_net", delta_net_conv_size=0)),
    # The same two with the convolutions starting as the identity (delta_init="exact": beta 0, so GPT-2 at step 0)
    # instead of the reference code's average over the window, which left the additive models above at the
    # unigram loss in this budget.
    "gpt2_tc_id": (
        "{base} + TC read, identity init (gate shut)",
        dict(delta_mode="additive", delta_state_read="temporal_conv", delta_init="exact"),
    ),
    "additive_dv1_tc_id": (
        "additive d_v=1 TC, identity init",
        dict(delta_mode="additive", delta_state_read="temporal_conv", delta_init="exact"),
    ),
    # The authors' own configurations (`DeltaGPTConfig.reference` / `DeltaLlamaConfig.reference`, their model files
    # at commit d1f7621): paper mode, v = 4 sigmoid(W_v r + b) from the raw read, their init, one read per block.
    "ref_dv1": ("reference d_v=1", dict(reference="dv1")),
    "ref_dv4_tc": ("reference d_v=4 TC", dict(reference="tc")),
    "ref_dv4_cc": ("reference d_v=4 CC", dict(reference="cc")),
}
BASELINE = "gpt2"  # the baseline of either arch (GPT-2, or the Llama-style backbone with --arch llama)
ARCHS = ("gpt2", "llama")
INITS = ("hf", "reference")
BASE_NAMES = {"gpt2": "GPT-2", "llama": "Llama-style"}


def label(variant: str, arch: str = "gpt2") -> str:
    return VARIANTS[variant][0].format(base=BASE_NAMES[arch])


#: Variants whose Delta gates are shut and frozen (rho = 0, so beta = 0 for every input).
GATE_SHUT = {"gpt2_tc", "gpt2_tc_id"}
#: Controls, not candidates: never picked as the best variant for the extra seeds.
ABLATIONS = {"gpt2_tc", "additive_dv1_tc", "delta_net_noconv", "gpt2_tc_id", "additive_dv1_tc_id"}
#: Paired differences reported besides those to the baseline: (variant, control) -> what the difference isolates.
CONTRASTS = {
    ("additive_dv1_tc", "gpt2_tc"): "the Delta term, same token convolution (additive d_v=1)",
    ("additive_dv1_tc_id", "gpt2_tc_id"): "the Delta term, same identity-initialised token convolution",
    ("gpt2_tc_id", "gpt2"): "a learnable token convolution added to {base} (identity init)",
    ("paper_dv4_tc", "gpt2_tc_id"): "the paper's d_v=4 TC model vs {base} with a learnable token convolution",
    ("paper_dv4_tc", "gpt2_tc"): "the paper's d_v=4 Delta residual vs {base}, both reading through a TC",
    ("paper_dv4_tc", "paper_dv4"): "the TC read inside the paper's d_v=4 residual",
    ("delta_net", "delta_net_noconv"): "DeltaNet's short convolution",
    ("ref_dv4_tc", "gpt2_tc_id"): "the authors' d_v=4 TC model vs {base} with a learnable token convolution",
}
KEEP_BELOW, REFLECT_ABOVE = 0.5, 1.5


@dataclasses.dataclass
class Preset:
    """Everything that fixes a study's numbers; its hash names the cache folder of its data and runs."""

    vocab_size: int = 512  # calibrated with dropout 0.1: 2048 ended 1.26 nats below the unigram entropy, 512 1.46
    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    block_size: int = 128
    batch_size: int = 8
    steps: int = 900
    learning_rate: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.1
    dropout: float = 0.0  # GPT-2's 0.1 only slows a study that sees each token < once: 3.60, 1.60 below (seed 0)
    eval_every: int = 50
    curve_eval_blocks: int = 48  # validation blocks for the curves (every eval_every steps)
    final_eval_blocks: int = 512  # validation blocks for the final loss and the beta regimes
    seeds: int = 3  # per variant
    extra_seeds: int = 2  # more for the baseline and the best variant
    train_corpus: str = "austen"
    eval_corpus: str = "austen-heldout"
    tokenizer: str = "bpe"  # "bpe": trained on the train corpus; "gpt2": GPT-2's own
    arch: str = "gpt2"  # "gpt2": GPT-2 vs DeltaGPT; "llama": the reference code's backbone vs DeltaLlama
    init: str = "hf"  # "hf": transformers' init of the backbone; "reference": the authors' (--arch llama)
    bf16: bool = False
    # Bump when the training code changes what a run computes. 2: from-scratch Delta parameters start with the
    # authors' init of commit d1f7621 (ddl-hf 0.2); recipe 1 was ddl-hf 0.1's (gate weight 0, v_proj N(0, 0.02)).
    recipe: int = 2

    def key(self) -> str:
        import hashlib

        # The number of seeds does not change what a run computes: asking for more reuses the runs already made.
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("seeds", "extra_seeds")}
        if fields["init"] == "hf":  # a field added after the first runs: absent at its default, as it was
            del fields["init"]
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:10]
        return f"L{self.n_layer}-D{self.n_embd}-V{self.vocab_size}-{self.steps}steps-{digest}"


PRESETS = {
    "cpu": Preset(),
    "quick": Preset(
        vocab_size=512,
        n_layer=2,
        n_embd=64,
        n_head=2,
        block_size=64,
        batch_size=8,
        steps=40,
        learning_rate=3e-3,
        warmup_steps=5,
        eval_every=20,
        curve_eval_blocks=16,
        final_eval_blocks=32,
        seeds=2,
        extra_seeds=0,
    ),
    # The paper's 124M shape, for GPUs (not run here): GPT-2's tokenizer, bf16, any `datasets` corpus (--dataset).
    "gpt2-small": Preset(
        vocab_size=50257,
        n_layer=12,
        n_embd=768,
        n_head=12,
        block_size=1024,
        batch_size=16,
        steps=20000,
        learning_rate=6e-4,
        warmup_steps=700,
        eval_every=500,
        curve_eval_blocks=64,
        final_eval_blocks=1024,
        tokenizer="gpt2",
        bf16=True,
    ),
}


# ---------------------------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------------------------


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else float("nan"))


def paired_difference(variant: Sequence[float], baseline: Sequence[float], level: float = 0.95) -> dict[str, float]:
    """Mean of the per-seed differences variant - baseline with its two-sided t confidence interval."""
    from scipy import stats

    diffs = [v - b for v, b in zip(variant, baseline, strict=True)]
    n = len(diffs)
    mean, std = mean_std(diffs)
    if n < 2:
        return {"n": n, "mean": mean, "std": std, "ci_low": float("nan"), "ci_high": float("nan"), "p": float("nan")}
    half = stats.t.ppf(0.5 + level / 2, n - 1) * std / math.sqrt(n)
    p = float(stats.ttest_rel(variant, baseline).pvalue) if std > 0 else float("nan")
    return {"n": n, "mean": mean, "std": std, "ci_low": mean - half, "ci_high": mean + half, "p": p}


def loss_at_step(curve: Sequence[tuple[int, float]], step: float) -> float:
    """The validation curve (step, loss) linearly interpolated at `step` (clamped to the measured range)."""
    steps, losses = [s for s, _ in curve], [v for _, v in curve]
    if step <= steps[0]:
        return losses[0]
    for (s0, l0), (s1, l1) in itertools.pairwise(curve):
        if step <= s1:
            return l0 + (l1 - l0) * (step - s0) / (s1 - s0)
    return losses[-1]


def unigram_entropy(token_ids: Sequence[Sequence[int]]) -> float:
    """Entropy (nats) of the token distribution of `token_ids`: the loss of the best context-free predictor."""
    from collections import Counter

    counts = Counter(t for row in token_ids for t in row)
    total = sum(counts.values())
    return -sum(c / total * math.log(c / total) for c in counts.values())


# ---------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------


def cache_root(args: argparse.Namespace, preset: Preset) -> Path:
    from ddl_hf.training import default_cache_dir

    base = Path(args.cache_dir) if args.cache_dir else default_cache_dir() / "pretrain"
    return base / (args.preset + "-" + preset.key() + (f"-{_dataset_tag(args)}" if args.dataset else ""))


def _dataset_tag(args: argparse.Namespace) -> str:
    import hashlib

    return hashlib.sha256(f"{args.dataset}|{args.dataset_config}|{args.text_column}".encode()).hexdigest()[:8]


def build_tokenizer(preset: Preset, train_text, folder: Path):
    """GPT-2's tokenizer, or a byte-level BPE of `preset.vocab_size` trained on the training text (cached)."""
    from transformers import PreTrainedTokenizerFast

    from ddl_hf.corpus import gpt2_tokenizer

    if preset.tokenizer == "gpt2":
        return gpt2_tokenizer()
    path = folder / "tokenizer"
    if not (path / "tokenizer.json").exists():
        from tokenizers import ByteLevelBPETokenizer

        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator(
            (row["text"] for row in train_text),
            vocab_size=preset.vocab_size,
            min_frequency=2,
            special_tokens=["<|endoftext|>"],
            show_progress=False,
        )
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=bpe._tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
        )
        tokenizer.model_max_length = preset.block_size
        tokenizer.save_pretrained(path)
    return PreTrainedTokenizerFast.from_pretrained(path)


def load_texts(args: argparse.Namespace, preset: Preset):
    """(train, validation) `datasets` text datasets: the bundled books, or `--dataset` (a Hub name or a path)."""
    from ddl_hf.corpus import load_text

    if not args.dataset:
        return load_text(preset.train_corpus), load_text(preset.eval_corpus)
    from datasets import load_dataset

    data = load_dataset(args.dataset, args.dataset_config)
    train = data["train"]
    valid = data.get("validation")
    if valid is None:  # a held-out tail of the training split
        parts = train.train_test_split(test_size=0.01, seed=0, shuffle=False)
        train, valid = parts["train"], parts["test"]
    if args.text_column != "text":
        train, valid = (d.rename_column(args.text_column, "text") for d in (train, valid))
    return train, valid


def prepare_data(args: argparse.Namespace, preset: Preset) -> dict[str, Any]:
    """Tokenizer, train blocks, validation blocks (saved with `datasets`, reused by every run) and their stats."""
    from datasets import load_from_disk

    from ddl_hf.corpus import tokenize_and_chunk

    folder = cache_root(args, preset)
    data_dir = folder / "data"
    if not (data_dir / "stats.json").exists():
        train_text, valid_text = load_texts(args, preset)
        tokenizer = build_tokenizer(preset, train_text, folder)
        train = tokenize_and_chunk(train_text, tokenizer, preset.block_size)
        valid = tokenize_and_chunk(valid_text, tokenizer, preset.block_size)
        valid = valid.select(range(min(len(valid), preset.final_eval_blocks)))
        stats = {
            "vocab_size": len(tokenizer),
            "train_blocks": len(train),
            "train_tokens": len(train) * preset.block_size,
            "valid_blocks": len(valid),
            "valid_tokens": len(valid) * preset.block_size,
            "valid_unigram_entropy": unigram_entropy(valid["input_ids"]),
            "epochs": preset.steps * preset.batch_size / max(len(train), 1),
        }
        train.save_to_disk(str(data_dir / "train"))
        valid.save_to_disk(str(data_dir / "valid"))
        (data_dir / "stats.json").write_text(json.dumps(stats, indent=2))
    return {
        "folder": folder,
        "tokenizer": build_tokenizer(preset, None, folder),
        "train": load_from_disk(str(data_dir / "train")),
        "valid": load_from_disk(str(data_dir / "valid")),
        "stats": json.loads((data_dir / "stats.json").read_text()),
    }


# ---------------------------------------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------------------------------------


def build_models(preset: Preset, vocab_size: int, variant: str, seed: int):
    """The baseline at `seed`, and the run's model: that baseline, or its Delta version starting from its weights.

    `arch="gpt2"`: GPT2LMHeadModel and DeltaGPT. `arch="llama"`: the reference code's backbone (RoPE, RMSNorm,
    SwiGLU, QK-norm: transformers' Qwen3 layer, tied embeddings, no biases) and DeltaLlama over it.
    """
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen3Config, Qwen3ForCausalLM

    import ddl_hf
    from ddl_lab.builders import gpt2_dropout

    ids = dict(vocab_size=vocab_size, bos_token_id=0, eos_token_id=0, pad_token_id=None)
    if preset.arch == "gpt2":
        shape = dict(
            n_positions=preset.block_size,
            n_embd=preset.n_embd,
            n_layer=preset.n_layer,
            n_head=preset.n_head,
            **gpt2_dropout(preset.dropout),
            **ids,
        )
        baseline_class, baseline_config = GPT2LMHeadModel, GPT2Config(**shape)
        delta_class, delta_config = ddl_hf.DeltaGPTForCausalLM, ddl_hf.DeltaGPTConfig
    else:
        reference = preset.init == "reference"  # the authors' SwiGLU width, RMSNorm epsilon and RoPE base
        shape = dict(
            hidden_size=preset.n_embd,
            # SwiGLU at GPT-2's MLP parameter count: theirs floor(8d/3), else rounded to a multiple of 64
            intermediate_size=8 * preset.n_embd // 3 if reference else 64 * round(8 * preset.n_embd / 3 / 64),
            num_hidden_layers=preset.n_layer,
            num_attention_heads=preset.n_head,
            num_key_value_heads=preset.n_head,
            head_dim=preset.n_embd // preset.n_head,
            max_position_embeddings=preset.block_size,
            attention_dropout=preset.dropout,
            tie_word_embeddings=True,
            **(
                dict(rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
                if reference
                else {}
            ),
            **ids,
        )
        baseline_class, baseline_config = Qwen3ForCausalLM, Qwen3Config(**shape)
        delta_class = ddl_hf.DeltaLlamaForCausalLM
        delta_config = functools.partial(ddl_hf.DeltaLlamaConfig, source_model_type="qwen3")
    torch.manual_seed(seed)
    baseline = baseline_class(baseline_config)
    if preset.init == "reference":  # the authors' backbone init; the Delta models share it (loaded below)
        ddl_hf.init_reference_backbone(baseline)
    overrides = VARIANTS[variant][1]
    if overrides is None:
        return baseline
    torch.manual_seed(seed + 10_000)  # the Delta parameters' own draws, the same for every variant at this seed
    if "reference" in overrides:  # the preset's own fields, the run's shape
        make_config = getattr(delta_config, "func", delta_config).reference
        model = delta_class(make_config(overrides["reference"], **(getattr(delta_config, "keywords", {}) | shape)))
    else:
        model = delta_class(delta_config(**shape, **overrides))
    missing, unexpected = model.load_state_dict(baseline.state_dict(), strict=False)
    delta_only = set(missing) <= set(model.delta_parameters()) | {
        n for n in missing if ".attn." in n and overrides.get("token_mixer") == "delta_net"
    }
    mixer_keys = all(".attn." in n for n in unexpected) and overrides.get("token_mixer") == "delta_net"
    if not delta_only or (unexpected and not mixer_keys):
        raise RuntimeError(f"{variant}: baseline weights do not map onto its Delta model: {missing=} {unexpected=}")
    if variant in GATE_SHUT:
        for block in model.delta_residuals().values():
            block.beta_open.data.zero_()
            block.beta_open.requires_grad_(False)
    return model


class StepTimer:
    """Trainer callback: process CPU seconds spent in training steps (not in evaluation), and their count."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        class _Callback(TrainerCallback):
            def on_step_begin(cb, args, state, control, **kwargs):
                self._start = time.process_time()

            def on_step_end(cb, args, state, control, **kwargs):
                self.seconds += time.process_time() - self._start
                self.steps += 1

        self.callback = _Callback()
        self.seconds, self.steps, self._start = 0.0, 0, 0.0


def beta_regimes(model, valid, batch_size: int) -> dict[str, dict[str, float]]:
    """Share of validation tokens with beta < 0.5 (keep), 0.5-1.5 (project), > 1.5 (reflect), per Delta residual."""
    import torch

    labels = list(model.delta_residuals(short_names=True))
    counts = {label: torch.zeros(3, dtype=torch.float64) for label in labels}
    sums = dict.fromkeys(labels, 0.0)
    ids = torch.tensor(valid["input_ids"])
    model.eval()
    with torch.no_grad():
        for start in range(0, len(ids), batch_size):
            betas = model(ids[start : start + batch_size], output_betas=True).betas
            for label, beta in zip(labels, betas, strict=True):
                beta = beta.double()
                keep, reflect = (beta < KEEP_BELOW).sum(), (beta > REFLECT_ABOVE).sum()
                counts[label] += torch.stack([keep, beta.numel() - keep - reflect, reflect])
                sums[label] += float(beta.sum())
    out = {}
    for label in labels:
        total = float(counts[label].sum())
        keep, project, reflect = (float(c) / total for c in counts[label])
        out[label] = {"keep": keep, "project": project, "reflect": reflect, "mean": sums[label] / total}
    return out


def train_one(args: argparse.Namespace, preset: Preset, variant: str, seed: int) -> dict[str, Any]:
    """Train one (variant, seed); return its curves, final validation loss, step cost and beta regimes."""
    import tempfile

    import torch
    from transformers import Trainer, default_data_collator

    from ddl_hf.training import DeltaTrainer, training_arguments, use_causal_lm_loss_accounting

    code = git_state()  # the code this run imports (a cached run is reused by later commits)
    data = prepare_data(args, preset)
    model = use_causal_lm_loss_accounting(build_models(preset, data["stats"]["vocab_size"], variant, seed))
    curve_set = data["valid"].select(range(min(preset.curve_eval_blocks, len(data["valid"]))))
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as tmp:
        training = training_arguments(
            tmp,
            max_steps=preset.steps,
            per_device_train_batch_size=preset.batch_size,
            per_device_eval_batch_size=32,
            learning_rate=preset.learning_rate,
            warmup_steps=preset.warmup_steps,
            weight_decay=preset.weight_decay,
            lr_scheduler_type="cosine",
            eval_strategy="steps",
            eval_steps=preset.eval_every,
            logging_steps=preset.eval_every,
            seed=seed,
            data_seed=seed,
            disable_tqdm=True,
            bf16=preset.bf16,
            use_cpu=not torch.cuda.is_available(),
        )
        kwargs = dict(
            model=model,
            args=training,
            train_dataset=data["train"],
            eval_dataset=curve_set,
            data_collator=default_data_collator,
            callbacks=[timer.callback],
        )
        trainer = Trainer(**kwargs) if VARIANTS[variant][1] is None else DeltaTrainer(**kwargs)
        start = trainer.evaluate()["eval_loss"]
        trainer.train()
        history = list(trainer.state.log_history)  # the curve; the final evaluation below uses the whole set
        final = trainer.evaluate(eval_dataset=data["valid"])["eval_loss"]
    curve = {0: start} | {e["step"]: e["eval_loss"] for e in history if "eval_loss" in e and e["step"] > 0}
    result = {
        "variant": variant,
        "seed": seed,
        "params": sum(p.numel() for p in model.parameters()),
        "curve": sorted(curve.items()),
        "train_loss": [(e["step"], e["loss"]) for e in history if "loss" in e],
        "final_valid_loss": final,
        "step_cpu_seconds": timer.seconds / max(timer.steps, 1),
        "steps": timer.steps,
        "code": code,
    }
    if VARIANTS[variant][1] is not None:
        result["beta_regimes"] = beta_regimes(model, data["valid"], 32)
    else:  # the trained baselines are the bases of the fine-tuning study (bench_finetune.py)
        model.save_pretrained(run_path(data["folder"], variant, seed).with_suffix(""))
        data["tokenizer"].save_pretrained(run_path(data["folder"], variant, seed).with_suffix(""))
    return result


# ---------------------------------------------------------------------------------------------------------------
# The study: runs in worker processes, then the report
# ---------------------------------------------------------------------------------------------------------------


def run_path(folder: Path, variant: str, seed: int) -> Path:
    return folder / "runs" / f"{variant}-seed{seed}.json"


def launch(jobs: list[tuple[list[str], Path, str, int]], workers: int, threads: int) -> None:
    """Run the missing jobs `(worker arguments, study folder, variant, seed)`, `workers` processes at a time with
    `threads` torch threads each, in the order given. A run is written only once complete (`main`), so a killed
    study redoes the runs it was in and never counts half of one."""
    from tqdm.auto import tqdm

    jobs = [job for job in jobs if not run_path(job[1], job[2], job[3]).exists()]
    if not jobs:
        return
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))  # ddl_lab, from anywhere

    def run(job: tuple[list[str], Path, str, int]) -> tuple[str, int, Path]:
        forward, folder, variant, seed = job
        log = folder / "logs" / f"{variant}-seed{seed}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", WORKER_MODULE, *forward, "--worker", variant, str(seed)]
        with open(log, "w") as out:
            code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
        return f"{folder.name}: {variant} seed {seed}", code, log

    failures = []
    with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
        bar = tqdm(total=len(jobs), desc="pretrain runs", unit="run")
        for name, code, log in pool.map(run, jobs):
            bar.update()
            bar.set_postfix_str(name + ("" if code == 0 else f" FAILED ({code})"))
            if code:
                failures.append(f"{name} (log: {log})")
        bar.close()
    if failures:
        raise SystemExit("bench_pretrain: runs failed: " + "; ".join(failures))


def load_runs(folder: Path) -> dict[str, dict[int, dict]]:
    """{variant: {seed: run}} of the finished runs, variants in `VARIANTS` order, seeds ascending."""
    runs: dict[str, dict[int, dict]] = {}
    for path in (folder / "runs").glob("*.json"):
        run = json.loads(path.read_text())
        runs.setdefault(run["variant"], {})[run["seed"]] = run
    return {v: dict(sorted(runs[v].items())) for v in VARIANTS if v in runs}


def analyse(runs: dict[str, dict[int, dict]], stats: dict, arch: str = "gpt2") -> dict[str, Any]:
    """Per variant: final loss mean/std, paired differences to the baseline at equal steps and equal compute."""
    base = runs[BASELINE]
    base_cost = statistics.median(r["step_cpu_seconds"] for r in base.values())
    table = {}
    for variant, by_seed in runs.items():
        seeds = sorted(by_seed)
        finals = [by_seed[s]["final_valid_loss"] for s in seeds]
        cost = statistics.median(by_seed[s]["step_cpu_seconds"] for s in seeds)
        row: dict[str, Any] = {
            "label": label(variant, arch),
            "seeds": seeds,
            "params": by_seed[seeds[0]]["params"],
            "final": dict(zip(("mean", "std"), mean_std(finals))),
            "step_cpu_seconds": cost,
            "cost_ratio": cost / base_cost,
        }
        if variant != BASELINE:
            paired = [s for s in seeds if s in base]
            row["equal_steps"] = paired_difference(
                [by_seed[s]["final_valid_loss"] for s in paired], [base[s]["final_valid_loss"] for s in paired]
            )
            # Equal compute: the variant's curve at the step where it has used the baseline's training CPU time,
            # against the baseline's curve at its last step (both on the curve subset of the validation set).
            steps = by_seed[paired[0]]["curve"][-1][0]
            at = steps * min(1.0, 1.0 / row["cost_ratio"])
            row["equal_compute_step"] = at
            row["equal_compute"] = paired_difference(
                [loss_at_step(by_seed[s]["curve"], at) for s in paired],
                [loss_at_step(base[s]["curve"], steps) for s in paired],
            )
            regimes = [by_seed[s]["beta_regimes"] for s in seeds]
            row["beta_regimes"] = {
                label: {k: statistics.fmean(r[label][k] for r in regimes) for k in regimes[0][label]}
                for label in regimes[0]
            }
        table[variant] = row
    contrasts = {}
    for (variant, control), meaning in CONTRASTS.items():
        paired = sorted(set(runs.get(variant, {})) & set(runs.get(control, {})))
        if len(paired) >= 2:  # a t-interval needs two pairs
            contrasts[f"{variant} - {control}"] = {
                "meaning": meaning.format(base=BASE_NAMES[arch]),
                "seeds": paired,
                "equal_steps": paired_difference(
                    [runs[variant][s]["final_valid_loss"] for s in paired],
                    [runs[control][s]["final_valid_loss"] for s in paired],
                ),
            }
    return {"variants": table, "contrasts": contrasts, "data": stats}


def fmt_ci(d: dict, digits: int = 4) -> str:
    """`mean [ci_low, ci_high]` of a difference (`paired_difference`, or a study's trend); the mean alone where there
    is no interval, with `n` where the difference has one."""
    mean = f"{d['mean']:+.{digits}f}"
    if d.get("n", 2) < 2:
        return f"{mean} (n={d['n']})"
    if math.isnan(d["ci_low"]):
        return mean
    return f"{mean} [{d['ci_low']:+.{digits}f}, {d['ci_high']:+.{digits}f}]"


#: What `verdict` says where the interval lies below 0, above 0, or spans it.
VERDICTS = ("better (CI below 0)", "worse (CI above 0)", "within noise (CI spans 0)")


def verdict(d: dict, words: tuple[str, str, str] = VERDICTS) -> str:
    """Where a difference's 95% interval lies, in `words` (below 0, above 0, spanning 0); "n too small" without one."""
    if d.get("n", 2) < 2 or math.isnan(d["ci_low"]):
        return "n too small"
    below, above, spans = words
    return below if d["ci_high"] < 0 else above if d["ci_low"] > 0 else spans


def markdown(results: dict) -> str:
    analysis, preset, stats = results["analysis"], results["preset"], results["analysis"]["data"]
    rows = analysis["variants"]
    base, name = rows[BASELINE], BASE_NAMES[preset.get("arch", "gpt2")]
    delta_name = "DeltaGPT" if preset.get("arch", "gpt2") == "gpt2" else "DeltaLlama"
    lines = [
        f"# From scratch: {name} vs {delta_name} at equal budget",
        "",
    ]
    if results["runs_done"] < results["runs_planned"]:
        lines += [
            f"**Partial results: {results['runs_done']} of {results['runs_planned']} planned runs** (the study "
            "resumes where it stopped; rows with fewer seeds have wider intervals).",
            "",
        ]
    lines += [
        f"Shape: {preset['n_layer']} layers, d = {preset['n_embd']}, {preset['n_head']} heads, context "
        f"{preset['block_size']}, vocabulary {stats['vocab_size']} ({preset['tokenizer']}); {preset['steps']} steps of "
        f"{preset['batch_size']} x {preset['block_size']} tokens ({stats['epochs']:.2f} epochs of "
        f"{stats['train_tokens']:,} training tokens), AdamW lr {preset['learning_rate']:g}, cosine, "
        f"{preset['warmup_steps']} warm-up steps, weight decay {preset['weight_decay']:g}.",
        f"Validation: {stats['valid_tokens']:,} tokens of a held-out book; its unigram entropy is "
        f"**{stats['valid_unigram_entropy']:.3f} nats** (the loss of the best context-free predictor). {name} ends at "
        f"{base['final']['mean']:.3f}, {abs(stats['valid_unigram_entropy'] - base['final']['mean']):.2f} nats "
        f"{'below' if base['final']['mean'] < stats['valid_unigram_entropy'] else 'above'} it "
        f"(the study's target was at least 1.5 nats below: "
        f"{'met' if stats['valid_unigram_entropy'] - base['final']['mean'] >= 1.5 else 'missed'}).",
        "",
        f"Differences are variant − {name} per seed (same data order, same initial shared weights), mean and 95% "
        f"t-interval; negative = lower validation loss than {name}. *Equal compute*: the variant's validation curve "
        f"at the step where it has spent {name}'s training CPU time (its measured step cost), against {name} at the "
        "end, "
        f"both on the curves' {preset['curve_eval_blocks']} validation blocks; "
        "a slower variant is then compared before its learning-rate schedule has finished, which is conservative.",
        "",
        "| variant | seeds | params | final valid loss | Δ equal steps [95% CI] | | step cost | Δ equal compute "
        "[95% CI] | |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for variant, row in rows.items():
        final = f"{row['final']['mean']:.4f} ± {row['final']['std']:.4f}"
        if variant == BASELINE:
            lines.append(f"| {row['label']} | {len(row['seeds'])} | {row['params']:,} | {final} | | | 1.00 | | |")
            continue
        eq, ec = row["equal_steps"], row["equal_compute"]
        lines.append(
            f"| {row['label']} | {len(row['seeds'])} | {row['params']:,} | {final} | {fmt_ci(eq)} | {verdict(eq)} | "
            f"{row['cost_ratio']:.2f} | {fmt_ci(ec)} | {verdict(ec)} |"
        )
    if analysis.get("contrasts"):
        lines += [
            "",
            "## Ablations: paired contrasts between variants",
            "",
            "Variant − control per seed, final validation loss, mean and 95% t-interval; negative = the variant is "
            "better.",
            "",
            "| contrast | isolates | seeds | Δ [95% CI] | |",
            "|---|---|---|---|---|",
        ]
        for name, c in analysis["contrasts"].items():
            variant, control = name.split(" - ")
            label = f"{rows[variant]['label']} − {rows[control]['label']}"
            eq = c["equal_steps"]
            lines.append(f"| {label} | {c['meaning']} | {len(c['seeds'])} | {fmt_ci(eq)} | {verdict(eq)} |")
    lines += [
        "",
        "## Beta regimes of the trained models",
        "",
        "Share of validation tokens with β < 0.5 (keep), 0.5–1.5 (project), > 1.5 (reflect), mean β; per Delta "
        "residual (L = layer), averaged over seeds.",
        "",
    ]
    for row in rows.values():
        if "beta_regimes" not in row:
            continue
        lines += [
            f"**{row['label']}**",
            "",
            "| residual | keep | project | reflect | mean β |",
            "|---|---|---|---|---|",
        ]
        for label, r in row["beta_regimes"].items():
            lines.append(f"| {label} | {r['keep']:.3f} | {r['project']:.3f} | {r['reflect']:.3f} | {r['mean']:.3f} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def plot(results: dict, runs: dict[str, dict[int, dict]], path: Path) -> None:
    plt = pyplot()
    import numpy as np

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8))
    rows, base = results["analysis"]["variants"], BASE_NAMES[results["preset"].get("arch", "gpt2")]
    for variant, by_seed in runs.items():
        curves = [by_seed[s]["curve"] for s in sorted(by_seed)]
        steps = np.array([s for s, _ in curves[0]])
        losses = np.array([[v for _, v in c] for c in curves])
        mean, std = losses.mean(0), losses.std(0)
        style = (
            dict(lw=2.2, color="black")
            if variant == BASELINE
            else dict(lw=1.2, ls="--" if variant in ABLATIONS else "-")
        )
        (line,) = ax.plot(steps, mean, label=rows[variant]["label"], **style)
        ax.fill_between(steps, mean - std, mean + std, color=line.get_color(), alpha=0.15)
    ax.set(xlabel="step", ylabel="validation loss (nats/token)", title="Validation loss (mean ± std over seeds)")
    ax.set_ylim(top=min(ax.get_ylim()[1], results["analysis"]["data"]["valid_unigram_entropy"] + 0.5))
    ax.axhline(results["analysis"]["data"]["valid_unigram_entropy"], ls=":", color="gray", label="unigram entropy")
    ax.legend(fontsize=7)
    names = [v for v in rows if v != BASELINE]
    for i, key in enumerate(("equal_steps", "equal_compute")):
        means = [rows[v][key]["mean"] for v in names]
        lows = [rows[v][key]["mean"] - rows[v][key]["ci_low"] for v in names]
        highs = [rows[v][key]["ci_high"] - rows[v][key]["mean"] for v in names]
        y = np.arange(len(names)) + (0.18 if i else -0.18)
        bx.errorbar(means, y, xerr=[lows, highs], fmt="o", capsize=3, label=key.replace("_", " "))
    bx.axvline(0, color="black", lw=0.8)
    bx.set_yticks(np.arange(len(names)), [rows[v]["label"] for v in names], fontsize=8)
    bx.set(xlabel=f"Δ validation loss vs {base} (95% CI)", title=f"Paired difference to {base}")
    bx.legend(fontsize=8)
    save_figure(fig, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--quick", action="store_true", help="same as --preset quick (CI-sized)")
    parser.add_argument(
        "--arch",
        choices=ARCHS,
        default=None,
        help="gpt2: GPT-2 vs DeltaGPT (default); llama: the reference code's backbone (RoPE, RMSNorm, SwiGLU, "
        "QK-norm) vs DeltaLlama",
    )
    parser.add_argument(
        "--init",
        choices=INITS,
        default=None,
        help="the backbone's init: hf (transformers', default) or reference (the authors', --arch llama only)",
    )
    parser.add_argument(
        "--variants", nargs="+", choices=list(VARIANTS), default=None, help="default: every one the arch supports"
    )
    parser.add_argument("--seeds", type=int, default=None, help="seeds per variant (default: the preset's)")
    parser.add_argument("--extra-seeds", type=int, default=None, help="more seeds for GPT-2 and the best variant")
    parser.add_argument("--steps", type=int, default=None, help="override the preset's steps")
    parser.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="FIELD=VALUE",
        help="override any Preset field, e.g. --set vocab_size=1024 learning_rate=3e-3",
    )
    parser.add_argument("--workers", type=int, default=2, help="runs at a time (0: in this process, e.g. GPUs)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--dataset", default=None, help="a `datasets` name or path instead of the bundled books")
    parser.add_argument("--dataset-config", default=None)
    parser.add_argument("--text-column", default="text")
    parser.add_argument("--cache-dir", default=None, help="default: $DDL_HF_CACHE or ~/.cache/ddl_hf, /pretrain")
    parser.add_argument("--output-dir", default=str(RESULTS))
    parser.add_argument("--name", default=None, help="stem of the result files (default pretrain / pretrain_quick)")
    parser.add_argument(
        "--report-only", action="store_true", help="write the report from the runs finished so far; train nothing"
    )
    parser.add_argument("--worker", nargs=2, metavar=("VARIANT", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.preset = "quick"
    if args.variants is not None and BASELINE not in args.variants:
        parser.error(f"--variants must include the baseline {BASELINE!r}: every comparison is paired with it")
    # What a worker process needs to rebuild the same preset (everything but the worker/report options).
    raw = list(sys.argv[1:] if argv is None else argv)
    if "--worker" in raw:
        raw = raw[: raw.index("--worker")] + raw[raw.index("--worker") + 3 :]
    args.forward = raw
    return args


def resolve_preset(args: argparse.Namespace) -> Preset:
    preset = dataclasses.replace(PRESETS[args.preset])
    for field in ("seeds", "extra_seeds", "steps", "arch", "init"):
        if getattr(args, field) is not None:
            setattr(preset, field, getattr(args, field))
    types = {f.name: f.type for f in dataclasses.fields(Preset)}
    for item in args.set:
        field, _, value = item.partition("=")
        if field not in types or not value:
            raise SystemExit(f"bench_pretrain: --set {item!r}: expected FIELD=VALUE with FIELD one of {sorted(types)}")
        kind = {"int": int, "float": float, "str": str, "bool": lambda v: v.lower() in ("1", "true", "yes")}[
            types[field]
        ]
        setattr(preset, field, kind(value))
    if preset.arch not in ARCHS:
        raise SystemExit(f"bench_pretrain: arch {preset.arch!r}: expected one of {ARCHS}")
    if preset.init not in INITS or (preset.init == "reference" and preset.arch != "llama"):
        raise SystemExit(
            f"bench_pretrain: init {preset.init!r}: expected one of {INITS}; 'reference' (the authors' backbone "
            "init) needs --arch llama"
        )
    supported = [v for v in VARIANTS if preset.arch == "gpt2" or "token_mixer" not in (VARIANTS[v][1] or {})]
    if args.variants is None:
        args.variants = supported
    elif set(args.variants) - set(supported):
        raise SystemExit(
            f"bench_pretrain: --arch {preset.arch} has no DeltaNet token mixer; drop "
            f"{sorted(set(args.variants) - set(supported))} from --variants"
        )
    return preset


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    preset = resolve_preset(args)
    import torch

    torch.set_num_threads(args.threads)
    if args.worker:
        variant, seed = args.worker[0], int(args.worker[1])
        result = train_one(args, preset, variant, seed)
        path = run_path(cache_root(args, preset), variant, seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, path)  # a run exists only once it is complete
        return result

    prov = provenance(None if argv is None else [__file__, *argv])
    started = time.time()
    data = prepare_data(args, preset)  # once, before the workers (they reuse it)
    folder = data["folder"]
    first = [(v, s) for s in range(preset.seeds) for v in args.variants]

    def run_all(jobs):
        if args.workers == 0:
            for variant, seed in jobs:
                if not run_path(folder, variant, seed).exists():
                    main([*args.forward, "--worker", variant, str(seed)])
        else:
            launch([(args.forward, folder, v, s) for v, s in jobs], args.workers, args.threads)

    if not args.report_only:
        run_all(first)
    runs = {v: r for v, r in load_runs(folder).items() if v in args.variants}
    best = None
    if preset.extra_seeds:  # the best by the first seeds only, so that a resumed study picks the same one
        means = {
            v: statistics.fmean(r["final_valid_loss"] for s, r in runs[v].items() if s < preset.seeds)
            for v in runs
            if v != BASELINE and v not in ABLATIONS
        }
        best = min(means, key=means.get) if means else None
        extra = [(v, s) for s in range(preset.seeds, preset.seeds + preset.extra_seeds) for v in (BASELINE, best) if v]
        if not args.report_only:
            run_all(extra)
        runs = {v: r for v, r in load_runs(folder).items() if v in args.variants}
    for variant, by_seed in runs.items():  # only the seeds this study asked for
        wanted = preset.seeds + (preset.extra_seeds if variant in (BASELINE, best) else 0)
        runs[variant] = {s: r for s, r in by_seed.items() if s < wanted}
    planned = len(args.variants) * preset.seeds + (2 * preset.extra_seeds if best else 0)
    done = sum(len(by_seed) for by_seed in runs.values())

    results = {
        "provenance": prov,
        "preset_name": args.preset,
        "preset": dataclasses.asdict(preset),
        "best_variant": best,
        "runs_done": done,
        "runs_planned": planned,
        "wall_seconds": time.time() - started,
        "analysis": analyse(runs, data["stats"], preset.arch),
        "runs": runs,
    }
    name = args.name or (
        "pretrain_quick" if args.preset == "quick" else f"pretrain{'' if args.preset == 'cpu' else '_' + args.preset}"
    )
    out = Path(args.output_dir)
    write_results(out, name, results, markdown(results))
    plot(results, runs, out / f"{name}.png")
    print(markdown(results))
    return results


if __name__ == "__main__":
    main()
