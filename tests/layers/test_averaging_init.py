"""Why the averaging start of the token convolution stalls with the Delta gates shut (docs/variants.md).

The cause, in two parts that these tests show:
1. The averaging read keeps a position-independent input whole and divides a token-dependent one: K taps of 1/K
   pass a constant with gain 1 and K independent per-token vectors with squared gain 1/K (the identity: 1 and 1).
2. Training from scratch (this recipe: AdamW 3e-3, warm-up) first collapses every model's reads onto one
   position-independent vector, the unigram plateau. Leaving it takes the token-dependent part of the reads to grow
   back; through averaging reads that part, and the gradient that grows it, are cut by the same factor, so the
   identity start leaves the plateau within 100 steps and the averaging start does not.
"""

from __future__ import annotations

import pytest
import torch

from ddl_hf import DeltaGPTConfig, DeltaGPTForCausalLM
from ddl_hf.delta_reads import DeltaStateConv


def averaging_and_identity(hidden: int, size: int = 4) -> tuple[DeltaStateConv, DeltaStateConv]:
    convs = []
    for start in ("average", "identity"):
        conv = DeltaStateConv("temporal_conv", hidden, 1, size).double()
        with torch.no_grad():
            conv.weight.copy_(conv.identity() if start == "identity" else torch.full_like(conv.weight, 1 / size))
        convs.append(conv)
    return convs[0], convs[1]


def test_averaging_keeps_the_position_independent_part_and_divides_the_token_dependent_part():
    size, hidden = 4, 64
    average, identity = averaging_and_identity(hidden, size)
    constant = torch.randn(1, 1, hidden, dtype=torch.float64).expand(1, 32, hidden)
    tokens = torch.eye(32, hidden, dtype=torch.float64)[None]  # one orthonormal vector per position
    with torch.no_grad():
        for conv, token_gain in ((average, 1 / size), (identity, 1.0)):
            # past the first K - 1 positions (whose window reaches before the sequence)
            torch.testing.assert_close(conv(constant)[:, size - 1 :], constant[:, size - 1 :])
            gains = conv(tokens)[0, size - 1 :].pow(2).sum(-1)
            torch.testing.assert_close(gains, torch.full_like(gains, token_gain))


def token_dependent_share(reads: torch.Tensor) -> float:
    """Share of the reads' (centred, as LayerNorm sees them) energy that varies across positions."""
    reads = reads.reshape(-1, reads.shape[-1])
    reads = reads - reads.mean(-1, keepdim=True)
    varying = reads - reads.mean(0)
    return float(varying.pow(2).sum() / reads.pow(2).sum())


def train_gate_shut_tc(blocks: torch.Tensor, start: str, steps: int = 100) -> list[tuple[int, float, float]]:
    """GPT-2 whose sublayers and final norm read through a TC (every gate shut: beta = 0), from `start`;
    (step, training loss, token-dependent share of the final read) every 20 steps."""
    torch.manual_seed(0)
    config = DeltaGPTConfig(
        vocab_size=512, n_positions=128, n_embd=128, n_layer=4, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, delta_mode="additive", delta_state_read="temporal_conv",
    )  # fmt: skip
    model = DeltaGPTForCausalLM(config)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, DeltaStateConv):
                assert torch.allclose(module.weight, torch.full_like(module.weight, 0.25))  # from-scratch: average
                if start == "identity":
                    module.weight.copy_(module.identity())
        for block in model.delta_residuals().values():
            block.beta_open.zero_()
            block.beta_open.requires_grad_(False)
    reads = {}
    model.transformer.ln_f.register_forward_hook(lambda module, args, out: reads.__setitem__("final", args[0]))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 50))
    order = torch.randint(0, len(blocks), (steps + 1, 8), generator=torch.Generator().manual_seed(0))
    trace = []
    for step in range(steps + 1):
        batch = blocks[order[step]]
        loss = model(batch, labels=batch).loss
        if step % 20 == 0:
            trace.append((step, float(loss.detach()), token_dependent_share(reads["final"].detach())))
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    return trace


@pytest.fixture(scope="module")
def text_blocks() -> torch.Tensor:
    from tokenizers import ByteLevelBPETokenizer

    from ddl_hf.corpus import load_text

    text = load_text("austen-heldout")["text"]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(text, vocab_size=512, min_frequency=2, show_progress=False)
    ids = [i for encoding in bpe.encode_batch(text) for i in encoding.ids]
    return torch.tensor(ids[: len(ids) // 128 * 128]).view(-1, 128)


def test_both_starts_fall_onto_the_unigram_plateau_and_only_the_identity_leaves_it(text_blocks):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same float rounding on every machine's thread count
    try:
        traces = {start: train_gate_shut_tc(text_blocks, start) for start in ("identity", "average")}
    finally:
        torch.set_num_threads(threads)
    identity, average = traces["identity"], traces["average"]
    # At the start the averaging read already carries a smaller token-dependent share (measured 0.71 vs 0.84).
    assert average[0][2] < identity[0][2] - 0.05
    # By step 20 both have collapsed their final read onto one vector: the unigram plateau (both about 0.008).
    assert identity[1][2] < 0.05 and average[1][2] < 0.05
    # Then the identity start grows its token-dependent read back (0.07, 0.15, 0.30 at steps 60-100) and its loss
    # falls; the average's stays flat (0.007) and its loss with it (5.09 vs 5.31 at step 100).
    assert identity[-1][2] > 0.15 and identity[-1][2] > identity[-2][2] > identity[-3][2]
    assert average[-1][2] < 0.03 and average[-1][2] < 2 * average[1][2]
    assert identity[-1][1] < average[-1][1] - 0.1
