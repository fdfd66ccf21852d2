"""Guarantee 2: starting from beta = 0 exactly, an ordinary Trainer fine-tune (AdamW, lr 1e-4) opens gates.

beta = 2 sigmoid(gate) * clamp(beta_open, 0, 1) with a straight-through clamp: at beta_open = 0 the forward pass is
exactly GPT-2, yet d loss / d beta_open = sum over tokens of 2 sigmoid(gate) * d loss / d beta is non-zero, so AdamW
moves every opening by about lr per step: up where opening helps (beta > 0), down where it does not (beta stays 0).
"""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainingArguments

import ddl_hf
from ddl_hf.conversion import SAMPLE_TEXT
from tests.gpt2_fixtures import (
    text_ids,
    trained_gpt2,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Fine-tuning data from another "domain" than the source's training text, so there is something to learn.
FINETUNE_IDS = text_ids(SAMPLE_TEXT * 2)[0]
PROBE = text_ids(SAMPLE_TEXT)[:, :96]


class Windows(torch.utils.data.Dataset):
    def __init__(self, ids: torch.Tensor, length: int = 64, count: int = 256):
        generator = torch.Generator().manual_seed(0)
        self.starts = torch.randint(0, ids.numel() - length, (count,), generator=generator).tolist()
        self.ids, self.length = ids, length

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict:
        window = self.ids[self.starts[i] : self.starts[i] + self.length]
        return {"input_ids": window, "labels": window}


def beta_table(model) -> list[tuple[str, float, float, float]]:
    """(block, mean beta, max beta, opening beta_open) per Delta block, on the probe text."""
    model.eval()
    with torch.no_grad():
        betas = model(PROBE, output_betas=True).betas
    rows = []
    for i, beta in enumerate(betas):
        block = model.transformer.h[i // 2]
        delta = block.attn_delta if i % 2 == 0 else block.mlp_delta
        name = f"h.{i // 2}.{'attn' if i % 2 == 0 else 'mlp'}"
        rows.append((name, float(beta.mean()), float(beta.max()), float(delta.beta_open.detach())))
    return rows


def test_gates_open_in_a_short_trainer_finetune(tmp_path):
    source = trained_gpt2()  # first: training it (when not cached yet) must not shift the seed below
    torch.manual_seed(0)
    model = ddl_hf.convert_gpt2(source)
    before = beta_table(model)
    assert all(mean == 0.0 and top == 0.0 for _, mean, top, _ in before)  # exactly GPT-2 at step 0

    # Every opening gets a gradient at beta = 0 (the straight-through clamp), so no gate is stuck.
    model.train()
    model(PROBE, labels=PROBE).loss.backward()
    grads = [
        float(delta.beta_open.grad) for block in model.transformer.h for delta in (block.attn_delta, block.mlp_delta)
    ]
    assert all(g != 0.0 for g in grads), grads
    model.zero_grad()

    args = TrainingArguments(
        output_dir=str(tmp_path),
        learning_rate=1e-4,
        optim="adamw_torch",
        max_steps=30,
        per_device_train_batch_size=8,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
    )
    result = Trainer(model=model, args=args, train_dataset=Windows(FINETUNE_IDS)).train()
    after = beta_table(model)

    print("\nper-block beta on the probe text (mean / max / beta_open), before -> after 30 AdamW steps at lr 1e-4")
    for (name, m0, x0, o0), (_, m1, x1, o1) in zip(before, after):
        print(f"  {name:8s} {m0:.2e} / {x0:.2e} / {o0:+.2e}  ->  {m1:.2e} / {x1:.2e} / {o1:+.2e}")
    print(f"  training loss {result.training_loss:.4f}")

    opened = [name for name, mean, _, _ in after if mean > 1e-4]
    assert opened, after  # beta left 0 in at least one block
    # Closed gates moved too: the optimiser pushed their opening below 0, where beta stays exactly 0.
    assert all(abs(opening) > 1e-5 for _, _, _, opening in after)
    assert all(top <= 2.0 * max(opening, 0.0) + 1e-9 for _, _, top, opening in after)
