"""The paper's variants (docs/variants.md): the convolutions against plain loops, and generation with their
cached windows against uncached runs, single prompts, beam search without a cache and plain greedy decoding."""

from __future__ import annotations

import pytest
import torch

import ddl_hf
from ddl_hf.delta_compat import cache_argument, cache_of
from ddl_hf.delta_fused import channel_conv_read, channel_conv_read_weight, temporal_conv_read
from ddl_hf.delta_ops import channel_conv, same_document_taps, temporal_conv
from ddl_hf.delta_reads import DeltaConvContext, DeltaStateCache
from ddl_hf.delta_state import state_plan
from tests.builders import VOCAB, variant_model
from tests.greedy import greedy_reference

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Temporal variants (their cache keeps convolution windows), and one per other read for the plain-loop checks.
TEMPORAL = [
    dict(delta_value_channels=1, delta_state_read="temporal_conv"),
    dict(delta_value_channels=4, delta_state_read="temporal_conv", delta_embed_expand="conv", delta_mode="paper"),
    dict(delta_value_channels=3, delta_embed_expand="conv", delta_conv_size=3, delta_value="constant"),
    dict(delta_value_channels=2, delta_state_read="temporal_conv", delta_erase=False, token_mixer="delta_net"),
    dict(delta_value_channels=1, delta_state_read="temporal_conv", delta_value="sigmoid", delta_mode="paper"),
]


def test_temporal_conv_matches_a_plain_loop() -> None:
    g = torch.Generator().manual_seed(0)
    size, steps = 3, 5
    history = torch.randn(2, size - 1 + steps, 4, 2, generator=g, dtype=torch.float64)
    weight = torch.randn(4, 2, size, generator=g, dtype=torch.float64)
    expected = torch.zeros(2, steps, 4, 2, dtype=torch.float64)
    for t in range(steps):
        for j in range(size):  # tap j reads the input j - (size - 1) tokens from the current one
            expected[:, t] += weight[..., j] * history[:, t + j]
    torch.testing.assert_close(temporal_conv(history, weight), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("steps", [1, 2, 6])
@pytest.mark.parametrize("cached", [False, True], ids=["no-cache", "cache"])
@pytest.mark.parametrize("packed", [False, True], ids=["one-document", "packed"])
def test_the_one_pass_tc_read_is_the_convolution_summed_over_channels(steps, cached, packed) -> None:
    """`temporal_conv_read` against its definition, `temporal_conv(cat([past or zeros, x]), w).sum(-1)`, in float64:
    values, and gradients of x and of the kernels (`gradcheck` of its own backward), with a cached window or none,
    in one document or packed rows."""
    g = torch.Generator().manual_seed(steps * 4 + 2 * cached + packed)
    x = torch.randn(2, steps, 5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    past = torch.randn(2, 3, 5, 3, generator=g, dtype=torch.float64) if cached else None
    taps = same_document_taps(torch.rand(2, steps, generator=g) < 0.4, 4) if packed else None
    history = torch.cat([past if cached else x.new_zeros(2, 3, 5, 3), x], dim=1)
    expected = temporal_conv(history, weight, taps).sum(-1)
    torch.testing.assert_close(temporal_conv_read(x, weight, past, taps), expected, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda a, w: temporal_conv_read(a, w, past, taps), (x, weight))
    grads = torch.autograd.grad(temporal_conv_read(x, weight, past, taps).sum(), (x, weight))
    for got, want in zip(grads, torch.autograd.grad(expected.sum(), (x, weight))):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_a_training_forward_builds_no_windows_and_a_given_cache_keeps_only_its_window() -> None:
    """A training forward (training mode, autograd on) that is not given a cache builds none for a TC model, even with
    `use_cache` (the default, also under Trainer): no cache out, and autograd saves exactly what it saves without one.
    Given a cache, a TC read's window is the last K - 1 inputs, and autograd saves the same storages as without a
    cache: not the whole `[B, K - 1 + T, D, d_v]` history."""
    model = variant_model(delta_value_channels=4, delta_state_read="temporal_conv", delta_mode="paper").train()
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))

    def saved_bytes(**kwargs) -> tuple[int, object]:
        storages = {}

        def pack(tensor):
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = model(ids, **kwargs)
        return sum(storages.values()), out

    without, _ = saved_bytes(use_cache=False)
    asked, out = saved_bytes(use_cache=True)
    assert cache_of(out) is None and asked == without
    given, out = saved_bytes(use_cache=True, **cache_argument(DeltaStateCache(model.config)))
    windows = cache_of(out).delta_windows
    assert windows and all(w.shape[1] == model.config.delta_conv_size - 1 for w in windows.values())
    kv = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache_of(out).layers)  # GPT-2 saves these too
    pasts = sum(w.nbytes for w in windows.values())  # each read's K - 1 past inputs (zeros here), saved as a copy
    assert given <= without + kv + pasts


