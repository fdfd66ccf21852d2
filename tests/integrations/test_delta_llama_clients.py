"""DeltaLlama under the tools the GPT-2 path supports: peft's default LoRA targets, `DeltaTrainer` with
`DeltaStatsCallback`, `ddl-hf inspect`, `pipeline("text-generation")` and gradient checkpointing.

Tiny models of each family (2 layers, hidden 32) with a vocabulary of 257: the byte-level GPT-2 tokenizer of
`gpt2_fixtures` (token id = byte value, 256 = <|endoftext|>) is the genuine tokenizer code without a download.
KV cache, left padding, `Trainer` and `output_betas` are covered in `test_delta_llama.py`.
"""

from __future__ import annotations

import pytest
import torch
from peft import IA3Config, LoraConfig, TaskType, get_peft_model
from transformers import pipeline

import ddl_hf
import ddl_hf_cli
from ddl_hf import DeltaLlamaForCausalLM
from ddl_hf.callbacks import DeltaStatsCallback, plot_beta_history
from ddl_hf.training import DeltaTrainer, training_arguments
from tests.builders import LLAMA_FAMILIES as FAMILIES
from tests.builders import adapted_modules, enable_activation_checkpointing, inspect_table
from tests.builders import build_source as build_family_source
from tests.gpt2_fixtures import EOS, byte_tokenizer

#: LLAMA_TINY models with the byte tokenizer's vocabulary (ids 0-256, 256 = <|endoftext|>).
TOKENIZER_FIELDS = dict(vocab_size=EOS + 1, bos_token_id=EOS, eos_token_id=EOS, pad_token_id=None)
BLOCKS = ("L0.attn", "L0.mlp", "L1.attn", "L1.mlp")


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """Tiny models: one intra-op thread is fastest and does not slow down on a busy machine."""


def build_source(family: str, seed: int = 0):
    """A tiny random model of `family`, built by transformers' own class, that the byte tokenizer can drive."""
    return build_family_source(family, seed, **TOKENIZER_FIELDS)


def set_betas(model: DeltaLlamaForCausalLM, seed: int = 1) -> DeltaLlamaForCausalLM:
    """One regime per block: L0.attn keeps (closed), L0.mlp projects (beta 1), L1.attn token-dependent, L1.mlp
    reflects (beta 2 sigmoid(4) ~ 1.964)."""
    generator = torch.Generator().manual_seed(seed)
    blocks = list(model.delta_residuals().values())
    with torch.no_grad():
        for block, (opening, bias) in zip(blocks, [(0.0, 0.0), (1.0, 0.0), (0.5, 0.0), (1.0, 4.0)]):
            block.beta_open.fill_(opening)
            block.gate_output.bias.fill_(bias)
        weight = blocks[2].gate_output.weight
        weight.copy_(torch.randn(weight.shape, generator=generator) * 2.0)
    return model


