"""peft methods that pick their target modules by model type work on DeltaGPT as they do on GPT-2."""

from __future__ import annotations

import pytest
import torch
from peft import IA3Config, LoraConfig, TaskType
from transformers import GPT2Config, GPT2LMHeadModel

import ddl_hf
from tests.builders import adapted_modules

SHAPE = dict(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=32)


@pytest.mark.filterwarnings("ignore::UserWarning")  # peft's fan_in_fan_out note for GPT-2's Conv1D
@pytest.mark.parametrize("make_config", [LoraConfig, IA3Config], ids=["lora", "ia3"])
def test_default_targets_match_gpt2(make_config):
    gpt2 = adapted_modules(GPT2LMHeadModel(GPT2Config(**SHAPE)), make_config(task_type=TaskType.CAUSAL_LM))
    delta = adapted_modules(
        ddl_hf.DeltaGPTForCausalLM(ddl_hf.DeltaGPTConfig(**SHAPE)), make_config(task_type=TaskType.CAUSAL_LM)
    )
    assert gpt2 and delta == gpt2


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("make_config", [LoraConfig, IA3Config], ids=["lora", "ia3"])
def test_default_targets_of_the_delta_net_mixer_are_its_projections(make_config):
    model = ddl_hf.DeltaGPTForCausalLM(ddl_hf.DeltaGPTConfig(**SHAPE, token_mixer="delta_net"))
    names = adapted_modules(model, make_config(task_type=TaskType.CAUSAL_LM))
    attention = [n for n in names if ".attn." in n]
    assert attention == sorted(f"transformer.h.{i}.attn.{p}_proj" for i in range(2) for p in "kqv")
    assert not any("_delta" in n for n in names)  # never the Delta residuals' own v_proj
    ids = torch.randint(0, SHAPE["vocab_size"], (1, 6))
    model(ids, labels=ids).loss.backward()  # the adapted model trains
