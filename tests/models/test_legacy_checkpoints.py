"""Checkpoints written by ddl-hf 0.1, whose `beta_open` is 0-dim (today `[1]`, for FSDP2): `from_pretrained` refuses
them with one line naming `ddl-hf upgrade`, and once upgraded they load and compute what 0.1 computed: through
`from_pretrained`, through the Hub code without ddl_hf, as a peft adapter, and as a Trainer checkpoint to resume
from. The fixtures were written by the 0.1 code itself (tests/data/ddl_hf_0_1/make_fixtures.py says how); what they
hold is the independent reference. The upgrade's own guarantees (nothing else changes, atomic, refusals) follow."""

from __future__ import annotations

import errno
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, TrainerCallback

import ddl_hf
import ddl_hf_cli
from ddl_hf.conversion import upgrade
from tests.rounding import assert_close_to_saved, float64_logits_and_bound

FIXTURES = Path(__file__).parents[1] / "data" / "ddl_hf_0_1"
sys.path.insert(0, str(FIXTURES))
from legacy_run import TINY, restore_pickles, training_arguments, training_data  # noqa: E402

MODELS = ["delta_gpt", "delta_llama"]


def openings(folder: Path, file: str = "model.safetensors") -> list[torch.Tensor]:
    return [tensor for name, tensor in load_file(folder / file).items() if name.endswith("beta_open")]


@pytest.fixture(scope="module")
def legacy(tmp_path_factory) -> Path:
    """A copy of the 0.1 fixtures, with the Trainer checkpoint's pickles written back (legacy_run.py)."""
    folder = tmp_path_factory.mktemp("ddl_hf_0_1") / "run"
    shutil.copytree(FIXTURES, folder, ignore=shutil.ignore_patterns("__pycache__"))
    restore_pickles(folder / "trainer_checkpoint")
    return folder


@pytest.fixture(scope="module")
def upgraded(legacy) -> Path:
    """`ddl-hf upgrade` of the whole fixture directory at once: both models, the adapter, the Trainer checkpoint."""
    output = legacy.parent / "upgraded"
    assert ddl_hf_cli.main(["upgrade", str(legacy), "--output", str(output)]) == 0
    return output


def one_line_error(error: pytest.ExceptionInfo, folder: Path) -> None:
    message = str(error.value)
    assert "\n" not in message and f"`ddl-hf upgrade {folder} --output UPGRADED_DIR`" in message, message


@pytest.mark.parametrize("ignore_mismatched_sizes", [False, True])
@pytest.mark.parametrize("name", MODELS)
def test_from_pretrained_refuses_a_0_1_checkpoint_with_one_line_naming_the_upgrade(name, ignore_mismatched_sizes):
    """Not transformers' size-mismatch report, nor (`ignore_mismatched_sizes=True`) gates re-initialised in silence."""
    folder = FIXTURES / name
    assert openings(folder) and all(tensor.dim() == 0 for tensor in openings(folder))
    with pytest.raises(ValueError, match=r"was saved by ddl-hf 0\.1") as error:
        AutoModelForCausalLM.from_pretrained(folder, ignore_mismatched_sizes=ignore_mismatched_sizes)
    one_line_error(error, folder)


@pytest.mark.parametrize("name", MODELS)
def test_an_upgraded_0_1_checkpoint_loads_and_computes_what_0_1_computed(upgraded, name):
    folder = upgraded / name
    expected = load_file(folder / "expected.safetensors")
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert all(residual.beta_open.shape == (1,) for residual in model.delta_residuals().values())
    assert_close_to_saved(model, expected["logits"], expected["input_ids"])


