"""`delta_implementation`, the per-model choice of kernels (as transformers' `attn_implementation` chooses attention).

The contract: a config field of both families defaulting to "auto", one of `DELTA_IMPLEMENTATIONS` or a ValueError
naming them; how this process runs a model, not what the model is, so `save_pretrained` does not write it and
`from_pretrained(..., delta_implementation=...)` sets it; `set_delta_implementation` refuses, before any forward, what
cannot run here and leaves the model as it was; "native" on the CPU gives the loss, gradients and logits of "eager"
to within float32 rounding (bounds measured against a float64 copy, as tests/rounding.py does); two models in one
process run their own implementations at the same time. The kernels themselves: tests/ops/test_native_kernels.py,
tests/ops/test_triton_delta.py, tests/ops/test_fla_kernels.py.
"""

from __future__ import annotations

import copy
import importlib.util
import json

import pytest
import torch

import ddl_hf.kernels as backends
import ddl_hf.native as native
from ddl_hf import DeltaGPTConfig, DeltaLlamaConfig, delta_ops
from ddl_hf.delta_ops import DELTA_IMPLEMENTATIONS, DeltaKernels
from ddl_hf.kernels import DeltaImplementationUnavailable
from tests.builders import VOCAB, build_source, delta_model, to_delta, variant_model
from tests.rounding import ROUNDING_FACTOR, float64_logits_and_bound

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHOICES = r"\('auto', 'eager', 'triton', 'native'\)"
TC = dict(delta_value_channels=4, delta_state_read="temporal_conv", delta_mode="paper")
EPS32 = torch.finfo(torch.float32).eps


def delta_llama(**fields):
    return to_delta(build_source("llama"), delta_value_channels=4, **fields)


FAMILIES = {"delta_gpt": delta_model, "delta_llama": delta_llama}


@pytest.fixture
def cold_kernel_cache(monkeypatch):
    """An empty cache of chosen kernels (what a fresh process has), put back after the test."""
    monkeypatch.setattr(delta_ops, "_CHOSEN", {})


def test_a_config_field_of_both_families_defaulting_to_auto():
    assert DELTA_IMPLEMENTATIONS == ("auto", "eager", "triton", "native")
    for config_class in (DeltaGPTConfig, DeltaLlamaConfig):
        assert config_class().delta_implementation == "auto"
        for name in DELTA_IMPLEMENTATIONS:
            assert config_class(delta_implementation=name).delta_implementation == name
        for bad in ("flash", "Eager", None):
            with pytest.raises(ValueError, match=rf"delta_implementation={bad!r} is invalid.*{CHOICES}"):
                config_class(delta_implementation=bad)


@pytest.mark.parametrize("family", FAMILIES)
def test_it_is_not_saved_and_from_pretrained_sets_it(family, tmp_path):
    """Not in config.json (nor `to_dict`), whatever the model ran: a saved model loads as "auto" unless
    `from_pretrained` is told otherwise, through the model class and the Auto class alike."""
    from transformers import AutoModelForCausalLM

    model = FAMILIES[family]()
    model.set_delta_implementation("eager")
    assert model.config.delta_implementation == "eager"
    assert "delta_implementation" not in model.config.to_dict()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "delta_implementation" not in saved and "delta_mode" in saved  # the model's own fields are saved
    assert type(model).from_pretrained(tmp_path).config.delta_implementation == "auto"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, delta_implementation="eager")
    assert type(loaded) is type(model) and loaded.config.delta_implementation == "eager"
    with pytest.raises(ValueError, match=CHOICES):
        type(model).from_pretrained(tmp_path, delta_implementation="fast")


def test_set_delta_implementation_refuses_what_cannot_run_and_keeps_the_model_as_it_was(monkeypatch):
    """An unknown name (ValueError naming the choices), "triton" without Triton and "native" without a compiler
    (`DeltaImplementationUnavailable` naming what is missing): refused when set, before any forward, and the model
    keeps running what it ran; a model asked to be built that way is not built."""
    model = delta_model()
    ids = torch.tensor([[4, 8, 15, 16]])
    with torch.no_grad():
        before = model(ids).logits
    with pytest.raises(ValueError, match=CHOICES):
        model.set_delta_implementation("compiled")
    monkeypatch.setattr(backends, "triton_problem", lambda: "Triton is not installed")
    monkeypatch.setattr(native, "native_build_problem", lambda: "no C++ compiler on PATH")
    with pytest.raises(DeltaImplementationUnavailable, match=r"'triton' cannot run here: Triton is not installed"):
        model.set_delta_implementation("triton")
    with pytest.raises(DeltaImplementationUnavailable, match=r"'native' cannot be built here: no C\+\+ compiler"):
        model.set_delta_implementation("native")
    with pytest.raises(DeltaImplementationUnavailable, match="'native' cannot be built here"):
        delta_model(delta_implementation="native")
    assert model.config.delta_implementation == "auto"
    model.set_delta_implementation("eager")  # always runs
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)  # "auto" on the CPU is the tensor ops, as "eager"


