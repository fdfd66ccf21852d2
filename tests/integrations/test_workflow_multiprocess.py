"""Two-process Trainer on CPU (examples/multiprocess_train.py): DDP over gloo under both launchers, both ranks end
with bit-identical parameters; an FSDP launch that accelerate cannot honour on CPU is refused, not silently run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.workflow_utils import ROOT, free_port, tiny_gpt2_dir

LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"],
    # `--multi_gpu` is accelerate's torchrun launcher; Trainer's use_cpu=True makes it DDP over gloo on CPUs
    "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"],
    "accelerate-fsdp2-config": [
        *(sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2"),
        *("--config_file", str(ROOT / "examples" / "fsdp2" / "deltagpt.yaml")),
    ],
}


def launch(launcher: str, tmp_path, *extra: str) -> subprocess.CompletedProcess:
    base = tiny_gpt2_dir(tmp_path / "base")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    script = [str(ROOT / "examples" / "multiprocess_train.py"), "--base", str(base), "--output-dir"]
    options = ["--steps", "3", "--batch-size", "2", "--block-size", "16", *extra]
    port = ["--main_process_port", str(free_port())] if launcher.startswith("accelerate") else []
    command = [*LAUNCHERS[launcher], *port, *script, str(tmp_path / "ddp"), *options]
    return subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400)


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_two_process_gloo_trainer_ranks_agree(tmp_path, launcher):
    completed = launch(launcher, tmp_path)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    out = tmp_path / "ddp"
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in reports] == [2, 2]
    assert [r["global_step"] for r in reports] == [3, 3]
    assert reports[0]["final_digest"] == reports[1]["final_digest"]
    assert reports[0]["final_digest"] != reports[0]["initial_digest"]  # training did change the weights
    assert reports[0]["eval_loss"] == reports[1]["eval_loss"]
    assert (out / "final" / "modeling_delta_gpt.py").exists()


@pytest.mark.parametrize(
    "launcher, extra, message",
    [
        # the launcher's FSDP environment, or TrainingArguments(fsdp=True): on CPU accelerate sets up DDP instead
        ("accelerate-fsdp2-config", (), "FSDP was requested, but accelerate set up MULTI_CPU"),
        ("torchrun", ("--fsdp",), "FSDP was requested, but accelerate set up MULTI_CPU"),
    ],
    ids=["accelerate-config", "trainer-arguments"],
)
def test_an_fsdp_launch_on_cpu_is_refused(tmp_path, launcher, extra, message):
    completed = launch(launcher, tmp_path, *extra)
    assert completed.returncode != 0
    assert message in completed.stdout + completed.stderr, completed.stderr[-3000:]
    assert not (tmp_path / "ddp" / "rank0.json").exists()
