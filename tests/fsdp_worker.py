"""One process of the FSDP2 tests (tests/integrations/test_fsdp.py), started by torchrun: tiny Delta models sharded with
`ddl_hf.distributed.fully_shard_model` (every block, then the model) over gloo, trained on a fixed global batch split
across the ranks. Rank 0 writes what the test compares with an unsharded run: the loss of every step (the mean over
the global batch), and, on request, the gathered full model (`--save-full`) or a `torch.distributed.checkpoint`
of model and optimizer (`--dcp-save`), or a run resumed from one (`--dcp-resume`).

`--engine accelerate` (started by `accelerate launch --config_file examples/fsdp2/<model>.yaml`) shards with
accelerate's own FSDP2 preparation, configured from the launcher's environment, i.e. from the shipped config.
accelerate sets up FSDP only where there are GPUs (on CPU it sets up DDP, `MULTI_CPU`, without a word), so the worker
records what accelerate chose and then hands it the FSDP plugin that it would have built on GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import ddl_hf
from ddl_hf.distributed import fully_shard_model, gather_full_state_dict
from tests.builders import CLIENT_VARIANTS, delta_model, enable_activation_checkpointing

VARIANTS = {
    "gpt-dv1": CLIENT_VARIANTS["additive-dv1"],
    "gpt-paper-dv4": CLIENT_VARIANTS["paper-dv4"],
    "gpt-tc-ec-dv4": CLIENT_VARIANTS["tc-ec-paper-dv4"],
    "gpt-delta_net": CLIENT_VARIANTS["delta_net-dv1"],
    "llama-qwen3-dv4": None,
}
VOCAB, SEQ, GLOBAL_BATCH = 61, 12, 4


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum: a state to checkpoint, and updates linear in the gradients, so that the float rounding by
    which a sharded run's gradients differ stays that small (AdamW would turn it into learning-rate-sized steps for
    parameters whose gradients are near 0)."""
    return torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)


def build(variant: str) -> torch.nn.Module:
    """The same model on every rank and in the test's unsharded reference: built from its config (DeltaLlama:
    converted), gates half open with gently token-dependent betas. A well-conditioned start: a sharded run differs
    from the unsharded one by the float rounding of its sums, and a run from weights 1e-7 apart stays within 1e-5
    of it over the 10 steps (measured), so the comparison is of that rounding, not of chaos."""
    if variant.startswith("llama"):
        from tests.builders import build_source

        source = build_source("qwen3", vocab_size=VOCAB)
        model = ddl_hf.convert_llama(source, delta_value_channels=4, delta_beta_init=0.5)
    else:
        model = delta_model(VARIANTS[variant], vocab_size=VOCAB)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for residual in model.delta_residuals().values():
            residual.beta_open.fill_(0.6)  # well inside (0, 1), where the opening's clamp has no kink
            weight = residual.gate_output.weight
            weight.copy_(0.05 * torch.randn(weight.shape, generator=generator))
    return model.train()


def batches(steps: int) -> torch.Tensor:
    """`[steps, GLOBAL_BATCH, SEQ]` token ids, the same for every run: one batch, repeated, so that the loss falls
    step after step (the model memorises it)."""
    batch = torch.randint(1, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    return batch.expand(steps, -1, -1)


def step_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def train(model, optimizer, data: torch.Tensor, first: int, last: int, rank: int, world: int) -> list[float]:
    """Steps `first`..`last - 1`; each rank takes its rows of the global batch. Returns the global mean losses."""
    rows = GLOBAL_BATCH // world
    losses = []
    for step in range(first, last):
        loss = step_loss(model, data[step, rank * rows : (rank + 1) * rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    return losses


def fsdp_accelerator(report: dict):
    """An `Accelerator` (which starts the process group) set up for FSDP2 with the plugin read from the launcher's
    environment."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    accelerator = Accelerator(cpu=True)  # MULTI_CPU: ranks and process group as under a GPU launch
    report["accelerate_chose"] = accelerator.distributed_type.value
    report["accelerate_env"] = {k: v for k, v in os.environ.items() if k.startswith("FSDP_")}
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin()
    return accelerator


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--activation-checkpointing", action="store_true", help="also a run of each with it on")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--engine", choices=["ddl_hf", "accelerate"], default="ddl_hf")
    parser.add_argument("--save-full", action="store_true", help="gather each model and save_pretrained it")
    parser.add_argument("--dcp-save", type=int, metavar="STEP", help="stop after STEP steps with a DCP checkpoint")
    parser.add_argument("--dcp-resume", type=int, metavar="STEP", help="resume the DCP checkpoint of STEP steps")
    args = parser.parse_args()

    torch.set_num_threads(1)
    report = {"node_rank": int(os.environ.get("GROUP_RANK", 0)), "losses": {}}
    accelerator = fsdp_accelerator(report) if args.engine == "accelerate" else dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    report["world_size"] = world
    data = batches(args.steps)
    for variant in args.variants:
        for checkpointing in (False, True) if args.activation_checkpointing else (False,):
            model = build(variant)
            if checkpointing:
                enable_activation_checkpointing(model, use_reentrant=False)
            if args.engine == "accelerate":
                # accelerate's FSDP2 preparation: auto-wrap policy, embedding and head groups, cpu-RAM-efficient
                # loading; it swaps the optimizer's parameters for the sharded ones
                model, optimizer = accelerator.prepare(model, make_optimizer(model))
            else:
                optimizer = make_optimizer(fully_shard_model(model))
            first, last = 0, args.steps
            checkpoint = args.out / "dcp" / variant
            if args.dcp_resume is not None:
                state = dict(zip(("model", "optimizer"), get_state_dict(model, optimizer)))
                dcp.load(state, checkpoint_id=checkpoint)
                set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
                first = args.dcp_resume
            if args.dcp_save is not None:
                last = args.dcp_save
            losses = train(model, optimizer, data, first, last, rank, world)
            if args.dcp_save is not None:
                dcp.save(dict(zip(("model", "optimizer"), get_state_dict(model, optimizer))), checkpoint_id=checkpoint)
            key = f"{variant}{' checkpointing' if checkpointing else ''}"
            report["losses"][key] = losses
            if args.save_full:
                full = gather_full_state_dict(model)
                if rank == 0:  # the sharded model writes the gathered weights, as examples/multiprocess_train.py does
                    model.save_pretrained(args.out / "full" / key.replace(" ", "-"), state_dict=full)
    if rank == 0:
        (args.out / "report.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()
    # Leave without interpreter finalization: the sharded modules keep the gloo group alive (their device mesh
    # holds it), so its worker threads would be torn down while Python finalizes, and a thread that then takes
    # the GIL is exited inside a noexcept frame: "terminate called without an active exception", SIGABRT, after
    # all the work is done (seen once in CI, in none of 24 runs here; pytorch PR 179291 describes the race).
    # Everything this process owes the test is written by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