@pytest.mark.parametrize("name", MODELS)
def test_through_the_hub_code_without_ddl_hf_0_1_is_refused_and_upgraded_computes_the_same(tmp_path, upgraded, name):
    """The upgraded directory carries this release's custom code and loads through it alone; the 0.1 weights beside
    that code (as after pushing today's code to a 0.1 repository) are refused with the same one line."""
    code = sorted(path.name for path in (upgraded / name).glob("*.py"))
    assert {f"configuration_{name}.py", f"modeling_{name}.py", "delta_compat.py", "delta_ops.py"} <= set(code)
    legacy = tmp_path / name
    shutil.copytree(FIXTURES / name, legacy)
    for file in code:
        shutil.copy(upgraded / name / file, legacy / file)
    script = textwrap.dedent(
        """
        import sys
        sys.modules["ddl_hf"] = None  # the directory's own code, as for a user without this package
        import torch
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        upgraded, legacy, bound = sys.argv[1:]
        expected = load_file(upgraded + "/expected.safetensors")
        model = AutoModelForCausalLM.from_pretrained(upgraded, trust_remote_code=True).eval()
        assert "ddl_hf" not in type(model).__module__, type(model).__module__
        with torch.no_grad():
            logits = model(expected["input_ids"]).logits
        torch.testing.assert_close(logits, expected["logits"], rtol=0, atol=2 * float(bound))
        print("same logits")
        try:
            AutoModelForCausalLM.from_pretrained(legacy, trust_remote_code=True)
        except ValueError as error:
            print("refused:", str(error).replace("\\n", "NEWLINE"))
        """
    )
    # float32 rounding, as measured here against float64 (the saved logits were computed on another machine)
    expected = load_file(upgraded / name / "expected.safetensors")
    model = AutoModelForCausalLM.from_pretrained(upgraded / name).eval()
    _, bound = float64_logits_and_bound(model, expected["input_ids"])
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "PATH": ""}
    result = subprocess.run(
        [sys.executable, "-c", script, str(upgraded / name), str(legacy), str(bound)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert result.returncode == 0 and "same logits" in result.stdout, result.stderr[-3000:]
    refusal = result.stdout.split("refused: ", 1)[-1]
    assert f"`ddl-hf upgrade {legacy} --output UPGRADED_DIR`" in refusal and "NEWLINE" not in refusal, result.stdout


def test_an_upgraded_0_1_peft_adapter_with_delta_residuals_to_save_computes_the_same(upgraded):
    """peft loads adapters with `load_state_dict`: the 0.1 one fails there with torch's size mismatch, not silently;
    the upgraded one computes what 0.1 computed."""
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(upgraded / "delta_gpt")
    with pytest.raises(RuntimeError, match=r"size mismatch for .*beta_open"):
        PeftModel.from_pretrained(base, FIXTURES / "adapter")
    expected = load_file(upgraded / "adapter" / "expected.safetensors")
    base = AutoModelForCausalLM.from_pretrained(upgraded / "delta_gpt")
    model = PeftModel.from_pretrained(base, upgraded / "adapter").eval()
    copies = [p for n, p in model.named_parameters() if "modules_to_save" in n and n.endswith("beta_open")]
    assert copies and all(p.shape == (1,) and float(p) == pytest.approx(0.3) for p in copies)
    assert_close_to_saved(model, expected["logits"], expected["input_ids"])


class Unfused(TrainerCallback):
    """Steps with the single-tensor AdamW: a resumed optimizer takes its settings from the checkpoint (the 0.1 run's
    fused AdamW, which reads a 0-dim state as one number and would not notice a wrong shape)."""

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        for group in optimizer.param_groups:
            group.update(fused=False, foreach=False)


def test_resuming_a_0_1_trainer_checkpoint_stops_at_the_size_mismatch(tmp_path, legacy):
    """Trainer loads checkpoints with `load_state_dict`: torch names each 0-dim `beta_open`, nothing runs on."""
    from transformers import Trainer

    model = ddl_hf.DeltaGPTForCausalLM(ddl_hf.DeltaGPTConfig(**TINY, delta_init="exact"))
    trainer = Trainer(model=model, args=training_arguments(tmp_path), train_dataset=training_data())
    with pytest.raises(RuntimeError, match=r"size mismatch for transformer\.h\.0\.attn_delta\.beta_open"):
        trainer.train(resume_from_checkpoint=legacy / "trainer_checkpoint")


@pytest.mark.parametrize("callbacks", [[], [Unfused()]], ids=["fused", "unfused"])
def test_resuming_an_upgraded_0_1_trainer_checkpoint_ends_where_0_1_ended(tmp_path, upgraded, callbacks):
    """The 0.1 run checkpointed after 2 of 4 steps; upgraded (weights, and AdamW's state for `beta_open`) and resumed
    today, it reaches the parameters the 0.1 run reached after 4, with its fused AdamW and with the single-tensor one
    (which broadcasts the `[1]` gradient into a 0-dim state and fails unless the upgrade reshaped it).
    To 5e-4, not bit for bit: the CPU's float kernels differ between machines (bit-exact where the fixture was made,
    4.5e-5 apart on an AVX-512 EPYC), while a lost optimizer state moves the parameters by 3.5e-2 (measured)."""
    from transformers import Trainer

    checkpoint = upgraded / "trainer_checkpoint"
    optimizer = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    states = [value for state in optimizer["state"].values() for key, value in state.items() if key != "step"]
    assert states and all(value.dim() > 0 for value in states)
    expected = load_file(checkpoint / "expected_after_4_steps.safetensors")
    torch.manual_seed(0)
    model = ddl_hf.DeltaGPTForCausalLM(ddl_hf.DeltaGPTConfig(**TINY, delta_init="exact"))
    args, dataset = training_arguments(tmp_path), training_data()
    trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=callbacks)
    trainer.train(resume_from_checkpoint=checkpoint)
    assert all(group["fused"] is not bool(callbacks) for group in trainer.optimizer.param_groups)
    final = dict(model.named_parameters())
    assert final.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(final[name].detach(), value.reshape(final[name].shape), rtol=0, atol=5e-4, msg=name)


# ----------------------------------------------------------------------------------------------------------------
# The upgrade itself: a reshape and nothing else, all or nothing, never over an existing directory.
# ----------------------------------------------------------------------------------------------------------------


def test_the_upgrade_reshapes_the_0_1_tensors_and_copies_every_other_file(legacy, upgraded):
    code = {path.relative_to(upgraded) for path in upgraded.rglob("*.py") if path.parent != upgraded}
    for path in sorted(p for p in legacy.rglob("*") if p.is_file()):
        name = path.relative_to(legacy)
        target = upgraded / name
        if path.suffix == ".safetensors":
            before, after = load_file(path), load_file(target)
            assert before.keys() == after.keys(), name
            for key, value in before.items():
                zero_dim = key.endswith("beta_open") and value.dim() == 0  # trainer_states.safetensors' stay 0-dim
                assert after[key].shape == ((1,) if zero_dim else value.shape), (name, key)
                assert torch.equal(after[key].reshape(value.shape), value), (name, key)
        elif path.name == "optimizer.pt":
            before, after = (torch.load(p, weights_only=True) for p in (path, target))
            assert before["param_groups"] == after["param_groups"]
            reshaped = 0
            for index, state in before["state"].items():
                for key, value in state.items():
                    new = after["state"][index][key]
                    assert torch.equal(new.reshape(value.shape), value)
                    reshaped += new.shape != value.shape
            assert reshaped == 2 * len(openings(path.parent))  # exp_avg and exp_avg_sq of each beta_open
        elif name not in code:  # the custom-code files are this release's (checked through the Hub code above)
            assert target.read_bytes() == path.read_bytes(), name
    assert {p.relative_to(upgraded) for p in upgraded.rglob("*") if p.is_file()} >= {
        p.relative_to(legacy) for p in legacy.rglob("*") if p.is_file()
    }


def test_the_upgrade_reshapes_torch_format_weights_too(tmp_path):
    source = tmp_path / "bin"
    source.mkdir()
    shutil.copy(FIXTURES / "delta_gpt" / "config.json", source)
    weights = load_file(FIXTURES / "delta_gpt" / "model.safetensors")
    torch.save(weights, source / "pytorch_model.bin")
    report = upgrade.upgrade_checkpoint(source, tmp_path / "out")
    assert report.reshaped == {"pytorch_model.bin": 4}
    after = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    assert all(after[k].shape == ((1,) if k.endswith("beta_open") else v.shape) for k, v in weights.items())


def no_trace(output: Path) -> bool:
    return not output.exists() and not list(output.parent.glob(f".{output.name}.*"))


def test_an_upgrade_that_fails_midway_leaves_nothing(tmp_path, monkeypatch, capsys):
    """Interrupted after every tensor file is written (the code files come last): no output, no temporary directory."""

    def interrupted(config):
        raise KeyboardInterrupt

    monkeypatch.setattr(upgrade, "_write_todays_code", interrupted)
    output = tmp_path / "new" / "upgraded"
    assert ddl_hf_cli.main(["upgrade", str(FIXTURES / "delta_gpt"), "--output", str(output)]) == 130
    assert capsys.readouterr().err == f"error: interrupted; nothing was written to {output}.\n"
    assert no_trace(output) and not output.parent.exists()


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), "disk full while writing the upgrade of"),
        (PermissionError(errno.EACCES, "Permission denied"), "cannot write"),
    ],
)
def test_an_upgrade_that_cannot_write_says_why_and_leaves_nothing(tmp_path, monkeypatch, capsys, error, message):
    """A full disk gets the same advice as `convert`'s (free space or another --output); other OS errors name the
    output. Either way one line, exit code 1, no trace."""

    def fails(config):
        raise error

    monkeypatch.setattr(upgrade, "_write_todays_code", fails)
    output = tmp_path / "upgraded"
    assert ddl_hf_cli.main(["upgrade", str(FIXTURES / "delta_gpt"), "--output", str(output)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1 and str(output) in err
    assert no_trace(output)


def test_the_upgrade_refuses_an_existing_destination_and_an_upgraded_source(tmp_path, upgraded, capsys):
    output = tmp_path / "existing"
    output.mkdir()
    (output / "keep.txt").write_text("mine")
    assert ddl_hf_cli.main(["upgrade", str(FIXTURES / "delta_gpt"), "--output", str(output)]) == 1
    error = capsys.readouterr().err
    assert error.startswith(f"error: --output {output} already exists") and error.count("\n") == 1, error
    assert [p.name for p in output.iterdir()] == ["keep.txt"]
    again = tmp_path / "again"
    assert ddl_hf_cli.main(["upgrade", str(upgraded / "delta_gpt"), "--output", str(again)]) == 1
    error = capsys.readouterr().err
    assert "no tensor that ddl-hf 0.1 saved 0-dim" in error and error.count("\n") == 1, error
    assert no_trace(again)


def test_the_upgrade_in_place_replaces_the_directory_only_when_complete(tmp_path):
    """`--output SRC --force`, however SRC is spelled (`..` included), ends as the upgraded directory, nothing else."""
    folder = tmp_path / "model"
    shutil.copytree(FIXTURES / "delta_gpt", folder)
    assert ddl_hf_cli.main(["upgrade", str(folder), "--output", str(folder / ".." / "model"), "--force"]) == 0
    assert [tensor.shape for tensor in openings(folder)] == [(1,)] * 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
