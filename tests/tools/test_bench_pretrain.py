"""ddl_lab/studies/bench_pretrain.py: its statistics against closed forms, and the whole study pipeline at toy size."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

from ddl_lab.studies import bench_finetune, bench_pretrain


def test_paired_difference_is_the_t_interval():
    # diffs 4, 5, 6: mean 5, sd 1, n 3; t(0.975, df=2) = 4.302652729911275 (any t table).
    d = bench_pretrain.paired_difference([14.0, 15.0, 16.0], [10.0, 10.0, 10.0])
    half = 4.302652729911275 / math.sqrt(3)
    assert d["n"] == 3 and d["mean"] == pytest.approx(5.0) and d["std"] == pytest.approx(1.0)
    assert (d["ci_low"], d["ci_high"]) == pytest.approx((5.0 - half, 5.0 + half))
    assert bench_pretrain.verdict(d) == "worse (CI above 0)"
    assert bench_pretrain.verdict(bench_pretrain.paired_difference([1.0, 3.0], [2.0, 2.0])) == (
        "within noise (CI spans 0)"
    )


def test_unigram_entropy_and_curve_interpolation():
    assert bench_pretrain.unigram_entropy([[0, 1, 2, 3], [0, 1, 2, 3]]) == pytest.approx(math.log(4))
    assert bench_pretrain.unigram_entropy([[5, 5, 5]]) == 0.0
    curve = [(0, 4.0), (10, 3.0), (20, 2.5)]
    assert bench_pretrain.loss_at_step(curve, 5) == pytest.approx(3.5)
    assert bench_pretrain.loss_at_step(curve, 15) == pytest.approx(2.75)
    assert bench_pretrain.loss_at_step(curve, 30) == 2.5  # clamped to the measured range


def test_delta_models_start_from_the_baselines_weights():
    """The pairing: at one seed every variant's GPT-2 weights are the baseline's initial weights."""
    preset = bench_pretrain.Preset(vocab_size=50, n_layer=1, n_embd=16, n_head=2, block_size=16)
    gpt2 = bench_pretrain.build_models(preset, 50, "gpt2", seed=3).state_dict()
    for variant in ("paper_dv4_tc", "delta_net"):
        model = bench_pretrain.build_models(preset, 50, variant, seed=3).state_dict()
        shared = [name for name in model if name in gpt2]
        assert len(shared) >= 10 and all(torch.equal(model[name], gpt2[name]) for name in shared)


def test_toy_study_writes_every_output(tmp_path):
    """Two variants, two seeds plus one extra seed for the baseline and the best, in this process (workers 0)."""
    threads = torch.get_num_threads()
    small = [
        "vocab_size=300",
        "n_layer=1",
        "n_embd=16",
        "n_head=2",
        "block_size=32",
        "batch_size=2",
        "eval_every=2",
        "curve_eval_blocks=4",
        "final_eval_blocks=8",
        "train_corpus=shakespeare-eval",
        "eval_corpus=shakespeare-eval",
    ]
    argv = ["--variants", "gpt2", "paper_dv1", "--seeds", "2", "--extra-seeds", "1", "--steps", "4", "--workers", "0"]
    argv += ["--cache-dir", str(tmp_path / "cache"), "--output-dir", str(tmp_path / "out"), "--name", "toy"]
    try:
        results = bench_pretrain.main([*argv, "--set", *small])
        partial = bench_pretrain.main([*argv, "--report-only", "--name", "partial", "--set", *small])
    finally:
        torch.set_num_threads(threads)
    assert results["best_variant"] == "paper_dv1"
    assert results["runs_done"] == results["runs_planned"] == 6
    assert partial["analysis"] == results["analysis"]  # --report-only rebuilds the same report from the runs
    rows = results["analysis"]["variants"]
    assert rows["gpt2"]["seeds"] == [0, 1, 2] and rows["paper_dv1"]["seeds"] == [0, 1, 2]
    runs = results["runs"]
    diffs = [runs["paper_dv1"][s]["final_valid_loss"] - runs["gpt2"][s]["final_valid_loss"] for s in (0, 1, 2)]
    assert rows["paper_dv1"]["equal_steps"]["mean"] == pytest.approx(sum(diffs) / 3)
    assert [step for step, _ in runs["gpt2"][0]["curve"]] == [0, 2, 4]
    regimes = rows["paper_dv1"]["beta_regimes"]
    assert set(regimes) == {"L0.attn", "L0.mlp"}
    assert all(sum(r[k] for k in ("keep", "project", "reflect")) == pytest.approx(1.0) for r in regimes.values())
    saved = json.loads((tmp_path / "out" / "toy.json").read_text())
    assert saved["provenance"]["command"].endswith("--name toy --set " + " ".join(small))
    assert (tmp_path / "out" / "toy.md").read_text().count("| paper d_v=1 |") == 1
    assert (tmp_path / "out" / "toy.png").stat().st_size > 10_000
    # The kept baseline is a base for the fine-tuning study.
    folder = next((tmp_path / "cache").iterdir())
    base, tokenizer = bench_finetune.load_base(folder / "runs" / "gpt2-seed0")
    assert base.config.n_layer == 1 and len(tokenizer) == base.config.vocab_size


def test_shut_gate_control_is_gpt2_reading_a_convolved_stream():
    """gpt2_tc: beta is 0 for every input and stays 0 under training; with identity convolutions it is GPT-2."""
    preset = bench_pretrain.Preset(vocab_size=50, n_layer=2, n_embd=16, n_head=2, block_size=16)
    gpt2 = bench_pretrain.build_models(preset, 50, "gpt2", seed=1).eval()
    control = bench_pretrain.build_models(preset, 50, "gpt2_tc", seed=1)
    assert set(control.beta_upper_bounds().values()) == {0.0}
    convs = {name: m for name, m in control.named_modules() if type(m).__name__ == "DeltaStateConv"}
    assert len(convs) == 5  # the attention and MLP reads of both layers, and the final read
    ids = torch.randint(0, 50, (2, 12))
    before = {name: m.weight.detach().clone() for name, m in convs.items()}
    optimizer = torch.optim.AdamW([p for p in control.parameters() if p.requires_grad], lr=1e-2)
    control.train()
    control(ids, labels=ids).loss.backward()
    optimizer.step()
    assert set(control.beta_upper_bounds().values()) == {0.0}  # the gate stayed shut
    assert all(not torch.equal(m.weight, before[name]) for name, m in convs.items())  # the convolutions learn
    with torch.no_grad():
        for m in convs.values():
            m.weight.copy_(m.identity())
    control.eval()
    with torch.no_grad():
        # Only the convolutions and the (inert) Delta weights changed: reset GPT-2's weights to compare.
        control.load_state_dict(gpt2.state_dict(), strict=False)
        torch.testing.assert_close(control(ids).logits, gpt2(ids).logits, rtol=1e-5, atol=1e-5)


def test_contrasts_are_paired_differences_between_variants():
    def run(loss: float) -> dict:
        return {"final_valid_loss": loss, "step_cpu_seconds": 1.0, "params": 1, "curve": [(0, 5.0), (10, loss)]}

    def delta_run(loss: float) -> dict:
        return run(loss) | {"beta_regimes": {"L0.attn": {"keep": 1.0, "project": 0.0, "reflect": 0.0, "mean": 0.0}}}

    runs = {
        "gpt2": {s: run(3.0 + s) for s in range(3)},
        "gpt2_tc": {s: delta_run(2.0 + s) for s in range(3)},
        "additive_dv1_tc": {s: delta_run(1.9 + s + 0.01 * s) for s in range(3)},
    }
    analysis = bench_pretrain.analyse(runs, {})
    assert set(analysis["contrasts"]) == {"additive_dv1_tc - gpt2_tc"}  # pairs with both sides only
    contrast = analysis["contrasts"]["additive_dv1_tc - gpt2_tc"]["equal_steps"]
    assert contrast["mean"] == pytest.approx(statistics.fmean([-0.1, -0.09, -0.08]))
    assert analysis["variants"]["gpt2_tc"]["equal_steps"]["mean"] == pytest.approx(-1.0)


def test_identity_initialised_convolution_control_starts_as_gpt2():
    preset = bench_pretrain.Preset(vocab_size=50, n_layer=2, n_embd=16, n_head=2, block_size=16)
    gpt2 = bench_pretrain.build_models(preset, 50, "gpt2", seed=2).eval()
    control = bench_pretrain.build_models(preset, 50, "gpt2_tc_id", seed=2).eval()
    assert set(control.beta_upper_bounds().values()) == {0.0}
    ids = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        assert torch.equal(control(ids).logits, gpt2(ids).logits)


def test_preset_key_ignores_the_number_of_seeds_only():
    """More seeds reuse the runs already made; anything that changes what a run computes starts a new folder."""
    base = bench_pretrain.Preset()
    assert bench_pretrain.Preset(seeds=7, extra_seeds=0).key() == base.key()
    assert bench_pretrain.Preset(steps=901).key() != base.key()
    assert bench_pretrain.Preset(learning_rate=1e-3).key() != base.key()


def test_llama_arch_pairs_delta_llama_with_the_reference_backbone(tmp_path):
    """--arch llama: the baseline is transformers' Qwen3 layer (RoPE, RMSNorm, SwiGLU, QK-norm); every DeltaLlama
    variant starts from its weights, the identity-initialised control computes it exactly, and the whole study runs."""
    preset = bench_pretrain.Preset(vocab_size=50, n_layer=2, n_embd=16, n_head=2, block_size=16, arch="llama")
    base = bench_pretrain.build_models(preset, 50, "gpt2", seed=4).eval()
    assert type(base).__name__ == "Qwen3ForCausalLM" and hasattr(base.model.layers[0].self_attn, "q_norm")
    ids = torch.randint(0, 50, (2, 12))
    for variant in ("paper_dv4_tc", "gpt2_tc_id"):
        model = bench_pretrain.build_models(preset, 50, variant, seed=4).eval()
        assert type(model).__name__ == "DeltaLlamaForCausalLM" and model.config.source_model_type == "qwen3"
        shared = [n for n in model.state_dict() if n in base.state_dict()]
        assert len(shared) >= 20 and all(torch.equal(model.state_dict()[n], base.state_dict()[n]) for n in shared)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, base(ids).logits)  # gpt2_tc_id: gates shut, identity convolutions

    with pytest.raises(SystemExit, match="no DeltaNet token mixer"):
        bench_pretrain.main(["--arch", "llama", "--variants", "gpt2", "delta_net", "--report-only"])
    threads = torch.get_num_threads()
    small = ["vocab_size=300", "n_layer=1", "n_embd=16", "n_head=2", "block_size=32", "batch_size=2", "eval_every=2"]
    small += ["curve_eval_blocks=4", "final_eval_blocks=8", "train_corpus=shakespeare-eval"]
    argv = ["--arch", "llama", "--variants", "gpt2", "additive_dv1", "--seeds", "2", "--extra-seeds", "0"]
    argv += ["--steps", "2", "--workers", "0", "--cache-dir", str(tmp_path), "--output-dir", str(tmp_path)]
    try:
        results = bench_pretrain.main([*argv, "--name", "toy", "--set", *small, "eval_corpus=shakespeare-eval"])
    finally:
        torch.set_num_threads(threads)
    assert results["preset"]["arch"] == "llama" and results["runs_done"] == 4
    assert results["analysis"]["variants"]["gpt2"]["label"] == "Llama-style (baseline)"
    report = (tmp_path / "toy.md").read_text()
    assert report.startswith("# From scratch: Llama-style vs DeltaLlama") and "GPT-2" not in report
    assert set(results["analysis"]["variants"]["additive_dv1"]["beta_regimes"]) == {"L0.attn", "L0.mlp"}
