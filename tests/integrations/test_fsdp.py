"""FSDP2 end to end on 2 CPU processes over gloo (torchrun): `ddl_hf.distributed.fully_shard_model` shards every
block and then the model (tests/fsdp_worker.py is one process). The reference is the same training without sharding,
in this process, on the same global batches: its losses, and its parameters after the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import DistributedType
from transformers import AutoModelForCausalLM

import ddl_hf
from ddl_hf.distributed import block_classes, check_launch, fully_shard_model
from tests.builders import CLIENT_VARIANTS, delta_model
from tests.fsdp_worker import VARIANTS, batches, build, make_optimizer, step_loss
from tests.workflow_utils import free_port

STEPS = 10
WORKER = Path(__file__).parents[1] / "fsdp_worker.py"
ROOT = Path(__file__).resolve().parents[2]


def torchrun(out: Path, *worker_args: str, nodes: int = 1, accelerate_config: str | None = None) -> dict:
    """Run the worker on 2 processes (1 node with 2, or `nodes=2` agents with 1 each, meeting at a c10d
    rendezvous on localhost, as two machines would; or `accelerate launch` with a shipped config, float32) and
    return rank 0's report."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error")
    worker = [str(WORKER), "--out", str(out), "--steps", str(STEPS), *worker_args]
    run = [sys.executable, "-m", "torch.distributed.run"]
    if accelerate_config:
        config = ["--config_file", str(ROOT / "examples" / "fsdp2" / accelerate_config)]
        launch = [sys.executable, "-m", "accelerate.commands.launch", *config, "--num_processes", "2"]
        launch += ["--main_process_port", str(free_port())]
        commands = [[*launch, "--mixed_precision", "no", *worker, "--engine", "accelerate"]]
    elif nodes == 1:
        commands = [[*run, "--standalone", "--nproc_per_node", "2", *worker]]
    else:
        port = free_port()
        run_id = f"ddl-hf-test-{uuid.uuid4().hex}"  # two runs on one machine never join each other's rendezvous
        rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id]
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


SHIPPED_CONFIGS = {"deltagpt.yaml": ["gpt-dv1", "gpt-paper-dv4"], "deltallama.yaml": ["llama-qwen3-dv4"]}


@pytest.mark.parametrize("config", list(SHIPPED_CONFIGS))
def test_accelerate_fsdp2_with_the_shipped_config_has_the_unsharded_losses(unsharded, tmp_path, config):
    """`accelerate launch --config_file examples/fsdp2/<model>.yaml` (float32 here): accelerate's own FSDP2
    preparation, with the wrap class, resharding and cpu-RAM-efficient loading of the shipped config."""
    variants = SHIPPED_CONFIGS[config]
    report = torchrun(tmp_path, "--variants", *variants, accelerate_config=config)
    assert report["world_size"] == 2
    wrap = report["accelerate_env"]["FSDP_TRANSFORMER_CLS_TO_WRAP"]
    assert wrap == block_classes(unsharded[variants[0]][1])[0].__name__
    for variant in variants:
        losses, expected = report["losses"][variant], unsharded[variant][0]
        assert max(abs(a - b) for a, b in zip(losses, expected, strict=True)) <= 1e-5, (variant, losses, expected)


@pytest.mark.parametrize("config", list(SHIPPED_CONFIGS))
def test_the_shipped_gpu_configs_are_fsdp2_with_bf16_and_the_right_wrap_class(config):
    """What the GPU user runs, read by accelerate's own config loader: FSDP version 2, bf16, and a wrap class that
    every variant of that model family has, with every parameter shardable (at least 1-D)."""
    cluster = load_config_from_file(str(ROOT / "examples" / "fsdp2" / config))
    assert cluster.distributed_type == DistributedType.FSDP
    assert str(cluster.mixed_precision) == "bf16"
    fsdp = cluster.fsdp_config
    assert fsdp["fsdp_version"] == 2
    assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    if config == "deltallama.yaml":
        models = [build("llama-qwen3-dv4")]
    else:
        models = [delta_model(spec, vocab_size=61) for spec in CLIENT_VARIANTS.values()]
    for model in models:
        assert [cls.__name__ for cls in block_classes(model)] == [fsdp["fsdp_transformer_layer_cls_to_wrap"]]
        assert all(p.dim() >= 1 for p in model.parameters())


def test_check_launch_refuses_what_accelerate_would_silently_change(monkeypatch):
    """An FSDP launch that accelerate turned into DDP, and processes that each train alone (an FSDP config on a
    CPU-only machine under a bare `Accelerator()`); a consistent launch passes."""
    fake = lambda kind, processes: type("Accelerator", (), dict(distributed_type=kind, num_processes=processes))  # noqa: E731
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(RuntimeError, match="2 processes were launched, but accelerate set up NO in each"):
        check_launch(fake(DistributedType.NO, 1))
    with pytest.raises(RuntimeError, match="FSDP was requested, but accelerate set up MULTI_CPU"):
        check_launch(fake(DistributedType.MULTI_CPU, 2))
    check_launch(fake(DistributedType.FSDP, 2))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    check_launch(fake(DistributedType.MULTI_CPU, 2))
    with pytest.raises(RuntimeError, match="FSDP was requested"):
        check_launch(fake(DistributedType.MULTI_CPU, 2), fsdp_requested=True)


@pytest.fixture
def second_rank_of_an_fsdp_launch(monkeypatch):
    """This process as rank 1 of `accelerate launch` with an FSDP config and cpu-RAM-efficient loading (the
    environment that transformers' from_pretrained reads), in a one-process gloo group."""
    import torch.distributed as dist

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "true")
    monkeypatch.setenv("LOCAL_RANK", "1")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_conversion_on_a_non_main_rank_leaves_no_meta_parameters(second_rank_of_an_fsdp_launch, family):
    """There transformers leaves the parameters that a state dict lacks on the meta device, for accelerate to
    broadcast; two meta parameters share data pointer 0, which accelerate's optimizer mapping confuses (the Delta
    parameters of every rank but the first trained wrongly). Conversion gives them storage and their init."""
    if family == "llama":
        from tests.builders import build_source

        model = ddl_hf.convert_llama(build_source("qwen3", vocab_size=61), delta_value_channels=4)
    else:
        from transformers import GPT2Config, GPT2LMHeadModel

        source = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=61, n_positions=16))
        model = ddl_hf.convert_gpt2(source, delta_value_channels=4)
    assert not [n for n, p in model.named_parameters() if p.device.type == "meta"]
    for residual in model.delta_residuals().values():  # the closed gates of a conversion, as on the first rank
        assert torch.equal(residual.gate_output.weight, torch.zeros_like(residual.gate_output.weight))
