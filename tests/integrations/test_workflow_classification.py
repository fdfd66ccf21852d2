"""Sequence classification fine-tuning with DeltaGPTForSequenceClassification and Trainer."""

from __future__ import annotations

import torch
from transformers import AutoModelForSequenceClassification

from tests.workflow_utils import run_example


def test_author_classification_learns_and_pools_last_real_token(tmp_path):
    result = run_example(
        "sequence_classification", tmp_path, per_class=48, max_length=24, steps=24, batch_size=8, lr=3e-3
    )
    assert result["after"]["eval_loss"] < result["before"]["eval_loss"]
    assert result["after"]["eval_accuracy"] >= 0.7  # two very different styles; chance is 0.5

    # Saved with its head; AutoModelForSequenceClassification loads it (ddl_hf registered the class).
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out" / "final").eval()
    assert type(model).__name__ == "DeltaGPTForSequenceClassification"
    # Padding-independent pooling: a right- and a left-padded batch give each sentence's own logits (with left
    # padding, position ids come from the mask, exactly as for GPT-2).
    tokenizer = result["tokenizer"]
    texts = ["It is a truth universally acknowledged.", "O, what a noble mind is here o'erthrown!  Alas."]
    with torch.no_grad():
        alone = torch.cat([model(**tokenizer(t, return_tensors="pt")).logits for t in texts])
        for side in ("right", "left"):
            tokenizer.padding_side = side
            batch = tokenizer(texts, return_tensors="pt", padding=True)
            if side == "left":
                batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
            torch.testing.assert_close(model(**batch).logits, alone, rtol=1e-4, atol=1e-5)
    tokenizer.padding_side = "right"
