"""`DeltaStatsCallback`: per-layer beta statistics in the Trainer logs, and a plot of them over training.

Each Delta block's gate beta in [0, 2] says what the block does to the residual state along its direction k:
beta < 0.5 keeps it (near identity), 0.5-1.5 projects (forgets and rewrites), > 1.5 reflects. The callback
collects beta from the training forward passes themselves (forward hooks, no extra compute) and adds, at every
logging step, for each block `beta/L{layer}.{attn|mlp}/{mean,keep,project,reflect}` to the log, plus three summary
numbers over all blocks, `beta_mean`, `beta_max` and `beta_keep`.

The per-block keys are for loggers (TensorBoard, W&B, `trainer_state.json`): 4 per block, 96 for a 12-layer model,
far too many for a console line. The console (Trainer's progress bar or printer) shows the three summary numbers
only; see `DeltaStatsCallback` for who sees what with `DeltaTrainer` and with a plain `Trainer`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from .inspection import KEEP_BELOW, REFLECT_ABOVE, beta_stats
from .unwrap import find_delta_model

STATS = ("mean", "keep", "project", "reflect")
#: Summary keys over all blocks, the only beta keys the console shows.
SUMMARY_KEYS = ("beta_mean", "beta_max", "beta_keep")


def delta_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(label, module) for every Delta block in forward order, labelled `L{layer}.attn` / `L{layer}.mlp`.

    Asks the model (`delta_residuals`) through any wrapper (DDP, peft). Under peft's `modules_to_save` the module
    is the wrapper, whose forward runs (and whose attributes are) the active adapter's trainable copy.
    """
    inner = find_delta_model(model)
    return list(inner.delta_residuals(short_names=True).items()) if inner is not None else []


class DeltaStatsCallback(TrainerCallback):
    """Per-block beta statistics of the training batches since the last log, for every Trainer log entry.

    Only training-mode forward passes are counted, not evaluation. Statistics cover every position of the batch
    (padding included) and are per process under DDP; with gradient checkpointing the recomputed forward passes are
    counted too (the same betas twice, so the means are unchanged).

    Who sees what:

    - with `ddl_hf.training.DeltaTrainer` (recommended): the full statistics (per-block keys and the summary) go
      into the log dict before any callback runs, so reporting integrations (TensorBoard, W&B, ...; Trainer puts
      them before user callbacks) record them, and into `state.log_history` / `trainer_state.json`; the console
      shows only `beta_mean`, `beta_max`, `beta_keep`.
    - with a plain `Trainer`: Trainer runs integrations before user callbacks, so they log before this callback
      and never see beta. The full statistics still go into `state.log_history` (so `trainer_state.json` and
      `plot_beta_history` have them); the log dict passed on to later callbacks and to the console gets the
      three summary numbers, or everything with `console="full"`.

    Args:
        console: "summary" (default) or "full": what a plain `Trainer`'s later callbacks and console get.
    """

    def __init__(self, console: str = "summary") -> None:
        if console not in ("summary", "full"):
            raise ValueError(f"DeltaStatsCallback(console={console!r}): choose 'summary' or 'full'.")
        self.console = console
        self._handles: list = []
        # label -> [tokens (int), counts (keep, reflect: int64 on the betas' device), sum and max of beta (float32)]
        self._sums: dict[str, list] = {}

    def _hook(self, label: str):
        def record(module: torch.nn.Module, inputs: tuple, output: tuple) -> None:
            # Device-side sums only: a host read here (`float()`, `.item()`) would stall every training step on an
            # accelerator until the device caught up. The host reads them once per log (`pop_stats`).
            betas = output[1]  # a Delta residual returns (new state, beta[, shared read])
            if not module.training or betas.numel() == 0:
                return
            betas = betas.detach().float()
            counts = torch.stack(((betas < KEEP_BELOW).sum(), (betas > REFLECT_ABOVE).sum()))
            values = torch.stack((betas.sum(), betas.amax()))
            entry = self._sums.get(label)
            if entry is None:
                self._sums[label] = [betas.numel(), counts, values]
            else:
                entry[0] += betas.numel()
                entry[1] = entry[1] + counts
                entry[2] = torch.stack((entry[2][0] + values[0], torch.maximum(entry[2][1], values[1])))

        return record

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, model=None, **kwargs
    ) -> None:
        self.remove_hooks()
        self._sums = {}
        blocks = delta_blocks(model)
        if not blocks:
            raise ValueError(
                "DeltaStatsCallback: the model has no Delta blocks (is it a DeltaGPT or DeltaLlama model?)."
            )
        self._handles = [module.register_forward_hook(self._hook(label)) for label, module in blocks]

    def pop_stats(self) -> dict[str, float]:
        """The statistics since the last call (per-block keys, then the summary), and start counting afresh.

        Empty when no training forward pass ran since. `DeltaTrainer.log` calls this before any callback runs. The
        one place the sums come to the host: once per block and log, not per step.
        """
        stats: dict[str, float] = {}
        if not self._sums:
            return stats
        tokens = total = keep_all = 0.0
        top = 0.0
        for label, (count, counts, values) in self._sums.items():
            (keep, reflect), (total_beta, largest) = counts.tolist(), values.tolist()
            n = max(count, 1)
            stats[f"beta/{label}/mean"] = total_beta / n
            stats[f"beta/{label}/keep"] = keep / n
            stats[f"beta/{label}/project"] = (count - keep - reflect) / n
            stats[f"beta/{label}/reflect"] = reflect / n
            tokens, total, keep_all, top = tokens + count, total + total_beta, keep_all + keep, max(top, largest)
        stats["beta_mean"] = total / max(tokens, 1.0)
        stats["beta_max"] = top
        stats["beta_keep"] = keep_all / max(tokens, 1.0)
        self._sums = {}
        return stats

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs=None, **kwargs
    ) -> None:
        # Under DeltaTrainer the statistics were already popped into the logs; this runs for a plain Trainer.
        if not self._sums or logs is None or "loss" not in logs:
            return
        stats = self.pop_stats()
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(stats)
        logs.update(stats if self.console == "full" else {k: stats[k] for k in SUMMARY_KEYS})

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        self.remove_hooks()

    def remove_hooks(self) -> None:
        """Detach the forward hooks (done at the end of training)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def console_logs(logs: dict) -> dict:
    """`logs` without the per-block `beta/...` keys (the summary `beta_mean`/`beta_max`/`beta_keep` stay)."""
    return {k: v for k, v in logs.items() if not k.startswith("beta/")}


class _CompactBetaConsole:
    """Mixin for Trainer's console callbacks: print the log line without the per-block beta keys."""

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs=None, **kwargs):
        return super().on_log(args, state, control, logs=None if logs is None else console_logs(logs), **kwargs)


