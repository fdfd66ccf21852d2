"""`ddl-hf convert` / `convert_checkpoint` for Llama-family sources: the same Hub-ready, verified, atomic
job as for GPT-2, the family picked from the source's config.

Sources are transformers' own `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM` and `Qwen3ForCausalLM`
of the tiny random configs of `builders` (RoPE scaling, sliding windows, attention biases, QK-norm), with a
vocabulary of 257 so that the genuine byte-level GPT-2 tokenizer of `gpt2_fixtures` is their tokenizer.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedConfig, PreTrainedModel

import ddl_hf
import ddl_hf_cli as cli
from ddl_hf.conversion import SAMPLE_TEXT, ConversionError
from tests.builders import BYTE_LEVEL_LLAMA, TINY, build_source, gpt2_model
from tests.builders import LLAMA_FAMILIES as FAMILIES
from tests.conversion_runs import (
    DELTA_LLAMA_CODE,
    assert_refused,
    hub_auto_map,
    partial_save_then,
    with_weights_changed,
)
from tests.gpt2_fixtures import byte_tokenizer, text_ids

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REPO_ROOT = Path(__file__).resolve().parents[2]
FAMILY_NAMES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
HELD_OUT = text_ids(SAMPLE_TEXT)[:, :128]
HUB_ID = "someone/tiny-mistral"


def build(family: str) -> PreTrainedModel:
    """builders' LLAMA_TINY with the byte tokenizer's vocabulary and a context that holds HELD_OUT (128 tokens)."""
    return build_source(family, **BYTE_LEVEL_LLAMA)


@pytest.fixture(scope="module")
def sources() -> dict[str, PreTrainedModel]:
    return {family: build(family) for family in FAMILIES}


@pytest.fixture(scope="module")
def source_dirs(sources, tmp_path_factory) -> dict[str, Path]:
    """Each source saved like a Hub checkpoint: weights, config, generation config (a non-default value), tokenizer."""
    dirs = {}
    for family, model in sources.items():
        directory = tmp_path_factory.mktemp(f"{family}-source")
        model.generation_config.max_length = 77
        model.save_pretrained(directory)
        byte_tokenizer().save_pretrained(directory)
        dirs[family] = directory
    return dirs


def run_convert(*args: str) -> int:
    return cli.main(["convert", "--quiet", *args])


def convert_printing(*args: str) -> tuple[int, str]:
    """`ddl-hf convert` in this process; its exit code and what it printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = run_convert(*args)
    return code, printed.getvalue()


