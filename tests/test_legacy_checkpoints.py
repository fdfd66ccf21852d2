"""Checkpoints written by ddl-hf 0.1, whose `beta_open` is 0-dim (today `[1]`, for FSDP2), load and compute what 0.1
computed: through `from_pretrained`, through the Hub code without ddl_hf, as a peft adapter, and as a Trainer
checkpoint to resume from. The fixtures were written by the 0.1 code itself (tests/data/ddl_hf_0_1/make_fixtures.py
says how); what they hold is the independent reference."""

from __future__ import annotations

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

FIXTURES = Path(__file__).parent / "data" / "ddl_hf_0_1"
sys.path.insert(0, str(FIXTURES))
from legacy_run import TINY, restore_pickles, training_arguments, training_data  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HUB_FILES = {
    "delta_gpt": ("configuration_delta_gpt.py", "modeling_delta_gpt.py", "delta_ops.py", "delta_compat.py"),
    "delta_llama": (
        "configuration_delta_gpt.py",
        "modeling_delta_gpt.py",
        "delta_ops.py",
        "delta_compat.py",
        "configuration_delta_llama.py",
        "modeling_delta_llama.py",
    ),
}


def saved_0_1_weights_are_0_dim(folder: Path) -> bool:
    weights = load_file(folder / "model.safetensors")
    openings = [tensor for name, tensor in weights.items() if name.endswith("beta_open")]
    return bool(openings) and all(tensor.dim() == 0 for tensor in openings)


@pytest.mark.parametrize("name", ["delta_gpt", "delta_llama"])
def test_a_0_1_checkpoint_loads_and_computes_what_0_1_computed(name):
    folder = FIXTURES / name
    assert saved_0_1_weights_are_0_dim(folder)
    expected = load_file(folder / "expected.safetensors")
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    openings = [residual.beta_open for residual in model.delta_residuals().values()]
    assert openings and all(p.shape == (1,) for p in openings)
    with torch.no_grad():
        logits = model(expected["input_ids"]).logits
    torch.testing.assert_close(logits, expected["logits"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["delta_gpt", "delta_llama"])
def test_a_0_1_checkpoint_loads_through_todays_hub_code_without_ddl_hf(tmp_path, name):
    """The 0.1 weights beside today's custom-code files (as after pushing today's code to a 0.1 repository)."""
    folder = tmp_path / name
    shutil.copytree(FIXTURES / name, folder)
    for file in HUB_FILES[name]:
        shutil.copy(ROOT / file, folder / file)
    script = textwrap.dedent(
        """
        import sys
        sys.modules["ddl_hf"] = None  # the directory's own code, as for a user without this package
        import torch
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        expected = load_file(sys.argv[1] + "/expected.safetensors")
        model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
        assert "ddl_hf" not in type(model).__module__, type(model).__module__
        with torch.no_grad():
            logits = model(expected["input_ids"]).logits
        torch.testing.assert_close(logits, expected["logits"], rtol=0, atol=1e-6)
        print("same logits")
        """
    )
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "PATH": ""}
    result = subprocess.run(
        [sys.executable, "-c", script, str(folder)], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert result.returncode == 0 and "same logits" in result.stdout, result.stderr[-3000:]


def test_a_0_1_peft_adapter_with_delta_residuals_to_save_loads_and_computes_the_same():
    from peft import PeftModel

    expected = load_file(FIXTURES / "adapter" / "expected.safetensors")
    base = AutoModelForCausalLM.from_pretrained(FIXTURES / "delta_gpt")
    model = PeftModel.from_pretrained(base, FIXTURES / "adapter").eval()
    copies = [p for n, p in model.named_parameters() if "modules_to_save" in n and n.endswith("beta_open")]
    assert copies and all(p.shape == (1,) and float(p) == pytest.approx(0.3) for p in copies)
    with torch.no_grad():
        logits = model(expected["input_ids"]).logits
    torch.testing.assert_close(logits, expected["logits"], rtol=0, atol=1e-6)


class Unfused(TrainerCallback):
    """Steps with the single-tensor AdamW: a resumed optimizer takes its settings from the checkpoint (the 0.1 run's
    fused AdamW, which reads a 0-dim state as one number and would not notice a wrong shape)."""

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        for group in optimizer.param_groups:
            group.update(fused=False, foreach=False)


@pytest.mark.parametrize("callbacks", [[], [Unfused()]], ids=["fused", "unfused"])
def test_resuming_a_0_1_trainer_checkpoint_ends_where_0_1_ended(tmp_path, callbacks):
    """The 0.1 run checkpointed after 2 of 4 steps; resumed today (weights, and AdamW's state for the 0-dim
    `beta_open`), it reaches the parameters the 0.1 run reached after 4, with its fused AdamW and with the
    single-tensor one (which broadcasts the `[1]` gradient into a 0-dim state and fails unless the state is reshaped).
    To 5e-4, not bit for bit: the CPU's float kernels differ between machines (bit-exact where the fixture was made,
    4.5e-5 apart on an AVX-512 EPYC), while a lost optimizer state moves the parameters by 3.5e-2 (measured)."""
    from transformers import Trainer

    shutil.copytree(FIXTURES / "trainer_checkpoint", tmp_path / "checkpoint-2")
    restore_pickles(tmp_path / "checkpoint-2")  # Trainer's optimizer, scheduler and RNG files, from safetensors + JSON
    expected = load_file(tmp_path / "checkpoint-2" / "expected_after_4_steps.safetensors")
    torch.manual_seed(0)
    model = ddl_hf.DeltaGPTForCausalLM(ddl_hf.DeltaGPTConfig(**TINY, delta_init="exact"))
    args, dataset = training_arguments(tmp_path), training_data()
    trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=callbacks)
    trainer.train(resume_from_checkpoint=tmp_path / "checkpoint-2")
    assert all(group["fused"] is not bool(callbacks) for group in trainer.optimizer.param_groups)
    final = dict(model.named_parameters())
    assert final.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(final[name].detach(), value.reshape(final[name].shape), rtol=0, atol=5e-4, msg=name)
