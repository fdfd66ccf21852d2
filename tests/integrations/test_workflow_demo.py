"""The main job's pipeline end to end, at smoke sizes; plus device_map="auto" loading."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM, GPT2LMHeadModel
from workflow_utils import load_example, tiny_gpt2_dir

import ddl_hf


def test_demo_smoke_pipeline(tmp_path):
    demo = load_example("demo")
    cache, out = tmp_path / "cache", tmp_path / "out"
    summary = demo.main(["--smoke", "--cache-dir", str(cache), "--output-dir", str(out)])
    # 1. the base was pretrained and cached; 2. the conversion is exact
    cached = list((cache / "base").iterdir())
    assert len(cached) == 1 and (cached[0] / "model.safetensors").exists()
    assert summary["equivalence"]["max_abs_logit_diff"] == 0.0 and summary["equivalence"]["greedy_identical"]
    # 3. both models start from the same function and both improve on the held-out play
    assert abs(summary["gpt2"]["ppl_before"] / summary["delta_gpt"]["ppl_before"] - 1) < 1e-5
    for name in ("gpt2", "delta_gpt"):
        assert summary[name]["ppl_after"] < summary[name]["ppl_before"]
    # 4. plot, saved model with custom code, identical reload
    assert (out / "beta_over_training.png").read_bytes()[:4] == b"\x89PNG"
    assert {"modeling_delta_gpt.py", "configuration_delta_gpt.py", "tokenizer.json"} <= {
        p.name for p in (out / "delta-gpt").iterdir()
    }
    assert summary["reload_identical"]
    assert json.loads((out / "summary.json").read_text())["finetune_steps"] == 3
    # The next run reuses the cached base instead of pretraining again.
    from ddl_hf.training import base_gpt2

    mtime = (cached[0] / "model.safetensors").stat().st_mtime_ns
    _, _, origin = base_gpt2(cache_dir=cache, spec=demo.SMOKE_SPEC)
    assert origin.startswith("cached small GPT-2")
    assert (cached[0] / "model.safetensors").stat().st_mtime_ns == mtime
    # Reproducible: a second run at the same seed, now with the cached base (so no pretraining draws from the
    # random generators before the conversion), ends with bit-identical DeltaGPT weights and eval losses.
    again = demo.main(["--smoke", "--cache-dir", str(cache), "--output-dir", str(tmp_path / "again")])
    assert again["base"].startswith("cached small GPT-2")
    for name in ("gpt2", "delta_gpt"):
        assert again[name] == summary[name]
    weights = "delta-gpt/model.safetensors"
    assert (tmp_path / "again" / weights).read_bytes() == (out / weights).read_bytes()


def test_device_map_auto_loads_the_same_model(tmp_path):
    base = tiny_gpt2_dir(tmp_path / "base", dropout=0.0)
    model = ddl_hf.convert_gpt2(GPT2LMHeadModel.from_pretrained(base), delta_value_channels=2, delta_beta_init=0.5)
    model.save_pretrained(tmp_path / "delta")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "delta", device_map="auto").eval()
    assert {p.device.type for p in loaded.parameters()} == {"cpu"}  # the only device here
    ids = torch.tensor([[464, 3290, 318, 257, 1332, 13]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model.eval()(ids).logits, rtol=0, atol=0)
