"""`ddl-hf upgrade`: a checkpoint directory that ddl-hf 0.1 wrote, rewritten for this release.

ddl-hf 0.1 saved each Delta residual's `beta_open` 0-dim; since 0.2 it is `[1]` (FSDP2 shards along dim 0), and
`from_pretrained` refuses a 0.1 checkpoint with one line naming this command (delta_compat's
`check_checkpoint_format`). The upgrade is that reshape and nothing else, in every file under the directory (a model,
a peft adapter whose `modules_to_save` holds Delta residuals, a Trainer checkpoint, or a run directory holding
several): the 0-dim `beta_open` of the weights (safetensors, `pytorch_model*.bin`, `adapter_model.bin`) and the
optimizer state kept for them (`optimizer.pt`: AdamW's `exp_avg` and `exp_avg_sq`) become `[1]`. Every other file is
copied byte for byte, except a model directory's custom-code files: `[1]` weights need this release's code (0.1's
would refuse them), so the directory gets today's, the files `save_pretrained` writes. The output is written into an
`atomic_directory`, so a failure leaves no partial output.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import shutil
from collections import Counter
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers.dynamic_module_utils import get_relative_import_files

from ..delta_compat import is_0_1_tensor
from .atomic import _umask, atomic_directory
from .converting import hub_kwargs, looks_like_path
from .errors import ConversionError

#: Weight files in torch's pickle format that may hold a 0.1 `beta_open` (a model's, or a peft adapter's).
WEIGHT_BIN = re.compile(r"(pytorch_model|adapter_model).*\.bin")
#: The optimizer state of a Trainer checkpoint (`Trainer._save_optimizer_and_scheduler`).
OPTIMIZER_FILE = "optimizer.pt"
#: The custom-code modules that `save_pretrained` writes for each model type (with their relative imports).
CODE_MODULES = {
    "delta_gpt": ("configuration_delta_gpt", "modeling_delta_gpt"),
    "delta_llama": ("configuration_delta_llama", "modeling_delta_llama"),
}


@dataclasses.dataclass
class UpgradeReport:
    """What `upgrade_checkpoint` wrote: the files it reshaped tensors in (and how many), the code files it wrote
    from this release, and the files it copied unchanged (paths relative to the output)."""

    source: Path
    output: Path
    reshaped: dict[str, int] = dataclasses.field(default_factory=dict)
    code: list[str] = dataclasses.field(default_factory=list)
    copied: list[str] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"Upgraded the ddl-hf 0.1 checkpoint {self.source} into {self.output}:"]
        lines += [f"  {name}: {count} 0-dim tensors reshaped to [1]" for name, count in self.reshaped.items()]
        if self.code:
            lines.append(f"  this release's code: {', '.join(self.code)}")
        lines.append(f"  copied unchanged: {len(self.copied)} files")
        return "\n".join(lines)


def upgrade_checkpoint(source: str | os.PathLike, output: str | os.PathLike, *, force: bool = False) -> UpgradeReport:
    """Write `source` (a directory or Hub id holding ddl-hf 0.1 checkpoints) to `output` in this release's format.

    Refuses (ConversionError, nothing written) a non-empty `output` unless `force` (`output == source` with `force`
    upgrades in place, once the new directory is complete), an `output` inside `source` or around it, and a source
    with no 0.1 tensor. Leaves `source` unchanged and, on any error, `output` as it was (`atomic_directory`).
    """
    source_dir = _resolve_source(str(source))
    output = Path(os.path.abspath(output))
    resolved, resolved_source = output.resolve(), source_dir.resolve()
    if resolved != resolved_source and (
        resolved.is_relative_to(resolved_source) or resolved_source.is_relative_to(resolved)
    ):
        raise ConversionError(f"--output {output} and {source_dir} must not contain one another; nothing was written.")
    # Weights before optimizer states: a directory's states are checked against its 0-dim weights.
    files = [path for path in source_dir.rglob("*") if path.is_file()]
    files = sorted(  # `hf download --local-dir`'s records of the source's files are not copied
        (path for path in files if ".cache" not in path.relative_to(source_dir).parts),
        key=lambda path: (path.name == OPTIMIZER_FILE, path),
    )
    report = UpgradeReport(source=source_dir, output=output)
    with atomic_directory(output, force=force) as tmp:
        legacy_weights: Counter[Path] = Counter()  # 0-dim `beta_open` per directory
        for path in files:
            name = path.relative_to(source_dir)
            target = tmp / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if path.name == OPTIMIZER_FILE:
                reshaped = _upgrade_optimizer(path, target, legacy_weights[name.parent], name)
            else:
                reshaped = _upgrade_weights(path, target)
                legacy_weights[name.parent] += reshaped
            if reshaped:
                target.chmod(0o666 & ~_umask())  # safetensors writes 0600; the copies get the usual permissions
                report.reshaped[name.as_posix()] = reshaped
            else:
                shutil.copyfile(path, target)
                report.copied.append(name.as_posix())
        if not report.reshaped:
            raise ConversionError(
                f"{source} holds no tensor that ddl-hf 0.1 saved 0-dim (beta_open): it needs no upgrade, and nothing "
                "was written."
            )
        for config in sorted(tmp.rglob("config.json")):
            for written in _write_todays_code(config):
                name = written.relative_to(tmp).as_posix()
                report.code.append(name)
                if name in report.copied:
                    report.copied.remove(name)
    return report


def _resolve_source(source: str) -> Path:
    """The source directory: a local one, or a Hub repository's files (downloaded, or from the cache offline)."""
    if os.path.isdir(source):
        return Path(os.path.abspath(source))
    if looks_like_path(source):
        raise ConversionError(f"{source} is not a directory; nothing was written.")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, **hub_kwargs(source)))
    except Exception as error:  # no such repository, offline and not cached, no access
        raise ConversionError(f"Cannot read {source}: not a directory, and not a Hub repository ({error}).") from error


