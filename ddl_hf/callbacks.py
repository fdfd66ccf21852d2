"""`DeltaStatsCallback`: per-layer beta statistics in the Trainer logs, and a plot of them over training.

Each Delta block's gate beta in [0, 2] says what the block does to the residual state along its direction k:
beta < 0.5 keeps it (near identity), 0.5-1.5 projects (forgets and rewrites), > 1.5 reflects. The callback
collects beta from the training forward passes themselves (forward hooks, no extra compute) and adds, at every
logging step, for each block `beta/L{layer}.{attn|mlp}/{mean,keep,project,reflect}` to the log.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from .unwrap import find_delta_model

#: Bin edges of the three regimes: keep (identity-like), project, reflect.
KEEP_BELOW, REFLECT_ABOVE = 0.5, 1.5
STATS = ("mean", "keep", "project", "reflect")


def delta_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(label, module) for every Delta block in forward order, labelled `L{layer}.attn` / `L{layer}.mlp`.

    Asks the model (`delta_residuals`) through any wrapper (DDP, peft). Under peft's `modules_to_save` the module
    is the wrapper, whose forward runs (and whose attributes are) the active adapter's trainable copy.
    """
    inner = find_delta_model(model)
    return list(inner.delta_residuals(short_names=True).items()) if inner is not None else []


def beta_stats(betas: torch.Tensor) -> dict[str, float]:
    """Mean beta and the fraction of tokens in each regime, for a tensor of betas (any shape)."""
    betas = betas.detach().float().flatten()
    n = max(betas.numel(), 1)
    keep = int((betas < KEEP_BELOW).sum())
    reflect = int((betas > REFLECT_ABOVE).sum())
    return {
        "mean": float(betas.mean()) if betas.numel() else 0.0,
        "keep": keep / n,
        "project": (betas.numel() - keep - reflect) / n,
        "reflect": reflect / n,
    }


class DeltaStatsCallback(TrainerCallback):
    """Adds per-block beta statistics of the training batches since the last log to each Trainer log entry.

    The values go into `logs` (seen by callbacks after this one, e.g. TensorBoard/W&B integrations added later)
    and into `state.log_history` (so `trainer_state.json` in every checkpoint has them, and `plot_beta_history`
    can draw beta per layer over training). Only training-mode forward passes are counted, not evaluation.
    Statistics cover every position of the batch (padding included) and are per process under DDP; with gradient
    checkpointing the recomputed forward passes are counted too (the same betas twice, so the means are unchanged).
    """

    def __init__(self) -> None:
        self._handles: list = []
        self._sums: dict[str, list[float]] = {}

    def _hook(self, label: str):
        def record(module: torch.nn.Module, inputs: tuple, output: tuple) -> None:
            if not module.training:
                return
            betas = output[1].detach().float()
            sums = self._sums.setdefault(label, [0.0, 0.0, 0.0, 0.0])  # count, sum, keep, reflect
            sums[0] += betas.numel()
            sums[1] += float(betas.sum())
            sums[2] += float((betas < KEEP_BELOW).sum())
            sums[3] += float((betas > REFLECT_ABOVE).sum())

        return record

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, model=None, **kwargs
    ) -> None:
        self.remove_hooks()
        blocks = delta_blocks(model)
        if not blocks:
            raise ValueError("DeltaStatsCallback: the model has no Delta blocks (is it a DeltaGPT model?).")
        self._handles = [module.register_forward_hook(self._hook(label)) for label, module in blocks]

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs=None, **kwargs
    ) -> None:
        if not self._sums or logs is None or "loss" not in logs:
            return
        stats = {}
        for label, (count, total, keep, reflect) in self._sums.items():
            count = max(count, 1.0)
            stats[f"beta/{label}/mean"] = total / count
            stats[f"beta/{label}/keep"] = keep / count
            stats[f"beta/{label}/project"] = (count - keep - reflect) / count
            stats[f"beta/{label}/reflect"] = reflect / count
        self._sums = {}
        logs.update(stats)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(stats)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        self.remove_hooks()

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


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


__all__ = ["DeltaStatsCallback", "beta_history", "beta_stats", "delta_blocks", "plot_beta_history"]
