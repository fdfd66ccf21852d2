"""The whole job behind `ddl-hf convert`: a complete, verified Hub repository on disk, and its upload.

`convert_checkpoint` converts (GPT-2 -> DeltaGPT, Llama / Mistral / Qwen2 / Qwen3 -> DeltaLlama, picked from the
source's config by `families.conversion_path`), writes config (with `auto_map`), the custom-code files, safetensors,
tokenizer, generation config and model card into an `atomic_directory`, reloads what it wrote and checks it against
the source, so a failure at any point leaves no partial output. `push_converted_to_hub` uploads that folder as it is.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi, ModelCard, ModelCardData
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoTokenizer, PreTrainedConfig, PreTrainedModel
from transformers.utils import logging as hf_logging

from .atomic import atomic_directory
from .converting import _quiet_transformers, _resolve_dtype, hub_kwargs, looks_like_path
from .errors import ConversionError
from .families import (
    ConversionPath,
    ResolvedSource,
    conversion_path,
    family_name,
    resolve_source,
    source_class_name,
    source_model_type,
)
from .verifying import EquivalenceReport, equivalence_report, sample_input_ids

logger = hf_logging.get_logger(__name__)

DEFAULT_MAX_SHARD_SIZE = "2GB"
# Files that make the output directory a tokenizer repository as well (any one of them is enough).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json")


LOCAL_LOAD_ID = "path/to/this/directory"


def model_card(
    base_model: str | None,
    report: EquivalenceReport | None,
    config: PreTrainedConfig,
    command: str | None = None,
    load_id: str = LOCAL_LOAD_ID,
    path: ConversionPath | None = None,
) -> ModelCard:
    """A model card (README.md) saying what the model is, how it was made, how it checks out, and how to load it.

    `config` is the converted model's (`DeltaGPTConfig`, or `DeltaLlamaConfig` naming its source family).
    `base_model` must be a Hub id or None (the card is published: a local path means nothing to its readers);
    `load_id` is the Hub id shown in the loading examples, a neutral placeholder when it is not pushed.
    """
    path = path or conversion_path(config, "The converted model")  # given by a conversion, which resolved it
    family, family_type = family_name(config), source_model_type(config)
    card_data = ModelCardData(
        library_name="transformers",
        base_model=base_model or None,
        pipeline_tag="text-generation",
        tags=[path.tag, "deep-delta-learning", family_type, "text-generation", "custom_code"],
    )
    how = command or (
        f"ddl_hf.convert_checkpoint({base_model or f'path/to/{family_type}'!r}, OUT, delta_mode={config.delta_mode!r}, "
        f"value_channels={config.delta_value_channels}, beta_init={config.delta_beta_init})"
    )
    exact = config.delta_mode == "additive" and config.delta_beta_init == 0.0
    heads = f"{config.num_attention_heads} heads"
    kv_heads = getattr(config, "num_key_value_heads", None)
    if kv_heads is not None and kv_heads != config.num_attention_heads:
        heads += f" over {kv_heads} key/value heads"
    architecture = f"{family} ({config.num_hidden_layers} layers, {config.hidden_size} wide, {heads})"
    body = f"""
# {path.delta_name} converted from {f"`{base_model}`" if base_model else f"a {family} checkpoint"}

A {architecture} whose every attention and MLP residual
is a Deep Delta Learning block (Zhang, Liu, Wang, Gu, *Deep Delta Learning*, arXiv 2601.00417):
`X' = X [+ F(x) 1^T] + beta k (v^T - k^T X)` with a learned gate beta in [0, 2].

| setting | value |
|---|---|
| delta_mode | `{config.delta_mode}` |
| value channels d_v | {config.delta_value_channels} |
| initial beta | {config.delta_beta_init:g} |
| gate | `{config.delta_gate}` |

{
        f"With these settings the model computes exactly the function of the source {family} until fine-tuning "
        "opens the gates."
        if exact
        else f"These settings change the function of the source {family} at step 0; see the perplexity change below."
    }

## How it was made

Converted with the `ddl_hf` package:

```bash
{how}
```

All {family} weights are copied under their own names; the Delta parameters are new. The conversion was verified
against the source on held-out text before the files were written:

```
{report if report is not None else "(not verified)"}
```

## How to load

