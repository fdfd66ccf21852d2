"""FSDP2 end to end on 2 CPU processes over gloo (torchrun): `ddl_hf.distributed.fully_shard_model` shards every
block and then the model (tests/fsdp_worker.py is one process). The reference is the same training without sharding,
in this process, on the same global batches: its losses, and its parameters after the run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fsdp_worker import VARIANTS, batches, build, make_optimizer, step_loss
from transformers import AutoModelForCausalLM

from ddl_hf.distributed import block_classes, fully_shard_model

STEPS = 10
WORKER = Path(__file__).parent / "fsdp_worker.py"
ROOT = Path(__file__).resolve().parents[1]


def torchrun(out: Path, *worker_args: str, nodes: int = 1) -> dict:
    """Run the worker on 2 processes (1 node with 2, or `nodes=2` agents with 1 each, meeting at a c10d
    rendezvous on localhost, as two machines would) and return rank 0's report."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error")
    worker = [str(WORKER), "--out", str(out), "--steps", str(STEPS), *worker_args]
    run = [sys.executable, "-m", "torch.distributed.run"]
    if nodes == 1:
        commands = [[*run, "--standalone", "--nproc_per_node", "2", *worker]]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "ddl-hf-test"]
        commands = [[*run, "--nnodes", str(nodes), "--nproc_per_node", "1", *rendezvous, *worker]] * nodes
    agents = [
        subprocess.Popen(c, env=env, cwd=out, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for c in commands
    ]
    logs = [agent.communicate(timeout=500)[0] for agent in agents]
    assert all(agent.returncode == 0 for agent in agents), "\n".join(log[-3000:] for log in logs)
    return json.loads((out / "report.json").read_text())


@pytest.fixture(scope="module")
def unsharded() -> dict:
    """{variant: (losses, model)}: the same training without sharding, the whole global batch in one process."""
    data = batches(STEPS)
    runs = {}
    for variant in VARIANTS:
        model = build(variant)
        optimizer = make_optimizer(model)
        losses = []
        for step in range(STEPS):
            loss = step_loss(model, data[step])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
        runs[variant] = (losses, model)
    return runs


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("fsdp")
    return torchrun(out, "--activation-checkpointing", "--save-full"), out


@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "activation-checkpointing"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sharded_training_has_the_unsharded_losses(sharded, unsharded, variant, checkpointing):
    report, _ = sharded
    assert report["world_size"] == 2
    losses = report["losses"][f"{variant}{' checkpointing' if checkpointing else ''}"]
    expected = unsharded[variant][0]
    assert len(losses) == len(expected) == STEPS
    assert max(abs(a - b) for a, b in zip(losses, expected)) <= 1e-5, (losses, expected)
    assert expected[0] != expected[-1]  # the weights moved


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_gathered_full_model_saves_and_loads_like_the_unsharded_one(sharded, unsharded, variant):
    _, out = sharded
    loaded = AutoModelForCausalLM.from_pretrained(out / "full" / variant)
    reference = dict(unsharded[variant][1].named_parameters())
    assert type(loaded) is type(unsharded[variant][1])
    loaded = dict(loaded.named_parameters())
    assert loaded.keys() == reference.keys()
    for name, param in reference.items():
        torch.testing.assert_close(loaded[name], param.detach(), rtol=1e-4, atol=1e-5, msg=name)


def test_a_dcp_checkpoint_resumes_as_the_uninterrupted_run_continues(sharded, tmp_path):
    """Model and optimizer written with torch.distributed.checkpoint after 5 steps, read back by new processes,
    which continue with the losses of the run that was never interrupted."""
    variants = ["gpt-tc-ec-dv4", "llama-qwen3-dv4"]
    first = torchrun(tmp_path, "--variants", *variants, "--dcp-save", "5")
    resumed = torchrun(tmp_path, "--variants", *variants, "--dcp-resume", "5")
    uninterrupted = sharded[0]["losses"]
    for variant in variants:
        assert first["losses"][variant] == uninterrupted[variant][:5]
        assert resumed["losses"][variant] == uninterrupted[variant][5:], variant


def test_two_nodes_train_as_one_node_with_the_same_world_size(sharded, tmp_path):
    """`torchrun --nnodes 2` (two node agents on localhost, a c10d rendezvous): the losses of one node with two."""
    report = torchrun(tmp_path, "--variants", "gpt-paper-dv4", nodes=2)
    assert report["world_size"] == 2
    assert report["losses"]["gpt-paper-dv4"] == sharded[0]["losses"]["gpt-paper-dv4"]


def test_what_fully_shard_model_wraps_and_refuses():
    model = build("gpt-paper-dv4")
    assert [cls.__name__ for cls in block_classes(model)] == ["DeltaGPTBlock"]
    assert [cls.__name__ for cls in block_classes(build("llama-qwen3-dv4"))] == ["DeltaLlamaDecoderLayer"]
    assert all(p.dim() >= 1 for p in model.parameters())
    with pytest.raises(ValueError, match="names no block class"):
        fully_shard_model(torch.nn.Linear(2, 2))
    model.register_parameter("scalar", torch.nn.Parameter(torch.zeros(())))
    with pytest.raises(ValueError, match="0-dim parameters: scalar"):
        fully_shard_model(model)
