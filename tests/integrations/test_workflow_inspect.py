"""`ddl-hf inspect`: the beta table and heat-map agree with the model's own output_betas."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

import ddl_hf
from ddl_hf.inspection import beta_map
from tests.builders import inspect_table
from tests.workflow_utils import load_example, tiny_gpt2_dir


@pytest.fixture(scope="module")
def delta_dir(tmp_path_factory):
    from transformers import GPT2LMHeadModel

    tmp = tmp_path_factory.mktemp("inspect")
    base = tiny_gpt2_dir(tmp / "base", dropout=0.0)
    model = ddl_hf.convert_gpt2(GPT2LMHeadModel.from_pretrained(base))
    # Three regimes on purpose: layer 0 attention keeps (closed), layer 0 MLP projects (~1), layer 1 MLP reflects.
    with torch.no_grad():
        blocks = [m for m in model.modules() if isinstance(m, ddl_hf.DeltaResidual)]
        blocks[1].beta_open.fill_(1.0)  # beta = 2 sigmoid(0) * 1 = 1
        blocks[3].beta_open.fill_(1.0)
        blocks[3].beta_proj.bias.fill_(4.0)  # beta = 2 sigmoid(4) ~ 1.96
        blocks[2].beta_open.fill_(0.5)
        blocks[2].beta_proj.weight.normal_(0.0, 2.0)  # token-dependent
    model.save_pretrained(tmp / "delta")
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(base).save_pretrained(tmp / "delta")
    return tmp, model.eval()


def test_inspect_cli_table_and_heatmap(delta_dir, tmp_path):
    tmp, model = delta_dir
    text = tmp_path / "sample.txt"
    text.write_text("If music be the food of love, play on;\nGive me excess of it, that, surfeiting,\n")
    inspect_table(tmp / "delta", text, tmp_path / "betas.png")

    # The map is the model's own betas for these tokens (independent path: a direct forward).
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp / "delta")
    result = beta_map(model, tokenizer, text.read_text(), max_tokens=64)
    ids = tokenizer(text.read_text(), return_tensors="pt")["input_ids"]
    with torch.no_grad():
        direct = torch.stack([b[0] for b in model(ids, output_betas=True).betas])
    torch.testing.assert_close(result.betas, direct)
    assert "".join(result.tokens) == text.read_text()


def test_inspect_example_script(delta_dir, tmp_path):
    tmp, _ = delta_dir
    example = load_example("inspect_betas")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert example.main(["--model", str(tmp / "delta"), "--output", str(tmp_path / "b.png")]) == 0
    assert "L1.mlp" in stdout.getvalue() and (tmp_path / "b.png").exists()
