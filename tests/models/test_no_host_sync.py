"""No forward or backward reads tensor data back to the host: no `.item()`, `.tolist()`, `int()`,
`bool()` or `float()` of a tensor, which on an accelerator stalls the host until the device catches up.

Each call runs the model's own forward (and backward) under `FakeTensorMode`, on fake copies of its parameters,
buffers and inputs: tensors with shapes, dtypes and devices but no data, so any host read of their values raises
(`DataDependentOutputException`; a data-dependent output shape, as `nonzero` gives, raises too). Every call first
runs on the real tensors, so that a failure here is a host read, not a call the model refuses, and so that anything
the model caches on first use is a real tensor (which the mode fakes again, without its values, when it meets it).
GPT2LMHeadModel and LlamaForCausalLM run the same calls as controls. transformers skips its own mask shortcuts that
read the attention mask (`is_tracing` counts a fake tensor as tracing), so the test does not see those.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import traceback
from collections.abc import Callable, Iterator

import pytest
import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.utils._pytree import tree_map_only

from ddl_hf.delta_compat import CACHE_ARG, cache_of
from tests.builders import CLIENT_VARIANTS, VOCAB, delta_llama, delta_model, gpt2_model, llama_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BATCH, LENGTH = 2, 8


#: Each model by id: every DeltaGPT client variant (both modes at d_v 1 and 4, DeltaNet, TC, TC + EC, CC, the
#: sigmoid value of the reference configuration), DeltaLlama, and the two transformers models as controls.
MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    **{f"delta_gpt-{name}": (lambda fields=fields: delta_model(**fields)) for name, fields in CLIENT_VARIANTS.items()},
    "delta_llama-llama-dv1": lambda: delta_llama(),
    "delta_llama-llama-paper-dv4": lambda: delta_llama(delta_mode="paper", delta_value_channels=4),
    "delta_llama-llama-tc-dv4": lambda: delta_llama(delta_value_channels=4, delta_state_read="temporal_conv"),
    "control-gpt2": gpt2_model,
    "control-llama": llama_model,
}


class OnFakeTensors:
    """`model`'s forward on fake copies of its parameters and buffers (fake leaves that collect their gradients) and
    of the tensors passed in: `torch.func.functional_call` swaps them in, so the model's own code runs unchanged."""

    def __init__(self, model: torch.nn.Module):
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.model = model
        named = itertools.chain(model.named_parameters(), model.named_buffers())
        self.state = {name: self.mode.from_tensor(tensor) for name, tensor in named}

    def __call__(self, **inputs):
        inputs = tree_map_only(torch.Tensor, self.mode.from_tensor, inputs)
        with self.mode, naming_the_host_read():
            return torch.func.functional_call(self.model, self.state, (), inputs)

    def backward(self, loss: torch.Tensor) -> None:
        with self.mode, naming_the_host_read():
            loss.backward()


@contextlib.contextmanager
def naming_the_host_read() -> Iterator[None]:
    """A host read fails the test with the line that made it (the innermost frame outside torch), not with a
    traceback through torch's fake-tensor dispatch."""
    try:
        yield
    except (DataDependentOutputException, DynamicOutputShapeException) as error:
        torch_dir = os.path.dirname(torch.__file__)
        frame = [frame for frame in traceback.extract_tb(error.__traceback__) if torch_dir not in frame.filename][-1]
        where = f"{type(error).__name__}({error}) at {frame.filename}:{frame.lineno} in {frame.name}: {frame.line}"
        raise pytest.fail.Exception(f"Host read of tensor data: {where}", pytrace=False) from None


