"""The GPU path kept honest without a GPU: every model runs its forward on fake CUDA tensors, and no tensor it creates
on the CPU is mixed in (the first thing a GPU user would meet: "Expected all tensors to be on the same device").

`FakeTensorMode` gives tensors with a device, shape and dtype but no data; the parameters, buffers and inputs are
made on device "cuda" there, so any op that meets a CPU tensor (one the model made with the wrong device) raises
`FakeTensorDeviceMismatchError`. This needs a torch built with CUDA (CI's newest-torch environment installs one), but
no GPU; elsewhere it is skipped. Each model runs a training forward with its loss in float32 and under bf16 autocast,
and a prefill plus one cached decoding step; GPT2LMHeadModel and LlamaForCausalLM run the same calls as controls.

What this cannot check: the backward (autograd's engine needs a real device context), real kernels (a fake tensor
runs none, so the Delta models run `delta_implementation="eager"`, the tensor ops, rather than "auto"'s Triton op and
fla's rule; which kernels "auto" asks for on CUDA is checked with stand-ins that decline), and numbers.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
from collections.abc import Callable, Iterator
from unittest import mock

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map_only

import ddl_hf.fla_kernels as fla_kernels
import ddl_hf.kernels as backends
from ddl_hf import delta_ops
from ddl_hf.delta_compat import CACHE_ARG, cache_of
from tests.builders import CLIENT_VARIANTS, delta_llama, delta_model, gpt2_model, llama_model


def fake_cuda_problem() -> str | None:
    """Why this torch cannot make fake CUDA tensors here, or None: it must be built with CUDA, and older releases
    (torch 2.7 does) initialise the CUDA driver for a fake tensor too, which fails without a GPU."""
    if not torch.backends.cuda.is_built():
        return "fake CUDA tensors need a torch built with CUDA (no GPU needed)"
    try:
        with FakeTensorMode():
            torch.empty(1).to("cuda")
    except RuntimeError as error:
        first_line = str(error).splitlines()[0]
        return f"torch {torch.__version__} initialises the CUDA driver for a fake CUDA tensor: {first_line}"
    return None


pytestmark = [
    pytest.mark.compat,
    pytest.mark.skipif(fake_cuda_problem() is not None, reason=str(fake_cuda_problem())),
    pytest.mark.usefixtures("one_torch_thread"),
]

BATCH, LENGTH = 2, 8


def eager(model):
    """`model` running the tensor ops: "auto"'s kernels on CUDA (Triton's op, fla's rule) cannot run on fake tensors."""
    model.set_delta_implementation("eager")
    return model


MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "control-gpt2": gpt2_model,
    "control-llama": llama_model,
    "delta_gpt-additive-dv1": lambda: eager(delta_model(**CLIENT_VARIANTS["additive-dv1"])),
    "delta_gpt-paper-dv4-tc": lambda: eager(
        delta_model(delta_mode="paper", delta_value_channels=4, delta_state_read="temporal_conv")
    ),
    "delta_gpt-dv4-cc-ec": lambda: eager(
        delta_model(delta_value_channels=4, delta_state_read="channel_conv", delta_embed_expand="conv")
    ),
    # sigmoid v, shared read
    "delta_gpt-reference-tc-dv4": lambda: eager(delta_model(**CLIENT_VARIANTS["reference-tc-dv4"])),
    "delta_gpt-delta_net-dv1": lambda: eager(delta_model(**CLIENT_VARIANTS["delta_net-dv1"])),
    "delta_llama-dv4-tc": lambda: eager(delta_llama(delta_value_channels=4, delta_state_read="temporal_conv")),
}


@contextlib.contextmanager
def cuda_autocast(dtype: torch.dtype) -> Iterator[None]:
    """`torch.autocast("cuda", dtype)` as on a GPU: without one, torch disables CUDA autocast at construction (and
    asks the device whether it supports bf16), so those two questions are answered as a GPU would answer them."""
    with (
        mock.patch("torch.cuda.is_available", return_value=True),
        mock.patch("torch.cuda.is_bf16_supported", return_value=True),
    ):
        context = torch.autocast("cuda", dtype=dtype)
    with context:
        yield