class CompactProgressCallback(_CompactBetaConsole, ProgressCallback):
    """Trainer's tqdm progress callback, printing log lines without the per-block beta keys."""


class CompactPrinterCallback(_CompactBetaConsole, PrinterCallback):
    """Trainer's printer callback (`disable_tqdm=True`), printing log lines without the per-block beta keys."""


def use_compact_console(callbacks: list[TrainerCallback]) -> None:
    """Replace, in place, Trainer's console callback in a callback list by its compact variant (same position).

    Why: with the statistics injected before all callbacks (so integrations see them), the console callback would
    otherwise print every per-block key. A notebook progress callback or any other console callback is left alone.
    """
    for i, callback in enumerate(callbacks):
        if type(callback) is ProgressCallback:
            compact = CompactProgressCallback()
            compact.__dict__.update(callback.__dict__)
            callbacks[i] = compact
        elif type(callback) is PrinterCallback:
            callbacks[i] = CompactPrinterCallback()


def beta_history(log_history: Sequence[dict]) -> tuple[list[int], dict[str, list[float]]]:
    """Steps and mean beta per block from a Trainer log history written with `DeltaStatsCallback`."""
    entries = [e for e in log_history if any(k.startswith("beta/") for k in e)]
    labels = sorted(
        {k.split("/")[1] for e in entries for k in e if k.startswith("beta/") and k.endswith("/mean")},
        key=lambda s: (int(s.split(".")[0][1:]), s.split(".")[1] != "attn"),
    )
    steps = [int(e["step"]) for e in entries]
    return steps, {label: [float(e.get(f"beta/{label}/mean", float("nan"))) for e in entries] for label in labels}


def plot_beta_history(log_history: Sequence[dict], path: str | os.PathLike, title: str = "") -> str:
    """PNG of mean beta per Delta block over training steps (attention solid, MLP dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, curves = beta_history(log_history)
    if not steps:
        raise ValueError("No beta statistics in the log history: train with DeltaStatsCallback.")
    fig, ax = plt.subplots(figsize=(7, 4))
    layers = sorted({int(label.split(".")[0][1:]) for label in curves})
    colors = plt.get_cmap("viridis")([i / max(len(layers) - 1, 1) for i in range(len(layers))])
    for label, values in curves.items():
        layer, kind = int(label.split(".")[0][1:]), label.split(".")[1]
        ax.plot(
            steps,
            values,
            linestyle="-" if kind == "attn" else "--",
            color=colors[layers.index(layer)],
            marker="o",
            markersize=3,
            label=label,
        )
    ax.set_xlabel("training step")
    ax.set_ylabel("mean beta over training tokens")
    ax.set_title(title or "Delta gate beta per layer during fine-tuning")
    ax.grid(alpha=0.3)
    ax.legend(ncol=2, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


__all__ = [
    "SUMMARY_KEYS",
    "CompactPrinterCallback",
    "CompactProgressCallback",
    "DeltaStatsCallback",
    "beta_history",
    "beta_stats",
    "console_logs",
    "delta_blocks",
    "plot_beta_history",
    "use_compact_console",
]
