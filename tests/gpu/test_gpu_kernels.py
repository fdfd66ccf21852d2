"""The kernels a CUDA device runs against the tensor ops and the float64 reference, at GPT-2 small's shape (12 layers,
width 768, 1024 tokens; batch 2): each variant's bf16 training step with `delta_implementation="triton"` (one Triton
op per Delta residual, forward and backward) against float32 "eager"; and DeltaNet's delta rule through
flash-linear-attention's kernels against the float64 recurrence, then a DeltaNet model with "triton" (fla's rule)
against "eager": its logits and its bf16 training step (CUDA autocast hands fla a float32 q / k beside a bf16 v: only
a device sees that). Bounds: `gpu_models`.
"""

from __future__ import annotations

import pytest
import torch

from ddl_hf.delta_net_ops import delta_rule, delta_rule_recurrent
from ddl_hf.delta_ops import delta_kernels
from ddl_hf.fla_kernels import fla_available
from tests.builders import delta_model
from tests.gpu.gpu_models import (
    BETA,
    SMALL,
    VARIANTS,
    assert_bf16_training_matches_float32_eager,
    baseline,
    bf16_bound,
    delta_of,
    exact_fp32,
    fp32_bound,
    logits_of,
    random_ids,
    rel_err,
    running,
)

pytestmark = pytest.mark.gpu

BATCH = 2


@pytest.fixture(scope="module")
def triton_kernels(device):
    """`delta_implementation="triton"`'s kernels on the device, or a skip with the library's reason."""
    try:
        return delta_kernels("triton", torch.empty(0, device=device))
    except (ImportError, RuntimeError) as error:  # DeltaImplementationUnavailable is a RuntimeError
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def fla_rule(triton_kernels):
    if not fla_available():
        pytest.skip("fla is not installed (pip install 'ddl-hf[fla]')")
    return triton_kernels.delta_rule


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_triton_ops_bf16_training_step_matches_float32_eager(variant, device, triton_kernels):
    """Loss and every parameter's gradient, each within 4 times "eager"'s own bf16 error against float32 "eager"."""
    source = baseline(VARIANTS[variant][0], SMALL)
    model = delta_of(variant, source, "eager").to(device).train()
    ids = random_ids(model.config.vocab_size, BATCH, SMALL["seq"], seed=4).to(device)
    assert_bf16_training_matches_float32_eager(model, ids, "triton")


#: (tokens, dtype): one decoding step, a chunk, several chunks with a ragged end; fla's chunk form runs for bf16 and
#: T > 1, fused_recurrent otherwise.
FLA_CASES = [(1, torch.float32), (64, torch.float32), (200, torch.float32), (64, torch.bfloat16), (200, torch.bfloat16)]


@pytest.mark.parametrize(("tokens", "dtype"), FLA_CASES, ids=lambda case: str(case).removeprefix("torch."))
def test_flas_delta_rule_matches_the_float64_recurrence(tokens, dtype, device, fla_rule):
    """Output and final state from an initial state, against `delta_rule_recurrent` in float64 on the device; bound: 8
    times the error our torch form makes on the same inputs in the same dtype (mostly the inputs' own rounding)."""
    heads, d = 4, 64
    g = torch.Generator().manual_seed(tokens)
    q, k = (torch.nn.functional.normalize(torch.randn(2, heads, tokens, d, generator=g), dim=-1) for _ in "qk")
    v = torch.randn(2, heads, tokens, d, generator=g)
    beta = torch.rand(2, heads, tokens, generator=g)
    state = torch.randn(2, heads, d, d, generator=g) * 0.1
    inputs = [x.to(device) for x in (q, k, v, beta, state)]
    exact = delta_rule_recurrent(*(x.double() for x in inputs[:4]), inputs[4].double())

    def error(kernel) -> float:
        o, final = delta_rule(*(x.to(dtype) for x in inputs[:4]), initial_state=inputs[4], kernel=kernel)
        return max(rel_err(o, exact[0]), rel_err(final, exact[1]))

    assert error(fla_rule) <= max(8 * error(None), 1e-6)


@pytest.fixture(scope="module")
def delta_net(device, fla_rule) -> tuple[torch.nn.Module, torch.Tensor]:
    """A DeltaNet DeltaGPT at GPT-2 small's shape (gates open), on the device, running "eager"."""
    shape = {k: SMALL[k] for k in ("n_layer", "n_embd", "n_head", "vocab_size")}
    model = delta_model(**shape, n_positions=1024, token_mixer="delta_net", delta_beta_init=BETA, seed=1)
    model.set_delta_implementation("eager")
    model.loss_type = "ForCausalLM"  # transformers logs that it resolves the loss otherwise
    ids = random_ids(model.config.vocab_size, BATCH, SMALL["seq"], seed=5).to(device)
    yield model.to(device), ids
    del model
    torch.cuda.empty_cache()


def test_a_delta_net_models_logits_with_fla_match_float32_eager(delta_net):
    """bf16 autocast within 4 times "eager"'s own bf16 error; float32 within the float32 bound (TF32 off)."""
    model, ids = delta_net
    with exact_fp32():
        reference = logits_of(model, ids)
    eager_bf16 = rel_err(logits_of(model, ids, bf16=True), reference)
    with running(model, "triton"):
        assert rel_err(logits_of(model, ids, bf16=True), reference) <= bf16_bound(eager_bf16)
        with exact_fp32():
            assert rel_err(logits_of(model, ids), reference) <= fp32_bound(SMALL)


def test_a_delta_net_models_bf16_training_step_with_fla_matches_float32_eager(delta_net):
    model, ids = delta_net
    model.train()
    try:
        assert_bf16_training_matches_float32_eager(model, ids, "triton")
    finally:
        model.eval()