def on_cuda(model: torch.nn.Module, mode: FakeTensorMode) -> dict[str, torch.Tensor]:
    """Fake CUDA copies of the model's parameters and buffers, by name (for `torch.func.functional_call`)."""
    named = itertools.chain(model.named_parameters(), model.named_buffers())
    return {name: mode.from_tensor(tensor).to("cuda") for name, tensor in named}


def devices(output) -> set[str]:
    leaves, _ = tree_flatten(tree_map_only(torch.Tensor, lambda t: t.device.type, dict(output)))
    return {leaf for leaf in leaves if isinstance(leaf, str)}


@pytest.fixture(params=MODELS, scope="module")
def model(request) -> torch.nn.Module:
    return MODELS[request.param]().eval()


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["float32", "bf16-autocast"])
def test_a_training_forward_runs_on_cuda_tensors_only(model, autocast):
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    with mode:
        state = on_cuda(model, mode)
        ids = torch.randint(1, 90, (BATCH, LENGTH), device="cuda")
        with cuda_autocast(autocast) if autocast else contextlib.nullcontext():
            out = torch.func.functional_call(model, state, (), {"input_ids": ids, "labels": ids})
    assert out.loss.device.type == "cuda" and out.loss.requires_grad
    assert devices(out) == {"cuda"}
    # The sublayers ran in bf16 under autocast; the Delta update and the loss stay float32.
    assert out.logits.dtype == (autocast or torch.float32)
    assert out.loss.dtype == torch.float32


def test_a_prefill_and_a_cached_decoding_step_run_on_cuda_tensors_only(model):
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    with mode, torch.no_grad():
        state = on_cuda(model, mode)
        ids = torch.randint(1, 90, (BATCH, LENGTH), device="cuda")
        mask = torch.ones(BATCH, LENGTH + 1, dtype=torch.long, device="cuda")
        prefill = torch.func.functional_call(model, state, (), {"input_ids": ids, "use_cache": True})
        step = torch.func.functional_call(
            model,
            state,
            (),
            {"input_ids": ids[:, -1:], CACHE_ARG: cache_of(prefill), "attention_mask": mask, "use_cache": True},
        )
    assert step.logits.shape == (BATCH, 1, model.config.vocab_size)
    assert devices(prefill) == devices(step) == {"cuda"}


def test_a_delta_net_model_on_cuda_asks_auto_for_flas_rule_and_tritons_residual_op(monkeypatch):
    """ "auto" (the default) on CUDA tensors: each DeltaNet layer hands its delta rule to fla's kernel where fla is
    installed, and each Delta residual to Triton's op where Triton imports (`ddl_hf.kernels`). Stand-ins for the two
    record the calls and decline (a fake tensor runs no kernel), so the torch forms run, on CUDA tensors only."""
    asked = collections.Counter()

    def declining(name: str):
        def kernel(*args):
            asked[name] += 1
            return None

        return kernel

    monkeypatch.setattr(fla_kernels, "fla_delta_rule", declining("delta_rule"))
    triton = backends.triton_problem() is None
    if triton:
        import ddl_hf.triton_delta as triton_delta

        monkeypatch.setattr(triton_delta, "residual", declining("residual"))
    monkeypatch.setattr(delta_ops, "_CHOSEN", {})  # chosen afresh, from the stand-ins
    model = delta_model(**CLIENT_VARIANTS["delta_net-dv1"]).eval()
    assert model.config.delta_implementation == "auto"
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    with mode:
        state = on_cuda(model, mode)
        ids = torch.randint(1, 90, (BATCH, LENGTH), device="cuda")
        out = torch.func.functional_call(model, state, (), {"input_ids": ids, "labels": ids})
    assert devices(out) == {"cuda"} and out.loss.requires_grad
    assert asked["delta_rule"] == (model.config.n_layer if fla_kernels.fla_available() else 0)
    assert asked["residual"] == (len(model.delta_residuals()) if triton else 0)
