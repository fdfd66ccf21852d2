"""What make_fixtures.py (run with the 0.1 code) and tests/test_legacy_checkpoints.py (today's code) share: the tiny
model, the Trainer run that was checkpointed, and the Trainer checkpoint's pickle files kept as safetensors + JSON.

`Trainer` writes its optimizer, scheduler and RNG states with `torch.save` (pickle). The repository keeps no pickle:
`pickle_free` turns them into `trainer_states.safetensors` (every tensor) and `trainer_states.json` (the rest), and
`restore_pickles` writes Trainer's files back from them, the same values, in the directory a test resumes from.
Only torch, numpy, safetensors, datasets and transformers are imported, so the 0.1 code can run this too.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

TINY = dict(
    vocab_size=97,
    n_positions=64,
    n_embd=32,
    n_layer=2,
    n_head=4,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)
PICKLES = ("optimizer.pt", "scheduler.pt", "rng_state.pth")


def training_data():
    """The 16 rows of 12 token ids the run trains on."""
    from datasets import Dataset

    data = torch.randint(1, 97, (16, 12), generator=torch.Generator().manual_seed(4))
    return Dataset.from_dict({"input_ids": data.tolist(), "labels": data.tolist()})


def training_arguments(output_dir: str | Path, **overrides):
    """4 AdamW steps at a constant 1e-2, a checkpoint every 2."""
    from transformers import TrainingArguments

    fields = dict(
        max_steps=4,
        save_steps=2,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        seed=0,
        report_to=[],
        use_cpu=True,
    )
    return TrainingArguments(output_dir, **(fields | overrides))


def pickle_free(checkpoint: Path) -> None:
    """Replace the checkpoint's pickles (`PICKLES`) by `trainer_states.{safetensors,json}` holding the same states."""
    optimizer = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    scheduler = torch.load(checkpoint / "scheduler.pt", weights_only=True)
    rng = torch.load(checkpoint / "rng_state.pth", weights_only=False)
    tensors = {
        f"optimizer.{index}.{name}": value.contiguous()
        for index, state in optimizer["state"].items()
        for name, value in state.items()
    }
    numpy_kind, numpy_keys, numpy_pos, numpy_has_gauss, numpy_gauss = rng["numpy"]
    tensors["rng.cpu"] = rng["cpu"]
    tensors["rng.numpy"] = torch.from_numpy(numpy_keys.astype(np.int64))
    python_version, python_state, python_gauss = rng["python"]
    other = {
        "optimizer_param_groups": optimizer["param_groups"],
        "scheduler": scheduler,
        "rng": {
            "python": [python_version, list(python_state), python_gauss],
            "numpy": [numpy_kind, int(numpy_pos), int(numpy_has_gauss), float(numpy_gauss)],
        },
    }
    save_file(tensors, checkpoint / "trainer_states.safetensors")
    (checkpoint / "trainer_states.json").write_text(json.dumps(other, indent=1) + "\n")
    for name in PICKLES:
        (checkpoint / name).unlink()


def restore_pickles(checkpoint: Path) -> None:
    """Write Trainer's `PICKLES` into `checkpoint` from `trainer_states.{safetensors,json}` (inverse of
    `pickle_free`)."""
    tensors = load_file(checkpoint / "trainer_states.safetensors")
    other = json.loads((checkpoint / "trainer_states.json").read_text())
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("optimizer."):
            _, index, name = key.split(".")
            state.setdefault(int(index), {})[name] = value
    groups = [group | {"betas": tuple(group["betas"])} for group in other["optimizer_param_groups"]]
    torch.save({"state": state, "param_groups": groups}, checkpoint / "optimizer.pt")
    torch.save(other["scheduler"], checkpoint / "scheduler.pt")
    version, python_state, gauss = other["rng"]["python"]
    kind, pos, has_gauss, cached = other["rng"]["numpy"]
    numpy_state = (kind, tensors["rng.numpy"].numpy().astype(np.uint32), pos, has_gauss, cached)
    rng = {"python": (version, tuple(python_state), gauss), "numpy": numpy_state, "cpu": tensors["rng.cpu"]}
    torch.save(rng, checkpoint / "rng_state.pth")
