"""trl's SFTTrainer (packed and not) and DPOTrainer on tiny DeltaGPTs, both token mixers.

References: SFT with `packing=True` (padding-free rows, `position_ids` restarting at 0 and `cu_seq_lens`) must train
exactly like SFT on the same documents padded in a batch (each document alone); DPO's sequence log-probabilities
must equal each prompt + completion scored alone by the model, and training must raise the reward margin.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import trl
from datasets import Dataset
from transformers import AutoModelForCausalLM

from tests.builders import CLIENT_VARIANTS, DELTA_NET, delta_model, scramble_delta_weights, word_tokenizer

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning"),
]

DOCS = [
    "The dog is a good friend .",
    "It rained all day in the town and the roads were wet .",
    "Elinor was calm .",
    "A long letter came from Marianne , who wrote of the weather , the walks and the new piano .",
    "Yes .",
    "They dined at Barton Park on Tuesday .",
]
PREFERENCES = {
    "prompt": ["The dog is", "It rained", "Elinor was", "They dined"],
    "chosen": [" a good friend .", " all day .", " calm .", " at Barton Park ."],
    "rejected": [" wet .", " calm .", " a good friend .", " in the town and the roads ."],
}
TOKENIZER = word_tokenizer(DOCS + [p + c + r for p, c, r in zip(*PREFERENCES.values())])
MIXERS = {"attention": {}, "delta_net": DELTA_NET}


def tiny_model(mixer: str):
    special = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if mixer in MIXERS:
        return delta_model(MIXERS[mixer], vocab_size=len(TOKENIZER), delta_beta_init=0.5, **special)
    # The exact scheme (then scrambled), not the authors' init: from that one, 6 SGD steps at lr 1 turn the float
    # rounding by which packed and padded gradients differ (4e-6 relative, measured) into 1e-3 of loss.
    variant = CLIENT_VARIANTS[mixer.removeprefix("attention-")]
    model = delta_model(variant, vocab_size=len(TOKENIZER), delta_init="exact", delta_beta_init=1.0, **special)
    scramble_delta_weights(model)  # the EC expansion starts as the identity: make it, and the TC read, matter
    return model


def common_args(tmp_path, **overrides) -> dict:
    """float32: trl turns bf16 autocast on by default, also on CPU, and its rounding would hide a wrong result."""
    fields = dict(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, save_strategy="no", logging_steps=1)
    return fields | dict(seed=0) | overrides


@pytest.mark.parametrize("mixer", [*MIXERS, "attention-tc-ec-paper-dv4"])  # TC / EC windows restart per document
def test_sft_packed_trains_exactly_like_unpacked(mixer, tmp_path):
    """One batch of every document per step: packed into one padding-free row, or padded rows. Same loss before
    training, same loss curve and weights after 6 SGD steps; and the packing metadata matters (the same row
    without it, read as one document, gives another loss). The weights agree within what float32 rounding allows:
    4x (tests/rounding.py) the larger distance of either float32 run from its float64 twin."""
    trainers, twins = {}, {}
    for packing, dtype in itertools.product((False, True), (torch.float32, torch.float64)):
        args = trl.SFTConfig(
            **common_args(tmp_path / str(packing)),
            packing=packing,
            max_length=64,
            max_steps=6,
            optim="sgd",  # Adam would blow float noise in near-zero gradients up to lr-sized steps
            learning_rate=1.0,
            per_device_train_batch_size=len(DOCS),
        )
        train = Dataset.from_dict({"text": DOCS})
        trainer = trl.SFTTrainer(
            model=tiny_model(mixer).to(dtype), args=args, train_dataset=train, processing_class=TOKENIZER
        )
        (trainers if dtype == torch.float32 else twins)[packing] = trainer
    batches = {packing: next(iter(trainer.get_train_dataloader())) for packing, trainer in trainers.items()}
    assert "attention_mask" in batches[False] and batches[True]["input_ids"].shape[0] == 1
    assert "cu_seq_lens_q" in batches[True] and int((batches[True]["position_ids"] == 0).sum()) == len(DOCS)

    with torch.no_grad():
        before = {packing: trainers[packing].compute_loss(trainers[packing].model.eval(), dict(batch)).item()
                  for packing, batch in batches.items()}  # fmt: skip
        packed = batches[True]
        model = trainers[True].model
        as_packed = model(**{k: v for k, v in packed.items() if k != "labels"}, use_cache=False).logits
        as_one_document = model(packed["input_ids"], use_cache=False).logits
    assert abs(before[True] - before[False]) <= 1e-5
    assert (as_one_document - as_packed).abs().max() > 1e-2

    for trainer in trainers.values():
        trainer.train()
    curves = {packing: [h["loss"] for h in t.state.log_history if "loss" in h] for packing, t in trainers.items()}
    assert len(curves[True]) == 6 and curves[True][-1] < curves[True][0] - 0.1  # it learns
    assert curves[True] == pytest.approx(curves[False], rel=1e-5, abs=0)
    for twin in twins.values():
        twin.train()
    weights = {packing: dict(t.model.named_parameters()) for packing, t in trainers.items()}
    exact = {packing: dict(t.model.named_parameters()) for packing, t in twins.items()}
    for name, param in weights[False].items():
        own = max(float((weights[p][name].double() - exact[p][name]).abs().max()) for p in (False, True))
        floor = 4 * torch.finfo(torch.float32).eps * float(exact[False][name].abs().max())
        difference = float((param - weights[True][name]).abs().max())
        assert difference <= 4 * max(own, floor), (name, difference, own)


def completion_logps(model, prompt: str, completion: str) -> float:
    """Sum of log p(completion + EOS | prompt), the prompt and completion scored alone (no padding, no batch)."""
    prompt_ids = TOKENIZER(prompt)["input_ids"]
    ids = torch.tensor([prompt_ids + TOKENIZER(completion)["input_ids"] + [TOKENIZER.eos_token_id]])
    with torch.no_grad():
        logps = model(ids).logits[0, :-1].log_softmax(-1)
    targets = ids[0, 1:]
    return float(logps[torch.arange(len(targets)), targets][len(prompt_ids) - 1 :].sum())


@pytest.mark.parametrize("mixer", MIXERS)
def test_dpo_log_probs_match_the_model_alone_and_training_raises_the_margin(mixer, tmp_path):
    """Loaded from a directory, as trl builds the reference model from the policy's `name_or_path`."""
    tiny_model(mixer).save_pretrained(tmp_path / "policy")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    pairs = list(zip(*PREFERENCES.values()))
    expected_chosen = sum(completion_logps(model, p, c) for p, c, _ in pairs) / len(pairs)
    expected_rejected = sum(completion_logps(model, p, r) for p, _, r in pairs) / len(pairs)

    args = trl.DPOConfig(
        **common_args(tmp_path / "run"),
        max_steps=8,
        learning_rate=1e-2,
        per_device_train_batch_size=len(pairs),
        beta=0.5,
    )
    trainer = trl.DPOTrainer(
        model=model, args=args, train_dataset=Dataset.from_dict(PREFERENCES), processing_class=TOKENIZER
    )
    trainer.train()
    history = [h for h in trainer.state.log_history if "loss" in h]
    first, last = history[0], history[-1]
    # Step 1 ran the untrained model on the padded batch: its log-probs are each pair's own, the loss log 2.
    assert first["logps/chosen"] == pytest.approx(expected_chosen, abs=1e-5)
    assert first["logps/rejected"] == pytest.approx(expected_rejected, abs=1e-5)
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert last["rewards/margins"] > 0.5 and last["loss"] < first["loss"] - 0.1
