"""The authors' DDL (github.com/yifanzhang-pro/deep-delta-learning, `model/`): their value branch, initialisation
and one compressor per block, and the preset that assembles their configuration of each model file.

References are independent of the implementation: closed-form float64 expressions of their update, the formulas of
their initialisation, and their parameter-count formulas (docs/variants.md, "The reference preset"). The side-by-side
run against their own modules is `ddl_lab/checks/compare_reference.py` (it needs their code, which CI cannot fetch).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import ddl_hf
from ddl_hf import DeltaGPTConfig, DeltaLlamaConfig, DeltaLlamaForCausalLM
from ddl_hf.delta_layers import REFERENCE_COMMIT, DeltaResidual, spectral_std
from tests.builders import VOCAB, delta_config, delta_model, scramble_delta_weights
from tests.greedy import greedy_reference

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LEGACY = Path(__file__).parents[1] / "data" / "ddl_hf_0_1"
REFERENCE_FILES = ("dv1", "tc", "tc_ec", "cc", "cc_ec")


# ---- the value branch: v = scale * sigmoid(W_v r + b) from the un-normalised read -----------------------------------


@pytest.mark.parametrize("d_v", [1, 4])
@pytest.mark.parametrize("mode", ["paper", "additive"])
@pytest.mark.parametrize("grad", [True, False], ids=["autograd", "no-grad"])
def test_the_sigmoid_value_update_is_the_closed_form_in_float64(d_v, mode, grad):
    """X' = X (+ h 1^T) + beta k (v^T - k^T X), k = h / sqrt(|h|^2 + eps^2), beta = 2 sigmoid(w.c + b) rho,
    v = 2.5 sigmoid(W_v r + b_v) with r the read, not c; under autograd (the update's own backward) and without."""
    config = delta_config(delta_mode=mode, delta_value_channels=d_v, delta_value="sigmoid", delta_value_scale=2.5)
    module = DeltaResidual(config).double()
    g = torch.Generator().manual_seed(d_v)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
        module.beta_open.fill_(0.7)
    state = torch.randn(2, 3, 32, *((d_v,) if d_v > 1 else ()), generator=g, dtype=torch.float64)
    c, h, r = (torch.randn(2, 3, 32, generator=g, dtype=torch.float64) for _ in range(3))
    with torch.set_grad_enabled(grad):
        new_state, beta = module(state, r, c, h)  # X, its read r, c = norm(r), h = sublayer(c)
    assert new_state.requires_grad == grad

    w, b = module.beta_proj.weight[0].detach(), module.beta_proj.bias.detach()
    expected_beta = 2 * torch.sigmoid(c @ w + b) * 0.7
    v = 2.5 * torch.sigmoid(r @ module.v_proj.weight.detach().T + module.v_proj.bias.detach())  # [2, 3, d_v]
    k = h / torch.sqrt((h * h).sum(-1, keepdim=True) + config.delta_eps**2)
    x = state if d_v > 1 else state.unsqueeze(-1)
    expected = x + expected_beta[..., None, None] * k[..., :, None] * (v - (k[..., :, None] * x).sum(-2))[..., None, :]
    if mode == "additive":
        expected = expected + h[..., None]
    torch.testing.assert_close(beta, expected_beta, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(new_state, expected if d_v > 1 else expected[..., 0], rtol=1e-12, atol=1e-12)
    assert v.min() > 0 and v.max() < 2.5


@pytest.mark.parametrize("d_v", [1, 4])
def test_a_conversion_with_the_authors_value_and_shared_reads_computes_gpt2_exactly(d_v):
    """Additive mode at beta = 0 skips the Delta term whatever v is: GPT-2's logits, bit for bit."""
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32)).eval()
    model = ddl_hf.convert_gpt2(
        gpt2, delta_value="sigmoid", delta_value_channels=d_v, delta_shared_read=True, delta_state_read="temporal_conv"
    ).eval()
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, gpt2(ids).logits)


