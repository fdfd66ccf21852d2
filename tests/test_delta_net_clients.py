"""DeltaNet under the tools people plug it into (issue 10, items 3-5): bf16 autocast, packed rows, export.

Every check compares against an independent reference: the recurrent loop, each document run alone, the float32
model, the eager model.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.nn.functional import normalize

import ddl_hf  # noqa: F401  (registers the Auto classes)
from ddl_hf import DeltaGPTConfig, DeltaGPTForCausalLM
from ddl_hf.delta_ops import delta_rule_chunkwise, delta_rule_recurrent, unit_lower_triangular_inverse

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 61


def tiny_model(seed: int = 0, **overrides) -> DeltaGPTForCausalLM:
    fields = dict(
        vocab_size=VOCAB,
        n_positions=96,
        n_embd=32,
        n_layer=2,
        n_head=4,
        token_mixer="delta_net",
        delta_net_chunk_size=8,  # several chunks (and padding) at test lengths
        delta_beta_init=0.5,  # Delta residuals open, so the DeltaNet output matters everywhere
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(seed)
    model = DeltaGPTForCausalLM(DeltaGPTConfig(**(fields | overrides))).eval()
    with torch.no_grad():  # a visible short conv (the HF init makes it tiny), so a window across documents shows
        for block in model.transformer.h:
            if hasattr(block.attn, "conv1d"):
                block.attn.conv1d.weight.normal_(std=0.5)
    return model


def make_inputs(batch=2, heads=3, seq_len=37, d_k=8, d_v=5, beta_max=2.0, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = normalize(torch.randn(batch, heads, seq_len, d_k, generator=g, dtype=dtype), dim=-1)
    k = normalize(torch.randn(batch, heads, seq_len, d_k, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(batch, heads, seq_len, d_v, generator=g, dtype=dtype)
    beta = beta_max * torch.rand(batch, heads, seq_len, generator=g, dtype=dtype)
    state = torch.randn(batch, heads, d_v, d_k, generator=g, dtype=dtype)
    return q, k, v, beta, state


def starts_mask(batch: int, seq_len: int, starts: list[list[int]]) -> torch.Tensor:
    mask = torch.zeros(batch, seq_len, dtype=torch.bool)
    for row, row_starts in enumerate(starts):
        mask[row, row_starts] = True
    return mask


# ---------------------------------------------------------------------------------------------------------------
# The exportable inverse and document starts in the delta rule
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 3, 7, 8, 37, 64])
def test_unit_lower_triangular_inverse_is_the_inverse(size):
    """Against LAPACK's inverse, on the matrices the rule builds: strict_lower(diag(beta) K K^T), beta in (0, 2)."""
    _, k, _, beta, _ = make_inputs(batch=1, heads=3, seq_len=size, d_k=4, dtype=torch.float64, seed=size)
    a = ((beta.unsqueeze(-1) * k) @ k.transpose(-1, -2)).tril(-1)
    expected = torch.linalg.inv(torch.eye(size, dtype=torch.float64) + a)
    torch.testing.assert_close(unit_lower_triangular_inverse(a), expected, rtol=1e-10, atol=1e-10)


# Row 0: starts inside chunks, on a chunk boundary (8, 16), two in a row (21, 22), the last token; row 1: none but
# t = 0 (drops the initial state).
STARTS = [[5, 8, 16, 21, 22, 36], [0]]


def run_documents_alone(q, k, v, beta, s0, starts, erase):
    """The reference: each document of each row through the recurrent loop on its own."""
    outputs, finals = [], []
    for row, row_starts in enumerate(starts):
        bounds = sorted({0, *row_starts, q.shape[2]})
        pieces, state = [], s0[row : row + 1] if 0 not in row_starts else None
        for lo, hi in itertools.pairwise(bounds):
            piece = (x[row : row + 1, :, lo:hi] for x in (q, k, v, beta))
            o, state = delta_rule_recurrent(*piece, state if lo == 0 else None, erase=erase)
            pieces.append(o)
        outputs.append(torch.cat(pieces, dim=2))
        finals.append(state)
    return torch.cat(outputs), torch.cat(finals)


@pytest.mark.parametrize("erase", [True, False], ids=["delta", "write_only"])
@pytest.mark.parametrize("chunk_size", [1, 4, 8, 64], ids=lambda c: f"chunk{c}")
def test_document_starts_equal_each_document_alone(chunk_size, erase):
    q, k, v, beta, s0 = make_inputs()
    starts = starts_mask(2, 37, STARTS)
    o_ref, s_ref = run_documents_alone(q, k, v, beta, s0, STARTS, erase)
    for o, s in (
        delta_rule_chunkwise(q, k, v, beta, chunk_size, s0, erase=erase, document_starts=starts),
        delta_rule_recurrent(q, k, v, beta, s0, erase=erase, document_starts=starts),
    ):
        assert (o - o_ref).abs().max() <= 1e-5
        assert (s - s_ref).abs().max() <= 1e-5
    # and they matter: without them the documents leak into each other
    o_leak, _ = delta_rule_chunkwise(q, k, v, beta, chunk_size, s0, erase=erase)
    assert (o_leak - o_ref).abs().max() > 0.1


def test_document_start_gradients_equal_recurrent_gradients():
    inputs = [x.requires_grad_(True) for x in make_inputs(seq_len=37)]
    starts = starts_mask(2, 37, [[3, 8, 20], [11]])
    g = torch.Generator().manual_seed(1)
    o_weight, s_weight = torch.randn(2, 3, 37, 5, generator=g), torch.randn(2, 3, 5, 8, generator=g)

    def grads(fn):
        o, s = fn(*inputs[:4], inputs[4], document_starts=starts)
        return torch.autograd.grad((o * o_weight).sum() + (s * s_weight).sum(), inputs)

    ref = grads(delta_rule_recurrent)
    chunked = grads(lambda *x, **kw: delta_rule_chunkwise(*x[:4], 8, x[4], **kw))
    for name, a, b in zip(["q", "k", "v", "beta", "initial_state"], ref, chunked):
        assert (a - b).abs().max() <= 1e-5 * max(1.0, a.abs().max().item()), name
