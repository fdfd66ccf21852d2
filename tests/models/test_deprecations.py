"""Early warning: the core paths with every FutureWarning / DeprecationWarning turned into an error, and transformers'
logged deprecation notices ("`past_key_values` ... deprecated") failing the test too.

transformers deprecates a name a dozen releases before it removes it (5.24 renamed `past_key_values` to `cache`,
removal in 5.40). These tests make the next rename fail our CI on the release that announces it, while the old name
still works, not on the day it is removed."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, StaticCache, Trainer, TrainingArguments, pipeline
from transformers.utils import logging as hf_logging

import ddl_hf
from ddl_hf.delta_compat import CACHE_ARG, cache_of
from tests.builders import (
    BYTE_LEVEL,
    CLIENT_VARIANTS,
    VOCAB,
    build_source,
    delta_model,
    enable_activation_checkpointing,
    gpt2_model,
    random_ids,
    scramble_delta_weights,
)
from tests.builders import LLAMA_FAMILIES as FAMILIES
from tests.builders import open_llama_gates as open_gates
from tests.gpt2_fixtures import byte_tokenizer
from tests.greedy import greedy_reference

pytestmark = pytest.mark.filterwarnings("error::FutureWarning", "error::DeprecationWarning")


class LoggedNotices(logging.Handler):
    """transformers' logged deprecation notices during a test. Those that the same call on transformers' own model
    logs too (`while_reference_runs`) are transformers' own (its pipeline on some releases), not ours."""

    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.notices: list[str] = []
        self.theirs: set[str] = set()
        self.recording_theirs = False

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "deprecat" in message.lower():
            (self.theirs.add if self.recording_theirs else self.notices.append)(message)

    @contextlib.contextmanager
    def while_reference_runs(self):
        self.recording_theirs = True
        try:
            yield
        finally:
            self.recording_theirs = False
            logging.Logger.warning_once.cache_clear()  # so that our call logs the same notice again, if it does

    def ours(self) -> list[str]:
        return [message for message in self.notices if message not in self.theirs]


@pytest.fixture(autouse=True)
def logged_notices():
    """transformers logs some deprecations (once per process) instead of warning: fail on those as well."""
    logging.Logger.warning_once.cache_clear()  # transformers' `warning_once` would hide a notice seen earlier
    handler = LoggedNotices()
    root = hf_logging.get_logger()
    root.addHandler(handler)
    yield handler
    root.removeHandler(handler)
    assert not handler.ours(), handler.ours()


GREEDY = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("variant", ["additive-dv1", "paper-dv4", "delta_net-dv1", "tc-ec-paper-dv4"])
def test_forward_and_every_generation_mode(variant):
    model = delta_model(CLIENT_VARIANTS[variant])
    scramble_delta_weights(model)
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, use_cache=False, output_hidden_states=True, output_betas=True)
        model(ids[:, -1:], cache=cache_of(model(ids[:, :-1], use_cache=True)))
    uncached = greedy_reference(model, ids, use_cache=False, **GREEDY)
    uncached.assert_matches(model.generate(ids, **GREEDY)[:, ids.shape[1] :])
    model.generate(ids, num_beams=2, **GREEDY)
    torch.manual_seed(0)
    model.generate(ids, max_new_tokens=3, do_sample=True, top_k=5, pad_token_id=0)
    if variant in ("additive-dv1", "paper-dv4"):
        uncached.assert_matches(model.generate(ids, cache_implementation="static", **GREEDY)[:, ids.shape[1] :])
        # Prompt lookup: assisted decoding's cache cropping (an assistant model would log transformers' own notice
        # about its generation_config, GPT2LMHeadModel's as well).
        greedy_reference(model, ids[:1], **GREEDY).assert_matches(
            model.generate(ids[:1], prompt_lookup_num_tokens=2, **GREEDY)[:, ids.shape[1] :]
        )


@pytest.mark.parametrize("family", list(FAMILIES))
def test_delta_llama_forward_generate_and_conversion(family):
    source = build_source(family)
    model = open_gates(ddl_hf.convert_llama(source, delta_value_channels=4).eval())
    ids = random_ids(2, 7)
    greedy_reference(model, ids, **GREEDY).assert_matches(
        model.generate(ids, use_cache=False, **GREEDY)[:, ids.shape[1] :]
    )
    closed = ddl_hf.convert_llama(source).eval()
    assert torch.equal(closed.generate(ids, **GREEDY), source.generate(ids, **GREEDY))
    torch.testing.assert_close(ddl_hf.export_to_llama(closed)(ids).logits, source(ids).logits, rtol=0, atol=0)


def test_batched_pipeline_of_a_converted_gpt2(logged_notices):
    tokenizer = byte_tokenizer()
    tokenizer.pad_token, tokenizer.padding_side = tokenizer.eos_token, "left"
    source = gpt2_model(BYTE_LEVEL)
    model = ddl_hf.convert_gpt2(source).eval()
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    reference = pipeline("text-generation", model=source, tokenizer=tokenizer)
    prompts = ["The mill", "A river runs under the bridge"]
    kwargs = dict(batch_size=2, max_new_tokens=6, do_sample=False)
    with logged_notices.while_reference_runs():
        expected = reference(prompts, **kwargs)
    assert generator(prompts, **kwargs) == expected


def test_conversion_to_a_directory_reloads_through_the_hub_code(tmp_path):
    tokenizer = byte_tokenizer()
    ddl_hf.convert_checkpoint(gpt2_model(BYTE_LEVEL), tmp_path / "delta", tokenizer=tokenizer, progress=False)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "delta", trust_remote_code=True)
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(1))
    reloaded.generate(ids, **GREEDY)


def test_trainer_steps_with_and_without_activation_checkpointing(tmp_path):
    from datasets import Dataset

    ids = torch.randint(1, VOCAB, (8, 12), generator=torch.Generator().manual_seed(0))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    for checkpointing in (False, True):
        model = delta_model(CLIENT_VARIANTS["paper-dv4"]).train()
        if checkpointing:
            enable_activation_checkpointing(model)
        args = TrainingArguments(
            tmp_path / str(checkpointing), max_steps=2, per_device_train_batch_size=4, report_to=[], use_cpu=True
        )
        Trainer(model=model, args=args, train_dataset=data).train()


def test_a_static_cache_object_passed_in():
    model = delta_model()
    ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    cache = StaticCache(config=model.config, max_cache_len=16)
    cached = model.generate(ids, **{CACHE_ARG: cache}, **GREEDY)  # generate's name for it on this release
    greedy_reference(model, ids, use_cache=False, **GREEDY).assert_matches(cached[:, ids.shape[1] :])
