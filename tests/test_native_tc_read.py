"""The optional native TC read (`ddl_hf.native.enable_native_tc_read`) against the readable definition.

The kernel stands in for `temporal_conv_read`'s tensor ops, forward and backward, so it is held to the same
contract: the definition `temporal_conv(cat([past or zeros, x]), w).sum(-1)` in float64 (values, gradients,
`gradcheck`) with a cached window, in packed rows and both together; and in a model, the losses, gradients and
generated tokens of the tensor-op model, under left padding, packed rows, the cache, and bf16 autocast. It runs
only where it applies (CPU float32 / float64, not compiling). Built with the machine's C++ compiler; where there
is none, the tests that need it are skipped with the reason, and the error a user gets is tested instead.
"""

from __future__ import annotations

import copy

import pytest
import torch
from builders import VOCAB
from test_delta_net_clients import packed_row
from test_variants import variant_model

import ddl_hf.native as native
from ddl_hf.delta_ops import same_document_taps, temporal_conv, temporal_conv_read
from ddl_hf.modeling_delta_gpt import DeltaStateConv
from ddl_hf.native import NativeKernelUnavailable, disable_native_tc_read, enable_native_tc_read

TC = dict(delta_value_channels=4, delta_state_read="temporal_conv", delta_mode="paper")


@pytest.fixture(scope="module")
def kernel():
    problem = native.native_build_problem()
    if problem is not None:
        pytest.skip(f"the native kernel cannot be built here: {problem}")
    return native.load_tc_read_kernel()


class Counting:
    """`kernel` with a count of its forward and backward calls."""

    def __init__(self, kernel):
        self.kernel, self.forwards, self.backwards = kernel, 0, 0

    def tc_read_forward(self, *args):
        self.forwards += 1
        return self.kernel.tc_read_forward(*args)

    def tc_read_backward(self, *args):
        self.backwards += 1
        return self.kernel.tc_read_backward(*args)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("cached", [False, True], ids=["no-cache", "cache"])
@pytest.mark.parametrize("packed", [False, True], ids=["one-document", "packed"])
def test_the_native_read_is_the_convolution_summed_over_channels(kernel, size, cached, packed):
    g = torch.Generator().manual_seed(10 * size + 2 * cached + packed)
    x = torch.randn(2, 6, 5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, 3, size, generator=g, dtype=torch.float64, requires_grad=True)
    past = torch.randn(2, size - 1, 5, 3, generator=g, dtype=torch.float64) if cached else None
    taps = same_document_taps(torch.rand(2, 6, generator=g) < 0.4, size) if packed else None
    history = torch.cat([past if cached else x.new_zeros(2, size - 1, 5, 3), x], dim=1)
    expected = temporal_conv(history, weight, taps).sum(-1)
    spy = Counting(kernel)
    got = temporal_conv_read(x, weight, past, taps, spy)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    grad_out = torch.randn(expected.shape, generator=g, dtype=torch.float64)
    for mine, want in zip(
        torch.autograd.grad(got, (x, weight), grad_out), torch.autograd.grad(expected, (x, weight), grad_out)
    ):
        torch.testing.assert_close(mine, want, rtol=0, atol=1e-12)
    assert (spy.forwards, spy.backwards) == (1, 1)
    assert torch.autograd.gradcheck(lambda a, w: temporal_conv_read(a, w, past, taps, kernel), (x, weight))


def test_the_native_read_computes_only_the_gradients_asked_for(kernel):
    x = torch.randn(1, 5, 4, 2, dtype=torch.float64)
    weight = torch.randn(4, 2, 3, dtype=torch.float64, requires_grad=True)
    (grad_weight,) = torch.autograd.grad(temporal_conv_read(x, weight, kernel=kernel).sum(), weight)
    expected = torch.autograd.grad(temporal_conv_read(x, weight).sum(), weight)[0]
    torch.testing.assert_close(grad_weight, expected, rtol=0, atol=1e-12)


def spy_on(model) -> Counting:
    """Enable the native read on `model` with one counting wrapper shared by all its TC reads."""
    enable_native_tc_read(model)
    reads = [m for m in model.modules() if isinstance(m, DeltaStateConv)]
    spy = Counting(reads[0].native_read)
    for read in reads:
        read.native_read = spy
    return spy


