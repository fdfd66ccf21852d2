"""The optional native training kernels (`ddl_hf.native.enable_native_training`) against independent references.

The kernels stand in for tensor ops, forward and backward, so they are held to the same contracts. The Delta update:
the dense A = I - beta k k^T reference and the tensor-op fused update in float64 (values, gradients, `gradcheck`),
GPT-2's bits at beta = 0. The TC read: its definition `temporal_conv(cat([past or zeros, x]), w).sum(-1)` in float64
with a cached window, in packed rows and both together. In models: the losses, every gradient and the generated
tokens of the tensor-op model, under left padding, packed rows, the cache, and bf16 autocast. They run only where
they apply (CPU float32 / float64 of one dtype, not compiling). Built with the machine's C++ compiler; where there
is none, the tests that need it are skipped with the reason, and the error a user gets is tested instead.
"""

from __future__ import annotations

import copy

import pytest
import torch
from builders import VOCAB
from test_delta_net_clients import packed_row
from test_fused_delta import EPS, dense_reference, make_inputs
from test_variants import variant_model

import ddl_hf.native as native
from ddl_hf.delta_ops import fused_delta_update, same_document_taps, temporal_conv, temporal_conv_read
from ddl_hf.modeling_delta_gpt import DeltaResidual, DeltaStateConv
from ddl_hf.native import NativeKernelUnavailable, disable_native_training, enable_native_training

TC = dict(delta_value_channels=4, delta_state_read="temporal_conv", delta_mode="paper")


@pytest.fixture(scope="module")
def kernel():
    problem = native.native_build_problem()
    if problem is not None:
        pytest.skip(f"the native kernel cannot be built here: {problem}")
    return native.load_training_kernels()