def losses_and_grads(model, ids) -> tuple[torch.Tensor, torch.Tensor]:
    """The next-token loss in the model's dtype (transformers' own loss casts the logits to float32, which would round
    the float64 reference) and every gradient, flattened in parameter order."""
    model.zero_grad()
    logits = model(ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def rounding_bound(float32: torch.Tensor, float64: torch.Tensor) -> float:
    """As `rounding.float64_logits_and_bound`: `ROUNDING_FACTOR` times the float32 run's distance from the float64
    one, at least a few roundings of the largest value."""
    measured = float((float32.double() - float64).abs().max())
    return ROUNDING_FACTOR * max(measured, 4 * EPS32 * float(float64.abs().max()))


def test_native_on_the_cpu_gives_the_loss_gradients_and_logits_of_eager_to_float32_rounding():
    """A TC model (the update and the read kernels in training, the inference step in the forward without autograd):
    "native" in float32 is as far from the float64 copy of the model as "eager" in float32 may be."""
    if problem := native.native_build_problem():
        pytest.skip(f"the native kernels cannot be built here: {problem}")
    model = variant_model(**TC, delta_implementation="eager").train()
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    loss64, grads64 = losses_and_grads(copy.deepcopy(model).double(), ids)
    loss_eager, grads_eager = losses_and_grads(model, ids)
    model.set_delta_implementation("native")
    loss_native, grads_native = losses_and_grads(model, ids)
    assert not torch.equal(grads_native, grads_eager)  # another implementation ran
    torch.testing.assert_close(loss_native.double(), loss64, rtol=0, atol=rounding_bound(loss_eager, loss64))
    torch.testing.assert_close(grads_native.double(), grads64, rtol=0, atol=rounding_bound(grads_eager, grads64))
    model.eval().set_delta_implementation("eager")
    logits64, bound = float64_logits_and_bound(model, ids)
    model.set_delta_implementation("native")
    with torch.no_grad():
        logits = model(ids).logits
    torch.testing.assert_close(logits.double(), logits64, rtol=0, atol=bound)


def test_two_models_in_one_process_run_their_own_implementations_at_once(monkeypatch, cold_kernel_cache):
    """A "native" model and an "eager" one, the eager one run from inside the native one's forward: the native
    model's residuals ask its kernel (a stand-in that records and declines, so this needs no compiler), the eager
    model's never do, and each gives the logits it gives alone."""
    asked = []

    def residual_step(state, x, c, h, weights):
        asked.append(state.shape)
        return None  # declined: the tensor ops run

    chosen = backends.kernels_for
    monkeypatch.setattr(native, "native_build_problem", lambda: None)
    monkeypatch.setattr(
        backends,
        "kernels_for",
        lambda name, device: DeltaKernels(residual_step=residual_step) if name == "native" else chosen(name, device),
    )
    fast = delta_model(delta_value_channels=4, delta_implementation="native")
    plain = delta_model(delta_value_channels=4, delta_implementation="eager", seed=1)
    ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain_alone = plain(ids).logits
        assert not asked
        fast_alone = fast(ids).logits
        residuals = len(fast.delta_residuals())
        assert len(asked) == residuals
        inside = []
        handle = fast.transformer.h[0].register_forward_hook(lambda *args: inside.append(plain(ids).logits))
        asked.clear()
        together = fast(ids).logits
        handle.remove()
    assert len(asked) == residuals  # the native model's residuals only
    assert torch.equal(together, fast_alone) and torch.equal(inside[0], plain_alone)


def test_the_first_forward_of_a_process_compiles_into_one_graph(cold_kernel_cache):
    """`torch.compile(model, fullgraph=True)` with the default "auto" before any eager forward (a fresh process: the
    kernels are loaded when the model is built, so that the traced forward only looks them up)."""
    delta_ops._CHOSEN.clear()  # as a fresh process
    model = delta_model(delta_value_channels=4)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    torch._dynamo.reset()
    with torch.no_grad():
        logits = torch.compile(model, fullgraph=True, backend="eager")(ids).logits
        expected = model(ids).logits
    torch.testing.assert_close(logits, expected)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize(("capability", "takes_triton"), [((6, 0), False), ((7, 0), True), ((9, 0), True)])
def test_auto_takes_triton_only_on_a_gpu_triton_runs_on(monkeypatch, capability, takes_triton):
    """ "auto" on CUDA takes the Triton ops on compute capability 7.0 and newer and the tensor ops on older GPUs
    (Triton does not run there); asking for "triton" on such a GPU is a clear error. The GPU is simulated: what the
    choice reads of it is `torch.cuda`'s answer."""
    from ddl_hf import kernels, triton_delta

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    chosen = kernels.kernels_for("auto", "cuda")
    assert (chosen.residual is triton_delta.residual) == takes_triton
    assert (chosen.read is triton_delta.read) == takes_triton
    if takes_triton:
        assert kernels.kernels_for("triton", "cuda").residual is triton_delta.residual
    else:
        with pytest.raises(kernels.DeltaImplementationUnavailable, match=r"compute capability 7\.0"):
            kernels.kernels_for("triton", "cuda")