@pytest.fixture(scope="module")
def converted(source_dirs, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """`ddl-hf convert --source DIR` of each family (default settings): the output and the printed report."""
    results = {}
    for family, source in source_dirs.items():
        out = tmp_path_factory.mktemp(f"{family}-converted") / "delta"
        code, printed = convert_printing("--source", str(source), "--output", str(out))
        assert code == 0, printed
        results[family] = out, printed
    return results


def listing(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


def greedy(model: PreTrainedModel, tokens: int = 24) -> torch.Tensor:
    kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
    return model.generate(HELD_OUT[:, :8], **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# Each family through `ddl-hf convert --source DIR`
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_output_is_a_complete_hub_repository(family, converted, source_dirs):
    out, _ = converted[family]
    files = listing(out)
    assert {"config.json", "model.safetensors", "generation_config.json", "README.md", *DELTA_LLAMA_CODE} <= files
    assert "modeling_delta_gpt.py" not in files  # DeltaLlama's code imports nothing of DeltaGPT's model
    assert {"tokenizer.json", "tokenizer_config.json"} <= files
    assert not any(name.startswith(".") for name in files)
    assert listing(out.parent) == {"delta"}  # no temporary directory left beside it

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "delta_llama" and config["source_model_type"] == family
    assert config["auto_map"] == hub_auto_map("DeltaLlama")
    for name in DELTA_LLAMA_CODE:  # the shipped Hub code is the code of this checkout
        assert (out / name).read_text() == (REPO_ROOT / name).read_text(), name
    assert json.loads((out / "generation_config.json").read_text())["max_length"] == 77
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer(SAMPLE_TEXT).input_ids == byte_tokenizer()(SAMPLE_TEXT).input_ids
    weights, source_weights = load_file(out / "model.safetensors"), load_file(source_dirs[family] / "model.safetensors")
    for name, tensor in source_weights.items():  # every source weight is copied unchanged, under its own name
        assert torch.equal(weights[name], tensor), name


@pytest.mark.parametrize("family", list(FAMILIES))
def test_report_says_equivalent_bit_for_bit(family, converted):
    _, printed = converted[family]
    assert f"Equivalence report (converted DeltaLlama vs source {FAMILY_NAMES[family]})" in printed
    assert "128 tokens of held-out sample text" in printed
    assert "max |logit difference|       : 0.000e+00" in printed
    assert "greedy 64 tokens identical  : True" in printed
    assert "same to 4 significant digits: True" in printed


@pytest.mark.parametrize("family", list(FAMILIES))
def test_model_card_names_the_family(family, converted):
    out, _ = converted[family]
    card = ModelCard.load(out / "README.md")
    assert card.data.library_name == "transformers" and card.data.base_model is None  # a local source
    assert {"delta-llama", "deep-delta-learning", family, "custom_code"} <= set(card.data.tags)
    assert "gpt2" not in card.data.tags and "delta-gpt" not in card.data.tags
    name = FAMILY_NAMES[family]
    text = card.text
    assert f"# DeltaLlama converted from a {name} checkpoint" in text
    assert f"A {name} (2 layers, 32 wide, 4 heads over 2 key/value heads)" in text
    assert f"ddl-hf convert --source path/to/{family} --output OUT --delta-mode additive" in text
    assert "convert-gpt2-to-delta-gpt" not in text and "GPT-2" not in text
    assert f"`ddl_hf.export_to_llama(model)` turns the model back into a plain `{name}ForCausalLM`" in text
    assert "registers DeltaLlama" in text and "trust_remote_code=True" in text
    assert str(out.parent) not in text and str(Path.home()) not in text


@pytest.mark.parametrize("family", list(FAMILIES))
def test_reloaded_output_equals_the_source(family, converted, sources):
    out, _ = converted[family]
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model) is ddl_hf.DeltaLlamaForCausalLM and model.dtype == torch.float32
    source = sources[family]
    ids = torch.cat([HELD_OUT[:, :20], torch.randint(0, 257, (1, 20), generator=torch.Generator().manual_seed(0))])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, source(ids).logits)
        assert torch.equal(greedy(model), greedy(source))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_back_equals_the_source_bit_for_bit(family, converted, sources):
    out, _ = converted[family]
    exported = ddl_hf.export_to_llama(AutoModelForCausalLM.from_pretrained(out)).eval()
    source = sources[family]
    assert type(exported) is type(source)
    exported_weights, source_weights = exported.state_dict(), source.state_dict()
    assert exported_weights.keys() == source_weights.keys()
    assert all(torch.equal(exported_weights[name], tensor) for name, tensor in source_weights.items())
    with torch.no_grad():
        assert torch.equal(exported(HELD_OUT).logits, source(HELD_OUT).logits)


# ---------------------------------------------------------------------------------------------------------------
# A Hub id, in a fresh process; other precisions and settings; the Python API
# ---------------------------------------------------------------------------------------------------------------


def test_hub_id_in_a_subprocess(source_dirs, sources, tmp_path):
    """`python -m ddl_hf_cli convert --source someone/tiny-mistral` resolved from a Hub cache laid out like a
    download (HF_HUB_OFFLINE=1), so the Hub code path runs, not the local-directory one."""
    cache = tmp_path / "hub-cache"
    repo = cache / f"models--{HUB_ID.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(source_dirs["mistral"], repo / "snapshots" / commit)
    out = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", "ddl_hf_cli", "convert", "--source", HUB_ID, "--output", str(out), "--quiet"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert "converted DeltaLlama vs source Mistral" in result.stdout
    assert "max |logit difference|       : 0.000e+00" in result.stdout
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == HUB_ID
    assert f"# DeltaLlama converted from `{HUB_ID}`" in card.text
    assert f"ddl-hf convert --source {HUB_ID} --output OUT" in card.text
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(model(HELD_OUT).logits, sources["mistral"](HELD_OUT).logits)


def test_bfloat16_conversion(source_dirs, sources, tmp_path):
    out = tmp_path / "bf16"
    code, printed = convert_printing("--source", str(source_dirs["qwen3"]), "--output", str(out), "--dtype", "bfloat16")
    assert code == 0, printed
    assert "dtype=bfloat16" in printed and "greedy 64 tokens identical  : True" in printed
    measured = float(printed.split("max |logit difference|       : ")[1].split()[0])
    bound = float(printed.split("bound for an exact conversion ")[1].split(")")[0])
    assert measured <= bound
    weights = load_file(out / "model.safetensors")
    assert {tensor.dtype for tensor in weights.values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    reference = AutoModelForCausalLM.from_pretrained(source_dirs["qwen3"], dtype=torch.bfloat16).eval()
    with torch.no_grad():
        difference = (model(HELD_OUT).logits.float() - reference(HELD_OUT).logits.float()).abs().max()
    assert float(difference) == pytest.approx(measured, rel=1e-3)  # the report's figure, printed to 4 digits


def test_variant_flags_convert_exactly(source_dirs, sources, tmp_path):
    """Every Delta flag of `ddl-hf convert` is a DeltaLlama setting too: recorded in config and card, still exact."""
    out = tmp_path / "variants"
    flags = ["--value-channels", "4", "--state-read", "temporal_conv", "--embed-expand", "conv", "--conv-size", "3"]
    flags += ["--value", "constant", "--no-erase", "--gate", "mlp"]
    code, printed = convert_printing("--source", str(source_dirs["llama"]), "--output", str(out), *flags)
    assert code == 0, printed
    assert "max |logit difference|       : 0.000e+00" in printed
    config = json.loads((out / "config.json").read_text())
    assert (config["delta_value_channels"], config["delta_state_read"], config["delta_embed_expand"]) == (
        4,
        "temporal_conv",
        "conv",
    )
    assert (config["delta_conv_size"], config["delta_value"], config["delta_erase"], config["delta_gate"]) == (
        3,
        "constant",
        False,
        "mlp",
    )
    assert "--gate mlp --state-read temporal_conv --embed-expand conv --conv-size 3 --value constant --no-erase" in (
        (out / "README.md").read_text()
    )
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(out).eval()
        assert torch.equal(model(HELD_OUT).logits, sources["llama"](HELD_OUT).logits)


def test_paper_mode_is_reported_as_a_change(source_dirs, tmp_path):
    code, printed = convert_printing(
        "--source", str(source_dirs["qwen2"]), "--output", str(tmp_path / "paper"), "--delta-mode", "paper"
    )
    assert code == 0, printed
    assert "delta_mode=paper" in printed and "embeddings -> norm -> lm_head" in printed
    assert "same to 4 significant digits: False" in printed
    card = (tmp_path / "paper" / "README.md").read_text()
    assert "These settings change the function of the source Qwen2 at step 0" in card


def test_in_memory_source_through_the_api(sources, tmp_path):
    """`convert_checkpoint(model, OUT)` dispatches on the model's config; the source is left as it was."""
    source = sources["qwen2"]
    before = {name: tensor.clone() for name, tensor in source.state_dict().items()}
    report = ddl_hf.convert_checkpoint(source, tmp_path / "out", progress=False, value_channels=4)
    assert report.expected_equivalent and report.max_abs_logit_diff == 0.0 and report.greedy_identical
    assert (report.delta_name, report.source_family) == ("DeltaLlama", "Qwen2")
    assert report.eval_text == "fixed random token ids (no usable tokenizer)"
    assert not {"tokenizer.json", "tokenizer_config.json"} & listing(tmp_path / "out")
    assert "ddl_hf.convert_checkpoint('path/to/qwen2', OUT" in (tmp_path / "out" / "README.md").read_text()
    assert all(torch.equal(tensor, before[name]) for name, tensor in source.state_dict().items())


def test_push_uploads_the_output_with_a_commit_message_naming_the_family(converted, monkeypatch):
    """The Hub API is replaced by a recorder (no network here)."""
    from huggingface_hub import HfApi

    commits = []

    class Repo:
        repo_id = "someone/delta-qwen2"

    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kwargs: Repo())
    monkeypatch.setattr(HfApi, "create_commit", lambda self, **kwargs: commits.append(kwargs) or "url")
    out, _ = converted["qwen2"]
    assert ddl_hf.push_converted_to_hub(out, "someone/delta-qwen2") == "url"
    (commit,) = commits
    assert commit["commit_message"] == "Upload DeltaLlama converted from Qwen2"
    assert {op.path_in_repo for op in commit["operations"]} == listing(out)


def test_default_commit_message_of_a_gpt2_conversion_is_unchanged(tmp_path):
    from ddl_hf.conversion.hub import _default_commit_message

    ddl_hf.DeltaGPTConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=50).save_pretrained(tmp_path)
    assert _default_commit_message(tmp_path) == "Upload DeltaGPT converted from GPT-2"