def _upgrade_weights(path: Path, target: Path) -> int:
    """Write `path`'s tensors with each 0.1 `beta_open` as `[1]` to `target`; return how many (0: nothing written)."""
    if path.suffix == ".safetensors":
        with safe_open(path, framework="pt") as file:
            names = file.keys()
            legacy = [key for key in names if is_0_1_tensor(key, file.get_slice(key).get_shape())]
            metadata = file.metadata()
        if legacy:
            tensors = load_file(path)
            save_file({key: _as_1_dim(key, value) for key, value in tensors.items()}, target, metadata=metadata)
        return len(legacy)
    if WEIGHT_BIN.fullmatch(path.name):
        tensors = torch.load(path, map_location="cpu", weights_only=True)
        legacy = [key for key, value in tensors.items() if torch.is_tensor(value) and is_0_1_tensor(key, value.shape)]
        if legacy:
            torch.save({key: _as_1_dim(key, value) for key, value in tensors.items()}, target)
        return len(legacy)
    return 0


def _as_1_dim(key: str, value: torch.Tensor) -> torch.Tensor:
    return value.reshape(1) if is_0_1_tensor(key, value.shape) else value


def _upgrade_optimizer(path: Path, target: Path, legacy_weights: int, name: Path) -> int:
    """Write a Trainer checkpoint's optimizer state with the state of each 0.1 `beta_open` as `[1]` to `target`; return
    how many parameters' states changed (0: nothing written).

    The state is keyed by parameter index, not name; a 0-dim state other than `step` (0-dim by design) belongs to a
    0-dim parameter, and a 0.1 model's only ones are its `beta_open`. More such states than 0-dim `beta_open` in the
    weights beside it would mean other 0-dim parameters, which this command does not know: it refuses."""
    optimizer = torch.load(path, map_location="cpu", weights_only=True)
    changed = 0
    for state in optimizer.get("state", {}).values():
        keys = [key for key, value in state.items() if key != "step" and torch.is_tensor(value) and value.dim() == 0]
        for key in keys:
            state[key] = state[key].reshape(1)
        changed += bool(keys)
    if changed > legacy_weights:
        raise ConversionError(
            f"{name} holds the state of {changed} 0-dim parameters, but the weights beside it only {legacy_weights} "
            "0-dim beta_open: not a ddl-hf 0.1 checkpoint that `ddl-hf upgrade` understands. Nothing was written."
        )
    if changed:
        torch.save(optimizer, target)
    return changed


def _write_todays_code(config_path: Path) -> list[Path]:
    """This release's custom-code files beside a DeltaGPT / DeltaLlama `config.json` with an `auto_map` (what
    `save_pretrained` writes there: each auto-class module and its relative imports); none for other configs."""
    config = json.loads(config_path.read_text())
    if "auto_map" not in config or config.get("model_type") not in CODE_MODULES:
        return []
    files = []
    for module_name in CODE_MODULES[config["model_type"]]:
        module_file = importlib.import_module(f"ddl_hf.{module_name}").__file__
        files += [module_file, *get_relative_import_files(module_file)]
    written = []
    for file in dict.fromkeys(files):
        target = config_path.parent / Path(file).name
        shutil.copyfile(file, target)
        written.append(target)
    return written


__all__ = ["UpgradeReport", "upgrade_checkpoint"]
