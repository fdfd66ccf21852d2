"""The optional native decoding kernel (`ddl_hf.native`) against the float64 reference and the plain path.

The kernel is the one-token host path in one C++ call, so it is held to the host path's contract: the float64
`delta_update` reference with beta and v computed independently here, GPT-2's bits at beta = 0, the same tokens and
scores as the plain reference in `generate`, and only where the host path runs. It is built with the machine's C++
compiler; where there is none, the tests that need it are skipped with the reason, and the error a user gets is
tested instead.
"""

from __future__ import annotations

import pytest
import torch
from builders import CLIENT_VARIANTS, delta_model, open_gates, scramble_delta_weights
from test_delta_llama import build_source, to_delta
from test_delta_llama import open_gates as llama_open_gates
from test_fast_paths import CASES, Doubled, assert_greedy_decoding_matches_the_plain_reference, inputs, residual

import ddl_hf.modeling_delta_gpt as modeling
import ddl_hf.native as native
from ddl_hf.delta_ops import channel_conv, delta_update, same_document_taps, temporal_conv, unit_direction
from ddl_hf.modeling_delta_gpt import DeltaResidual, DeltaStateConv
from ddl_hf.native import NativeKernelUnavailable, disable_native_decoding, enable_native_decoding


@pytest.fixture(scope="module")
def kernel():
    problem = native.native_build_problem()
    if problem is not None:
        pytest.skip(f"the native kernel cannot be built here: {problem}")
    return native.load_one_token_kernel()


@pytest.fixture(scope="module")
def tc_read(kernel):
    return native.load_cached_tc_read()


def counting(kernel, calls: list):
    """`kernel`, appending to `calls` each time it updates (the native kernel returns None for inputs it declines)."""

    def counted(*args):
        result = kernel(*args)
        if result is not None:
            calls.append(1)
        return result

    return counted


def reference(module: DeltaResidual, state, normed, h, read=None):
    """The module's update in float64 from its parameters, with `delta_update` (the readable reference)."""
    p = {name: t.detach().double() for name, t in module.named_parameters()}
    state, normed, h = state.double(), normed.double(), h.double()
    logit = normed @ p["beta_proj.weight"].T + p["beta_proj.bias"]
    beta = (2 * torch.sigmoid(logit) * p["beta_open"].clamp(0, 1)).squeeze(-1)
    if module.v_proj is None:  # the constant value, as the tensors of the module's dtype hold it
        constant = torch.tensor(module.value_constant, dtype=module.beta_open.dtype).double()
        value = constant.expand(*beta.shape, module.value_channels)
    elif module.value_scale is None:
        value = normed @ p["v_proj.weight"].T + p["v_proj.bias"]
    else:  # the authors' value: scale * sigmoid(W_v r + b) of the un-normalised read
        value = module.value_scale * torch.sigmoid(read.double() @ p["v_proj.weight"].T + p["v_proj.bias"])
    additive = module.additive
    out = delta_update(state, unit_direction(h, module.eps), beta, value, h if additive else None, module.erase)
    return out, beta


