"""The GPU tests' training check can fail: `gpu_models.assert_bf16_training_matches_float32_eager` run on the CPU.

tests/gpu runs only on a CUDA device, so on most machines nothing would show that its bound rejects a wrong kernel.
Here `delta_implementation="triton"` is given a stand-in delta-rule kernel on CPU tensors (the library's own path from
a model's implementation to its kernels, the kernel chosen here): the torch chunkwise form passes, and the same form
with its outputs one token late fails (a scale would vanish in DeltaNet's output norm).
"""

from __future__ import annotations

import pytest
import torch

import ddl_hf.kernels as backends
from ddl_hf import delta_ops
from ddl_hf.delta_net_ops import delta_rule_chunkwise
from tests.builders import DELTA_NET, delta_model
from tests.gpu.gpu_models import assert_bf16_training_matches_float32_eager


def chunkwise_rule(calls: list, shift: int = 0):
    """A stand-in delta-rule kernel: the chunkwise form, its outputs `shift` tokens late; `calls` counts its calls."""

    def rule(q, k, v, beta, initial_state, erase, document_starts, cu_seqlens):
        calls.append(v.dtype)
        o, state = delta_rule_chunkwise(q, k, v, beta, initial_state=initial_state, erase=erase)
        return o.roll(shift, dims=2), state

    return rule


@pytest.fixture
def stand_in_triton(monkeypatch):
    """`install(rule)`: "triton" on the CPU runs `rule` as its delta rule and the tensor ops for the rest. The chosen
    kernels are cached per process (`delta_ops._CHOSEN`): a fresh cache here, the real one back afterwards."""

    def install(rule) -> None:
        monkeypatch.setattr(delta_ops, "_CHOSEN", {})
        kernels = delta_ops.DeltaKernels(delta_rule=rule)
        monkeypatch.setattr(backends, "prepare", lambda implementation: {"cpu": kernels})

    return install


def test_the_bf16_training_check_passes_the_same_math_and_fails_a_token_late_kernel(stand_in_triton):
    model = delta_model(DELTA_NET, n_layer=2, delta_implementation="eager")
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    calls: list = []
    stand_in_triton(chunkwise_rule(calls))
    assert_bf16_training_matches_float32_eager(model, ids, "triton")
    assert calls and model.config.delta_implementation == "eager"  # the kernel ran; the model's own is back

    stand_in_triton(chunkwise_rule(calls, shift=1))
    with pytest.raises(AssertionError, match="gradients past the bound"):
        assert_bf16_training_matches_float32_eager(model, ids, "triton")