# ---------------------------------------------------------------------------------------------------------------
# The same bad-input behaviour as for GPT-2: one error line naming the fix, no output, nothing left behind
# ---------------------------------------------------------------------------------------------------------------


def test_non_empty_output_needs_force(source_dirs, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert run_convert("--source", str(source_dirs["qwen3"]), "--output", str(out)) == 1
    err = capsys.readouterr().err
    assert "not empty" in err and "--force" in err
    assert listing(out) == {"keep.txt"}
    assert run_convert("--source", str(source_dirs["qwen3"]), "--output", str(out), "--force") == 0
    assert "keep.txt" not in listing(out) and "modeling_delta_llama.py" in listing(out)
    assert listing(tmp_path) == {"out"}


def test_full_disk_mid_write_leaves_nothing(source_dirs, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(
        ddl_hf.DeltaLlamaForCausalLM,
        "save_pretrained",
        partial_save_then(OSError(errno.ENOSPC, "No space left on device")),
    )
    out = tmp_path / "nested" / "out"
    code = run_convert("--source", str(source_dirs["llama"]), "--output", str(out))
    err = capsys.readouterr().err
    assert code == 1 and "disk full" in err and "free space" in err
    assert listing(tmp_path) == set()  # neither the output, a temporary directory, nor the parent it created


def test_unsupported_family_is_refused(tmp_path, capsys):
    from transformers import BertConfig

    BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32).save_pretrained(
        tmp_path / "bert"
    )
    out = tmp_path / "out"
    code = run_convert("--source", str(tmp_path / "bert"), "--output", str(out))
    assert_refused(capsys, code, out, "'bert'", "model_type 'gpt2'", "'llama', 'mistral', 'qwen2', 'qwen3'")


def test_quantized_source_is_refused(source_dirs, tmp_path, capsys):
    quantized = tmp_path / "quantized"
    shutil.copytree(source_dirs["qwen2"], quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    (quantized / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    code = run_convert("--source", str(quantized), "--output", str(out))
    assert_refused(capsys, code, out, "is quantized", "Convert the original float checkpoint")


def test_missing_unexpected_and_misshaped_weights_are_listed(source_dirs, tmp_path, capsys):
    missing, unexpected = "model.layers.1.mlp.up_proj.weight", "model.extra.weight"
    broken = with_weights_changed(source_dirs["llama"], tmp_path / "broken", drop=missing, add=unexpected)
    out = tmp_path / "out"
    code = run_convert("--source", str(broken), "--output", str(out))
    assert_refused(capsys, code, out, f"missing weights: {missing}", f"unexpected weights: {unexpected}")

    config = json.loads((source_dirs["llama"] / "config.json").read_text())
    shutil.copytree(source_dirs["llama"], tmp_path / "misshaped")
    intermediate = config["intermediate_size"]
    config["intermediate_size"] = intermediate // 2  # the weights were saved with the full width
    (tmp_path / "misshaped" / "config.json").write_text(json.dumps(config))
    code = run_convert("--source", str(tmp_path / "misshaped"), "--output", str(out))
    width = config["hidden_size"]
    shapes = f"[{intermediate}, {width}] in the checkpoint, [{intermediate // 2}, {width}] for config.json"
    assert_refused(capsys, code, out, f"model.layers.0.mlp.up_proj.weight {shapes}")


def test_an_unknown_dtype_is_refused_by_name_before_loading(source_dirs, tmp_path):
    """Both families' loaders (`load_exactly`): the dtype's own error, not a failed load's advice."""
    gpt2_model(TINY).save_pretrained(tmp_path / "gpt2")
    for convert, source in ((ddl_hf.convert_llama, source_dirs["llama"]), (ddl_hf.convert_gpt2, tmp_path / "gpt2")):
        with pytest.raises(ConversionError) as refused:
            convert(source, dtype="float64")
        assert str(refused.value) == "Unsupported dtype 'float64': use one of auto, float32, float16, bfloat16."


def test_delta_llama_source_is_refused(converted, tmp_path, capsys):
    out = tmp_path / "out"
    code = run_convert("--source", str(converted["qwen3"][0]), "--output", str(out))
    assert_refused(capsys, code, out, "already a DeltaLlama", "AutoModelForCausalLM.from_pretrained")


def test_bad_delta_setting_is_refused(source_dirs, tmp_path, capsys):
    out = tmp_path / "out"
    code = run_convert("--source", str(source_dirs["mistral"]), "--output", str(out), "--value-channels", "0")
    assert_refused(capsys, code, out, "Invalid DeltaLlama setting", "delta_value_channels=0")


def test_delta_net_settings_are_refused_by_name(source_dirs, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match=r"DeltaLlama has no DeltaNet token mixer, so token_mixer='delta_net'"):
        ddl_hf.convert_checkpoint(source_dirs["llama"], out, progress=False, token_mixer="delta_net")
    with pytest.raises(ConversionError, match=r"delta_net_chunk_size=8 cannot be set"):
        ddl_hf.convert_checkpoint(source_dirs["llama"], out, progress=False, delta_net_chunk_size=8)
    assert not out.exists() and listing(tmp_path) == set()


def test_source_that_is_no_model_is_refused(tmp_path):
    with pytest.raises(ConversionError, match=r"source must be a Hub id, a directory or a causal LM"):
        ddl_hf.convert_checkpoint({"not": "a model"}, tmp_path / "out", progress=False)
    config = PreTrainedConfig()
    with pytest.raises(ConversionError, match=r"not a GPT-2 checkpoint or a Llama-family one"):
        ddl_hf.convert_checkpoint(type("Model", (), {"config": config})(), tmp_path / "out", progress=False)
    assert listing(tmp_path) == set()