@pytest.mark.parametrize(
    ("d_v", "mode", "expanded_view"),
    [(d_v, mode, False) for d_v, mode in CASES] + [(4, mode, True) for mode in ("additive", "paper")],
)
@pytest.mark.parametrize(
    "fields", [{}, {"delta_erase": False}, {"delta_value": "constant"}, {"delta_value": "sigmoid"}], ids=str
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_native_update_matches_the_float64_reference(kernel, d_v, mode, expanded_view, fields, dtype):
    module = residual(d_v, mode, dtype, **fields)
    calls = []
    module.one_token_kernel = counting(kernel, calls)
    state, normed, h = inputs(d_v, dtype, shape=(1, 1), seed=7)
    read = 3 * normed.flip(-1) + 1  # the un-normalised read: another tensor than the normalised one
    if expanded_view:  # the first state of an expanded model: the embedding repeated over d_v, stride 0
        state = state[..., :1].expand(state.shape)
    with torch.inference_mode():
        out, beta = module(state, normed, h, read=read)
    assert calls == [1]
    expected, expected_beta = reference(module, state, normed, h, read)
    assert out.shape == state.shape and out.dtype == dtype and beta.shape == (1, 1) and beta.dtype == dtype
    tolerance = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(beta.double(), expected_beta, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)
    assert not torch.equal(out, state + (h.unsqueeze(-1) if d_v > 1 else h))  # the gate is open: a real update


@pytest.mark.parametrize(("d_v", "mode"), CASES)
def test_native_update_at_beta_zero_is_gpt2_bit_for_bit(kernel, d_v, mode):
    module = residual(d_v, mode)
    module.one_token_kernel = kernel
    with torch.no_grad():
        module.beta_open.fill_(0.0)
    state, normed, h = inputs(d_v, shape=(1, 1), seed=8)
    with torch.inference_mode():
        out, beta = module(state, normed, h)
    assert torch.equal(beta, torch.zeros(1, 1))
    assert torch.equal(out, state + (h.unsqueeze(-1) if d_v > 1 else h) if mode == "additive" else state)


def test_native_kernel_runs_only_where_the_host_path_runs(kernel, monkeypatch):
    """Same gate as the Python host path: autograd, autocast, several tokens or rows, half precision, a hooked or
    wrapped projection, the MLP gate and the plain reference keep the tensor path; the Python host path does not run
    as well."""
    host_calls, calls = [], []
    monkeypatch.setattr(modeling, "one_token_delta_update", counting(modeling.one_token_delta_update, host_calls))

    def native_runs(module, args, context=torch.no_grad) -> bool:
        calls.clear()
        module.one_token_kernel = counting(kernel, calls)
        with context():
            module(*args)
        return bool(calls)

    one = inputs(1, shape=(1, 1))
    assert native_runs(residual(1, "additive"), one)
    assert native_runs(residual(4, "paper"), inputs(4, shape=(1, 1)), context=torch.inference_mode)
    assert not host_calls  # the kernel replaces the Python host path
    assert not native_runs(residual(1, "additive"), one, context=torch.enable_grad)
    assert not native_runs(residual(1, "additive"), one, context=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    assert not native_runs(residual(1, "additive"), inputs(1, shape=(1, 2)))
    assert not native_runs(residual(1, "additive"), inputs(1, shape=(2, 1)))
    assert not native_runs(residual(1, "additive", dtype=torch.bfloat16), [t.bfloat16() for t in one])
    hooked = residual(1, "additive")
    hooked.beta_proj.register_forward_hook(lambda m, a, out: out)
    assert not native_runs(hooked, one)
    wrapped = residual(1, "additive")
    wrapped.v_proj = Doubled(*wrapped.v_proj.weight.shape[::-1])
    assert not native_runs(wrapped, one)
    assert not native_runs(residual(1, "additive", delta_gate="mlp"), one)
    plain = residual(1, "additive")
    plain.fused = False
    assert not native_runs(plain, one)


def counting_kernels(model) -> list:
    """Enable the kernel on `model` and spy on it: the returned list grows by one per kernel call."""
    assert enable_native_decoding(model) is model
    calls = []
    for module in model.modules():
        if isinstance(module, DeltaResidual):
            module.one_token_kernel = counting(module.one_token_kernel, calls)
    return calls


@pytest.mark.parametrize(("d_v", "mode"), CASES)
def test_greedy_decoding_with_the_native_kernel_matches_the_plain_reference(kernel, d_v, mode):
    model = delta_model(delta_value_channels=d_v, delta_mode=mode).eval()
    open_gates(model)
    assert_greedy_decoding_matches_the_plain_reference(model, counting_kernels(model))


def test_delta_llama_decodes_with_the_native_kernel(kernel):
    model = llama_open_gates(to_delta(build_source("llama"), delta_value_channels=4))
    assert_greedy_decoding_matches_the_plain_reference(model, counting_kernels(model), new_tokens=8)


def test_enable_finds_the_residuals_of_a_model_loaded_as_hub_custom_code(kernel, tmp_path):
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    delta_model(CLIENT_VARIANTS["tc-ec-paper-dv4"]).save_pretrained(tmp_path)
    hub_class = get_class_from_dynamic_module("modeling_delta_gpt.DeltaGPTForCausalLM", tmp_path)
    model = hub_class.from_pretrained(tmp_path).eval()
    residuals = [m for m in model.modules() if type(m).__name__ == "DeltaResidual"]
    assert residuals and all(type(m) is not DeltaResidual for m in residuals)  # the Hub copy of the class
    reads = [m for m in model.modules() if type(m).__name__ == "DeltaStateConv"]
    assert reads and all(type(m) is not DeltaStateConv for m in reads)
    enable_native_decoding(model)
    assert all(m.one_token_kernel is kernel for m in residuals)
    assert all(m.inference_read is native.load_cached_tc_read() for m in reads)
    disable_native_decoding(model)
    assert all(m.one_token_kernel is None for m in residuals) and all(m.inference_read is None for m in reads)


def test_enable_refuses_a_model_without_delta_residuals():
    with pytest.raises(ValueError, match="no Delta residuals"):
        enable_native_decoding(torch.nn.Linear(2, 2))


def test_a_machine_without_a_compiler_gets_an_error_that_names_it(monkeypatch):
    monkeypatch.setattr(native, "_decoding", None)
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    model = delta_model()
    with pytest.raises(NativeKernelUnavailable, match=r"no C\+\+ compiler .*works without it"):
        enable_native_decoding(model)
    # nothing was changed: the model keeps the Python host path
    assert all(m.one_token_kernel is None for m in model.modules() if isinstance(m, DeltaResidual))


def test_the_kernel_declines_what_the_host_path_declines_and_refuses_malformed_inputs(kernel):
    """None (the caller keeps the tensor path) for autograd, CPU autocast, several tokens, half precision, mixed
    dtypes and tensors off the CPU; an error for sizes that do not fit together."""
    module = residual(1, "additive")
    gate, value = module.beta_proj, module.v_proj
    state, normed, h = inputs(1, shape=(1, 1))

    def update(state=state, normed=normed, h=h, gate_weight=gate.weight):
        parameters = (gate_weight, gate.bias, value.weight, value.bias, module.beta_open)
        return kernel(state, normed, h, *parameters, 0.0, 1e-6, True, True, normed, 0.0)

    assert update() is None  # autograd is on
    with torch.no_grad():
        new_state, beta = update()
        assert new_state.shape == state.shape and beta.shape == (1, 1)
        assert update(state=state.bfloat16(), normed=normed.bfloat16(), h=h.bfloat16()) is None
        assert update(normed=normed.double()) is None
        assert update(state=state.expand(1, 2, -1), normed=normed.expand(1, 2, -1), h=h.expand(1, 2, -1)) is None
        assert update(state=state.to("meta")) is None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert update() is None
        with pytest.raises(RuntimeError, match="sizes do not match"):
            update(state=state[..., :-1])
        with pytest.raises(RuntimeError, match="D -> 1 linear layer"):
            update(gate_weight=gate.weight[:, :-1])


def test_a_model_with_the_kernel_enabled_pickles_without_it_and_decodes_the_same_tokens(kernel, tmp_path):
    """`torch.save(model)` / `copy.deepcopy`: the compiled kernel cannot be pickled, so the copy leaves it out and
    decodes on the Python host path, to the same tokens, until `enable_native_decoding` is called on it again."""
    import copy

    model = delta_model(CLIENT_VARIANTS["tc-ec-paper-dv4"])
    scramble_delta_weights(model)
    enable_native_decoding(model)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    copied = copy.deepcopy(model)
    for copy_ in (loaded, copied):
        residuals = [m for m in copy_.modules() if isinstance(m, DeltaResidual)]
        reads = [m for m in copy_.modules() if isinstance(m, DeltaStateConv)]
        assert residuals and all(m.one_token_kernel is None for m in residuals)
        assert reads and all(m.inference_read is None for m in reads)
    assert all(m.one_token_kernel is kernel for m in model.modules() if isinstance(m, DeltaResidual))
    assert all(m.inference_read is not None for m in model.modules() if isinstance(m, DeltaStateConv))
    prompt = torch.tensor([[5, 9, 2]])
    expected = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(loaded.generate(prompt, max_new_tokens=6, do_sample=False), expected)
    assert torch.equal(enable_native_decoding(copied).generate(prompt, max_new_tokens=6, do_sample=False), expected)


# The TC read of a forward with a cache and without autograd (`cached_tc_read`: a prompt, then each decoded token),
# against the definition: the history is the last K - 1 cached inputs (zeros without a cache), then the inputs times
# their mask, and the read is `temporal_conv` of it summed over the value channels with the read vector (d_v = 1: the
# convolution itself).


def window_case(d_v: int, size: int, past_rows: int | None, mask: str, steps: int = 1, dtype=torch.float64):
    g = torch.Generator().manual_seed(size * 10 + d_v)
    channels = (d_v,) if d_v > 1 else ()
    x = torch.randn(2, steps, 16, *channels, generator=g, dtype=torch.float64)
    past = None if past_rows is None else torch.randn(2, past_rows, 16, *channels, generator=g, dtype=torch.float64)
    weight = torch.randn(16, d_v, size, generator=g, dtype=torch.float64)
    read = torch.randn(d_v, generator=g, dtype=torch.float64) if d_v > 1 else None
    # "padding": the second row's last input is padding (it enters the window as zeros), and with three inputs the
    # one before is a token and the first padding again: the mask columns are x's, in order
    token_mask = {"none": None, "ones": torch.ones(2, 7, dtype=torch.long)}.get(mask)
    if mask == "padding":
        token_mask = torch.tensor([[1] * 7, [1, 1, 1, 1, 0, 1, 0]])
    cast = [t if t is None else t.to(dtype) for t in (x, past, weight, read)]
    return cast, token_mask


def window_reference(x, past, weight, read, token_mask, same_document=None):
    size, steps = weight.shape[-1], x.shape[1]
    x, weight = x.double(), weight.double()
    if token_mask is not None:
        x = x * token_mask[:, -steps:].double().view(*token_mask.shape[:1], steps, *[1] * (x.dim() - 2))
    past = torch.zeros(x.shape[0], size - 1, *x.shape[2:], dtype=x.dtype) if past is None else past.double()
    history = torch.cat([past[:, past.shape[1] - (size - 1) :], x], dim=1)
    if read is None:
        return temporal_conv(history, weight[:, 0], same_document), history
    return temporal_conv(history, weight * read.double()[:, None], same_document).sum(-1), history


@pytest.mark.parametrize("d_v", [1, 4])
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("past", ["none", "window", "prefill"])
@pytest.mark.parametrize("mask", ["none", "ones", "padding"])
@pytest.mark.parametrize("steps", [1, 3, "3 packed"])
def test_the_native_tc_read_is_its_definition(tc_read, d_v, size, past, mask, steps):
    """The read and the new window, in float64 to 1e-12 and in float32 to float32's rounding; past: no cached window
    (zeros: a prompt), the K - 1 inputs kept between decoding steps, or the whole window a prefill of 5 tokens left;
    "3 packed": three inputs whose second starts a new document in the first row (its taps stop there)."""
    past_rows = {"none": None, "window": size - 1, "prefill": size - 1 + 5}[past]
    same_document = None
    if steps == "3 packed":
        steps, same_document = 3, same_document_taps(torch.tensor([[True, True, False], [True, False, False]]), size)
    for dtype, tolerance in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        (x, cached, weight, read), token_mask = window_case(d_v, size, past_rows, mask, steps, dtype)
        with torch.inference_mode():
            out, window = tc_read(x, cached, weight, read, token_mask, same_document)
        expected, history = window_reference(x, cached, weight, read, token_mask, same_document)
        assert out.shape == (2, steps, 16) and out.dtype == dtype and window.shape == history.shape
        assert torch.equal(window.double(), history)  # a copy, bit for bit
        torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)
    if mask == "padding":  # a padded input is zeros in the window: what reads it gets only the rest
        assert torch.equal(window[1, -1], torch.zeros_like(window[1, -1]))
        assert steps == 1 or not torch.equal(window[1, -2], torch.zeros_like(window[1, -2]))


def test_the_native_tc_read_declines_what_the_tensor_path_keeps_and_refuses_malformed_inputs(tc_read):
    """None (the tensor path reads) with autograd or CPU autocast on, half precision, mixed dtypes, tensors off the
    CPU; an error naming the problem for sizes that do not fit together."""
    (x, past, weight, read), token_mask = window_case(4, 4, 3, "ones", dtype=torch.float32)

    def call(x=x, past=past, weight=weight, read=read, token_mask=token_mask, same_document=None):
        return tc_read(x, past, weight, read, token_mask, same_document)

    assert call() is None  # autograd is on
    with torch.no_grad():
        assert call() is not None
        assert call(x=torch.cat([x, x], 1))[0].shape == (2, 2, 16)  # a prompt of two tokens
        assert call(x=x.bfloat16(), past=past.bfloat16(), weight=weight.bfloat16(), read=read.bfloat16()) is None
        assert call(past=past.double()) is None
        assert call(x=x.to("meta")) is None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert call() is None
        with pytest.raises(RuntimeError, match=r"TC weight must be \[D, d_v, K\]"):
            call(weight=weight[:-1])
        with pytest.raises(RuntimeError, match="read vector of d_v entries"):
            call(read=read[:-1])
        with pytest.raises(RuntimeError, match="read vector of d_v entries"):
            call(x=x[..., 0], past=past[..., 0], weight=weight[:, :1])  # d_v = 1 reads without one
        with pytest.raises(RuntimeError, match="cached window must be"):
            call(past=past[:1])
        with pytest.raises(RuntimeError, match="cached window must be"):
            call(past=past[:, :2])
        with pytest.raises(RuntimeError, match="token mask must be"):
            call(token_mask=token_mask[:1])
        with pytest.raises(RuntimeError, match=r"token mask must be \[B, >= T\]"):
            call(x=x.expand(-1, 8, -1, -1), token_mask=token_mask)  # 7 columns for 8 tokens
        with pytest.raises(RuntimeError, match=r"same_document must be bool \[B, T, K\]"):
            call(same_document=torch.ones(2, 1, 3, dtype=torch.bool))
        with pytest.raises(RuntimeError, match="same_document must be bool"):
            call(same_document=torch.ones(2, 1, 4))


def counting_reads(model) -> list:
    """Spy on the native TC / CC reads that `enable_native_decoding` gave `model`: one entry per read it did."""
    calls = []
    for module in model.modules():
        if isinstance(module, DeltaStateConv):
            module.inference_read = counting(module.inference_read, calls)
    return calls


READ_VARIANTS = {name: CLIENT_VARIANTS[name] for name in ("tc-dv1", "tc-ec-paper-dv4", "reference-tc-dv4", "cc-dv4")}
READ_VARIANTS["cc-ec-paper-dv4"] = dict(
    CLIENT_VARIANTS["paper-dv4"], delta_state_read="channel_conv", delta_embed_expand="conv"
)


@pytest.mark.parametrize("variant", list(READ_VARIANTS))
def test_decoding_with_the_native_reads_gives_the_tokens_of_the_tensor_path(kernel, variant):
    """Greedy decoding, batch 1 and a left-padded batch of 2: every TC / CC read of the prompt and of every decoding
    step goes through the kernel, and tokens and scores are those of the Python path."""
    model = delta_model(READ_VARIANTS[variant])
    scramble_delta_weights(model)
    forwards = []  # the reads of the tensor path: one per module and forward (two with a shared read)
    for module in model.modules():
        if isinstance(module, DeltaStateConv):
            module.register_forward_hook(lambda *args: forwards.append(1))
    prompt = torch.randint(1, 97, (2, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0
    settings = dict(max_new_tokens=7, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    for ids, attention_mask in ((prompt[:1], mask[:1]), (prompt, mask)):
        with torch.inference_mode():
            forwards.clear()
            plain = model.generate(ids, attention_mask=attention_mask, **settings)
            reads = len(forwards) // 7  # per forward: the prefill, then 6 one-token steps
            enable_native_decoding(model)
            calls = counting_reads(model)
            fast = model.generate(ids, attention_mask=attention_mask, **settings)
            disable_native_decoding(model)
        assert reads >= 3 and len(calls) == reads * 7  # every read of every forward
        assert torch.equal(fast.sequences, plain.sequences)
        torch.testing.assert_close(torch.stack(fast.scores), torch.stack(plain.scores), rtol=1e-5, atol=1e-5)
    assert all(m.inference_read is None for m in model.modules() if isinstance(m, DeltaStateConv))


# The CC read of a forward without autograd (`cc_read`), against the definition: the channel convolution, then the
# read vector.


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", [(1, 1), (2, 5)], ids=["one token", "2x5"])
def test_the_native_cc_read_is_the_channel_convolution_then_the_read(kernel, size, shape):
    cc_read = native.load_cc_read()
    g = torch.Generator().manual_seed(size)
    x = torch.randn(*shape, 16, 4, generator=g, dtype=torch.float64)
    weight = torch.randn(16, size, generator=g, dtype=torch.float64)
    read = torch.randn(4, generator=g, dtype=torch.float64)
    expected = channel_conv(x, weight) @ read
    for dtype, tolerance in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        with torch.inference_mode():
            out = cc_read(x.to(dtype), weight.to(dtype), read.to(dtype))
        assert out.shape == (*shape, 16) and out.dtype == dtype
        torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)


def test_the_native_cc_read_declines_what_the_tensor_path_keeps_and_refuses_malformed_inputs(kernel):
    cc_read = native.load_cc_read()
    x, weight, read = torch.randn(1, 1, 16, 4), torch.randn(16, 3), torch.randn(4)
    assert cc_read(x, weight, read) is None  # autograd is on
    with torch.no_grad():
        assert cc_read(x.bfloat16(), weight.bfloat16(), read.bfloat16()) is None
        assert cc_read(x, weight.double(), read) is None
        assert cc_read(x.to("meta"), weight, read) is None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert cc_read(x, weight, read) is None
        with pytest.raises(RuntimeError, match=r"CC weight must be \[D, K\]"):
            cc_read(x, torch.randn(16, 5), read)  # K > d_v
        with pytest.raises(RuntimeError, match=r"CC weight must be \[D, K\]"):
            cc_read(x, weight[:-1], read)
        with pytest.raises(RuntimeError, match="read vector must have d_v entries"):
            cc_read(x, weight, read[:-1])
