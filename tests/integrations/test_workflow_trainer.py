"""Trainer workflow: checkpoints with custom code, bit-identical resume, beta statistics in the logs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.workflow_utils import flags, load_example, state_dict_equal, tiny_gpt2_dir

ARGS = flags(steps=6, save_steps=3, batch_size=2, block_size=32, eval_blocks=2)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("clm")
    base = tiny_gpt2_dir(tmp / "base")
    example = load_example("train_causal_lm")
    trainer = example.main(["--base", str(base), "--output-dir", str(tmp / "run"), *ARGS])
    return tmp, base, example, trainer


def test_resume_from_checkpoint_is_bit_identical(uninterrupted):
    tmp, base, example, trainer = uninterrupted
    checkpoint = tmp / "run" / "checkpoint-3"
    # A new process-like start: a different output directory, a freshly converted model (other random Delta init),
    # and the run continues from step 3 of the first run.
    resumed = example.main(
        ["--base", str(base), "--output-dir", str(tmp / "resumed"), "--resume", str(checkpoint), *ARGS]
    )
    assert resumed.state.global_step == trainer.state.global_step == 6
    assert state_dict_equal(trainer.model, resumed.model) == []
    # and the Delta gates did train (otherwise identity would be trivially "identical")
    assert any(m.beta_open.item() != 0.0 for m in trainer.model.modules() if hasattr(m, "beta_open"))


def test_beta_statistics_in_trainer_logs(uninterrupted):
    tmp, _, _, trainer = uninterrupted
    entries = [e for e in trainer.state.log_history if "loss" in e]
    assert entries and all("beta/L1.mlp/mean" in e for e in entries)
    for e in entries:
        for block in ("L0.attn", "L0.mlp", "L1.attn", "L1.mlp"):
            fractions = [e[f"beta/{block}/{k}"] for k in ("keep", "project", "reflect")]
            assert all(0.0 <= f <= 1.0 for f in fractions) and sum(fractions) == pytest.approx(1.0)
            assert 0.0 <= e[f"beta/{block}/mean"] <= 2.0
    # The callback's statistics against an independent reference that does not read the Delta blocks' outputs:
    # beta = 2 sigmoid(gate(c)) clamp(beta_open, 0, 1), recomputed from the gate weights and c = the block's
    # LayerNorm output (ln_1 feeds the attention residual's gate, ln_2 the MLP's), captured in the same pass.
    from ddl_hf.callbacks import DeltaStatsCallback

    model = trainer.model
    with torch.no_grad():  # gates wide open and token-dependent, so every statistic is far from trivial
        for m in model.modules():
            if hasattr(m, "beta_open"):
                m.beta_open.fill_(0.9)
                m.beta_proj.weight.normal_(0.0, 1.0)
    sites, normed = {}, {}
    for i, block in enumerate(model.transformer.h):
        for kind, residual, norm in (("attn", block.attn_delta, block.ln_1), ("mlp", block.mlp_delta, block.ln_2)):
            sites[f"L{i}.{kind}"] = (residual, norm)
    hooks = [
        norm.register_forward_hook(lambda module, args, out, label=label: normed.__setitem__(label, out.detach()))
        for label, (_, norm) in sites.items()
    ]
    callback = DeltaStatsCallback()
    callback.on_train_begin(trainer.args, trainer.state, trainer.control, model=model)
    ids = torch.tensor(trainer.eval_dataset["input_ids"][:2])
    model.train()  # the callback counts training passes only (dropout on: the reference reads the same pass)
    torch.manual_seed(0)
    model(ids)
    callback.on_train_end(trainer.args, trainer.state, trainer.control)
    for hook in hooks:
        hook.remove()
    model.eval()
    logs = callback.pop_stats()

    regimes, all_betas = [], []
    for label, (residual, _) in sites.items():
        gate = residual.beta_proj
        assert isinstance(gate, torch.nn.Linear)  # the example's gate: logit = w . c + b
        c = normed[label].double()
        logit = c @ gate.weight.detach().double()[0] + gate.bias.detach().double()[0]
        beta = 2.0 * torch.sigmoid(logit) * residual.beta_open.detach().double().clamp(0.0, 1.0)
        assert beta.shape == ids.shape
        reference = {
            "mean": float(beta.mean()),
            "keep": float((beta < 0.5).double().mean()),
            "reflect": float((beta > 1.5).double().mean()),
        }
        reference["project"] = 1.0 - reference["keep"] - reference["reflect"]
        for stat, value in reference.items():
            assert logs[f"beta/{label}/{stat}"] == pytest.approx(value, rel=1e-5, abs=1e-6), f"{label} {stat}"
        regimes.append(reference)
        all_betas.append(beta)
    all_betas = torch.stack(all_betas)  # the console summary: over every block and token
    assert logs["beta_mean"] == pytest.approx(float(all_betas.mean()), rel=1e-5)
    assert logs["beta_max"] == pytest.approx(float(all_betas.max()), rel=1e-5)
    assert logs["beta_keep"] == pytest.approx(float((all_betas < 0.5).double().mean()), abs=1e-6)
    # Not vacuous: every regime occurs, and the means are far from the closed gates' 0.
    assert all(r["mean"] > 0.1 for r in regimes)
    assert all(max(r[k] for r in regimes) > 0 for k in ("keep", "project", "reflect"))
    state = json.loads((tmp / "run" / "checkpoint-6" / "trainer_state.json").read_text())
    assert any("beta/L0.attn/mean" in e for e in state["log_history"])


def test_checkpoint_loads_on_its_own_without_ddl_hf(uninterrupted):
    tmp, _, _, _ = uninterrupted
    checkpoint = tmp / "run" / "checkpoint-3"
    files = {p.name for p in checkpoint.iterdir()}
    assert {"configuration_delta_gpt.py", "modeling_delta_gpt.py", "model.safetensors", "config.json"} <= files
    assert json.loads((checkpoint / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"]
    ids = torch.tensor([[464, 3290, 318, 257, 1332, 13, 198, 40]])
    reference = AutoModelForCausalLM.from_pretrained(checkpoint).eval()(ids).logits
    torch.save(ids, tmp / "ids.pt")
    script = textwrap.dedent(
        f"""
        import sys, torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(checkpoint)!r}, trust_remote_code=True).eval()
        assert "ddl_hf" not in sys.modules, "ddl_hf was imported"
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        with torch.no_grad():
            torch.save(model(torch.load({str(tmp / "ids.pt")!r})).logits, {str(tmp / "logits.pt")!r})
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(tmp / "hf_modules")
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp, env=env, timeout=300)
    assert torch.equal(torch.load(tmp / "logits.pt"), reference.detach())