def token_ids(batch: int = BATCH, length: int = LENGTH, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def left_padded_mask() -> torch.Tensor:
    mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
    mask[1, :3] = 0
    return mask


def training_inputs(case: str) -> dict[str, torch.Tensor | int]:
    ids = token_ids()
    if case == "no-mask":
        return dict(input_ids=ids, labels=ids)
    if case == "left-padded-mask":
        mask = left_padded_mask()
        return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    if case == "packed-position-ids":  # documents of 3 + 5 and 2 + 2 + 4 tokens in the two rows
        position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 0, 1, 0, 1, 2, 3]])
        return dict(input_ids=ids, position_ids=position_ids, labels=ids)
    # One padding-free row as DataCollatorWithFlattening(return_flash_attn_kwargs=True) makes it: documents of 3 + 5.
    ids = ids[:1]
    cu_seq_lens = torch.tensor([0, 3, LENGTH], dtype=torch.int32)
    return dict(
        input_ids=ids,
        position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]),
        cu_seq_lens_q=cu_seq_lens,
        cu_seq_lens_k=cu_seq_lens,
        max_length_q=5,
        max_length_k=5,
        labels=ids,
    )


def training_step(forward: Callable, backward: Callable, inputs: dict) -> torch.Tensor:
    loss = forward(**inputs, use_cache=False).loss
    backward(loss)
    return loss


def prefill_and_decode(forward: Callable, as_generate: bool) -> torch.Tensor:
    """A prompt into a new cache, then one token from that cache: plainly (no mask), or as `generate` calls the
    model for a left-padded batch (the mask, and position_ids counted from it, every step)."""
    ids, next_ids = token_ids(), token_ids(length=1, seed=1)
    if not as_generate:
        prefill, step = dict(input_ids=ids), dict(input_ids=next_ids)
    else:
        mask = torch.cat([left_padded_mask(), torch.ones(BATCH, 1, dtype=torch.long)], dim=1)
        position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        prefill = dict(input_ids=ids, attention_mask=mask[:, :-1], position_ids=position_ids[:, :-1])
        step = dict(input_ids=next_ids, attention_mask=mask, position_ids=position_ids[:, -1:])
    with torch.no_grad():
        cache = cache_of(forward(**prefill, use_cache=True))
        return forward(**step, use_cache=True, **{CACHE_ARG: cache}).logits


@pytest.mark.parametrize("case", ["no-mask", "left-padded-mask", "packed-position-ids", "packed-flash-kwargs"])
@pytest.mark.parametrize("name", list(MODELS))
def test_training_step_reads_nothing_back(name, case):
    model = MODELS[name]().train()
    inputs = training_inputs(case)
    training_step(model, torch.Tensor.backward, inputs)  # the same step on real tensors runs
    fake = OnFakeTensors(model)
    assert isinstance(training_step(fake, fake.backward, inputs), FakeTensor)
    # the fake backward reached the parameters the real one did
    reached = {name for name, param in model.named_parameters() if param.grad is not None}
    assert reached and {name for name, param in fake.state.items() if param.grad is not None} == reached


@pytest.mark.parametrize("as_generate", [False, True], ids=["plain", "left-padded-as-generate"])
@pytest.mark.parametrize("name", list(MODELS))
def test_prefill_and_one_cached_step_read_nothing_back(name, as_generate):
    model = MODELS[name]()
    prefill_and_decode(model, as_generate)  # the same calls on real tensors run
    assert isinstance(prefill_and_decode(OnFakeTensors(model), as_generate), FakeTensor)


@pytest.mark.parametrize("name", ["delta_gpt-additive-dv1", "delta_llama-llama-paper-dv4"])
def test_the_beta_statistics_callback_reads_nothing_back_during_training(name):
    """`DeltaStatsCallback`'s forward hooks keep their sums on the device: a training step with them attached runs
    on fake tensors, and the sums it left are fake (the hooks ran). The host reads them once per log."""
    from ddl_hf.callbacks import DeltaStatsCallback

    model = MODELS[name]().train()
    callback = DeltaStatsCallback()
    callback.on_train_begin(None, None, None, model=model)
    try:
        inputs = training_inputs("left-padded-mask")
        training_step(model, torch.Tensor.backward, inputs)
        assert callback.pop_stats()["beta_mean"] >= 0.0  # real tensors: the statistics come out as numbers
        fake = OnFakeTensors(model)
        training_step(fake, fake.backward, inputs)
        sums = list(callback._sums.values())
        assert len(sums) == len(model.delta_residuals())
        assert all(isinstance(tensor, FakeTensor) for _, *tensors in sums for tensor in tensors)
    finally:
        callback.remove_hooks()
