"""Directories saved before the layers-over-ops redesign (tests/data/ddl_hf_0_2, written by commit b72347a with
`make_fixtures.py` beside them) load with today's code and give the logits and greedy tokens that code computed: bit
for bit on the torch that wrote them (`written_with.json`), and within float32 rounding on another torch release,
whose CPU kernels may sum in another order. The saved outputs are the reference, not today's code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import ddl_hf  # noqa: F401  (registers the Auto classes)

FIXTURES = Path(__file__).parent / "data" / "ddl_hf_0_2"
NAMES = sorted(path.name for path in FIXTURES.iterdir() if path.is_dir())
WRITTEN_WITH = json.loads((FIXTURES / "written_with.json").read_text())


def test_every_fixture_is_found():
    assert len(NAMES) == 8 and "llama-dv4-tc" in NAMES and "delta_net-dv1" in NAMES


@pytest.mark.compat
@pytest.mark.parametrize("name", NAMES)
def test_a_directory_saved_before_the_redesign_computes_what_it_computed(name):
    expected = load_file(FIXTURES / name / "expected.safetensors")
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / name).eval()
    ids, mask = expected["input_ids"], expected["attention_mask"]
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
        tokens = model.generate(
            ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0
        )
    if torch.__version__ == WRITTEN_WITH["torch"]:
        assert torch.equal(logits, expected["logits"]), (logits - expected["logits"]).abs().max()
    else:  # a few float32 roundings per layer, relative to the logits' scale
        scale = float(expected["logits"].abs().max())
        eps = torch.finfo(torch.float32).eps
        torch.testing.assert_close(
            logits, expected["logits"], rtol=0, atol=64 * eps * scale * model.config.num_hidden_layers
        )
    assert torch.equal(tokens, expected["tokens"])