With the `ddl_hf` package installed (from its source repository; it is not on PyPI), no remote code is needed:

```python
import ddl_hf  # registers {path.delta_name} with the Auto classes
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{load_id}")
tokenizer = AutoTokenizer.from_pretrained("{load_id}")
```

With only `torch` and `transformers`, the custom-code files in this repository are used:

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{load_id}", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("{load_id}", trust_remote_code=True)  # without it, AutoTokenizer asks
```

`model(..., output_betas=True).betas` returns the gate of every Delta block. While every gate is closed,
`ddl_hf.{path.export}(model)` turns the model back into a plain `{source_class_name(config)}`.
"""
    return ModelCard(f"---\n{card_data.to_yaml()}\n---\n{body}")


def _load_tokenizer(source: str | os.PathLike):
    """The source's tokenizer, or None when the source has none (weights-only directories)."""
    name = os.fspath(source)
    if os.path.isdir(name) and not any(os.path.exists(os.path.join(name, f)) for f in TOKENIZER_FILES):
        logger.info(f"{name} has no tokenizer files; the output will hold the model only.")
        return None
    try:
        return AutoTokenizer.from_pretrained(name, **hub_kwargs(name))
    except (OSError, ValueError, TypeError) as error:
        if os.path.isdir(name):
            raise ConversionError(
                f"The tokenizer files in {name} cannot be loaded: {error}. Fix or remove them and retry."
            ) from error
        logger.info(f"{name} has no usable tokenizer ({error}); the output will hold the model only.")
        return None  # a Hub repository without tokenizer files


@contextlib.contextmanager
def _progress_bars(enabled: bool) -> Iterator[None]:
    """Turn transformers' own bars (loading/writing weights) off with ours, and restore them afterwards."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled and not enabled:
            hf_logging.enable_progress_bar()


def convert_checkpoint(
    source: str | os.PathLike | PreTrainedModel | ResolvedSource,
    output: str | os.PathLike,
    *,
    delta_mode: str = "additive",
    value_channels: int = 1,
    beta_init: float = 0.0,
    dtype: str = "auto",
    force: bool = False,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    base_model: str | None = None,
    tokenizer=None,
    progress: bool = True,
    command: str | None = None,
    hub_repo_id: str | None = None,
    **config_overrides,
) -> EquivalenceReport:
    """Convert `source` and write a complete, verified Hub repository to `output`; return the verification report.

    `source` is a Hub id, a directory or an in-memory causal LM of GPT-2 (converted to DeltaGPT, `convert_gpt2`) or
    of the Llama, Mistral, Qwen2 or Qwen3 family (converted to DeltaLlama, `convert_llama`); the family is read from
    its config's `model_type`. `config_overrides` are further fields of the Delta model's config.
    Everything is written to a temporary directory beside `output` (same filesystem, so the final rename is
    atomic), reloaded from there and compared with the source; only then is it renamed to `output`. On any error,
    including KeyboardInterrupt, SIGTERM (on the main thread) or a full disk, the temporary directory is removed and
    `output` is left as it was (see `atomic_directory`). Raises ConversionError when the additive beta = 0
    conversion is not equivalent (a bug: nothing is written).
    `hub_repo_id` (where the output will be pushed, if known) is used in the model card's loading examples.
    """
    output = Path(output).absolute()
    resolved = resolve_source(source)  # the config is read here once (or given already resolved)
    if base_model is None:  # only a Hub id belongs in a published card; a local path is dropped
        name = resolved.name if resolved.name is not None else getattr(resolved.config, "_name_or_path", "")
        base_model = name if name and not looks_like_path(name) else None
    overrides = dict(
        config_overrides, delta_mode=delta_mode, delta_value_channels=value_channels, delta_beta_init=beta_init
    )
    card = {"base_model": base_model, "command": command, "load_id": hub_repo_id or LOCAL_LOAD_ID}

    with _progress_bars(progress), atomic_directory(output, force=force) as tmp:
        bar = tqdm(total=6, desc="convert", unit="step", disable=not progress, file=sys.stderr)
        with contextlib.closing(bar) as stages:
            report = _write_verified(resolved, tmp, output, dtype, overrides, max_shard_size, tokenizer, card, stages)
            stages.update()
            stages.set_postfix_str("done")
    logger.info(f"Wrote the converted model to {output}.")
    return report


def _write_verified(
    resolved: ResolvedSource, tmp: Path, output: Path, dtype, overrides, max_shard_size, tokenizer, card: dict, stages
) -> EquivalenceReport:
    """Load and convert the source along its path, write every file into `tmp`, reload and verify them; return the
    report."""
    path, source = resolved.path, resolved.source
    torch_dtype = _resolve_dtype(dtype)
    stages.set_postfix_str("loading source")
    if resolved.name is not None:
        model_in = path.load(resolved.name, torch_dtype, resolved.config)
        if tokenizer is None:
            tokenizer = _load_tokenizer(resolved.name)  # from_pretrained already read generation_config.json
    else:
        model_in = source if torch_dtype == "auto" else copy.deepcopy(source).to(torch_dtype)
        model_in.eval()
    stages.update()

    stages.set_postfix_str("converting")
    converted = path.convert(model_in, overrides, share_weights=True)
    stages.update()

    stages.set_postfix_str("writing weights")
    converted.save_pretrained(tmp, max_shard_size=max_shard_size)
    del converted
    stages.update()

    stages.set_postfix_str("writing tokenizer")
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    stages.update()

    stages.set_postfix_str("verifying the written files")
    with _quiet_transformers():
        reloaded = path.delta_class.from_pretrained(tmp, dtype=model_in.dtype).eval()
    input_ids, text = sample_input_ids(tokenizer, model_in.config)
    report = equivalence_report(model_in, reloaded, input_ids, eval_text=text)
    if report.expected_equivalent and not report.within_tolerance:
        raise ConversionError(
            f"Verification failed: the converted model is not equivalent to the source "
            f"(max |logit difference| {report.max_abs_logit_diff:.3e} > {report.tolerance:.1e} or greedy continuation "
            f"differs). Nothing was written to {output}. Please report this with the source you used.\n{report}"
        )
    stages.update()

    stages.set_postfix_str("model card")
    model_card(report=report, config=reloaded.config, path=path, **card).save(tmp / "README.md")
    return report


def push_converted_to_hub(
    output: str | os.PathLike,
    repo_id: str,
    *,
    private: bool | None = None,
    token: str | None = None,
    commit_message: str | None = None,
) -> str:
    """Upload a directory written by `convert_checkpoint` as it is (the same files), return the commit URL.

    The default commit message names the model and its source family from config.json, e.g. "Upload DeltaGPT
    converted from GPT-2" or "Upload DeltaLlama converted from Qwen2".

    `model.push_to_hub(repo)` uploads only what `save_pretrained` writes (config, code, weights, generation config)
    plus a model card; `tokenizer.push_to_hub(repo)` adds the tokenizer. This sends every file of the folder in one
    commit, including our model card (what `hf upload REPO OUT` does too).
    """
    folder = Path(output)
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    if not (folder / "config.json").is_file():
        raise ConversionError(f"{folder} is not a converted model directory (no config.json); nothing was uploaded.")
    if commit_message is None:
        commit_message = _default_commit_message(folder)
    api = HfApi(token=token)
    repo = api.create_repo(repo_id, private=private, exist_ok=True)
    operations = [CommitOperationAdd(path_in_repo=p.relative_to(folder).as_posix(), path_or_fileobj=p) for p in files]
    commit = api.create_commit(repo_id=repo.repo_id, operations=operations, commit_message=commit_message)
    logger.info(f"Uploaded {len(files)} files of {folder} to {repo.repo_id}.")
    return str(getattr(commit, "commit_url", commit))


def _default_commit_message(folder: Path) -> str:
    """ "Upload DeltaLlama converted from Qwen2", read off a converted directory's config."""
    generic = "Upload a Delta model converted with ddl_hf"
    try:
        config = AutoConfig.from_pretrained(folder)
        path = conversion_path(config, str(folder))
    except (OSError, ValueError):  # not a config we know: the upload does not depend on the message
        return generic
    if config.model_type != path.delta_model_type:
        return generic
    return f"Upload {path.delta_name} converted from {family_name(config)}"


__all__ = ["DEFAULT_MAX_SHARD_SIZE", "convert_checkpoint", "model_card", "push_converted_to_hub"]
