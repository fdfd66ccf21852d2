"""QLoRA: converted DeltaGPT and DeltaLlama loaded in 4 bits (nf4) and 8 bits through bitsandbytes, on the CPU.

The models list their Delta modules in `_keep_in_fp32_modules` (`DeltaPreTrainedMixin`), so every quantizer leaves
them alone: the gate, opening, value, read and convolution parameters stay plain float32 modules, bit for bit the
saved ones, while the attention and MLP Linears become `Linear4bit` / `Linear8bitLt`. Then: generation, beta before
and after quantization (reported; bounded by what the quantized sublayers do to the gate's input), a LoRA adapter
trained after `prepare_model_for_kbit_training`, the same names under a float16 load, and the example's Trainer path.

Sizes: width 64. On a CPU with AVX512-BF16 (Intel Sapphire Rapids, AMD Zen 4 and later), bitsandbytes (0.50.2,
`backends/cpu/ops.py` and `functional._convert_weight_packed_for_cpu`) repacks a 4-bit weight at its first inference
call for a bf16 kernel that needs every quantized Linear's outputs to be a multiple of 32 (`block_n`) and its inputs
a multiple of the quantization block, 64 (`absmax` becomes `[outputs, inputs // 64]`): width 32 fails there with
"shape '[96, 0]' is invalid". Width 64 with 16-wide heads takes that path and every other CPU's path alike.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import bitsandbytes as bnb
import pytest
import torch
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from peft.tuners.lora import LoraLayer
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

import ddl_hf
from ddl_hf.conversion.verifying import equivalence_tolerance
from ddl_hf.peft_targets import LLAMA_PROJECTION_SUBLAYERS
from tests.builders import build_source, delta_model, gpt2_model, random_ids, to_delta
from tests.builders import open_llama_gates as open_gates
from tests.workflow_utils import load_example, tiny_gpt2_dir

pytestmark = pytest.mark.usefixtures("one_torch_thread")

QUANTIZATION = {
    "nf4": (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"), bnb.nn.Linear4bit),
    "int8": (BitsAndBytesConfig(load_in_8bit=True), bnb.nn.Linear8bitLt),
}
#: The sublayer Linears each model quantizes, per layer; nothing else may be quantized (lm_head is transformers'
#: default skip).
SUBLAYER_LINEARS = {
    "gpt": ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"),
    "delta_net": ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.c_fc", "mlp.c_proj"),
    "llama": tuple(f"{sublayer}.{name}" for name, sublayer in LLAMA_PROJECTION_SUBLAYERS.items()),
}
LORA_TARGETS = {
    "gpt": list(SUBLAYER_LINEARS["gpt"]),
    "llama": list(SUBLAYER_LINEARS["llama"]),  # qualified: a bare `v_proj` would match the Delta residuals' too
}
#: The models' width, and the Llama shape around it: 4 heads of 16 over 2 KV heads (k / v: 32 outputs), MLP 128.
WIDTH = 64
LLAMA_SHAPE = dict(hidden_size=WIDTH, intermediate_size=2 * WIDTH, head_dim=16)
#: A few float32 roundings of beta in [0, 2] and of its logit.
BETA_SLACK = 16 * torch.finfo(torch.float32).eps


def build(kind: str) -> ddl_hf.DeltaGPTForCausalLM | ddl_hf.DeltaLlamaForCausalLM:
    """float32 Delta models with every gate open (beta per token in (0, 1.6)):
    - gpt: a tiny GPT-2 converted (width 64, 2 layers);
    - gpt_variants: the same with the paper's MLP gate, 4 value channels, TC reads and the EC expansion;
    - delta_net: a DeltaGPT with the DeltaNet token mixer, built from its config (nothing to convert from);
    - llama, llama_variants: a tiny Llama converted (`LLAMA_SHAPE`), and with d_v 4 + TC + EC."""
    variants = dict(delta_value_channels=4, delta_state_read="temporal_conv", delta_embed_expand="conv")
    if kind == "gpt":
        model = ddl_hf.convert_gpt2(gpt2_model(n_embd=WIDTH))
    elif kind == "gpt_variants":
        model = ddl_hf.convert_gpt2(gpt2_model(n_embd=WIDTH), delta_gate="mlp", delta_gate_hidden_size=32, **variants)
    elif kind == "delta_net":
        model = delta_model(token_mixer="delta_net", delta_net_chunk_size=4, n_embd=WIDTH)
    elif kind == "llama":
        model = to_delta(build_source("llama", **LLAMA_SHAPE))
    else:
        model = to_delta(build_source("llama", **LLAMA_SHAPE), **variants)
    return open_gates(model.eval())


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """Each kind of model, saved (float32) and kept in memory as the reference."""
    root = tmp_path_factory.mktemp("qlora")
    models = {}
    for kind in ("gpt", "gpt_variants", "delta_net", "llama", "llama_variants"):
        model = build(kind)
        model.save_pretrained(root / kind)
        models[kind] = (root / kind, model)
    return models


def load(directory: Path, quantization: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(directory, quantization_config=QUANTIZATION[quantization][0]).eval()


def family(kind: str) -> str:
    return "delta_net" if kind == "delta_net" else kind.split("_")[0]


def expected_quantized(kind: str, model: torch.nn.Module) -> set[str]:
    prefix = "transformer.h" if family(kind) != "llama" else "model.layers"
    layers = range(model.config.num_hidden_layers)
    return {f"{prefix}.{i}.{name}" for i in layers for name in SUBLAYER_LINEARS[family(kind)]}


@pytest.mark.parametrize("quantization", list(QUANTIZATION))
@pytest.mark.parametrize("kind", ["gpt", "gpt_variants", "delta_net", "llama", "llama_variants"])
def test_delta_modules_stay_full_precision_while_sublayers_quantize(saved, kind, quantization):
    directory, reference = saved[kind]
    model = load(directory, quantization)
    quantized_class = QUANTIZATION[quantization][1]
    quantized = {name for name, module in model.named_modules() if isinstance(module, quantized_class)}
    assert quantized == expected_quantized(kind, model)

    # Every Delta parameter (gates in both forms, openings, values, reads, convolutions) unquantized, float32 and
    # the saved value bit for bit; every Linear inside a Delta residual a plain nn.Linear.
    delta = reference.delta_parameters()
    loaded = dict(model.named_parameters())
    for name, parameter in delta.items():
        assert loaded[name].dtype == torch.float32, name
        torch.testing.assert_close(loaded[name], parameter, rtol=0, atol=0, msg=name)
    for site, residual in model.delta_residuals().items():
        linears = [m for m in residual.modules() if isinstance(m, torch.nn.Linear)]
        assert linears and all(type(m) is torch.nn.Linear for m in linears), site
    if kind == "delta_net":  # DeltaNet's beta projection (4 outputs): kept out of quantization as well
        for layer in model.transformer.h:
            assert type(layer.attn.b_proj) is torch.nn.Linear and layer.attn.b_proj.weight.dtype == torch.float32


@pytest.mark.parametrize("quantization", list(QUANTIZATION))
@pytest.mark.parametrize("kind", ["gpt", "gpt_variants", "delta_net", "llama", "llama_variants"])
def test_generate_after_quantized_loading(saved, kind, quantization):
    directory, _ = saved[kind]
    model = load(directory, quantization)
    ids = random_ids(batch=2, length=8)
    with torch.no_grad():
        logits = model(ids).logits
        generated = model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.isfinite(logits).all()
    assert generated.shape == (2, 13) and torch.equal(generated[:, :8], ids)
    assert torch.equal(generated[:, 8], logits[:, -1].argmax(-1))  # the first new token is the forward's argmax


@pytest.mark.parametrize("quantization", list(QUANTIZATION))
@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_beta_moves_only_through_the_quantized_sublayers(saved, kind, quantization, record_property):
    """beta = 2 sigmoid(g(c)) rho with the float32 gate g kept: quantization moves beta only through the gate's
    input c = norm(x), which the quantized attention / MLP outputs change. Per token, by the mean value theorem
    (sigmoid' <= 1/4): |beta_q - beta| <= rho / 2 |g(c_q) - g(c)|, with g the saved float32 gate. The first residual
    reads the embedding, which nothing quantized has touched yet: its beta is unchanged, bit for bit."""
    directory, reference = saved[kind]
    model = load(directory, quantization)
    ids = random_ids(batch=2, length=12)
    before, c_before = betas_and_gate_inputs(reference, ids)
    after, c_after = betas_and_gate_inputs(model, ids)

    report = {}
    for (name, residual), beta, beta_q in zip(reference.delta_residuals().items(), before, after):
        with torch.no_grad():
            logit_shift = (residual.beta_proj(c_after[name]) - residual.beta_proj(c_before[name])).squeeze(-1).abs()
        bound = residual.opening() / 2 * logit_shift + BETA_SLACK
        moved = (beta_q - beta).abs()
        assert (moved <= bound).all(), (name, float((moved - bound).max()))
        c_error = (c_after[name] - c_before[name]).norm(dim=-1) / c_before[name].norm(dim=-1)
        report[name] = {
            "beta_mean_before": round(float(beta.mean()), 4),
            "beta_mean_after": round(float(beta_q.mean()), 4),
            "max_abs_change": round(float(moved.max()), 4),
            "mean_abs_change": round(float(moved.mean()), 4),
            "bound_max": round(float(bound.max()), 4),
            "gate_input_relative_error": round(float(c_error.mean()), 4),
        }
    first = next(iter(reference.delta_residuals()))
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=0)
    assert report[first]["gate_input_relative_error"] == 0.0

    record_property("beta_before_after", json.dumps(report))
    print(f"\nbeta before -> after {quantization} ({kind}):")
    for name, row in report.items():
        print(f"  {name}: {row}")


def betas_and_gate_inputs(model: torch.nn.Module, ids: torch.Tensor) -> tuple[list[torch.Tensor], dict]:
    """beta of every residual (`output_betas`) and its gate input c (the output of the norm feeding it), float32."""
    gate_inputs, hooks = {}, []
    for site in model.delta_sites():

        def keep(module, args, output, name=site.name):
            gate_inputs[name] = output.detach().float()

        hooks.append(site.norm.register_forward_hook(keep))
    try:
        with torch.no_grad():
            betas = [beta.float() for beta in model(ids, output_betas=True).betas]
    finally:
        for hook in hooks:
            hook.remove()
    return betas, gate_inputs


@pytest.mark.parametrize("quantization", list(QUANTIZATION))
@pytest.mark.parametrize("kind", ["gpt", "llama"])
# peft 0.21's prepare_model_for_kbit_training calls transformers' pre-5.23 name for activation checkpointing.
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
def test_lora_trains_on_the_quantized_model(saved, kind, quantization):
    """prepare_model_for_kbit_training, LoRA on the attention / MLP Linears and the Delta residuals trained in full
    (`modules_to_save`): the loss falls, gradients reach every adapter, the quantized weights do not change."""
    directory, _ = saved[kind]
    # Reentrant checkpointing, transformers' default: the path on which peft makes the embeddings' output need a grad.
    kwargs = {"use_reentrant": True}
    model = prepare_model_for_kbit_training(load(directory, quantization), gradient_checkpointing_kwargs=kwargs)
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=LORA_TARGETS[kind],
        modules_to_save=["attn_delta", "mlp_delta"],
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    trainable = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    assert any(".lora_A." in name for name in trainable) and any("modules_to_save" in name for name in trainable)
    assert not any(".lora_" in name or "modules_to_save" in name for name in frozen)

    ids = random_ids(batch=2, length=12)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = []
    for step in range(5):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if step == 0:  # lora_B starts at 0, so only B (and the Delta copies) have a gradient at the first step
            no_gradient = [
                n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.any())
            ]
            assert not [n for n in no_gradient if ".lora_B." in n or n.endswith("beta_open")], no_gradient
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses

    after = dict(model.named_parameters())
    changed = [name for name, value in frozen.items() if not torch.equal(after[name], value)]
    assert not changed, changed  # the quantized base (and the original Delta copies) untouched
    for name, value in trainable.items():
        if ".lora_" in name or name.endswith("beta_open"):
            assert not torch.equal(after[name], value), f"{name} did not train"
    adapted = [m.base_layer for m in model.modules() if isinstance(m, LoraLayer)]
    assert len(adapted) == len(expected_quantized(kind, model.get_base_model()))
    assert all(isinstance(layer, QUANTIZATION[quantization][1]) for layer in adapted)


@pytest.mark.parametrize("kind", ["gpt_variants", "delta_net", "llama_variants"])
def test_float16_load_keeps_the_delta_modules_in_float32(saved, kind, tmp_path):
    """The same names under `dtype=torch.float16`: the Delta parameters (not the read-out's read vector
    `read_out.weights`, cast where it is used) load in float32, everything else in float16; DeltaNet's beta
    projection follows the model's dtype. bfloat16 loads are unchanged. Saving and reloading round-trips; `.half()`
    and `.to(bfloat16)` cast everything."""
    directory, reference = saved[kind]
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float16).eval()
    in_float32 = {name for name, p in model.named_parameters() if p.dtype == torch.float32}
    expected = {name for name in reference.delta_parameters() if not name.endswith("read_out.weights")}
    assert in_float32 == expected
    assert model.dtype == torch.float16
    ids = random_ids(batch=2, length=12)
    with torch.no_grad():
        reference_logits = reference(ids).logits
        logits = model(ids).logits
    scale = float(reference_logits.abs().max())
    tolerance = equivalence_tolerance(torch.float16, model.config.num_hidden_layers, model.config.hidden_size, scale)
    assert float((logits.float() - reference_logits).abs().max()) <= tolerance

    model.save_pretrained(tmp_path / "fp16")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "fp16").eval()  # dtype "auto": float16 from config
    assert {n for n, p in reloaded.named_parameters() if p.dtype == torch.float32} == expected
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, logits, rtol=0, atol=0)

    bf16 = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval()
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    for cast, dtype in ((lambda m: m.half(), torch.float16), (lambda m: m.to(torch.bfloat16), torch.bfloat16)):
        model = cast(reloaded)
        assert {p.dtype for p in model.parameters()} == {dtype}
        with torch.no_grad():
            assert torch.isfinite(model(ids).logits).all()


@pytest.mark.parametrize("quantization", list(QUANTIZATION))
def test_saved_quantized_model_reloads_with_the_same_modules(saved, quantization, tmp_path):
    directory, _ = saved["llama_variants"]
    model = load(directory, quantization)
    model.save_pretrained(tmp_path / "quantized")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "quantized").eval()
    quantized_class = QUANTIZATION[quantization][1]
    names = {name for name, module in reloaded.named_modules() if isinstance(module, quantized_class)}
    assert names == expected_quantized("llama_variants", reloaded)
    ids = random_ids(batch=2, length=12)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=0)


@pytest.mark.slow
def test_hub_code_without_ddl_hf_keeps_the_delta_modules_too(saved):
    """The declaration travels with the weights (delta_layers.py is one of the Hub files): a fresh process that
    cannot import ddl_hf loads the saved model with trust_remote_code=True in 4 bits with the same modules kept."""
    directory, _ = saved["llama_variants"]
    script = (
        "import sys, torch\n"
        "sys.modules['ddl_hf'] = None  # the editable install would make it importable\n"
        "from transformers import AutoModelForCausalLM, BitsAndBytesConfig\n"
        "import bitsandbytes as bnb\n"
        "bits = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4')\n"
        "model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, quantization_config=bits)\n"
        "assert 'ddl_hf' not in type(model).__module__, type(model).__module__\n"
        "quantized = sorted(n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit))\n"
        "kept = [m for r in model.delta_residuals().values() for m in r.modules() if isinstance(m, torch.nn.Linear)]\n"
        "assert kept and all(type(m) is torch.nn.Linear for m in kept)\n"
        "print('QUANTIZED', ','.join(quantized))\n"
    )
    result = subprocess.run(
        [sys.executable, "-I", "-c", script, str(directory)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    printed = result.stdout.split("QUANTIZED ")[1].split()[0]
    assert set(printed.split(",")) == expected_quantized("llama_variants", saved["llama_variants"][1])


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
def test_example_trains_a_4bit_adapter_with_trainer(tmp_path):
    example = load_example("qlora_finetune")
    result = example.main(["--tiny", "--output-dir", str(tmp_path), "--steps", "3", "--lr", "1e-2"])
    assert len(result["quantized"]) == 8 and len(result["kept"]) == 8  # 2 layers x (4 sublayer / 4 Delta Linears)
    adapter = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= adapter
    assert result["reload_max_abs_diff"] == 0.0
    assert result["eval_loss_after"] < result["eval_loss_before"]
    assert result["generated"].shape[-1] > 0


def test_example_refuses_a_model_that_is_not_a_delta_model(tmp_path):
    example = load_example("qlora_finetune")
    with pytest.raises(SystemExit, match="not a converted Delta model"):
        example.main(["--delta", str(tiny_gpt2_dir(tmp_path / "gpt2")), "--output-dir", str(tmp_path / "out")])