def test_the_one_pass_tc_read_under_bf16_autocast_and_in_a_model_keeps_float32_state_grads() -> None:
    """A TC model's loss and gradients with the one-pass read equal those of the convolution-then-sum definition
    (swapped in) in float32; under bf16 autocast the one-pass model is as close to the float32 gradients as the
    definition is (any float32 reordering flips bf16 roundings downstream, so an elementwise bound would test luck)."""
    model = variant_model(delta_value_channels=4, delta_state_read="temporal_conv", delta_mode="paper")
    model.train()
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding: padded positions enter the window as zeros

    def run(autocast: bool):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    def flat(grads: dict) -> torch.Tensor:
        return torch.cat([grads[name].flatten() for name in sorted(grads)])

    fused, fused_bf16 = run(False), run(True)
    original = DeltaConvContext.convolve_read
    try:
        DeltaConvContext.convolve_read = lambda self, x, key, w, read=None, kernels=None: self.convolve(
            x, key, w if read is None else w * read[:, None]
        ).sum(-1)
        plain, plain_bf16 = run(False), run(True)
    finally:
        DeltaConvContext.convolve_read = original
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-5, atol=1e-6)
    assert fused[1].keys() == plain[1].keys()
    for name, grad in plain[1].items():
        assert fused[1][name].dtype == torch.float32, name
        torch.testing.assert_close(fused[1][name], grad, rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(fused_bf16[0], plain_bf16[0], rtol=2e-2, atol=2e-3)
    reference = flat(plain[1])
    fused_error = (flat(fused_bf16[1]) - reference).norm() / reference.norm()
    plain_error = (flat(plain_bf16[1]) - reference).norm() / reference.norm()
    assert 0 < fused_error <= 1.25 * plain_error, (fused_error, plain_error)


@pytest.mark.parametrize(("channels", "size"), [(4, 4), (4, 3), (5, 2), (3, 1)])
def test_channel_conv_matches_a_plain_loop(channels: int, size: int) -> None:
    g = torch.Generator().manual_seed(channels * 10 + size)
    state = torch.randn(2, 3, 6, channels, generator=g, dtype=torch.float64)
    weight = torch.randn(6, size, generator=g, dtype=torch.float64)
    left = (size - 1) // 2
    expected = torch.zeros_like(state)
    for o in range(channels):
        for j in range(size):
            c = o - left + j
            if 0 <= c < channels:
                expected[..., o] += weight[:, j] * state[..., c]
    torch.testing.assert_close(channel_conv(state, weight), expected, rtol=0, atol=1e-12)
    # The CC read's entry point folds the convolution and the read vector into one [D, d_v] weight.
    read = torch.randn(channels, generator=g, dtype=torch.float64)
    folded = (state * channel_conv_read_weight(weight, read)).sum(-1)
    torch.testing.assert_close(folded, expected @ read, rtol=0, atol=1e-12)
    torch.testing.assert_close(channel_conv_read(state, weight, read), expected @ read, rtol=0, atol=1e-12)


def test_model_reads_are_the_convolution_then_the_read_vector() -> None:
    """A sublayer's input, recomputed from the output_expanded_states with plain loops over tokens and channels."""
    model = variant_model(delta_value_channels=4, delta_state_read="temporal_conv", delta_embed_expand="conv")
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, output_expanded_states=True)
        base = model.transformer
        embeddings = base.wte(ids) + base.wpe(torch.arange(6))
        size = model.config.delta_conv_size
        expand = base.embed_expand.weight  # [D, d_v, K]
        state0 = torch.zeros(2, 6, 32, 4)
        for t in range(6):
            for j in range(size):
                if t - (size - 1) + j >= 0:
                    state0[:, t] += expand[..., j] * embeddings[:, t - (size - 1) + j, :, None]
        torch.testing.assert_close(out.expanded_states[0], state0, rtol=0, atol=1e-6)
        read = base.h[1].attn_read
        state = out.expanded_states[1]
        conv = torch.zeros_like(state)
        for t in range(6):
            for j in range(size):
                if t - (size - 1) + j >= 0:
                    conv[:, t] += read.conv.weight[..., j] * state[:, t - (size - 1) + j]
        torch.testing.assert_close(read(state), conv @ read.weights, rtol=0, atol=1e-6)


