"""What the conversion tests share: the Hub code files a saved model ships, a refused conversion leaves nothing
behind, a source whose weights do not match its config, a save that fails halfway, and the Hub API replaced by a
recorder of what an upload sends (no network here)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from huggingface_hub import HfApi, ModelCard, ModelCardData
from safetensors.torch import load_file, save_file

#: The Hub code a saved DeltaGPT ships beside its weights (the root files it imports, relatively).
DELTA_GPT_CODE = (
    "configuration_delta_gpt.py",
    "modeling_delta_gpt.py",
    "delta_layers.py",
    "delta_model.py",
    "delta_heads.py",
    "delta_reads.py",
    "delta_state.py",
    "delta_net.py",
    "delta_net_ops.py",
    "delta_ops.py",
    "delta_fused.py",
    "delta_compat.py",
)
#: The Hub code a saved DeltaLlama ships: its own two files, DeltaGPT's config (which its config extends) and the
#: shared files (delta_model imports the DeltaNet mixer's cache, so those come too).
DELTA_LLAMA_CODE = ("configuration_delta_llama.py", "modeling_delta_llama.py", *DELTA_GPT_CODE[:1], *DELTA_GPT_CODE[2:])


#: The heads a saved Delta model loads with through an Auto class of its own (`AutoModelFor<head>`).
HEADS = ("CausalLM", "SequenceClassification", "TokenClassification", "QuestionAnswering")


def hub_auto_map(model: str) -> dict[str, str]:
    """The `auto_map` a saved `model` ("DeltaGPT" or "DeltaLlama") must carry: AutoConfig, AutoModel and each head's
    Auto class, each to its class in the Hub code (`configuration_delta_gpt.py`, `modeling_delta_gpt.py` or Llama's)."""
    files = {"DeltaGPT": "delta_gpt", "DeltaLlama": "delta_llama"}[model]
    return {
        "AutoConfig": f"configuration_{files}.{model}Config",
        "AutoModel": f"modeling_{files}.{model}Model",
        **{f"AutoModelFor{head}": f"modeling_{files}.{model}For{head}" for head in HEADS},
    }


def assert_refused(capsys, code: int, out: Path, *needles: str, expected_code: int = 1) -> str:
    """The CLI exited with `expected_code`, left neither `out` nor a temporary or backup folder beside it, and said
    each of `needles` on stderr (returned)."""
    err = capsys.readouterr().err
    assert code == expected_code, err
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]  # no temp/backup dirs
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def with_weights_changed(source: Path, target: Path, drop: str, add: str) -> Path:
    """A copy of the saved checkpoint `source` at `target` whose weights lack `drop` and hold an extra `add`."""
    target.mkdir()
    for file in source.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    weights = load_file(target / "model.safetensors")
    del weights[drop]
    weights[add] = torch.zeros(3)
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return target


def partial_save_then(error: BaseException) -> Callable[..., None]:
    """A `save_pretrained` that writes half a shard, then raises `error` (a full disk, an interruption)."""

    def save_pretrained(self, directory, **kwargs):
        Path(directory, "model-00001-of-00002.safetensors").write_bytes(b"\0" * 1000)  # half-written shard
        raise error

    return save_pretrained


def record_hub_uploads(monkeypatch: pytest.MonkeyPatch) -> list[set[str]]:
    """Replace the Hub API calls that uploads make by a recorder: the list it returns gets the uploaded file names of
    each commit."""
    uploads: list[set[str]] = []

    class Repo:
        def __init__(self, repo_id: str) -> None:
            self.repo_id = repo_id

    def create_commit(self, repo_id, operations, **kwargs):
        uploads.append({op.path_in_repo for op in operations})
        return f"https://huggingface.co/{repo_id}/commit/0"

    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kwargs: Repo(repo_id))
    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    import transformers.utils.hub as transformers_hub

    monkeypatch.setattr(
        transformers_hub,
        "create_and_tag_model_card",
        lambda repo_id, tags=None, token=None: ModelCard.from_template(ModelCardData(library_name="transformers")),
    )
    return uploads
