"""The task heads of both families (`delta_heads.py`: sequence classification, token classification, question
answering), against transformers' own GPT-2 and Llama heads: a source head's weights in the Delta head, whose Delta
parameters start exact (additive mode, beta = 0), give the source's logits and loss, padding rules included; with the
gates open they do not (the comparison can fail)."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    GPT2ForQuestionAnswering,
    GPT2ForSequenceClassification,
    GPT2ForTokenClassification,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForQuestionAnswering,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
)

import ddl_hf
from tests.builders import gpt2_config, open_gates

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PAD = 0
LABELS = 3
# Row 0 right-padded, row 1 left-padded, row 2 unpadded: the sequence head pools each row's last real token.
IDS = torch.tensor([[5, 6, 7, 8, PAD, PAD], [PAD, PAD, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18]])
MASK = (IDS != PAD).long()

HEADS = {  # task: (GPT-2's head, Llama's head, DeltaGPT's, DeltaLlama's, the Auto class)
    "sequence": (
        GPT2ForSequenceClassification,
        LlamaForSequenceClassification,
        ddl_hf.DeltaGPTForSequenceClassification,
        ddl_hf.DeltaLlamaForSequenceClassification,
        AutoModelForSequenceClassification,
    ),
    "token": (
        GPT2ForTokenClassification,
        LlamaForTokenClassification,
        ddl_hf.DeltaGPTForTokenClassification,
        ddl_hf.DeltaLlamaForTokenClassification,
        AutoModelForTokenClassification,
    ),
    "qa": (
        GPT2ForQuestionAnswering,
        LlamaForQuestionAnswering,
        ddl_hf.DeltaGPTForQuestionAnswering,
        ddl_hf.DeltaLlamaForQuestionAnswering,
        AutoModelForQuestionAnswering,
    ),
}


def sources(family: str) -> tuple[object, object]:
    """The family's source config (with labels and a pad token) and the Delta config its conversion gives."""
    if family == "gpt2":
        config = gpt2_config(num_labels=LABELS, pad_token_id=PAD)
        delta = ddl_hf.convert_gpt2(GPT2LMHeadModel(config)).config
    else:
        config = LlamaConfig(
            vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=PAD, num_labels=LABELS,
        )  # fmt: skip
        delta = ddl_hf.convert_llama(LlamaForCausalLM(config)).config
    delta.num_labels, delta.pad_token_id = LABELS, PAD
    return config, delta


def labels_for(task: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if task == "sequence":
        return {"labels": torch.tensor([2, 0, 1])}
    if task == "token":
        return {"labels": torch.randint(0, LABELS, IDS.shape, generator=g)}
    return {"start_positions": torch.tensor([0, 2, 3]), "end_positions": torch.tensor([3, 5, 4])}


def outputs(out, task: str) -> list[torch.Tensor]:
    return [out.loss, out.logits] if task != "qa" else [out.loss, out.start_logits, out.end_logits]


@pytest.mark.parametrize("task", list(HEADS))
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_head_equals_transformers_head_at_beta_zero(family, task):
    gpt2_head, llama_head, delta_gpt_head, delta_llama_head, auto_class = HEADS[task]
    config, delta_config = sources(family)
    torch.manual_seed(0)
    source = (gpt2_head if family == "gpt2" else llama_head)(config).eval()
    with torch.no_grad():
        for parameter in source.parameters():  # random heads and biases: every weight takes part
            parameter.add_(0.1 * torch.randn_like(parameter))
    head_class = delta_gpt_head if family == "gpt2" else delta_llama_head
    model, info = head_class.from_pretrained(
        None, config=delta_config, state_dict=source.state_dict(), output_loading_info=True
    )
    model.eval()
    # the source's names, weight for weight (GPT-2's `classifier`, Llama's `score`, Llama QA's `transformer`)
    assert set(info["missing_keys"]) == set(model.delta_parameters()) and not info["unexpected_keys"]
    assert type(auto_class.from_config(delta_config)) is head_class

    kwargs = labels_for(task)
    with torch.no_grad():
        expected = outputs(source(IDS, attention_mask=MASK, **kwargs), task)
        got = outputs(model(IDS, attention_mask=MASK, **kwargs), task)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)  # float32, the same ops in the same order

    open_gates(model)  # beta > 0: the Delta terms change every output (so the comparison above could fail)
    with torch.no_grad():
        moved = outputs(model(IDS, attention_mask=MASK, **kwargs), task)
    assert all((a - b).abs().max() > 1e-4 for a, b in zip(moved[1:], expected[1:]))


def test_the_sequence_head_pools_the_last_real_token_and_carries_the_delta_outputs():
    """Each row's pooled logits are those of the row alone, unpadded; the Delta outputs come through."""
    _, delta_config = sources("llama")
    model = ddl_hf.DeltaLlamaForSequenceClassification(delta_config).eval()
    open_gates(model)
    with torch.no_grad():
        out = model(IDS, attention_mask=MASK, output_betas=True)
        alone = torch.cat([model(row[mask.bool()][None]).logits for row, mask in zip(IDS, MASK)])
    torch.testing.assert_close(out.logits, alone, rtol=0, atol=1e-5)
    assert len(out.betas) == 2 * delta_config.num_hidden_layers
    with pytest.raises(ValueError, match="without a padding token"):
        delta_config.pad_token_id = None
        ddl_hf.DeltaLlamaForSequenceClassification(delta_config)(IDS)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_heads_save_and_load_through_the_auto_classes(family, tmp_path):
    _, delta_config = sources(family)
    for task, (*_, delta_gpt_head, delta_llama_head, auto_class) in HEADS.items():
        model = (delta_gpt_head if family == "gpt2" else delta_llama_head)(delta_config).eval()
        model.save_pretrained(tmp_path / task)
        loaded = auto_class.from_pretrained(tmp_path / task).eval()
        assert type(loaded) is type(model)
        with torch.no_grad():
            for a, b in zip(
                outputs(loaded(IDS, attention_mask=MASK), task)[1:], outputs(model(IDS, attention_mask=MASK), task)[1:]
            ):
                assert torch.equal(a, b)