def random_ids(batch: int = 2, length: int = 10, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, EOS, (batch, length), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------------------------
# peft
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_lora_default_targets_are_the_family_attention_projections(family):
    """`LoraConfig()` without target_modules adapts what it adapts on the family's own model (peft's table), and
    never a Delta residual's own `v_proj`, which a bare `v_proj` would match too."""
    source = build_source(family)
    model = ddl_hf.convert_llama(source)  # before peft wraps the source's modules in place
    assert any(name.endswith("_delta.v_proj") for name, _ in model.named_modules())  # the trap is there
    expected = adapted_modules(source, LoraConfig(task_type=TaskType.CAUSAL_LM))
    assert expected == sorted(f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qv")
    assert adapted_modules(model, LoraConfig(task_type=TaskType.CAUSAL_LM)) == expected


def test_ia3_default_targets_qualify_the_feedforward_projection():
    """IA3 also needs its feed-forward list (`mlp.down_proj`) to be a subset of its targets, by the same names."""
    source = build_source("llama")
    model = ddl_hf.convert_llama(source)  # before peft wraps the source's modules in place
    expected = adapted_modules(source, IA3Config(task_type=TaskType.CAUSAL_LM))
    assert expected == sorted(
        f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj")
    )
    assert adapted_modules(model, IA3Config(task_type=TaskType.CAUSAL_LM)) == expected


def test_lora_step_trains_only_the_adapters_and_merging_keeps_the_function():
    model = set_betas(ddl_hf.convert_llama(build_source("qwen3"), delta_value_channels=4))
    peft_model = get_peft_model(model, LoraConfig(task_type=TaskType.CAUSAL_LM, r=4))
    before = {name: p.detach().clone() for name, p in peft_model.named_parameters()}
    trainable = {name for name, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in name for name in trainable)

    ids = random_ids(4, 10)
    optimizer = torch.optim.SGD([p for p in peft_model.parameters() if p.requires_grad], lr=1.0)
    peft_model.train()
    peft_model(ids, labels=ids).loss.backward()
    optimizer.step()
    changed = {name for name, p in peft_model.named_parameters() if not torch.equal(p.detach(), before[name])}
    assert changed and changed <= trainable  # lora_B only at the first step (lora_A's gradient is B^T ... = 0)

    peft_model.eval()
    with torch.no_grad():
        adapted = peft_model(ids).logits
        merged = peft_model.merge_and_unload()
        assert type(merged) is DeltaLlamaForCausalLM
        assert not any(".lora_" in name for name, _ in merged.named_parameters())
        torch.testing.assert_close(merged(ids).logits, adapted, rtol=1e-5, atol=1e-5)
        fresh = set_betas(ddl_hf.convert_llama(build_source("qwen3"), delta_value_channels=4)).eval()
        assert (fresh(ids).logits - adapted).abs().max() > 1e-3  # the adapter step mattered


# ----------------------------------------------------------------------------------------------------------------
# DeltaTrainer + DeltaStatsCallback
# ----------------------------------------------------------------------------------------------------------------


def test_delta_trainer_logs_beta_of_every_block_and_groups_exactly_the_delta_parameters(tmp_path):
    model = set_betas(ddl_hf.convert_llama(build_source("mistral"), delta_value_channels=4))
    ids = random_ids(8, 12)
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = training_arguments(
        tmp_path / "run", max_steps=2, logging_steps=1, per_device_train_batch_size=4, learning_rate=1e-3
    )
    trainer = DeltaTrainer(
        model=model, args=args, train_dataset=data, callbacks=[DeltaStatsCallback()], delta_lr_scale=10.0
    )
    trainer.train()

    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 2
    for entry in logged:
        assert {f"beta/{b}/{s}" for b in BLOCKS for s in ("mean", "keep", "project", "reflect")} <= entry.keys()
        assert entry["beta/L0.attn/keep"] == 1.0 and entry["beta/L1.mlp/reflect"] == 1.0
        assert 0.0 < entry["beta_mean"] <= entry["beta_max"] <= 2.0
    assert plot_beta_history(trainer.state.log_history, tmp_path / "history.png")
    assert (tmp_path / "history.png").read_bytes()[:4] == b"\x89PNG"

    # `initial_lr`: the group's learning rate before the scheduler's decay (lr x delta_lr_scale for the Delta group).
    delta_groups = [g for g in trainer.optimizer.param_groups if g["initial_lr"] == pytest.approx(1e-2)]
    assert len(delta_groups) == 1
    delta = {id(p) for p in model.delta_parameters().values()}
    assert {id(p) for p in delta_groups[0]["params"]} == delta
    assert "model.read_out.weights" in model.delta_parameters()  # d_v 4: the model-level read counts as Delta
    others = [p for g in trainer.optimizer.param_groups if g is not delta_groups[0] for p in g["params"]]
    assert len(others) + len(delta) == sum(1 for p in model.parameters() if p.requires_grad)


# ----------------------------------------------------------------------------------------------------------------
# ddl-hf inspect
# ----------------------------------------------------------------------------------------------------------------


def test_inspect_cli_on_a_saved_delta_llama(tmp_path):
    model = set_betas(ddl_hf.convert_llama(build_source("qwen2"))).eval()
    model.save_pretrained(tmp_path / "delta")
    byte_tokenizer().save_pretrained(tmp_path / "delta")
    text = tmp_path / "sample.txt"
    text.write_text("If music be the food of love, play on.\n")
    rows = inspect_table(tmp_path / "delta", text, tmp_path / "betas.png")
    ids = torch.tensor([list(text.read_bytes())])
    with torch.no_grad():
        attn_mean = float(model(ids, output_betas=True).betas[2].mean())
    assert float(rows["L1.attn"][1]) == pytest.approx(attn_mean, abs=1e-3)  # the model's own betas


def test_inspect_without_a_saved_tokenizer_asks_for_one(tmp_path, capsys):
    """GPT-2's tokenizer is the fallback for DeltaGPT only: a Llama-family vocabulary is the checkpoint's own."""
    ddl_hf.convert_llama(build_source("llama")).save_pretrained(tmp_path / "delta")
    (tmp_path / "sample.txt").write_text("hello\n")
    assert ddl_hf_cli.main(["inspect", str(tmp_path / "delta"), "--text", str(tmp_path / "sample.txt")]) == 1
    assert "no tokenizer saved with" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------
# pipeline, gradient checkpointing
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_text_generation_pipeline_equals_the_source_at_beta_zero(family):
    source = build_source(family)
    model = ddl_hf.convert_llama(source).eval()
    tokenizer = byte_tokenizer()
    tokenizer.pad_token, tokenizer.padding_side = tokenizer.eos_token, "left"
    prompts = ["The river runs", "By noon"]  # different lengths: the batch is left-padded
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, batch_size=2, return_tensors=True)
    expected = pipeline("text-generation", model=source, tokenizer=tokenizer)(prompts, **kwargs)
    got = pipeline("text-generation", model=model, tokenizer=tokenizer)(prompts, **kwargs)
    assert got == expected
    assert all(len(out[0]["generated_token_ids"]) > len(prompt) for out, prompt in zip(got, prompts))
    text = pipeline("text-generation", model=model, tokenizer=tokenizer)(prompts[0], max_new_tokens=8, do_sample=False)
    assert text[0]["generated_text"] == tokenizer.decode(got[0][0]["generated_token_ids"])


@pytest.mark.parametrize(
    "overrides",
    [{}, dict(delta_value_channels=4, delta_state_read="temporal_conv", delta_embed_expand="conv")],
    ids=["dv1", "tc-ec-dv4"],
)
def test_gradient_checkpointing_gives_the_same_gradients(overrides):
    """The temporal variants drop their window cache under checkpointing (the recomputed forward must not read a
    window the first pass already filled): the gradients equal those without checkpointing."""
    model = set_betas(ddl_hf.convert_llama(build_source("llama"), **overrides)).train()
    ids = random_ids(2, 10)

    def gradients() -> tuple[float, dict[str, torch.Tensor]]:
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain_loss, plain = gradients()
    enable_activation_checkpointing(model)
    mlp_calls = []
    model.model.layers[0].mlp.register_forward_hook(lambda *_: mlp_calls.append(1))
    loss, checkpointed = gradients()
    assert len(mlp_calls) == 2  # the backward pass recomputed the layer: checkpointing is on
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    assert checkpointed.keys() == plain.keys() and any(name in plain for name in model.delta_parameters())
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-4, atol=1e-6, msg=name)
