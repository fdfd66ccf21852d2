"""Write the checkpoints of tests/test_saved_checkpoints.py: tiny models saved by the code of one commit, with their
logits and greedy tokens, so that later code is checked against what that code computed (the reference is the saved
output, not today's code). `ddl_hf_0_2/` was written at commit b72347a (before the layers-over-ops redesign),
`main_e568c07/` at e568c07 (before the read became a module of the block, which renamed its parameters).

Run once, from the repository root, at the commit the folder is named after:

    PYTHONPATH=. python tests/data/make_fixtures.py tests/data/<folder>
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))  # tests/, for builders
from builders import CLIENT_VARIANTS, delta_model, scramble_delta_weights  # noqa: E402
from rounding import machine  # noqa: E402

import ddl_hf  # noqa: E402

VARIANTS = {
    name: CLIENT_VARIANTS[name]
    for name in ("additive-dv1", "paper-dv4", "delta_net-dv1", "tc-ec-paper-dv4", "cc-dv4", "reference-tc-dv4")
}


def llama(**delta) -> ddl_hf.DeltaLlamaForCausalLM:
    config = ddl_hf.DeltaLlamaConfig(
        source_model_type="llama",
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
        **delta,
    )
    torch.manual_seed(0)
    return ddl_hf.DeltaLlamaForCausalLM(config).eval()


def write(root: Path, name: str, model: torch.nn.Module) -> None:
    scramble_delta_weights(model)
    folder = root / name
    model.save_pretrained(folder)
    for code in folder.glob("*.py"):  # the Hub files: a test runs today's code on the weights, not a saved copy
        code.unlink()
    # The outputs of the model as loaded from the directory (an in-memory model can differ in the last bit).
    model = type(model).from_pretrained(folder).eval()
    ids = torch.randint(
        1,
        97 if model.config.vocab_size >= 97 else model.config.vocab_size,
        (2, 9),
        generator=torch.Generator().manual_seed(0),
    )
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded second row
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
        tokens = model.generate(
            ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0
        )
    save_file(
        {"input_ids": ids, "attention_mask": mask, "logits": logits, "tokens": tokens}, folder / "expected.safetensors"
    )


if __name__ == "__main__":
    root = Path(sys.argv[1])
    root.mkdir(parents=True, exist_ok=False)  # never over a folder that tests read
    for name, variant in VARIANTS.items():
        write(root, name, delta_model(**variant))
    write(root, "llama-dv4-tc", llama(delta_value_channels=4, delta_state_read="temporal_conv"))
    write(root, "llama-dv1-paper", llama(delta_mode="paper"))
    # A shared read at the embedding's expansion, Llama side (the CC read, the sigmoid value, EC).
    write(
        root,
        "llama-reference-cc-ec-dv4",
        llama(
            delta_mode="paper",
            delta_value_channels=4,
            delta_state_read="channel_conv",
            delta_embed_expand="conv",
            delta_value="sigmoid",
            delta_shared_read=True,
        ),
    )
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    written_with = {
        "commit": commit,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "machine": machine(),
    }
    (root / "written_with.json").write_text(json.dumps(written_with) + "\n")