# ---- one compressor per block ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("read", ["linear", "temporal_conv", "channel_conv"])
def test_a_shared_read_is_the_per_residual_read_with_the_mlp_read_tied_to_the_attention_read(read):
    """delta_shared_read=True has no MLP read of its own, and computes what the per-residual model computes when its
    MLP reads carry the attention reads' weights: in a forward, and in cached greedy generation."""
    fields = dict(delta_mode="paper", delta_value_channels=4, delta_state_read=read, delta_value="sigmoid")
    shared = delta_model(delta_shared_read=True, **fields)
    scramble_delta_weights(shared)
    own = delta_model(**fields)
    missing, unexpected = own.load_state_dict(shared.state_dict(), strict=False)
    assert not unexpected and missing and all(".mlp_read." in name for name in missing)
    with torch.no_grad():
        for block in own.transformer.h:
            block.mlp_read.load_state_dict(block.attn_read.state_dict())
    assert not [n for n, _ in shared.named_parameters() if ".mlp_read." in n]
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(shared(ids).logits, own(ids).logits, rtol=0, atol=1e-5)
        generated = greedy_reference(shared, ids[:1, :3], max_new_tokens=6, min_new_tokens=6)
        generated.assert_matches(own.generate(ids[:1, :3], max_new_tokens=6, min_new_tokens=6, do_sample=False)[:, 3:])
        uncached = shared.generate(ids[:1, :3], max_new_tokens=6, min_new_tokens=6, do_sample=False, use_cache=False)
        generated.assert_matches(uncached[:, 3:])


# ---- the initialisation of the reference commit ---------------------------------------------------------------------


def pooled(model, suffix: str) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for n, p in model.named_parameters() if n.endswith(suffix)])


def test_the_reference_init_of_every_delta_parameter_follows_the_formulas():
    """Their `init_gpt_weights` at d1f7621: matrices N(0, spectral_std) with factor 0.5, the gate's bias
    logit(beta0 / 2), v_proj's bias nn.Linear's U(-1/sqrt(D), 1/sqrt(D)), averaging convolutions, read vectors 1/d_v,
    EC the identity; plus our opening rho at 1. Means and spreads within 5 standard errors of the formulas."""
    assert REFERENCE_COMMIT.startswith("d1f7621")
    width, d_v, layers = 256, 4, 4
    torch.manual_seed(0)
    config = DeltaGPTConfig.reference("tc_ec", n_embd=width, n_head=4, n_layer=layers, vocab_size=VOCAB)
    model = ddl_hf.DeltaGPTForCausalLM(config)

    def check_normal(values: torch.Tensor, std: float) -> None:
        n = values.numel()
        assert abs(float(values.mean())) <= 5 * std / math.sqrt(n)
        assert abs(float(values.std()) / std - 1) <= 5 / math.sqrt(2 * n)

    check_normal(pooled(model, "beta_proj.weight"), 0.5 / width)  # [1, D]: 0.5 / sqrt(D) * sqrt(1 / D)
    check_normal(pooled(model, "v_proj.weight"), 0.5 * math.sqrt(d_v) / width)  # [d_v, D]
    bias = pooled(model, "v_proj.bias")
    bound = 1 / math.sqrt(width)
    assert bias.abs().max() <= bound and abs(float(bias.mean())) <= 5 * bound / math.sqrt(3 * bias.numel())
    assert torch.equal(pooled(model, "beta_proj.bias"), torch.zeros(2 * layers))  # logit(1 / 2)
    assert torch.equal(pooled(model, "beta_open"), torch.ones(2 * layers))
    assert torch.equal(pooled(model, "_read.conv.weight"), torch.full((layers * width * d_v * 4,), 0.25))  # shared
    assert torch.equal(pooled(model, "read_out.conv.weight"), torch.full((width * d_v * 4,), 0.25))
    assert torch.equal(
        torch.cat([pooled(model, "_read.weights"), pooled(model, "read_out.weights")]),
        torch.full(((layers + 1) * d_v,), 0.25),
    )
    expand = model.transformer.embed_expand.weight
    assert torch.equal(expand, model.transformer.embed_expand.identity())

    mlp = ddl_hf.DeltaGPTForCausalLM(
        DeltaGPTConfig.reference(
            "dv1", n_embd=width, n_head=4, n_layer=layers, vocab_size=VOCAB, delta_gate="mlp",
            delta_gate_hidden_size=128, delta_beta_init=0.5,
        )
    )  # fmt: skip
    check_normal(pooled(mlp, "beta_proj.0.weight"), spectral_std(width, 128))
    check_normal(pooled(mlp, "beta_proj.2.weight"), spectral_std(128, 1))
    torch.testing.assert_close(pooled(mlp, "beta_proj.2.bias"), torch.full((2 * layers,), math.log(0.25 / 0.75)))
    assert spectral_std(768, 768) == 0.5 / math.sqrt(768) and spectral_std(128, 1) == 0.5 / 128


