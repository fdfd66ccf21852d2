"""Trainer helpers shared by the demo, the examples and the benchmark.

- `DeltaTrainer`: a `transformers.Trainer` that can give the Delta parameters their own learning rate (the gates
  start exactly closed, so with the base model's small fine-tuning learning rate they barely move).
- `base_gpt2`: the base GPT-2 of the demo: a Hub id / directory when given, else a small GPT-2 pretrained here on
  the bundled public-domain corpus and cached, so that everything works offline; `random_gpt2`, the freshly
  initialised GPT-2 that pretraining (and a quick tiny run) starts from.
- `finetune`: one causal-LM fine-tuning run with eval perplexity before and after.
- `training_arguments`, `add_base_arguments`, `add_training_arguments`, `training_arguments_from` (from
  `training_args.py`): the flags every example shares (`--base`, `--steps`, `--lr`, ...) and their `TrainingArguments`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Trainer,
    TrainerCallback,
    default_data_collator,
)
from transformers.utils import logging

from .callbacks import DeltaStatsCallback, use_compact_console
from .corpus import gpt2_tokenizer, load_text, tokenize_and_chunk
from .distributed import check_launch
from .training_args import (  # re-exported: the examples import them from here
    add_base_arguments,
    add_training_arguments,
    training_arguments,
    training_arguments_from,
)
from .unwrap import find_delta_model

logger = logging.get_logger(__name__)


def default_cache_dir() -> Path:
    """Where `ddl_hf` caches what it builds (the demo's small base GPT-2), following the Hugging Face conventions.

    `$DDL_HF_CACHE` when set, else `$XDG_CACHE_HOME/ddl_hf`, else `~/.cache/ddl_hf`. Resolved at every call, not at
    import, so setting the variables after `import ddl_hf` (in a notebook, a test, a launcher) takes effect.
    """
    own = os.environ.get("DDL_HF_CACHE")
    if own:
        return Path(own).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "ddl_hf"
    return Path.home() / ".cache" / "ddl_hf"


def __getattr__(name: str) -> Any:
    # `DEFAULT_CACHE_DIR` (the old module constant) is kept for compatibility, resolved when read.
    if name == "DEFAULT_CACHE_DIR":
        return default_cache_dir()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class DeltaTrainer(Trainer):
    """`Trainer` whose optimizer puts the Delta parameters in their own group (lr x `delta_lr_scale`, no decay).

    Why: converted models start with every gate exactly closed (beta = 0), and only the opening parameter gets a
    gradient there. A larger learning rate for the few Delta parameters lets gates open within a short fine-tune
    without changing how the pretrained weights (GPT-2's or a Llama family's) are trained. With `delta_lr_scale=1`
    the optimizer is plain Trainer's.

    With a `DeltaStatsCallback` among the callbacks, the beta statistics are put into each training log entry
    before any callback runs (`log`), so reporting integrations (TensorBoard, W&B; Trainer places them before user
    callbacks) record every per-block key, while the console shows only the `beta_mean`/`beta_max`/`beta_keep`
    summary (Trainer's progress/printer callback is swapped for its compact variant).
    """

    def __init__(self, *args: Any, delta_lr_scale: float = 1.0, **kwargs: Any):
        super().__init__(*args, **kwargs)
        check_launch(self.accelerator, fsdp_requested=bool(self.args.fsdp))
        self.delta_lr_scale = float(delta_lr_scale)
        use_compact_console(self.callback_handler.callbacks)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Trainer.log, with the beta statistics of every `DeltaStatsCallback` added to training log entries first."""
        if "loss" in logs:
            for callback in self.callback_handler.callbacks:
                if isinstance(callback, DeltaStatsCallback):
                    logs.update(callback.pop_stats())
        super().log(logs, start_time)

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        opt_model = self.model if model is None else model
        if self.optimizer is None and self.optimizer_cls_and_kwargs is None:
            decay = set(self.get_decay_parameter_names(opt_model))
            named = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad]
            inner = find_delta_model(opt_model)
            delta = {id(p) for p in inner.delta_parameters().values()} if inner is not None else set()
            groups = [
                {
                    "params": [p for n, p in named if n in decay and id(p) not in delta],
                    "weight_decay": self.args.weight_decay,
                },
                {
                    "params": [p for n, p in named if n not in decay and id(p) not in delta],
                    "weight_decay": 0.0,
                },
                {
                    "params": [p for _, p in named if id(p) in delta],
                    "weight_decay": 0.0,
                    "lr": self.args.learning_rate * self.delta_lr_scale,
                },
            ]
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
            self.optimizer = optimizer_cls([g for g in groups if g["params"]], **optimizer_kwargs)
            return self.optimizer
        return super().create_optimizer(model)


def use_causal_lm_loss_accounting(model: torch.nn.Module) -> torch.nn.Module:
    """Make Trainer count causal-LM loss tokens correctly for `GPT2LMHeadModel` (sets `loss_type`).

    Why: transformers derives `loss_type` from the class name; for `GPT2LMHeadModel` it is None, so Trainer counts
    `num_items_in_batch` over unshifted labels and reports GPT-2's loss scaled by (T-1)/T, while DeltaGPT's
    (`...ForCausalLM`) is exact. Comparing the two needs the same accounting.
    """
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if isinstance(inner, GPT2LMHeadModel) and getattr(inner, "loss_type", None) is None:
        inner.loss_type = "ForCausalLM"
    return model


# ----------------------------------------------------------------------------------------------------------------
# The base GPT-2
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class BaseSpec:
    """How the default small base GPT-2 is built; its hash names the cache entry, so changing it retrains."""

    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    n_positions: int = 256
    block_size: int = 128
    steps: int = 250
    batch_size: int = 4
    learning_rate: float = 2e-3
    warmup_steps: int = 25
    seed: int = 0
    corpus: str = "austen"
    extra: dict = field(default_factory=dict)
    recipe: int = 2  # bumped when the pretraining code changes, so that stale cached bases are not reused

    def key(self) -> str:
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]
        return f"gpt2-{self.n_layer}x{self.n_embd}-{self.corpus}-{self.steps}steps-{digest}"


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Restore the Python, NumPy and torch (CPU and CUDA) random states on exit.

    Why: pretraining the base seeds and draws from the global generators (Trainer calls `set_seed`), but it runs
    only when the base is not cached yet. Without this, everything random after `base_gpt2` (the Delta parameters'
    initialisation at conversion, for one) would differ between a first run and a cached one at the same seed.
    """
    import numpy as np

    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def pretrain_small_gpt2(
    spec: BaseSpec, output_dir: str | os.PathLike, tokenizer: PreTrainedTokenizerBase | None = None
) -> GPT2LMHeadModel:
    """Pretrain a small GPT-2 (GPT-2's BPE, 50257 tokens) from scratch with `Trainer`; save it to `output_dir`.

    Seeded by `spec.seed` alone; the caller's random state is left as it was (`preserved_rng`).
    """
    with preserved_rng():
        return _pretrain_small_gpt2(spec, output_dir, tokenizer)


def random_gpt2(tokenizer: PreTrainedTokenizerBase | None = None, seed: int = 0, **config: Any) -> GPT2LMHeadModel:
    """A GPT-2 initialised from `seed` for `tokenizer` (default: GPT-2's own): its vocabulary size, BOS and EOS.

    `config`: any other `GPT2Config` fields (sizes, dropout). The loss accounting is set as in `base_gpt2`.
    """
    tokenizer = tokenizer or gpt2_tokenizer()
    config = GPT2Config(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **config
    )
    torch.manual_seed(seed)
    return use_causal_lm_loss_accounting(GPT2LMHeadModel(config))


def _pretrain_small_gpt2(
    spec: BaseSpec, output_dir: str | os.PathLike, tokenizer: PreTrainedTokenizerBase | None
) -> GPT2LMHeadModel:
    tokenizer = tokenizer or gpt2_tokenizer()
    model = random_gpt2(
        tokenizer,
        spec.seed,
        n_layer=spec.n_layer,
        n_embd=spec.n_embd,
        n_head=spec.n_head,
        n_positions=spec.n_positions,
        **spec.extra,
    )
    blocks = tokenize_and_chunk(
        load_text(spec.corpus), tokenizer, spec.block_size, max_blocks=spec.steps * spec.batch_size
    )
    output_dir = Path(output_dir)
    with tempfile.TemporaryDirectory() as scratch:
        args = training_arguments(
            scratch,
            max_steps=spec.steps,
            per_device_train_batch_size=spec.batch_size,
            learning_rate=spec.learning_rate,
            warmup_steps=spec.warmup_steps,
            logging_steps=max(1, spec.steps // 10),
            seed=spec.seed,
            data_seed=spec.seed,
        )
        Trainer(model=model, args=args, train_dataset=blocks, data_collator=default_data_collator).train()
    model.eval()
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    (output_dir / "ddl_hf_base.json").write_text(json.dumps(asdict(spec), indent=2))
    return model


def base_gpt2(
    base: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
    spec: BaseSpec | None = None,
) -> tuple[GPT2LMHeadModel, PreTrainedTokenizerBase, str]:
    """The demo's base GPT-2 and its tokenizer, plus a description of where it came from.

    The model's `loss_type` is set to "ForCausalLM" (`use_causal_lm_loss_accounting`): exact loss accounting in
    Trainer, and no "`loss_type=None` ... unrecognized" warning when it is called with labels.

    `base` is a Hub id (e.g. "gpt2", needs network) or a directory. Without it, a small GPT-2 is pretrained on
    the bundled Austen corpus once and cached under `cache_dir` (default: `default_cache_dir()`, i.e.
    `$DDL_HF_CACHE`, else `$XDG_CACHE_HOME/ddl_hf`, else `~/.cache/ddl_hf`); later calls load the cached copy.
    The cache entry is written to a temporary directory and renamed, so an interrupted run never leaves a
    half-written base behind.
    """
    if base is not None:
        from transformers import AutoTokenizer

        model = GPT2LMHeadModel.from_pretrained(base)
        try:
            tokenizer = AutoTokenizer.from_pretrained(base)
        except (OSError, ValueError):  # a directory with weights only: GPT-2's own tokenizer
            tokenizer = gpt2_tokenizer()
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return use_causal_lm_loss_accounting(model.eval()), tokenizer, f"{base}"

    spec = spec or BaseSpec()
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / "base" / spec.key()
    tokenizer = gpt2_tokenizer()
    if (target / "model.safetensors").exists():
        model = use_causal_lm_loss_accounting(GPT2LMHeadModel.from_pretrained(target).eval())
        return model, tokenizer, f"cached small GPT-2 at {target}"
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        logger.info(f"Pretraining a small GPT-2 ({spec.n_layer} layers x {spec.n_embd}) on the bundled corpus")
        pretrain_small_gpt2(spec, scratch, tokenizer)
        if target.exists():  # another process won the race: use its copy
            shutil.rmtree(scratch)
        else:
            scratch.rename(target)
    finally:
        if scratch.exists():
            shutil.rmtree(scratch, ignore_errors=True)
    model = use_causal_lm_loss_accounting(GPT2LMHeadModel.from_pretrained(target).eval())
    return model, tokenizer, f"small GPT-2 pretrained here, cached at {target}"


# ----------------------------------------------------------------------------------------------------------------
# Fine-tuning
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class FinetuneResult:
    """Eval loss / perplexity before and after one fine-tuning run, and the Trainer's log history."""

    eval_loss_before: float
    eval_loss_after: float
    log_history: list[dict] = field(default_factory=list)

    @property
    def perplexity_before(self) -> float:
        return math.exp(self.eval_loss_before)

    @property
    def perplexity_after(self) -> float:
        return math.exp(self.eval_loss_after)


def finetune(
    model: PreTrainedModel,
    train_dataset: Dataset,
    eval_dataset: Dataset,
    output_dir: str | os.PathLike,
    steps: int,
    learning_rate: float = 5e-4,
    batch_size: int = 8,
    seed: int = 0,
    delta_lr_scale: float = 1.0,
    callbacks: Sequence[TrainerCallback] = (),
    **argument_overrides: Any,
) -> FinetuneResult:
    """Fine-tune a causal LM for `steps` optimizer steps with `DeltaTrainer`; evaluate before and after.

    The same call with the same seed trains GPT-2 and DeltaGPT on the same batches in the same order, which is
    what makes the side-by-side comparison fair.
    """
    args = training_arguments(
        output_dir,
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        learning_rate=learning_rate,
        warmup_steps=max(1, steps // 10),
        logging_steps=max(1, steps // 10),
        seed=seed,
        data_seed=seed,
        **argument_overrides,
    )
    trainer = DeltaTrainer(
        model=use_causal_lm_loss_accounting(model),
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        data_collator=default_data_collator,
        callbacks=list(callbacks),
        delta_lr_scale=delta_lr_scale,
    )
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    model.eval()
    return FinetuneResult(before, after, list(trainer.state.log_history))


__all__ = [
    "BaseSpec",
    "DeltaTrainer",
    "FinetuneResult",
    "add_base_arguments",
    "add_training_arguments",
    "base_gpt2",
    "default_cache_dir",
    "finetune",
    "preserved_rng",
    "pretrain_small_gpt2",
    "random_gpt2",
    "training_arguments",
    "training_arguments_from",
    "use_causal_lm_loss_accounting",
]
