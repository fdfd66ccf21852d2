"""ddl_lab/benchmarks/bench_decode_step.py: one cached decoding step, timed against GPT-2 and an A/A twin."""

from __future__ import annotations

import json

import pytest
import torch
from scipy import stats

from ddl_lab.benchmarks import bench_decode_step as bench
from ddl_lab.builders import SHAPES, build_pair


@pytest.mark.parametrize("value_channels", [1, 4])
def test_every_step_decodes_the_same_token_from_the_same_context(value_channels):
    """The step is what generation runs after the prompt, again and again: GPT-2's and DeltaGPT's logits equal those
    of a full forward over the prompt and the token, and the cache is back at the prompt's length after each step."""
    prompt = torch.randint(0, SHAPES["tiny"]["vocab_size"], (1, 7), generator=torch.Generator().manual_seed(2))
    for model in build_pair(SHAPES["tiny"], value_channels, "paper"):
        stepper = bench.Stepper(model, prompt)
        first, second = stepper.step(), stepper.step()
        assert stepper.cache.get_seq_length() == prompt.shape[1]
        with torch.no_grad():
            full = model(torch.cat([prompt, prompt[:, -1:]], dim=1)).logits[:, -1:]
        assert torch.equal(first, second)
        torch.testing.assert_close(first, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("value_channels", [1, 4])
def test_the_static_cache_step_writes_the_same_slot_again(value_channels):
    """The compiled rows' step, eager: a static cache one token longer than the prompt, its write position moved back
    after each step; the logits are the full forward's every time."""
    prompt = torch.randint(0, SHAPES["tiny"]["vocab_size"], (1, 5), generator=torch.Generator().manual_seed(3))
    for model in build_pair(SHAPES["tiny"], value_channels, "additive"):
        stepper = bench.Stepper(model, prompt, static=True)
        first, second = stepper.step(), stepper.step()
        with torch.no_grad():
            full = model(torch.cat([prompt, prompt[:, -1:]], dim=1)).logits[:, -1:]
        assert torch.equal(first, second)
        torch.testing.assert_close(first, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [12, 51, 300])
def test_the_median_interval_is_the_tightest_with_95_percent_coverage(n):
    """Ranks j and n + 1 - j cover the median with probability 1 - 2 P(Binomial(n, 1/2) < j): at least 0.95, and not
    at rank j + 1."""
    low, high = bench.median_interval([float(i) for i in range(1, n + 1)])
    j = int(low)
    assert high == n + 1 - j
    coverage = 1 - 2 * stats.binom.cdf(j - 1, n, 0.5)
    assert coverage >= 0.95 > 1 - 2 * stats.binom.cdf(j, n, 0.5)


@pytest.mark.slow
def test_a_quick_run_writes_every_row_with_its_breakdown_and_provenance(tmp_path):
    bench.main(["--quick", "--variants", "1:additive", "4:paper", "--profile", "--no-native", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "decode_step_quick.json").read_text())
    assert results["provenance"]["command"].startswith("python -m ddl_lab.benchmarks.bench_decode_step --quick")
    assert not results["native"] and results["delta_implementation"] == "eager"
    assert [(r["value_channels"], r["mode"]) for r in results["rows"]] == [(1, "additive"), (4, "paper")]
    for row in results["rows"]:
        assert row["ratio"]["ci_low"] <= row["ratio"]["median"] <= row["ratio"]["ci_high"]
        assert set(row["step_ms"]) == {"gpt2", "twin", "delta"}
        whole, inside, outside = row["ops"][:3]
        assert outside["delta_us"] == pytest.approx(whole["delta_us"] - inside["delta_us"])
    text = (tmp_path / "decode_step_quick.md").read_text()
    assert "| tiny | 4 | paper |" in text and "Where the difference goes" in text


def test_a_variant_is_d_v_and_mode():
    assert bench.parse_variant("4:paper") == (4, "paper")
    with pytest.raises(Exception, match="D_V:MODE"):
        bench.parse_variant("4-paper")


def test_the_without_kernel_copy_runs_the_tensor_ops_and_the_delta_model_its_native_kernels(monkeypatch):
    """`--without-kernel`: the Delta model runs `delta_implementation="native"`, its copy "eager". Counted at the
    native extension: the Delta stepper's steps call its whole-residual step once per residual, the copy's never, and
    both decode the same logits; the copy's setting leaves the Delta model's alone (kernels are chosen per model)."""
    import ddl_hf.native as native

    if native.native_build_problem() is not None:
        pytest.skip(f"the native kernels cannot be built here: {native.native_build_problem()}")
    kernels, calls = native.load_training_kernels(), []

    class Counting:
        def __getattr__(self, name):
            return getattr(kernels, name)

        def residual_step(self, *args):
            calls.append(1)
            return kernels.residual_step(*args)

    monkeypatch.setattr(native, "_kernels", Counting())
    prompt = torch.randint(0, SHAPES["tiny"]["vocab_size"], (1, 5), generator=torch.Generator().manual_seed(4))
    _, delta = build_pair(SHAPES["tiny"], 4, "paper", implementation="native")
    with_kernels, without = bench.Stepper(delta, prompt), bench.without_kernels(delta, prompt)
    assert delta.config.delta_implementation == "native" and without.model.config.delta_implementation == "eager"
    calls.clear()  # the prompts' forwards
    plain = without.step()
    assert calls == []
    torch.testing.assert_close(with_kernels.step(), plain, rtol=1e-5, atol=1e-5)
    assert len(calls) == 2 * delta.config.n_layer  # one per residual: attention and MLP of every layer


@pytest.mark.slow
def test_without_kernel_times_a_tensor_ops_copy_in_the_same_rounds(tmp_path):
    """`--without-kernel` (an op name as before: kernels are chosen per model now, so the copy runs "eager"): the row
    reports both ratios and says which kernels were taken away; compiled, the option is refused."""
    from ddl_hf.native import native_build_problem

    if native_build_problem() is not None:
        pytest.skip(f"the native kernels cannot be built here: {native_build_problem()}")
    results = bench.main(
        ["--quick", "--variants", "4:paper", "--without-kernel", "residual_step", "--out", str(tmp_path)]
    )
    assert results["native"] and results["delta_implementation"] == "native"
    row = results["rows"][0]
    assert row["without_kernel"] == "native" and row["kernel_ratio"]["median"] > 0 and row["without_ratio"]["median"]
    text = (tmp_path / "decode_step_quick.md").read_text()
    assert "| tiny | 4 | paper | `native` |" in text and 'delta_implementation="eager"' in text
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--compiled", "--without-kernel", "--out", str(tmp_path)])