@pytest.mark.parametrize("variant", REFERENCE_FILES)
def test_the_reference_preset_builds_each_file_and_a_llama_one_initialises_from_meta_alike(variant):
    config = DeltaLlamaConfig.reference(variant, hidden_size=64, num_hidden_layers=2, head_dim=16, vocab_size=VOCAB)
    assert (config.delta_value, config.delta_value_scale, config.delta_eps) == ("sigmoid", 4.0, 1e-5)
    assert config.delta_mode == "paper" and config.delta_init == "reference" and config.delta_beta_init == 1.0
    assert config.delta_shared_read == (variant != "dv1")
    assert config.intermediate_size == 8 * 64 // 3 and config.tie_word_embeddings
    model = DeltaLlamaForCausalLM(config)
    ids = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(3))
    assert torch.isfinite(model(ids, labels=ids).loss)


# ---- the preset's parameter counts against the authors' formulas ----------------------------------------------------


def authors_backbone_parameters(d: int, layers: int, heads: int, head_dim: int, vocab: int) -> int:
    """Their backbone (tied embeddings counted once, as their `get_num_params`): embedding, final norm, and per
    layer q/k/v/o projections, per-head q/k RMSNorms, the SwiGLU of width floor(8 d / 3) and two RMSNorms."""
    attention, ffn = heads * head_dim, 8 * d // 3
    return vocab * d + d + layers * (4 * d * attention + 2 * head_dim + 3 * d * ffn + 2 * d)


def authors_delta_parameters(variant: str, d: int, layers: int, d_v: int = 4) -> int:
    """Their Delta parameters: two residuals per layer (gate w and b; v_proj), and for d_v > 1 one compressor per
    block plus the final readout (TC: a [d d_v, 4] kernel; CC: [d, d_v]; each with a read vector) and EC's
    [d d_v, 4] expansion."""
    dv = 1 if variant == "dv1" else d_v
    residuals = layers * 2 * ((d + 1) + (dv * d + dv))
    if variant == "dv1":
        return residuals
    compressor = (d * dv * 4 if variant.startswith("tc") else d * dv) + dv
    return residuals + (layers + 1) * compressor + (d * dv * 4 if variant.endswith("_ec") else 0)


MEASURED_124M = {"dv1": 123_627_312, "tc": 123_842_476, "tc_ec": 123_854_764, "cc": 123_722_668, "cc_ec": 123_734_956}


@pytest.mark.parametrize("variant", REFERENCE_FILES)
@pytest.mark.parametrize("size", ["124M", "small"])
def test_the_presets_count_the_authors_parameters_plus_one_opening_per_residual(variant, size):
    """At their 124M defaults (the formulas give the counts measured from their code) and a small size: DeltaLlama's
    Qwen3 backbone has their parameters, and its Delta parameters (like DeltaGPT's) are theirs plus rho, one number
    per residual."""
    shape = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=6) if size == "124M" else dict(
        hidden_size=96, num_hidden_layers=3, num_attention_heads=2, head_dim=48, vocab_size=VOCAB
    )  # fmt: skip
    config = DeltaLlamaConfig.reference(variant, **shape)
    d, L = config.hidden_size, config.num_hidden_layers
    with torch.device("meta"):
        model = DeltaLlamaForCausalLM(config)
    theirs = authors_backbone_parameters(d, L, config.num_attention_heads, config.head_dim, config.vocab_size)
    theirs += authors_delta_parameters(variant, d, L)
    assert sum(p.numel() for p in model.parameters()) == theirs + 2 * L
    assert sum(p.numel() for p in model.delta_parameters().values()) == authors_delta_parameters(variant, d, L) + 2 * L
    if size == "124M":
        assert theirs == MEASURED_124M[variant]
    else:
        gpt = ddl_hf.DeltaGPTForCausalLM(DeltaGPTConfig.reference(variant, n_embd=d, n_layer=L, n_head=2))
        assert (
            sum(p.numel() for p in gpt.delta_parameters().values()) == authors_delta_parameters(variant, d, L) + 2 * L
        )


