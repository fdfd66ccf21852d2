"""Write the ddl-hf 0.1 checkpoints that tests/test_legacy_checkpoints.py loads with today's code.

ddl-hf 0.1 stored every Delta residual's `beta_open` as a 0-dim parameter; 0.2 stores it as `[1]` (FSDP2 shards
along dim 0). These fixtures were written by the 0.1 code itself, so that the test proves that what users saved
before the change still loads and computes the same:

    git worktree add /tmp/ddl-hf-0.1 712f6fb     # the last 0.1 commit
    PYTHONPATH=/tmp/ddl-hf-0.1 python tests/data/ddl_hf_0_1/make_fixtures.py tests/data/ddl_hf_0_1
    # with torch 2.13.0 (CPU) and transformers 5.23.0, which 0.1 was tested with

Each model directory holds what `save_pretrained` wrote (weights, config, the 0.1 custom-code files) and
`expected.safetensors`: the inputs and what the 0.1 model computed on them. The Trainer checkpoint's optimizer,
scheduler and RNG states are kept as safetensors + JSON instead of Trainer's pickles (legacy_run.py).
(The first fixtures were written before legacy_run.py existed; their pickles were converted by `pickle_free`,
a lossless round trip.)
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from legacy_run import TINY, pickle_free, training_arguments, training_data
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Qwen3Config, Trainer

import ddl_hf


def open_gates(model: torch.nn.Module, seed: int) -> None:
    """Token-dependent beta in (0, 2) and a non-trivial value map, so that every Delta term moves the logits."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, ddl_hf.DeltaResidual):
                module.beta_open.fill_(0.5 + 0.5 * torch.rand((), generator=generator).item())
                for param in module.beta_proj.parameters():
                    param.copy_(torch.randn(param.shape, generator=generator))
                module.v_proj.weight.copy_(torch.randn(module.v_proj.weight.shape, generator=generator))


def write_model(model: torch.nn.Module, folder: Path, ids: torch.Tensor) -> None:
    model.save_pretrained(folder)
    with torch.no_grad():
        logits = model(ids).logits
    save_file({"input_ids": ids, "logits": logits.contiguous()}, folder / "expected.safetensors")


def main(out: Path) -> None:
    torch.manual_seed(0)
    ids = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(1))

    # DeltaGPT: paper mode, expanded state (d_v = 4) with the temporal-conv read, open gates.
    config = ddl_hf.DeltaGPTConfig(
        **TINY, delta_mode="paper", delta_value_channels=4, delta_state_read="temporal_conv", delta_beta_init=0.5
    )
    gpt = ddl_hf.DeltaGPTForCausalLM(config).eval()
    open_gates(gpt, seed=2)
    write_model(gpt, out / "delta_gpt", ids)

    # DeltaLlama: a Qwen3 (QK-norm, GQA) converted with d_v = 4, open gates.
    source = AutoModelForCausalLM.from_config(
        Qwen3Config(
            vocab_size=97,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=64,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
    ).eval()
    llama = ddl_hf.convert_llama(source, delta_value_channels=4).eval()
    open_gates(llama, seed=3)
    write_model(llama, out / "delta_llama", ids)

    # A peft LoRA adapter whose modules_to_save copies the Delta residuals (beta_open among their parameters).
    lora = get_peft_model(gpt, LoraConfig(target_modules=["c_attn"], modules_to_save=["attn_delta", "mlp_delta"]))
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.1)
            if "modules_to_save" in name and name.endswith("beta_open"):
                param.fill_(0.3)
    lora.save_pretrained(out / "adapter")
    with torch.no_grad():
        logits = lora(ids).logits
    save_file({"input_ids": ids, "logits": logits.contiguous()}, out / "adapter" / "expected.safetensors")

    # A Trainer run of an additive d_v = 1 DeltaGPT (a converted model's setting, gates opening during training):
    # its checkpoint after 2 of 4 steps, and the parameters after all 4.
    torch.manual_seed(0)
    model = ddl_hf.DeltaGPTForCausalLM(ddl_hf.DeltaGPTConfig(**TINY, delta_init="exact"))
    run = out / "trainer_run"
    args = training_arguments(run, save_only_model=False)
    dataset = training_data()
    Trainer(model=model, args=args, train_dataset=dataset).train()
    shutil.rmtree(run / "checkpoint-4")
    shutil.move(run / "checkpoint-2", out / "trainer_checkpoint")
    shutil.rmtree(run)
    pickle_free(out / "trainer_checkpoint")  # the repository keeps no pickle: the test writes them back
    final = {name: param.detach().clone().contiguous() for name, param in model.named_parameters()}
    save_file(final, out / "trainer_checkpoint" / "expected_after_4_steps.safetensors")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
