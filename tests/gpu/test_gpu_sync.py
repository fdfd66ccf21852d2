"""No host synchronisation on a CUDA device: a training step (bf16 autocast forward with labels, backward) and one
cached decoding step of every variant under `torch.cuda.set_sync_debug_mode("error")`, which raises at any call
that waits for the device (`.item()`, `.tolist()`, a data-dependent shape). Each runs once before, to warm up (the
first call may read what it caches). GPT2LMHeadModel and LlamaForCausalLM of the same shape are the controls: a
control that fails says the harness or transformers synchronises, not the Delta model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from ddl_hf.delta_compat import cache_argument, cache_of
from tests.gpu.gpu_models import CHECK, VARIANTS, baseline, bf16_autocast, delta_of, random_ids

pytestmark = pytest.mark.gpu

CONTROLS = ("gpt2", "llama")


@pytest.fixture(scope="module", params=[*(f"control-{family}" for family in CONTROLS), *VARIANTS])
def model_and_ids(request, device) -> tuple[torch.nn.Module, torch.Tensor]:
    name = request.param
    source = baseline(name.removeprefix("control-") if name.startswith("control-") else VARIANTS[name][0], CHECK)
    model = (source if name.startswith("control-") else delta_of(name, source)).to(device)
    yield model, random_ids(model.config.vocab_size, CHECK["batch"], CHECK["seq"], seed=3).to(device)
    del model
    torch.cuda.empty_cache()


@contextlib.contextmanager
def sync_debug_error() -> Iterator[None]:
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_a_training_step_does_not_synchronise(model_and_ids):
    model, ids = model_and_ids
    model.train()

    def step() -> None:
        with bf16_autocast(ids.device):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()

    try:
        step()
        model.zero_grad(set_to_none=True)
        with sync_debug_error():
            step()
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()


def test_a_cached_decoding_step_does_not_synchronise(model_and_ids):
    """Prefill, one step to warm up, then a step under the debug mode (no mask: an unpadded batch)."""
    model, ids = model_and_ids
    with torch.no_grad():
        out = model(input_ids=ids[:, : CHECK["prompt"]], use_cache=True)
        cache = cache_of(out)
        token = out.logits[:, -1:].argmax(-1)
        token = model(input_ids=token, use_cache=True, **cache_argument(cache)).logits[:, -1:].argmax(-1)
        with sync_debug_error():
            model(input_ids=token, use_cache=True, **cache_argument(cache))