def losses_and_grads(model, ids, **kwargs):
    model.zero_grad()
    loss = model(ids, labels=ids, **kwargs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("variant", [{}, {"delta_embed_expand": "conv"}], ids=["TC", "TC+EC"])
def test_a_model_trains_with_the_native_read_as_with_tensor_ops(kernel, variant):
    """Loss and every gradient, left-padded batch with the cache (Trainer's default) and without, float32."""
    model = variant_model(**TC, **variant).train()
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    reads = [m for m in model.modules() if isinstance(m, DeltaStateConv)]
    for use_cache in (True, False):
        plain = losses_and_grads(model, ids, attention_mask=mask, use_cache=use_cache)
        spy = spy_on(model)
        fast = losses_and_grads(model, ids, attention_mask=mask, use_cache=use_cache)
        disable_native_tc_read(model)
        assert spy.forwards == spy.backwards == len(reads)  # every TC read, the read-out's included
        torch.testing.assert_close(fast[0], plain[0], rtol=1e-6, atol=1e-6)
        assert fast[1].keys() == plain[1].keys()
        for name, grad in plain[1].items():
            torch.testing.assert_close(fast[1][name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_packed_row_reads_each_document_alone_with_the_native_read(kernel):
    model = variant_model(**TC).eval()
    spy = spy_on(model)
    docs, ids, position_ids, _ = packed_row()
    with torch.no_grad():
        packed = model(ids, position_ids=position_ids, use_cache=False).logits[0]
        alone = torch.cat([model(doc[None]).logits[0] for doc in docs])
    assert spy.forwards > 0
    assert (packed - alone).abs().max() <= 1e-5
    with torch.no_grad():
        leaked = model(ids, use_cache=False).logits[0]  # the same row read as one document
    assert (leaked - alone).abs().max() > 1e-2  # the test can fail: documents 2.. differ when not packed


def test_cached_generation_with_the_native_read_gives_the_same_tokens(kernel):
    """Prefill reads through the kernel (with the cached zeros as its past), one-token steps through the window."""
    model = variant_model(**TC).eval()
    prompt = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    settings = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    plain = model.generate(prompt, **settings)
    spy = spy_on(model)
    fast = model.generate(prompt, **settings)
    assert spy.forwards == sum(isinstance(m, DeltaStateConv) for m in model.modules())  # the prefill's reads
    assert torch.equal(fast.sequences, plain.sequences)
    for a, b in zip(fast.scores, plain.scores):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_native_read_runs_only_on_cpu_float32_and_float64_outside_compile(kernel, monkeypatch):
    x = torch.randn(1, 3, 4, 2)
    weight = torch.randn(4, 2, 3)
    spy = Counting(kernel)
    temporal_conv_read(x, weight, kernel=spy)
    temporal_conv_read(x.double(), weight.double(), kernel=spy)
    assert spy.forwards == 2
    temporal_conv_read(x.bfloat16(), weight, kernel=spy)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    temporal_conv_read(x, weight, kernel=spy)
    assert spy.forwards == 2


def test_the_native_read_under_bf16_autocast_matches_tensor_ops(kernel):
    """The state stays float32 under autocast, so the kernel runs; the loss and gradients are those of tensor ops."""
    model = variant_model(**TC).train()
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = losses_and_grads(model, ids)
        spy = spy_on(model)
        fast = losses_and_grads(model, ids)
    assert spy.forwards > 0 and spy.backwards > 0
    torch.testing.assert_close(fast[0], plain[0], rtol=1e-5, atol=1e-5)
    for name, grad in plain[1].items():
        torch.testing.assert_close(fast[1][name], grad, rtol=1e-3, atol=1e-4, msg=name)


def test_enable_copies_and_refusals(kernel):
    model = variant_model(**TC)
    assert enable_native_tc_read(model) is model
    reads = [m for m in model.modules() if isinstance(m, DeltaStateConv)]
    assert reads and all(m.native_read is kernel for m in reads)
    twin = copy.deepcopy(model)  # a compiled extension does not pickle: the copy reads with tensor ops
    assert all(m.native_read is None for m in twin.modules() if isinstance(m, DeltaStateConv))
    disable_native_tc_read(model)
    assert all(m.native_read is None for m in reads)
    for no_tc in (torch.nn.Linear(2, 2), variant_model(delta_value_channels=4, delta_state_read="channel_conv")):
        with pytest.raises(ValueError, match="no TC read of an expanded state"):
            enable_native_tc_read(no_tc)
    with pytest.raises(ValueError, match="no TC read of an expanded state"):  # d_v = 1 TC reads with temporal_conv
        enable_native_tc_read(variant_model(delta_state_read="temporal_conv"))


def test_a_machine_without_a_compiler_gets_an_error_that_names_it(monkeypatch):
    monkeypatch.setattr(native, "_tc_read", None)
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    model = variant_model(**TC)
    with pytest.raises(NativeKernelUnavailable, match=r"no C\+\+ compiler .*works without it"):
        enable_native_tc_read(model)
    assert all(m.native_read is None for m in model.modules() if isinstance(m, DeltaStateConv))
