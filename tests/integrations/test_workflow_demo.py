"""The main job's pipeline end to end, at smoke sizes, without the dev extra; plus device_map="auto" loading."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GPT2LMHeadModel

import ddl_hf
from tests.workflow_utils import tiny_gpt2_dir

#: What the dev extra adds to the package's own requirements: the main job must run without any of them (the README's
#: first line installs none). Marked absent in the demo's process (`sys.modules[name] = None`: an import fails, and
#: `importlib.util.find_spec`, which transformers asks, answers None).
DEV_ONLY = ("triton", "fla", "onnx", "onnxscript", "onnxruntime", "trl", "bitsandbytes", "hypothesis", "ruff",
            "scipy", "ninja", "pytest")  # fmt: skip

DEMO_RUNS = """
import json, sys
for name in {dev_only!r}:
    sys.modules[name] = None
sys.path.insert(0, {root!r})
from tests.workflow_utils import load_example
demo = load_example("demo")
cache, out, again = sys.argv[1:4]
summary = demo.main(["--smoke", "--cache-dir", cache, "--output-dir", out])
# The next run reuses the cached base instead of pretraining again (no random draws before the conversion).
from pathlib import Path
from ddl_hf.training import base_gpt2
(cached,) = list((Path(cache) / "base").iterdir())
mtime = (cached / "model.safetensors").stat().st_mtime_ns
origin = base_gpt2(cache_dir=cache, spec=demo.SMOKE_SPEC)[2]
second = demo.main(["--smoke", "--cache-dir", cache, "--output-dir", again])
loaded = sorted(name for name in {dev_only!r} if sys.modules.get(name) is not None)
print("RESULT", json.dumps(dict(summary=summary, again=second, origin=origin, loaded=loaded,
                                mtime_kept=(cached / "model.safetensors").stat().st_mtime_ns == mtime)))
"""


def test_demo_smoke_pipeline_without_the_dev_extra(tmp_path):
    """The main job end to end at smoke sizes, in a process where the dev extra's packages are absent; both runs in
    that one process (the second compares bit for bit with the first)."""
    root = Path(__file__).resolve().parents[2]
    script = DEMO_RUNS.format(dev_only=DEV_ONLY, root=str(root))
    cache, out, again = tmp_path / "cache", tmp_path / "out", tmp_path / "again"
    done = subprocess.run(
        [sys.executable, "-c", script, str(cache), str(out), str(again)],
        cwd=root, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.split("RESULT ", 1)[1])
    summary = result["summary"]
    assert result["loaded"] == []
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
    # The cached base is reused; reproducible: the second run (same process, same seed) ends with bit-identical
    # DeltaGPT weights and eval losses.
    assert result["origin"].startswith("cached small GPT-2") and result["mtime_kept"]
    assert result["again"]["base"].startswith("cached small GPT-2")
    for name in ("gpt2", "delta_gpt"):
        assert result["again"][name] == summary[name]
    weights = "delta-gpt/model.safetensors"
    assert (again / weights).read_bytes() == (out / weights).read_bytes()


def test_device_map_auto_loads_the_same_model(tmp_path):
    base = tiny_gpt2_dir(tmp_path / "base", dropout=0.0)
    model = ddl_hf.convert_gpt2(GPT2LMHeadModel.from_pretrained(base), delta_value_channels=2, delta_beta_init=0.5)
    model.save_pretrained(tmp_path / "delta")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "delta", device_map="auto").eval()
    assert {p.device.type for p in loaded.parameters()} == {"cpu"}  # the only device here
    ids = torch.tensor([[464, 3290, 318, 257, 1332, 13]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model.eval()(ids).logits, rtol=0, atol=0)