# ---- presets: errors, and configs of the previous release ----------------------------------------------------------


def test_a_wrong_preset_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"reference\(variant='tcc'\): expected one of \('dv1', 'tc'"):
        DeltaGPTConfig.reference("tcc")
    with pytest.raises(ValueError, match="'dv1' is the d_v = 1 file"):
        DeltaGPTConfig.reference("dv1", value_channels=4)
    with pytest.raises(ValueError, match="'dv1' is the d_v = 1 file"):
        DeltaLlamaConfig.reference("tc", value_channels=1)


@pytest.mark.parametrize("family", ["delta_gpt", "delta_llama"])
def test_a_config_saved_by_ddl_hf_0_1_keeps_its_value_branch_and_per_residual_reads(family):
    config_class = DeltaGPTConfig if family == "delta_gpt" else DeltaLlamaConfig
    config = config_class.from_pretrained(LEGACY / family)
    assert "delta_value_scale" not in (LEGACY / family / "config.json").read_text()
    assert config.delta_value == "linear" and config.delta_shared_read is False and config.delta_value_scale == 4.0


# ---- the authors' backbone init, and the study's `--init reference` ------------------------------------------------


def test_the_reference_backbone_init_follows_the_formulas_and_leaves_the_delta_parameters_alone():
    d, layers, heads, head_dim = 192, 3, 3, 64
    config = DeltaLlamaConfig.reference("tc", hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads,
                                        head_dim=head_dim, vocab_size=VOCAB)  # fmt: skip
    torch.manual_seed(0)
    model = DeltaLlamaForCausalLM(config)
    delta = {name: p.detach().clone() for name, p in model.delta_parameters().items()}
    with torch.no_grad():  # so that "norms at one" is a real check
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(3.0)
    ddl_hf.init_reference_backbone(model)
    assert all(torch.equal(p, delta[name]) for name, p in model.delta_parameters().items())
    ffn = 8 * d // 3
    expected = {
        "self_attn.q_proj.weight": spectral_std(d, heads * head_dim),
        "self_attn.k_proj.weight": spectral_std(d, heads * head_dim),
        "mlp.gate_proj.weight": spectral_std(d, ffn),
        "mlp.up_proj.weight": spectral_std(d, ffn),
        "self_attn.o_proj.weight": spectral_std(heads * head_dim, d) / layers,  # writes to the residual: / L
        "mlp.down_proj.weight": spectral_std(ffn, d) / layers,
    }
    for suffix, std in expected.items():
        values = pooled(model, suffix)
        assert abs(float(values.std()) / std - 1) <= 5 / math.sqrt(2 * values.numel()), suffix
    assert abs(float(model.model.embed_tokens.weight.detach().std()) / 0.02 - 1) < 0.05
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(bool((p == 1).all()) for n, p in model.named_parameters() if n.endswith("norm.weight"))


def test_bench_pretrain_init_reference_gives_baseline_and_delta_models_the_authors_backbone():
    from ddl_lab.studies import bench_pretrain

    preset = bench_pretrain.Preset(
        arch="llama", init="reference", n_layer=2, n_embd=64, n_head=2, block_size=16, vocab_size=VOCAB
    )
    baseline = bench_pretrain.build_models(preset, VOCAB, "gpt2", seed=0)
    delta = bench_pretrain.build_models(preset, VOCAB, "paper_dv4_tc", seed=0)
    o_proj = pooled(baseline, "self_attn.o_proj.weight")
    assert abs(float(o_proj.std()) / (spectral_std(64, 64) / 2) - 1) < 0.15
    shared = dict(delta.named_parameters())
    assert all(torch.equal(p, shared[n]) for n, p in baseline.named_parameters())
    with pytest.raises(SystemExit, match=r"'reference' .* needs --arch llama"):
        bench_pretrain.resolve_preset(bench_pretrain.parse_args(["--quick", "--init", "reference"]))
