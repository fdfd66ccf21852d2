"""`ddl-hf inspect MODEL --text FILE`: which Delta blocks keep, forget (project) or reflect, token by token.

For any Delta causal LM (DeltaGPT, DeltaLlama): the blocks are those the model lists (`delta_residuals`).

Runs the model once with `output_betas=True`, prints a per-block table of beta statistics and writes a heat-map
PNG of beta by block (rows: layer, attention then MLP) and token (columns).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .unwrap import find_delta_model

#: Bin edges of the three regimes: keep (identity-like), project, reflect.
KEEP_BELOW, REFLECT_ABOVE = 0.5, 1.5


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


@dataclass
class BetaMap:
    """Betas of one text: `betas[block, token]`, with block labels (`L0.attn`, `L0.mlp`, ...) and token strings."""

    tokens: list[str]
    labels: list[str]
    betas: torch.Tensor

    def table(self) -> str:
        """A fixed-width per-block table: mean/min/max beta and the fraction of tokens in each regime."""
        header = (
            f"{'block':<10} {'mean':>6} {'min':>6} {'max':>6}  "
            f"{'keep<' + str(KEEP_BELOW):>9} {'project':>8} {'reflect>' + str(REFLECT_ABOVE):>11}  mostly"
        )
        lines = [header, "-" * len(header)]
        for label, row in zip(self.labels, self.betas):
            s = beta_stats(row)
            mostly = max(
                ("keeps", s["keep"]), ("forgets", s["project"]), ("reflects", s["reflect"]), key=lambda x: x[1]
            )
            lines.append(
                f"{label:<10} {s['mean']:>6.3f} {float(row.min()):>6.3f} {float(row.max()):>6.3f}  "
                f"{s['keep']:>9.1%} {s['project']:>8.1%} {s['reflect']:>11.1%}  {mostly[0]}"
            )
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike, title: str = "") -> str:
        """Heat-map PNG of beta (0 = keep, 1 = project, 2 = reflect) by block and token."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        n_blocks, n_tokens = self.betas.shape
        fig, ax = plt.subplots(figsize=(max(6, 0.28 * n_tokens + 2), max(3, 0.3 * n_blocks + 1.5)))
        image = ax.imshow(self.betas.numpy(), aspect="auto", cmap="coolwarm", vmin=0.0, vmax=2.0)
        ax.set_yticks(range(n_blocks), self.labels, fontsize=7)
        ax.set_xticks(range(n_tokens), [t.replace("\n", "\\n") for t in self.tokens], rotation=90, fontsize=7)
        ax.set_xlabel("token")
        ax.set_ylabel("Delta block")
        ax.set_title(title or "beta by block and token (0 keep, 1 project/forget, 2 reflect)")
        fig.colorbar(image, ax=ax, label="beta")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return str(path)


@torch.no_grad()
def beta_map(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, text: str, max_tokens: int = 64) -> BetaMap:
    """Betas of every Delta block for the first `max_tokens` tokens of `text`."""
    limit = min(max_tokens, model.config.max_position_embeddings)  # GPT-2's n_positions under its common name
    input_ids = tokenizer(text, return_tensors="pt", truncation=True, max_length=limit)["input_ids"]
    if input_ids.shape[1] == 0:
        raise ValueError("The text is empty after tokenization.")
    model.eval()
    outputs = model(input_ids.to(model.device), output_betas=True)
    betas = torch.stack([b[0].float().cpu() for b in outputs.betas])
    labels = list(find_delta_model(model).delta_residuals(short_names=True))  # the order of outputs.betas
    tokens = [tokenizer.decode([t]) for t in input_ids[0].tolist()]
    return BetaMap(tokens=tokens, labels=labels, betas=betas)


def load_model_and_tokenizer(name: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A Delta causal LM (DeltaGPT or DeltaLlama; Hub id or directory) and its tokenizer.

    A DeltaGPT saved without one gets GPT-2's tokenizer (its vocabulary is GPT-2's); any other model needs its own,
    since a Llama-family vocabulary is the checkpoint's.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import ddl_hf  # noqa: F401  (registers the Delta models with the Auto classes)

    model = AutoModelForCausalLM.from_pretrained(name)
    if find_delta_model(model) is None:
        raise ValueError(
            f"{name} is a {type(model).__name__}, not a Delta model (DeltaGPT, DeltaLlama); convert it first."
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError):
        if model.config.model_type != "delta_gpt":
            raise ValueError(f"no tokenizer saved with {name}; save the source model's tokenizer next to it") from None
        from .corpus import gpt2_tokenizer

        tokenizer = gpt2_tokenizer()
    return model, tokenizer


def run_inspect(args: argparse.Namespace) -> int:
    """The `inspect` subcommand: print the table, write the heat-map; one `error:` line and exit 1 on a user error."""
    text_path = Path(args.text)
    if not text_path.is_file():
        return _fail(f"no such text file: {args.text}. Pass --text with an existing UTF-8 text file.")
    try:
        text = text_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        return _fail(f"cannot read {args.text} as UTF-8 text ({error}). Pass --text with a UTF-8 text file.")
    if _looks_local(args.model) and not os.path.isdir(args.model):
        return _fail(f"no such model directory: {args.model}. Pass a converted Delta model directory or a Hub id.")
    try:
        model, tokenizer = load_model_and_tokenizer(args.model)
        result = beta_map(model, tokenizer, text, max_tokens=args.max_tokens)
    except (OSError, ValueError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return _fail(
            f"cannot inspect {args.model}: {first_line}. Pass a converted DeltaGPT or DeltaLlama directory (or its "
            "Hub id) and a non-empty --text."
        )
    print(f"beta per Delta block of {args.model} on {args.text} ({len(result.tokens)} tokens)")
    print(result.table())
    output = args.output or f"{text_path.stem}_betas.png"
    try:
        result.plot(output, title=f"beta of {Path(args.model).name} on {text_path.name}")
    except OSError as error:
        return _fail(f"cannot write the heat-map {output} ({error}). Pass --output with a writable path.")
    print(f"heat-map written to {output}")
    return 0


def _looks_local(name: str) -> bool:
    """A path rather than a Hub id ("org/name"): starts like a path, has more than one "/", or exists."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or os.path.exists(name)


def _fail(message: str) -> int:
    """Print one `error:` line to stderr and return the exit code 1, like argparse's own usage errors."""
    print(f"error: {message}", file=sys.stderr)
    return 1


__all__ = ["BetaMap", "beta_map", "load_model_and_tokenizer", "run_inspect"]