@pytest.mark.parametrize("overrides", TEMPORAL, ids=lambda o: "-".join(f"{v}" for v in o.values()))
def test_cached_generation_equals_uncached_and_stepwise_forward(overrides: dict) -> None:
    model = variant_model(**overrides)
    ids = torch.randint(1, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids).logits
        first = model(ids[:, :6], use_cache=True)
        cache = cache_of(first)
        assert isinstance(cache, ddl_hf.DeltaNetCache if "token_mixer" in overrides else DeltaStateCache)
        steps = [first.logits]
        for t in range(6, 10):
            steps.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-5)

    prompt = ids[:1, :5]
    kwargs = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False)
    cached = greedy_reference(model, prompt, use_cache=True, **kwargs)
    cached.assert_matches(model.generate(prompt, use_cache=False, **kwargs)[:, 5:])


@pytest.mark.parametrize("overrides", TEMPORAL[:2], ids=["tc-dv1", "tc-ec-dv4"])
def test_left_padded_batch_equals_each_prompt_alone(overrides: dict) -> None:
    model = variant_model(**overrides)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, VOCAB, (n,), generator=generator) for n in (3, 7, 5)]
    width, pad = 7, model.config.pad_token_id
    batch = torch.stack([torch.cat([torch.full((width - len(p),), pad), p]) for p in prompts])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    kwargs = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=pad)
    batched = greedy_reference(model, batch, attention_mask=mask, **kwargs)
    ones = [torch.ones(1, len(prompt), dtype=torch.long) for prompt in prompts]
    alone = [model.generate(p[None], attention_mask=m, **kwargs)[0, len(p) :] for p, m in zip(prompts, ones)]
    batched.assert_matches(torch.stack(alone))


def test_beam_search_reorders_the_windows() -> None:
    """Beam search with the cache (windows reordered with the beams) equals beam search that recomputes everything."""
    model = variant_model(**TEMPORAL[1])
    prompt = torch.randint(1, VOCAB, (2, 4), generator=torch.Generator().manual_seed(3))
    kwargs = dict(num_beams=3, max_new_tokens=8, min_new_tokens=8, do_sample=False, early_stopping=False)
    cached = model.generate(prompt, use_cache=True, output_scores=True, return_dict_in_generate=True, **kwargs)
    uncached = model.generate(prompt, use_cache=False, output_scores=True, return_dict_in_generate=True, **kwargs)
    assert torch.equal(cached.sequences, uncached.sequences)
    torch.testing.assert_close(cached.sequences_scores, uncached.sequences_scores, rtol=0, atol=1e-5)
    assert cached.beam_indices is not None and bool((cached.beam_indices[:, 1:] != cached.beam_indices[:, :1]).any())


def test_assisted_decoding_crops_the_windows() -> None:
    """An assistant with other weights proposes tokens the model rejects: the cache is cropped, and greedy
    assisted decoding still equals plain greedy decoding."""
    model = variant_model(**TEMPORAL[1])
    assistant = variant_model(seed=7, **TEMPORAL[1])
    prompt = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(4))
    kwargs = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False)
    crops = []
    original = DeltaStateCache.crop

    def counting_crop(self, tokens_to_remove: int) -> None:
        crops.append(tokens_to_remove)
        original(self, tokens_to_remove)

    DeltaStateCache.crop = counting_crop
    try:
        assisted = model.generate(prompt, assistant_model=assistant, **kwargs)
    finally:
        DeltaStateCache.crop = original
    greedy_reference(model, prompt, **kwargs).assert_matches(assisted[:, prompt.shape[1] :])
    assert any(n < 0 for n in crops), crops  # tokens were really rejected and cropped


