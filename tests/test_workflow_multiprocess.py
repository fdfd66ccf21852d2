"""Two-process Trainer (DDP, gloo) on CPU: both ranks end with bit-identical parameters."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from workflow_utils import ROOT, tiny_gpt2_dir


def test_two_process_gloo_trainer_ranks_agree(tmp_path):
    base = tiny_gpt2_dir(tmp_path / "base")
    out = tmp_path / "ddp"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(ROOT / "examples" / "multiprocess_train.py"),
        "--base",
        str(base),
        "--output-dir",
        str(out),
        "--steps",
        "3",
        "--batch-size",
        "2",
        "--block-size",
        "16",
    ]
    completed = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in reports] == [2, 2]
    assert [r["global_step"] for r in reports] == [3, 3]
    assert reports[0]["final_digest"] == reports[1]["final_digest"]
    assert reports[0]["final_digest"] != reports[0]["initial_digest"]  # training did change the weights
    assert reports[0]["eval_loss"] == reports[1]["eval_loss"]
    assert (out / "final" / "modeling_delta_gpt.py").exists()
