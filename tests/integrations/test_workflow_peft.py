"""peft LoRA on the GPT-2 sublayers with the Delta parameters trainable: save, reload, merge."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from tests.workflow_utils import load_example, run_example


def test_lora_with_delta_params_save_reload_merge(tmp_path):
    result = run_example("peft_lora", tmp_path, steps=4, batch_size=2, block_size=16, rank=4, lr=1e-2)
    out = result["output_dir"]
    adapter_files = {p.name for p in (out / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= adapter_files

    # The adapter holds LoRA weights for all three sublayer kinds and the full Delta blocks.
    from safetensors.torch import load_file

    saved = load_file(out / "adapter" / "adapter_model.safetensors")
    for part in ("attn.c_attn.lora_A", "attn.c_proj.lora_B", "mlp.c_fc.lora_A", "mlp.c_proj.lora_A"):
        assert any(part in k for k in saved), part
    assert any("attn_delta" in k and "beta_open" in k for k in saved)
    assert any("mlp_delta" in k and "v_proj" in k for k in saved)

    # Training changed the function (LoRA B and the Delta gates moved), reload reproduces it exactly,
    # and merging gives the same outputs as the unmerged adapter.
    base_logits = AutoModelForCausalLM.from_pretrained(out / "base-delta-gpt").eval()
    ids = torch.tensor([[464, 3290, 318, 257, 1332, 13, 198, 40, 588, 340, 13, 198]])
    with torch.no_grad():
        assert not torch.allclose(base_logits(ids).logits, result["merged_model"](ids).logits, atol=1e-4)
    torch.testing.assert_close(result["unmerged"], result["trained"], rtol=0, atol=1e-6)
    torch.testing.assert_close(result["merged"], result["unmerged"], rtol=1e-4, atol=1e-4)
    merged_betas_open = [float(m.beta_open) for m in result["merged_model"].modules() if hasattr(m, "beta_open")]
    assert any(b != 0.0 for b in merged_betas_open), "the Delta gates were not trained"

    # The merged model is a plain DeltaGPT again and round-trips through AutoModelForCausalLM.
    reloaded = AutoModelForCausalLM.from_pretrained(out / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, result["merged_model"](ids).logits, rtol=0, atol=0)


def test_delta_stats_callback_sees_the_trained_copies_under_peft():
    from peft import get_peft_model
    from transformers import GPT2LMHeadModel

    import ddl_hf
    from ddl_hf.callbacks import delta_blocks
    from tests.builders import gpt2_config

    example = load_example("peft_lora")
    gpt2 = GPT2LMHeadModel(gpt2_config(vocab_size=64, n_positions=16, n_embd=8, n_head=2))
    model = get_peft_model(ddl_hf.convert_gpt2(gpt2), example.lora_config(rank=2))
    blocks = delta_blocks(model)
    assert [label for label, _ in blocks] == ["L0.attn", "L0.mlp", "L1.attn", "L1.mlp"]
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert all(id(m.beta_open) in trainable for _, m in blocks)  # the copies that train, not the frozen originals