class Counting:
    """`kernel` with a count of its calls, by name."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, {}

    def __getattr__(self, name):
        function = getattr(self.kernel, name)

        def counted(*args):
            self.calls[name] = self.calls.get(name, 0) + 1
            return function(*args)

        return counted

    @property
    def forwards(self) -> int:
        return self.calls.get("tc_read_forward", 0)

    @property
    def backwards(self) -> int:
        return self.calls.get("tc_read_backward", 0)


# ---- the Delta update ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d_v", [1, 4])
@pytest.mark.parametrize("mode", ["additive", "paper"])
@pytest.mark.parametrize("erase", [True, False], ids=["erase", "write-only"])
@pytest.mark.parametrize("beta_shape", ["[...]", "[..., 1]"])
def test_the_native_update_is_the_fused_update_and_the_dense_reference(kernel, d_v, mode, erase, beta_shape):
    additive = mode == "additive"
    state, h, beta, value = make_inputs(d_v, seed=d_v + 2 * erase)
    gate = beta.unsqueeze(-1) if beta_shape == "[..., 1]" else beta
    spy = Counting(kernel)
    got = fused_delta_update(state, h, gate, value, EPS, additive, erase, spy)
    want = fused_delta_update(state, h, gate, value, EPS, additive, erase)
    assert spy.calls == {"delta_update_forward": 1}
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    if erase:
        torch.testing.assert_close(got, dense_reference(state, h, beta, value, additive), rtol=0, atol=1e-12)
    grad_out = torch.randn(want.shape, generator=torch.Generator().manual_seed(5), dtype=want.dtype)
    inputs = (state, h, beta, value)
    for mine, theirs in zip(torch.autograd.grad(got, inputs, grad_out), torch.autograd.grad(want, inputs, grad_out)):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-11)
    assert spy.calls["delta_update_backward"] == 1
    assert torch.autograd.gradcheck(
        lambda *t: fused_delta_update(t[0], t[1], t[2], t[3], EPS, additive, erase, kernel), inputs
    )


@pytest.mark.parametrize("d_v", [1, 4])
def test_the_native_update_at_beta_zero_is_gpt2_bit_for_bit(kernel, d_v):
    state, h, beta, value = (t.detach().float() for t in make_inputs(d_v, seed=7))
    h = h * 1e3  # large enough that any rounding of the write would show
    zero = torch.zeros_like(beta)
    x_plus_h = state + (h if d_v == 1 else h.unsqueeze(-1))
    assert torch.equal(fused_delta_update(state, h, zero, value, EPS, True, True, kernel), x_plus_h)
    assert torch.equal(fused_delta_update(state, h, zero, value, EPS, False, True, kernel), state)


def test_the_native_update_runs_only_where_it_applies(kernel, monkeypatch):
    state, h, beta, value = (t.detach().float() for t in make_inputs(4, seed=3))
    spy = Counting(kernel)

    def runs(*tensors) -> bool:
        before = spy.calls.get("delta_update_forward", 0)
        fused_delta_update(*tensors, EPS, True, True, spy)
        return spy.calls.get("delta_update_forward", 0) > before

    assert runs(state, h, beta, value) and runs(state.double(), h.double(), beta.double(), value.double())
    assert not runs(state, h.bfloat16(), beta, value)  # a bf16 sublayer output (autocast): tensor ops
    assert not runs(state.bfloat16(), h.bfloat16(), beta.bfloat16(), value.bfloat16())
    assert not runs(state, h[:1], beta[:1], value[:1])  # broadcasting over the batch: tensor ops
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not runs(state, h, beta, value)


# ---- the TC read --------------------------------------------------------------------------------------------------


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
    """Enable the native kernels on `model` with one counting wrapper shared by its updates and TC reads."""
    enable_native_training(model)
    spy = None
    for module in model.modules():
        if isinstance(module, DeltaResidual):
            spy = spy or Counting(module.native_update)
            module.native_update = spy
        if isinstance(module, DeltaStateConv) and module.native_read is not None:
            module.native_read = spy
    return spy


def losses_and_grads(model, ids, **kwargs):
    model.zero_grad()
    loss = model(ids, labels=ids, **kwargs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


MODELS = {
    "d_v=1 additive": dict(delta_value_channels=1, delta_mode="additive"),
    "d_v=4 paper": dict(delta_value_channels=4, delta_mode="paper"),
    "d_v=4 write-only sigmoid value": dict(delta_value_channels=4, delta_erase=False, delta_value="sigmoid"),
    "TC": TC,
    "TC+EC": dict(TC, delta_embed_expand="conv"),
    "d_v=1 TC": dict(delta_state_read="temporal_conv"),
}


def flat(grads: dict) -> torch.Tensor:
    return torch.cat([grads[name].flatten() for name in sorted(grads)])


@pytest.mark.parametrize("fields", list(MODELS.values()), ids=list(MODELS))
def test_a_model_trains_with_the_native_kernels_as_with_tensor_ops(kernel, fields):
    """Loss and every gradient, left-padded batch with the cache (Trainer's default) and without: equal in float64;
    in float32 as close to the float64 gradients as the tensor ops are (the kernels sum in double precision, so
    their float32 results differ from the tensor ops' in the last bits)."""
    model = variant_model(**fields).train()
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    residuals = sum(isinstance(m, DeltaResidual) for m in model.modules())
    reads = sum(isinstance(m, DeltaStateConv) for m in model.modules())
    expected_calls = {"delta_update_forward": residuals, "delta_update_backward": residuals}
    if reads:  # every TC read, the read-out's included
        expected_calls |= {"tc_read_forward": reads, "tc_read_backward": reads}
    for use_cache in (True, False):
        runs = {}
        for dtype in (torch.float64, torch.float32):
            model.to(dtype)
            runs["plain", dtype] = losses_and_grads(model, ids, attention_mask=mask, use_cache=use_cache)
            spy = spy_on(model)
            runs["native", dtype] = losses_and_grads(model, ids, attention_mask=mask, use_cache=use_cache)
            disable_native_training(model)
            assert spy.calls == expected_calls
        fast, plain = runs["native", torch.float64], runs["plain", torch.float64]
        torch.testing.assert_close(fast[0], plain[0], rtol=1e-12, atol=1e-12)
        assert fast[1].keys() == plain[1].keys()
        for name, grad in plain[1].items():
            torch.testing.assert_close(fast[1][name], grad, rtol=1e-9, atol=1e-9, msg=name)
        reference = flat(plain[1])
        errors = {
            path: (flat(runs[path, torch.float32][1]).double() - reference).norm() / reference.norm()
            for path in ("native", "plain")
        }
        assert errors["native"] <= 1.25 * errors["plain"] + 1e-7, errors


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
    """Prefill reads and writes through the kernels (the read with the cached zeros as its past); one-token steps at
    batch 2 write through the update kernel and read through the window."""
    model = variant_model(**TC).eval()
    prompt = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    settings = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    plain = model.generate(prompt, **settings)
    spy = spy_on(model)
    fast = model.generate(prompt, **settings)
    assert spy.forwards == sum(isinstance(m, DeltaStateConv) for m in model.modules())  # the prefill's reads
    assert spy.calls["delta_update_forward"] == 8 * sum(isinstance(m, DeltaResidual) for m in model.modules())
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
    """The state stays float32 under autocast, so the TC read's kernel runs (the update's does not: the sublayer
    output is bf16); the loss and gradients are those of tensor ops."""
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


def test_the_kernels_refuse_sizes_that_do_not_fit_together(kernel):
    """An error naming the mismatch, never a read out of bounds, for a caller that bypasses the Python checks."""
    x, w = torch.randn(2, 5, 4, 3), torch.randn(4, 3, 3)
    with pytest.raises(RuntimeError, match="past must be"):
        kernel.tc_read_forward(x, w, torch.randn(2, 1, 4, 3), None)
    with pytest.raises(RuntimeError, match="same_document must be"):
        kernel.tc_read_forward(x, w, None, torch.ones(2, 5, 2, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="grad_out must be"):
        kernel.tc_read_backward(torch.randn(2, 4, 4), x, w, None, None, True, True)
    state, h, beta, value = torch.randn(6, 4, 3), torch.randn(6, 4), torch.rand(6), torch.randn(6, 3)
    with pytest.raises(RuntimeError, match="sizes do not fit"):
        kernel.delta_update_forward(state, h[:5], beta, value, EPS, True, True)
    _, r, hx = kernel.delta_update_forward(state, h, beta, value, EPS, True, True)
    with pytest.raises(RuntimeError, match="do not fit the forward"):
        kernel.delta_update_backward(torch.randn(6, 4, 2), state, h, beta, value, r, hx, EPS, True, True, [True] * 4)


def test_the_kernels_save_what_the_tensor_ops_save(kernel):
    """Training memory: the storages autograd keeps for the backward are the same size with and without the kernels
    (the peak-memory rows of bench_overhead are measured with tensor ops)."""
    model = variant_model(**dict(TC, delta_embed_expand="conv")).train()
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))

    def saved_bytes() -> int:
        storages = {}

        def pack(tensor):
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model(ids, labels=ids)
        return sum(storages.values())

    plain = saved_bytes()
    enable_native_training(model)
    assert saved_bytes() == plain


def test_enable_copies_and_refusals(kernel):
    model = variant_model(**TC)
    assert enable_native_training(model) is model
    residuals = [m for m in model.modules() if isinstance(m, DeltaResidual)]
    reads = [m for m in model.modules() if isinstance(m, DeltaStateConv)]
    assert reads and all(m.native_read is kernel for m in reads)
    assert residuals and all(m.native_update is kernel for m in residuals)
    twin = copy.deepcopy(model)  # a compiled extension does not pickle: the copy runs tensor ops
    assert all(
        getattr(m, "native_read", None) is None and getattr(m, "native_update", None) is None for m in twin.modules()
    )
    disable_native_training(model)
    assert all(m.native_read is None for m in reads) and all(m.native_update is None for m in residuals)
    with pytest.raises(ValueError, match="no Delta residuals"):
        enable_native_training(torch.nn.Linear(2, 2))
    d_v1_tc = enable_native_training(variant_model(delta_state_read="temporal_conv"))  # one channel: the same read
    assert all(m.native_read is kernel for m in d_v1_tc.modules() if isinstance(m, DeltaStateConv))


def test_enable_finds_the_modules_of_a_model_loaded_as_hub_custom_code(kernel, tmp_path):
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    variant_model(**TC).save_pretrained(tmp_path)
    hub_class = get_class_from_dynamic_module("modeling_delta_gpt.DeltaGPTForCausalLM", tmp_path)
    model = enable_native_training(hub_class.from_pretrained(tmp_path))
    residuals = [m for m in model.modules() if type(m).__name__ == "DeltaResidual"]
    reads = [m for m in model.modules() if type(m).__name__ == "DeltaStateConv"]
    assert residuals and all(type(m) is not DeltaResidual for m in residuals)  # the Hub copy of the class
    assert all(m.native_update is kernel for m in residuals) and all(m.native_read is kernel for m in reads)


def test_a_machine_without_a_compiler_gets_an_error_that_names_it(monkeypatch):
    monkeypatch.setattr(native, "_training", None)
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    model = variant_model(**TC)
    with pytest.raises(NativeKernelUnavailable, match=r"no C\+\+ compiler .*works without them"):
        enable_native_training(model)
    assert all(
        getattr(m, "native_read", None) is None and getattr(m, "native_update", None) is None for m in model.modules()
    )