def test_cache_operations_and_memory_do_not_grow_with_the_context() -> None:
    model = variant_model(**TEMPORAL[1])
    config = model.config
    ids = torch.randint(1, VOCAB, (3, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        cache = cache_of(model(ids[:, :8], use_cache=True))
        sizes = []
        for t in range(8, 12):
            model(ids[:, t : t + 1], cache=cache, use_cache=True)
            sizes.append(cache.delta_window_bytes())
    # Per sequence: K entries (K - 1 kept + the current token) of D * d_v floats at each of the 2 n_layer sublayer
    # reads and the final read, and of D floats for the embedding window.
    size, d, d_v = config.delta_conv_size, config.n_embd, config.delta_value_channels
    per_sequence = size * 4 * ((2 * config.n_layer + 1) * d * d_v + d)
    assert sizes == [3 * per_sequence] * 4

    window = cache.delta_windows["0.attn"].clone()
    cache.reorder_cache(torch.tensor([2, 0, 1]))
    assert torch.equal(cache.delta_windows["0.attn"], window[[2, 0, 1]])
    cache.batch_select_indices(torch.tensor([1]))
    assert torch.equal(cache.delta_windows["0.attn"], window[[0]])
    cache.batch_repeat_interleave(2)
    assert cache.delta_windows["0.attn"].shape[0] == 2
    cache.crop(-1)  # drop the last token: the window keeps the K - 1 before it
    assert torch.equal(cache.delta_windows["0.attn"][:1], window[[0], : size - 1])
    with pytest.raises(ValueError, match="Cannot crop 1 tokens"):
        cache.crop(-1)


@pytest.mark.parametrize(
    "overrides",
    [*TEMPORAL, dict(delta_value_channels=4, delta_state_read="channel_conv"), dict(token_mixer="delta_net")],
    ids=lambda o: "-".join(f"{v}" for v in o.values()),
)
def test_the_state_plan_names_what_a_cached_forward_keeps(overrides: dict) -> None:
    """`state_plan` is derived from the config alone; a cached forward keeps a window under exactly the keys it
    lists (the reads name their windows at run time), DeltaNet's recurrent state where it says so, and the answers
    that read the plan agree with it: `delta_temporal`, the cache class, the generation flags."""
    model = variant_model(**overrides)
    plan = state_plan(model.config)
    assert model.state_plan == plan
    with torch.no_grad():
        cache = cache_of(model(torch.randint(1, VOCAB, (2, 5)), use_cache=True))
    assert set(getattr(cache, "delta_windows", {})) == {window.key for window in plan.windows}
    windows_of_layer = sorted((window.layer, window.kind) for window in plan.windows if window.kind == "read")
    layers = model.config.n_layer
    read = overrides.get("delta_state_read") == "temporal_conv"
    assert windows_of_layer == (
        sorted([(i, "read") for i in range(layers)] * 2 + [(layers - 1, "read")]) if read else []
    )
    assert [w.key for w in plan.windows if w.kind == "expand"] == (
        ["embed"] if overrides.get("delta_embed_expand") == "conv" else []
    )
    recurrent = overrides.get("token_mixer") == "delta_net"
    assert plan.recurrent is recurrent and isinstance(cache, ddl_hf.DeltaNetCache) is recurrent
    assert model.config.delta_temporal is bool(plan.windows)
    assert plan.across_tokens is bool(plan.windows or recurrent) is bool(plan.settings)
    assert model._is_stateful is recurrent and model._can_compile_fullgraph is not recurrent
    assert isinstance(cache, DeltaStateCache) is (bool(plan.windows) and not recurrent)


def test_temporal_variant_refuses_a_cache_without_windows() -> None:
    from transformers import DynamicCache

    model = variant_model(**TEMPORAL[0])
    with pytest.raises(TypeError, match="DeltaStateCache"):
        model(torch.ones(1, 3, dtype=torch.long), cache=DynamicCache(), use_cache=True)


def test_a_compiled_tc_read_keeps_no_buffer_of_zeros_for_its_backward():
    """Under torch.compile (inductor's min-cut partitioner, captured through aot_autograd) the TC read's backward keeps
    what it keeps in eager, not a state-sized buffer of zeros: a `zeros_like(x)` buffer in the forward was merged with
    the backward's `zeros_like(x)` and saved, one state per read (GPT-2-small TC: ~300 MB at batch 2 x 512)."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    saved = []

    def forward_compiler(gm, example_inputs):
        (outputs,) = [node.args[0] for node in gm.graph.nodes if node.op == "output"]
        saved.extend(str(o.target) for o in outputs if isinstance(o, torch.fx.Node) and o.op == "call_function")
        return make_boxed_func(gm.forward)

    def backend(gm, example_inputs):
        return aot_module_simplified(
            gm,
            example_inputs,
            fw_compiler=forward_compiler,
            bw_compiler=lambda gm, example_inputs: make_boxed_func(gm.forward),
            partition_fn=min_cut_rematerialization_partition,
        )

    torch._dynamo.reset()
    x = torch.randn(2, 6, 8, 4, requires_grad=True)
    weight = torch.randn(8, 4, 3, requires_grad=True)
    read = torch.compile(temporal_conv_read, backend=backend, fullgraph=True)
    read(x, weight).sum().backward()
    assert x.grad is not None and weight.grad is not None
    assert not [target for target in saved if "zeros" in target], saved
