"""DeltaGPT under third-party tools that rewrite a model: torch.ao dynamic quantization.

Each tool is applied to a converted DeltaGPT and to the transformers GPT-2 it came from; with every gate closed
(additive, beta = 0) the two must still compute the same function.
"""

from __future__ import annotations

import pytest
import torch

import ddl_hf
from tests.builders import CLIENT_VARIANTS, delta_model, gpt2_model, open_gates


def quantize(model: torch.nn.Module) -> torch.nn.Module:
    return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_dynamic_quantization_of_a_converted_model_equals_quantized_gpt2():
    gpt2 = gpt2_model(random_constants=True)
    delta = ddl_hf.convert_gpt2(gpt2)
    ids = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = quantize(gpt2).eval()(ids).logits
        got = quantize(delta).eval()(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("variant", CLIENT_VARIANTS.values(), ids=CLIENT_VARIANTS.keys())
def test_dynamically_quantized_models_run_and_generate(variant):
    model = delta_model(**variant)
    open_gates(model)
    ids = torch.randint(1, 97, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(ids).logits
        quantized = quantize(model).eval()
        logits = quantized(ids).logits
        generated = quantized.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    assert quantized.transformer.h[0].mlp_delta.v_proj.__class__.__module__.startswith("torch.ao")
    assert torch.isfinite(logits).all() and generated.shape == (1, 10)
    # int8 weights: the same function up to quantization noise (a broken Delta path would decorrelate the logits).
    cosine = torch.nn.functional.cosine_similarity(logits.flatten(), reference.flatten(), dim=0)
    assert cosine > 0.95, cosine
