"""Every Delta variant on a CUDA device against an independent reference, at a shape where rounding accumulates (6
layers, width 384, batch 2 × 128 tokens): the device's route (`delta_implementation="auto"`: Triton's op per Delta
residual) against the tensor ops on the CPU in float32, bf16 autocast against float32 bounded by the baseline's own
bf16 error, greedy `generate` with the cache against without it, SDPA against eager attention, and flash attention
against SDPA where it is installed. Bounds: `gpu_models`. Error = max|Δ logits| / max|reference logits|.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import utils as hf_utils

from tests.gpu.gpu_models import (
    CHECK,
    VARIANTS,
    baseline,
    bf16_bound,
    delta_of,
    exact_fp32,
    fp32_bound,
    logits_of,
    random_ids,
    rel_err,
)

pytestmark = pytest.mark.gpu

BOUND = fp32_bound(CHECK)


@pytest.fixture(scope="module", params=list(VARIANTS))
def models(request, device) -> dict:
    """The variant and its baseline on the CPU and on the device, and the check's token ids on each."""
    source = baseline(VARIANTS[request.param][0], CHECK)
    cpu = {"baseline": source, "delta": delta_of(request.param, source)}
    ids = random_ids(cpu["delta"].config.vocab_size, CHECK["batch"], CHECK["seq"], seed=2)
    on_device = {name: copy.deepcopy(model).to(device) for name, model in cpu.items()}
    yield {"cpu": cpu, "device": on_device, "ids": ids, "device_ids": ids.to(device)}
    on_device.clear()
    torch.cuda.empty_cache()


def test_the_devices_float32_logits_equal_the_tensor_ops_on_the_cpu(models):
    """float32, TF32 off; the baseline within the same bound says the bound holds on this device."""
    with exact_fp32():
        for name in ("baseline", "delta"):
            reference = logits_of(models["cpu"][name], models["ids"])
            error = rel_err(logits_of(models["device"][name], models["device_ids"]), reference)
            assert error <= BOUND, (name, error, BOUND)


def test_bf16_autocast_is_as_close_to_float32_as_the_baselines(models):
    ids = models["device_ids"]
    with exact_fp32():
        errors = {
            name: rel_err(logits_of(model, ids, bf16=True), logits_of(model, ids))
            for name, model in models["device"].items()
        }
    assert errors["delta"] <= bf16_bound(errors["baseline"]), errors


def test_cached_greedy_generation_equals_uncached(models):
    """The cached route against the full forward of every prefix; a divergence only where the uncached logits of
    the two best tokens tie within the float32 bound."""
    from tests.greedy import assert_greedy_matches

    delta = models["device"]["delta"]
    prompt = models["device_ids"][:, : CHECK["prompt"]]
    n = CHECK["new_tokens"]
    kwargs = dict(
        max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompt)
    )
    kwargs.update(return_dict_in_generate=True, output_scores=True)
    with exact_fp32(), torch.no_grad():
        plain = delta.generate(prompt, use_cache=False, **kwargs)
        cached = delta.generate(prompt, use_cache=True, **kwargs)
    scores = torch.stack(plain.scores)  # min_new_tokens sets the end token's score to -inf
    # Each of the reference's best two may move by the bound, in opposite directions: a swap needs a gap under twice it.
    tie_margin = 2 * BOUND * scores[scores.isfinite()].abs().max().item()
    assert_greedy_matches(
        plain.sequences[:, prompt.shape[1] :],
        plain.scores,
        cached.sequences[:, prompt.shape[1] :],
        tie_margin=tie_margin,
    )


def test_sdpa_equals_eager_attention(models):
    ids = models["device_ids"]
    with exact_fp32():
        for name, model in models["device"].items():
            sdpa = logits_of(model, ids)
            model.set_attn_implementation("eager")
            try:
                error = rel_err(logits_of(model, ids), sdpa)
            finally:
                model.set_attn_implementation("sdpa")
            assert error <= BOUND, (name, error, BOUND)


@pytest.mark.parametrize(
    ("implementation", "probe"),
    [("flash_attention_2", "is_flash_attn_2_available"), ("flash_attention_3", "is_flash_attn_3_available")],
)
def test_flash_attention_is_as_close_to_sdpa_as_the_baselines(models, implementation, probe):
    """Both models in bfloat16 (flash attention takes no float32): flash against SDPA, bounded by the baseline's own
    difference."""
    if not getattr(hf_utils, probe, lambda: False)():
        pytest.skip(f"{implementation} is not installed")
    ids = models["device_ids"]
    errors = {}
    for name, model in models["device"].items():
        half = copy.deepcopy(model).to(torch.bfloat16)
        sdpa = logits_of(half, ids)
        half.set_attn_implementation(implementation)
        errors[name] = rel_err(logits_of(half, ids), sdpa)
        del half
    assert errors["delta"] <= bf16_bound(errors["baseline"]), errors
