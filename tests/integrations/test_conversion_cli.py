"""The `convert` command: a complete Hub repository, a verification report, and no mess on any failure.

Covers the output layout (auto_map, custom code, safetensors incl. sharding, tokenizer, generation config, model
card), push_to_hub's file set (Hub calls captured, no network), guarantee 4 (loading in fresh subprocesses with and
without `ddl_hf`) and guarantee 6 (bad input, full disk, interruption).
"""

from __future__ import annotations

import errno
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
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2LMHeadModel

import ddl_hf
import ddl_hf_cli as cli
from ddl_hf.conversion import SAMPLE_TEXT, ConversionError, atomic_directory
from tests.builders import BYTE_LEVEL, gpt2_config
from tests.conversion_runs import (
    DELTA_GPT_CODE,
    assert_refused,
    hub_auto_map,
    partial_save_then,
    record_hub_uploads,
    with_weights_changed,
)
from tests.gpt2_fixtures import (
    EOS,
    byte_tokenizer,
    save_source,
    text_ids,
    trained_gpt2,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REPO_ROOT = Path(__file__).resolve().parents[2]
HELD_OUT = text_ids(SAMPLE_TEXT)[:, :128]


def python_in(
    cwd: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """`python *args` in a fresh process in `cwd`, stdin closed (a prompt fails rather than waits): it exits 0; its
    result."""
    done = subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr
    return done


@pytest.fixture(scope="module")
def source_dir(tmp_path_factory) -> Path:
    """The trained GPT-2 saved like a Hub checkpoint: weights, config, generation config, tokenizer."""
    directory = save_source(trained_gpt2(), tmp_path_factory.mktemp("gpt2-source"))
    generation = json.loads((directory / "generation_config.json").read_text())
    generation["max_length"] = 77  # a non-default value, to see that it is copied
    (directory / "generation_config.json").write_text(json.dumps(generation))
    return directory


HUB_ID = "someone/tiny-gpt2"


@pytest.fixture(scope="module")
def hub_cache(source_dir, tmp_path_factory) -> Path:
    """The source laid out as the Hub cache holds a downloaded repository, so `--source someone/tiny-gpt2` takes the
    real Hub code path (hf_hub_download, resolved offline from the cache) instead of the local-directory one."""
    cache = tmp_path_factory.mktemp("hub-cache")
    repo = cache / f"models--{HUB_ID.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(source_dir, repo / "snapshots" / commit)
    return cache


@pytest.fixture(scope="module")
def converted_dir(hub_cache, tmp_path_factory) -> Path:
    """Converted once from the Hub id by the thin script in a subprocess (d_v = 4); shared by later tests."""
    out = tmp_path_factory.mktemp("converted") / "gpt2-delta"
    script = str(REPO_ROOT / "conversion" / "convert_gpt2_to_delta_gpt.py")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub_cache)}
    args = ["--source", HUB_ID, "--output", str(out), "--value-channels", "4"]
    result = python_in(REPO_ROOT, script, *args, env=env, timeout=300)
    assert "Equivalence report" in result.stdout and "greedy 64 tokens identical  : True" in result.stdout
    assert "max |logit difference|       : 0.000e+00" in result.stdout
    assert "convert:" in result.stderr  # the tqdm progress display
    return out


def run_convert(*args: str) -> int:
    return cli.main(["convert", "--quiet", *args])


def listing(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


# ---------------------------------------------------------------------------------------------------------------
# Output layout
# ---------------------------------------------------------------------------------------------------------------


def test_output_is_a_complete_hub_repository(converted_dir, source_dir):
    files = listing(converted_dir)
    assert {"config.json", "model.safetensors", "generation_config.json", "README.md", *DELTA_GPT_CODE} <= files
    assert {"tokenizer.json", "tokenizer_config.json"} <= files
    assert not any(name.startswith(".") for name in files)
    assert not [p for p in converted_dir.parent.iterdir() if p.name.startswith(".")]  # no temp dir left beside

    config = json.loads((converted_dir / "config.json").read_text())
    assert config["model_type"] == "delta_gpt" and config["delta_value_channels"] == 4
    assert config["auto_map"] == hub_auto_map("DeltaGPT")
    for name in DELTA_GPT_CODE:  # the shipped Hub code is the code of this checkout
        assert (converted_dir / name).read_text() == (REPO_ROOT / name).read_text()
    assert json.loads((converted_dir / "generation_config.json").read_text())["max_length"] == 77

    tokenizer = AutoTokenizer.from_pretrained(converted_dir)
    assert tokenizer(SAMPLE_TEXT).input_ids == byte_tokenizer()(SAMPLE_TEXT).input_ids
    assert tokenizer.eos_token_id == EOS

    weights = load_file(converted_dir / "model.safetensors")
    source_weights = load_file(source_dir / "model.safetensors")
    for name, tensor in source_weights.items():  # every GPT-2 weight is copied unchanged
        assert torch.equal(weights[name], tensor), name


def test_model_card(converted_dir):
    card = ModelCard.load(converted_dir / "README.md")
    assert card.data.library_name == "transformers"
    assert card.data.base_model == HUB_ID
    assert {"delta-gpt", "deep-delta-learning", "gpt2"} <= set(card.data.tags)
    text = card.text
    assert "## How it was made" in text and "convert-gpt2-to-delta-gpt --source" in text
    assert "## How to load" in text and "trust_remote_code=True" in text
    assert "max |logit difference|" in text  # the verification report is part of the card


def test_sharded_output_reloads(source_dir, tmp_path):
    out = tmp_path / "sharded"
    assert (
        run_convert(
            "--source",
            str(source_dir),
            "--output",
            str(out),
            "--max-shard-size",
            "100KB",
            "--base-model",
            "someone/tiny-gpt2",
        )
        == 0
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2 and shards <= listing(out) and "model.safetensors" not in listing(out)
    assert ModelCard.load(out / "README.md").data.base_model == "someone/tiny-gpt2"
    model = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        assert torch.equal(model(HELD_OUT).logits, trained_gpt2()(HELD_OUT).logits)


def test_report_printed_and_paper_mode_cost(source_dir, tmp_path, capsys):
    assert run_convert("--source", str(source_dir), "--output", str(tmp_path / "paper"), "--delta-mode", "paper") == 0
    out = capsys.readouterr().out
    assert "delta_mode=paper" in out and "identity map" in out and "cost of that choice" in out
    assert "same to 4 significant digits: False" in out
    assert ddl_hf.AutoConfig.from_pretrained(tmp_path / "paper").delta_mode == "paper"


def test_conversion_prints_no_loss_type_warning(source_dir, tmp_path):
    """The equivalence report computes both perplexities from the logits itself, so a GPT-2 config without a
    `loss_type` (every Hub GPT-2) is not warned about; transformers warns once per process, hence the cache clear."""
    from transformers.testing_utils import CaptureLogger
    from transformers.utils import logging as hf_logging

    library_logger = hf_logging.get_logger("transformers")
    hf_logging.warning_once.cache_clear()
    with CaptureLogger(library_logger) as conversion:
        assert run_convert("--source", str(source_dir), "--output", str(tmp_path / "out"), "--quiet") == 0
    assert "loss_type" not in conversion.out
    gpt2 = trained_gpt2()
    gpt2.config.loss_type = None
    gpt2.loss_type = None
    hf_logging.warning_once.cache_clear()
    with CaptureLogger(library_logger) as control:  # the control: the warning does reach this capture
        gpt2(HELD_OUT[:, :8], labels=HELD_OUT[:, :8])
    assert "loss_type" in control.out


def test_source_without_tokenizer(tmp_path, capsys):
    source = save_source(trained_gpt2(), tmp_path / "weights-only", tokenizer=False)
    assert run_convert("--source", str(source), "--output", str(tmp_path / "out")) == 0
    assert "fixed random token ids" in capsys.readouterr().out
    assert not {"tokenizer.json", "tokenizer_config.json"} & listing(tmp_path / "out")


def test_console_command_and_ddl_hf_subcommand_share_the_code(source_dir, tmp_path, capsys):
    assert (
        cli.convert_main(
            [
                "--source",
                str(source_dir),
                "--output",
                str(tmp_path / "a"),
                "--quiet",
                "--beta-init",
                "0.25",
                "--gate",
                "mlp",
                "--dtype",
                "bfloat16",
            ]
        )
        == 0
    )
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["delta_beta_init"] == 0.25 and config["delta_gate"] == "mlp" and config["dtype"] == "bfloat16"
    assert "beta_init=0.25" in capsys.readouterr().out


def test_variant_flags_convert_exactly(source_dir, tmp_path, capsys):
    """The paper's variants from the command line: recorded in the config and the card's command, still GPT-2."""
    out = tmp_path / "tc"
    flags = ["--value-channels", "4", "--state-read", "temporal_conv", "--embed-expand", "conv", "--conv-size", "3"]
    assert (
        run_convert("--source", str(source_dir), "--output", str(out), *flags, "--value", "constant", "--no-erase") == 0
    )
    config = json.loads((out / "config.json").read_text())
    assert (config["delta_state_read"], config["delta_embed_expand"], config["delta_conv_size"]) == (
        "temporal_conv",
        "conv",
        3,
    )
    assert config["delta_value"] == "constant" and config["delta_erase"] is False
    assert "--state-read temporal_conv --embed-expand conv --conv-size 3 --value constant --no-erase" in (
        (out / "README.md").read_text()
    )
    model = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        assert torch.equal(model(HELD_OUT).logits, trained_gpt2()(HELD_OUT).logits)
    assert (
        run_convert(
            "--source",
            str(source_dir),
            "--output",
            str(tmp_path / "bad"),
            "--state-read",
            "temporal_conv",
            "--conv-size",
            "0",
        )
        == 1
    )
    assert "delta_conv_size=0 is invalid" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# push_to_hub: the Hub API is replaced by a recorder (no network here)
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture
def hub_recorder(monkeypatch) -> list[set[str]]:
    return record_hub_uploads(monkeypatch)


def test_push_converted_uploads_exactly_the_output(converted_dir, hub_recorder):
    ddl_hf.push_converted_to_hub(converted_dir, "someone/gpt2-delta")
    assert hub_recorder == [listing(converted_dir)]


def test_model_and_tokenizer_push_to_hub_upload_the_same_file_set(converted_dir, hub_recorder):
    model = AutoModelForCausalLM.from_pretrained(converted_dir)
    model.push_to_hub("someone/gpt2-delta")
    AutoTokenizer.from_pretrained(converted_dir).push_to_hub("someone/gpt2-delta")
    model_files, tokenizer_files = hub_recorder
    assert {"config.json", "model.safetensors", "generation_config.json", "README.md", *DELTA_GPT_CODE} <= model_files
    assert model_files | tokenizer_files == listing(converted_dir)


# ---------------------------------------------------------------------------------------------------------------
# Guarantee 4: loading in fresh Python processes
# ---------------------------------------------------------------------------------------------------------------

LOAD_SCRIPT = r"""
import sys
out, ids_path, logits_path, mode = sys.argv[1:5]
if mode == "without":
    class BlockDdlHf:  # CI installs ddl_hf, so hide it explicitly
        def find_spec(self, name, path=None, target=None):
            if name == "ddl_hf" or name.startswith("ddl_hf."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
    sys.meta_path.insert(0, BlockDdlHf())
    try:
        import ddl_hf
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit("ddl_hf is importable")
    kwargs = {"trust_remote_code": True}
else:
    sys.path.insert(0, sys.argv[5])
    import ddl_hf
    kwargs = {}
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(out, **kwargs)
print(type(model).__module__)
assert ("ddl_hf" in sys.modules) == (mode == "with")
with torch.no_grad():
    torch.save(model(torch.load(ids_path)).logits, logits_path)
"""


@pytest.mark.parametrize("mode", ["without", "with"])
def test_output_loads_in_a_fresh_process(converted_dir, tmp_path, mode):
    ids_path, logits_path = tmp_path / "ids.pt", tmp_path / "logits.pt"
    torch.save(HELD_OUT, ids_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HOME=str(tmp_path / "hf-home"), HF_HUB_OFFLINE="1")
    args = [str(converted_dir), str(ids_path), str(logits_path), mode, str(REPO_ROOT)]
    result = python_in(tmp_path, "-I", "-c", LOAD_SCRIPT, *args, env=env, timeout=300)
    module = result.stdout.strip().splitlines()[-1]
    if mode == "without":  # the Hub custom code copied into the transformers modules cache
        assert module.startswith("transformers_modules.") and module.endswith("modeling_delta_gpt")
    else:
        assert module == "ddl_hf.modeling_delta_gpt"
    with torch.no_grad():
        expected = trained_gpt2()(HELD_OUT).logits
    assert float((torch.load(logits_path) - expected).abs().max()) <= 1e-5


# ---------------------------------------------------------------------------------------------------------------
# Guarantee 6: bad input never leaves a mess
# ---------------------------------------------------------------------------------------------------------------


def test_bert_source_is_refused(tmp_path, capsys):
    from transformers import BertConfig

    BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32).save_pretrained(
        tmp_path / "bert"
    )
    out = tmp_path / "out"
    code = run_convert("--source", str(tmp_path / "bert"), "--output", str(out))
    assert_refused(capsys, code, out, "not a GPT-2 checkpoint", "'bert'")


def test_delta_source_is_refused(converted_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert_refused(capsys, run_convert("--source", str(converted_dir), "--output", str(out)), out, "already a DeltaGPT")


def test_missing_source_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    code = run_convert("--source", str(tmp_path / "nowhere"), "--output", str(out))
    assert_refused(capsys, code, out, "No such directory", "Hub id")


def test_missing_and_unexpected_weights_are_listed(source_dir, tmp_path, capsys):
    missing, unexpected = "transformer.h.1.mlp.c_fc.weight", "transformer.h.0.adapter.weight"
    broken = with_weights_changed(source_dir, tmp_path / "broken", drop=missing, add=unexpected)
    out = tmp_path / "out"
    code = run_convert("--source", str(broken), "--output", str(out))
    assert_refused(capsys, code, out, f"missing weights: {missing}", f"unexpected weights: {unexpected}")


def test_wrongly_shaped_weights_are_listed(tmp_path, capsys):
    torch.manual_seed(0)
    GPT2LMHeadModel(gpt2_config(BYTE_LEVEL)).save_pretrained(tmp_path / "src")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    config["n_inner"] = 64  # the weights were saved with the default 4 * 32 = 128
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    code = run_convert("--source", str(tmp_path / "src"), "--output", str(out))
    assert_refused(capsys, code, out, "transformer.h.1.mlp.c_fc.weight [32, 128] in the checkpoint, [32, 64]")


def test_unsupported_gpt2_flag_is_refused(tmp_path, capsys):
    torch.manual_seed(0)
    GPT2LMHeadModel(gpt2_config(BYTE_LEVEL, add_cross_attention=True)).save_pretrained(tmp_path / "xattn")
    out = tmp_path / "out"
    code = run_convert("--source", str(tmp_path / "xattn"), "--output", str(out))
    assert_refused(capsys, code, out, "add_cross_attention=True", "decoder-only")


def test_bad_delta_setting_is_refused(source_dir, tmp_path, capsys):
    out = tmp_path / "out"
    code = run_convert("--source", str(source_dir), "--output", str(out), "--value-channels", "0")
    assert_refused(capsys, code, out, "delta_value_channels=0")


def test_non_empty_output_needs_force(source_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert run_convert("--source", str(source_dir), "--output", str(out)) == 1
    err = capsys.readouterr().err
    assert "not empty" in err and "--force" in err
    assert listing(out) == {"keep.txt"}
    assert run_convert("--source", str(source_dir), "--output", str(out), "--force") == 0
    assert "keep.txt" not in listing(out) and "model.safetensors" in listing(out)
    assert listing(tmp_path) == {"out"}


def test_empty_output_directory_is_fine(source_dir, tmp_path):
    (tmp_path / "out").mkdir()
    assert run_convert("--source", str(source_dir), "--output", str(tmp_path / "out")) == 0
    assert "config.json" in listing(tmp_path / "out")


@pytest.mark.parametrize("force", [False, True])
def test_full_disk_leaves_nothing(source_dir, tmp_path, capsys, monkeypatch, force):
    out = tmp_path / "nested" / "out"
    if force:  # an existing output survives a failed --force conversion unchanged
        out.mkdir(parents=True)
        (out / "keep.txt").write_text("mine")
    monkeypatch.setattr(
        ddl_hf.DeltaGPTForCausalLM,
        "save_pretrained",
        partial_save_then(OSError(errno.ENOSPC, "No space left on device")),
    )
    code = run_convert("--source", str(source_dir), "--output", str(out), *(["--force"] if force else []))
    err = capsys.readouterr().err
    assert code == 1 and "disk full" in err and "free space" in err
    if force:
        assert listing(out) == {"keep.txt"} and listing(out.parent) == {"out"}
    else:
        assert not (tmp_path / "nested").exists()  # even the parent it created is gone
        assert listing(tmp_path) == set()


def test_interruption_leaves_nothing(source_dir, tmp_path, capsys, monkeypatch):
    from transformers import PreTrainedTokenizerBase

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", interrupted)
    out = tmp_path / "out"
    code = run_convert("--source", str(source_dir), "--output", str(out))
    assert_refused(capsys, code, out, "interrupted", expected_code=130)
    assert listing(tmp_path) == set()


def test_sigterm_mid_write_leaves_nothing(source_dir, tmp_path, capsys, monkeypatch):
    """`kill PID` while the weights are being written: cleaned up like Ctrl-C."""
    import signal

    def killed(self, directory, **kwargs):
        Path(directory, "model.safetensors").write_bytes(b"\0" * 100)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(ddl_hf.DeltaGPTForCausalLM, "save_pretrained", killed)
    handler = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "out"
    code = run_convert("--source", str(source_dir), "--output", str(out))
    assert_refused(capsys, code, out, "interrupted", expected_code=130)
    assert listing(tmp_path) == set()
    assert signal.getsignal(signal.SIGTERM) == handler  # restored


def test_failed_verification_writes_nothing(source_dir, tmp_path, capsys, monkeypatch):
    """Should a conversion ever not reproduce the source, the output is not written."""
    import ddl_hf.conversion.hub as conversion_hub  # where convert_checkpoint looks equivalence_report up

    real_report = conversion_hub.equivalence_report

    def corrupted(*args, **kwargs):
        report = real_report(*args, **kwargs)
        report.max_abs_logit_diff = 0.5
        return report

    monkeypatch.setattr(conversion_hub, "equivalence_report", corrupted)
    out = tmp_path / "out"
    code = run_convert("--source", str(source_dir), "--output", str(out))
    assert_refused(capsys, code, out, "Verification failed", "5.000e-01")


def test_failed_final_rename_restores_the_old_output(source_dir, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    real_replace, calls = os.replace, []

    def flaky_replace(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # old output moved aside, new one about to move in
            raise OSError(errno.EIO, "Input/output error")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", flaky_replace)
    assert run_convert("--source", str(source_dir), "--output", str(out), "--force") == 1
    assert listing(out) == {"keep.txt"} and listing(tmp_path) == {"out"}


# ---------------------------------------------------------------------------------------------------------------
# atomic_directory on its own
# ---------------------------------------------------------------------------------------------------------------


def test_atomic_directory_renames_into_place_on_success(tmp_path):
    out = tmp_path / "nested" / "out"
    with atomic_directory(out) as tmp:
        assert tmp.parent == out.parent and tmp.name.startswith(".out.tmp-") and listing(tmp) == set()
        assert not out.exists()
        (tmp / "a.txt").write_text("new")
    assert listing(out) == {"a.txt"} and (out / "a.txt").read_text() == "new"
    assert listing(out.parent) == {"out"}  # no temporary directory left beside it


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_atomic_directory_leaves_nothing_on_an_exception(tmp_path, error):
    out = tmp_path / "nested" / "out"
    with pytest.raises(type(error)), atomic_directory(out) as tmp:
        (tmp / "half.bin").write_bytes(b"\0" * 100)
        raise error
    assert listing(tmp_path) == set()  # neither output, temporary directory nor the parent it created


def test_atomic_directory_exception_keeps_an_existing_output(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(RuntimeError), atomic_directory(out, force=True) as tmp:
        (tmp / "new.txt").write_text("new")
        raise RuntimeError("boom")
    assert listing(out) == {"keep.txt"} and listing(tmp_path) == {"out"}


def test_atomic_directory_refuses_a_non_empty_output_without_force(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    entered = False
    with pytest.raises(ConversionError, match=r"not empty.*--force"), atomic_directory(out):
        entered = True
    assert not entered
    assert listing(out) == {"keep.txt"} and listing(tmp_path) == {"out"}
    with atomic_directory(out, force=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert listing(out) == {"new.txt"} and listing(tmp_path) == {"out"}


def test_atomic_directory_turns_sigterm_into_a_clean_interrupt(tmp_path):
    """API callers (not only the CLI) get `kill PID` cleaned up like Ctrl-C, and the old handler back."""
    import signal

    handler = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt), atomic_directory(out) as tmp:
        (tmp / "half.bin").write_bytes(b"\0" * 100)
        os.kill(os.getpid(), signal.SIGTERM)
    assert listing(tmp_path) == set()
    assert signal.getsignal(signal.SIGTERM) == handler


def test_model_card_of_a_local_source_has_no_machine_paths(source_dir, tmp_path):
    out = tmp_path / "local-card"
    assert run_convert("--source", str(source_dir), "--output", str(out)) == 0
    readme = (out / "README.md").read_text()
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model is None  # a local source is no Hub id
    for path in (str(source_dir), str(out), str(tmp_path), os.path.expanduser("~")):
        assert path not in readme, path
    assert "pip install" not in readme
    assert 'from_pretrained("path/to/this/directory", trust_remote_code=True)' in readme


def test_model_card_with_push_target_loads_by_repo_id(source_dir, tmp_path):
    from ddl_hf.conversion import convert_checkpoint

    out = tmp_path / "pushed-card"
    convert_checkpoint(source_dir, out, progress=False, hub_repo_id="someone/tiny-delta", base_model="someone/tiny")
    readme = (out / "README.md").read_text()
    assert ModelCard.load(out / "README.md").data.base_model == "someone/tiny"
    assert 'from_pretrained("someone/tiny-delta", trust_remote_code=True)' in readme
    assert str(tmp_path) not in readme


def test_tokenizer_loads_without_ddl_hf_and_without_prompt(converted_dir, tmp_path):
    """The card's remote-code path, in a fresh isolated process (no ddl_hf on the path) with stdin closed."""
    readme = (converted_dir / "README.md").read_text()
    assert 'AutoTokenizer.from_pretrained("path/to/this/directory", trust_remote_code=True)' in readme
    code = (
        "import sys\n"
        "sys.modules['ddl_hf'] = None  # the editable install would make it importable even under -I\n"
        "from transformers import AutoTokenizer\n"
        "tokenizer = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
        "print(type(tokenizer).__name__, tokenizer('hello world')['input_ids'])\n"
    )
    done = python_in(tmp_path, "-I", "-c", code, str(converted_dir))
    assert done.stdout.startswith("GPT2Tokenizer ")
    assert "ddl_hf" not in done.stderr
    assert "[y/N]" not in done.stdout + done.stderr
    assert "model of type" not in done.stderr and "trust_remote_code" not in done.stderr, done.stderr


@pytest.mark.parametrize(
    "load",
    [
        "import ddl_hf\ntokenizer = AutoTokenizer.from_pretrained(sys.argv[1])",  # registered: local code, no prompt
        "from transformers import GPT2TokenizerFast\ntokenizer = GPT2TokenizerFast.from_pretrained(sys.argv[1])",
    ],
    ids=["auto-with-ddl_hf", "tokenizer-class-without-ddl_hf"],
)
def test_tokenizer_loads_without_trust_remote_code_and_without_prompt(converted_dir, tmp_path, load):
    """The two documented ways around transformers' custom-code prompt, which `AutoTokenizer` raises for any Hub
    custom-code model when `trust_remote_code` is not passed (it resolves config.json before tokenizer_config.json)."""
    block = "" if "import ddl_hf" in load else "sys.modules['ddl_hf'] = None\n"
    code = (
        f"import sys\n{block}from transformers import AutoTokenizer\n{load}\n"
        "print(tokenizer('hello world')['input_ids'])\n"
    )
    done = python_in(tmp_path, "-c", code, str(converted_dir))
    reference = AutoTokenizer.from_pretrained(converted_dir, trust_remote_code=True)
    assert done.stdout.strip() == str(reference("hello world")["input_ids"])
    # Not "stderr is empty": what other packages log at import depends on the machine (bitsandbytes on AVX512-BF16).
    assert "[y/N]" not in done.stdout + done.stderr, done.stderr
    assert "trust_remote_code" not in done.stderr and "custom code" not in done.stderr, done.stderr


def test_a_cli_run_reads_the_source_config_and_resolves_its_family_once(source_dir, tmp_path, monkeypatch):
    """The source is resolved into one value (`ResolvedSource`) that the recorded command, loading and the model
    card take: one read of its config (for a Hub id each read probes the network) and one family lookup."""
    import ddl_hf.conversion.converting as converting
    import ddl_hf.conversion.families as families
    import ddl_hf.conversion.hub as hub
    import ddl_hf.conversion.llama as llama

    calls = {"read_source_config": 0, "conversion_path": 0}

    def counted(function):
        def wrapper(*args, **kwargs):
            calls[function.__name__] += 1
            return function(*args, **kwargs)

        return wrapper

    for module in (converting, families, llama, hub):
        for name in calls:
            if hasattr(module, name):
                monkeypatch.setattr(module, name, counted(getattr(module, name)))
    assert run_convert("--source", str(source_dir), "--output", str(tmp_path / "out")) == 0
    assert calls == {"read_source_config": 1, "conversion_path": 1}


def test_the_trained_gpt2_fixture_trains_without_transformers_loss_type_warning():
    """Training the shared fixture computes GPT2LMHeadModel's loss: it must not log transformers' `loss_type=None`
    notice (which the control above shows does reach such a capture), and it ends as a Hub GPT-2 without a loss type."""
    from transformers.testing_utils import CaptureLogger
    from transformers.utils import logging as hf_logging

    from tests.gpt2_fixtures import train_gpt2

    hf_logging.warning_once.cache_clear()
    with CaptureLogger(hf_logging.get_logger("transformers")) as training:
        model = train_gpt2(steps=2)
    assert "loss_type" not in training.out
    assert model.loss_type is None and getattr(model.config, "loss_type", None) is None
