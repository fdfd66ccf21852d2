"""The one place that builds tiny GPT-2 / DeltaGPT and Llama-family / DeltaLlama configs and models for the tests
(no downloads).

One GPT-2 config builder and one DeltaGPT config builder; every test size is either keyword overrides at the call
site or one of the named presets below, passed positionally: `delta_config(DELTA_NET, delta_net_rule="write_only")`.
Later presets and then the keyword overrides win. The model builders take the same arguments (or a ready `config=`)
and seed torch's global generator first, so a test that draws random inputs afterwards sees the same numbers.

Import it as `from tests.builders import ...` (the repository root is on sys.path: pytest's `pythonpath`).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

import ddl_hf
from ddl_lab.builders import LLAMA_TINY, open_gates  # the lab's, shared with the tests
from tests.data.ddl_hf_0_1.legacy_run import TINY  # the default tiny GPT-2 (below)

if TYPE_CHECKING:
    from transformers.trainer_utils import TrainOutput

#: The default tiny GPT-2, `TINY` (2 layers, 32 wide, 4 heads, context 64, vocabulary 97; dropout off so runs are
#: deterministic), is the one the 0.1 fixtures were made with: that record, frozen, is its one home.
VOCAB = TINY["vocab_size"]

#: The byte-level GPT-2 of `gpt2_fixtures` (token id = byte, 256 = <|endoftext|>, no pad token), context 128, 2 heads.
BYTE_LEVEL = dict(vocab_size=257, n_positions=128, n_head=2, bos_token_id=256, eos_token_id=256, pad_token_id=None)
#: The same tokenizer's fields for a Llama-family config (over LLAMA_TINY): its vocabulary and end token, context 128.
BYTE_LEVEL_LLAMA = dict(vocab_size=257, max_position_embeddings=128, bos_token_id=256, eos_token_id=256)

#: A DeltaNet token mixer with several chunks at test lengths and open Delta residuals (so the DeltaNet output
#: matters everywhere). No special tokens: generate never stops early, and the tests pass pad_token_id themselves.
DELTA_NET = dict(
    vocab_size=61,
    n_positions=96,
    token_mixer="delta_net",
    delta_net_chunk_size=8,
    delta_beta_init=0.5,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

#: Paper mode with an expanded state (d_v = 4): the base of most variants below.
PAPER_DV4 = dict(delta_mode="paper", delta_value_channels=4)

#: One tiny model per kind of code path a tool can trip on: both modes at d_v 1 and 4, the DeltaNet mixer,
#: and the paper's read / expand variants (TC at d_v 1, TC + EC and CC at d_v 4). Ids are the keys.
CLIENT_VARIANTS: dict[str, dict[str, Any]] = {
    "additive-dv1": dict(),
    "paper-dv1": dict(delta_mode="paper"),
    "additive-dv4": dict(delta_value_channels=4),
    "paper-dv4": PAPER_DV4,
    "delta_net-dv1": dict(token_mixer="delta_net", delta_net_chunk_size=4),
    "delta_net-paper-dv4": dict(PAPER_DV4, token_mixer="delta_net", delta_net_chunk_size=4),
    "tc-dv1": dict(delta_state_read="temporal_conv"),
    "tc-ec-paper-dv4": dict(PAPER_DV4, delta_state_read="temporal_conv", delta_embed_expand="conv"),
    "cc-dv4": dict(delta_value_channels=4, delta_state_read="channel_conv"),
    # The authors' configuration (DeltaGPTConfig.reference("tc")): their value branch, one read per block.
    "reference-tc-dv4": dict(
        PAPER_DV4, delta_state_read="temporal_conv", delta_value="sigmoid", delta_shared_read=True
    ),
}

#: Shapes of the GPT-2 family: (n_layer, n_head, n_embd) of the real checkpoints.
GPT2_FAMILY = {
    "distilgpt2": (6, 12, 768),
    "gpt2": (12, 12, 768),
    "gpt2-medium": (24, 16, 1024),
    "gpt2-large": (36, 20, 1280),
    "gpt2-xl": (48, 25, 1600),
}


def _fields(presets: tuple[Mapping[str, Any], ...], overrides: dict[str, Any]) -> dict[str, Any]:
    fields = dict(TINY)
    for preset in presets:
        fields.update(preset)
    fields.update(overrides)
    return fields


def gpt2_config(*presets: Mapping[str, Any], **overrides) -> GPT2Config:
    """`TINY`, then each preset, then the overrides."""
    return GPT2Config(**_fields(presets, overrides))


def delta_config(*presets: Mapping[str, Any], **overrides) -> ddl_hf.DeltaGPTConfig:
    """The same fields as `gpt2_config` plus any DeltaGPT field (defaults: additive mode, beta = 0, attention)."""
    return ddl_hf.DeltaGPTConfig(**_fields(presets, overrides))


def family_config(name: str, head_dim: int = 4) -> GPT2Config:
    """The real member's depth and head count; width = n_head * head_dim, byte-level vocab (257) and context 128.

    Reduced from the real widths (768..1600), vocabulary (50257) and context (1024) so that all five members, twice
    (d_v = 1 and 4), fit the CI budget; depth and head count, the structure the conversion walks, are the real ones.
    initializer_range 0.1 (GPT-2 uses 0.02) makes the random logits far from uniform, so equality is a real test.
    """
    n_layer, n_head, _ = GPT2_FAMILY[name]
    return gpt2_config(BYTE_LEVEL, n_layer=n_layer, n_head=n_head, n_embd=n_head * head_dim, initializer_range=0.1)


def gpt2_model(
    *presets: Mapping[str, Any],
    config: GPT2Config | None = None,
    seed: int = 0,
    random_constants: bool = False,
    **overrides,
) -> GPT2LMHeadModel:
    """A GPT2LMHeadModel in eval mode, built right after `torch.manual_seed(seed)` from `config` or the arguments.

    `random_constants=True` adds noise to the biases and LayerNorms, which GPT-2 initialises to constants, so that
    equivalence tests see every weight (drawn from the global generator right after the weights).
    """
    if config is None:
        config = gpt2_config(*presets, **overrides)
    elif presets or overrides:
        raise TypeError("gpt2_model: pass either config= or presets/overrides, not both")
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config).eval()
    if random_constants:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "bias" in name or "ln" in name:
                    param.add_(0.1 * torch.randn_like(param))
    return model


def delta_model(
    *presets: Mapping[str, Any], config: ddl_hf.DeltaGPTConfig | None = None, seed: int = 0, **overrides
) -> ddl_hf.DeltaGPTForCausalLM:
    """A DeltaGPTForCausalLM in eval mode, built right after `torch.manual_seed(seed)`."""
    if config is None:
        config = delta_config(*presets, **overrides)
    elif presets or overrides:
        raise TypeError("delta_model: pass either config= or presets/overrides, not both")
    torch.manual_seed(seed)
    return ddl_hf.DeltaGPTForCausalLM(config).eval()


def variant_model(seed: int = 0, **overrides) -> ddl_hf.DeltaGPTForCausalLM:
    """A DeltaGPT of the variant `overrides` with open gates and random convolution weights: every part of the
    variant acts on the output."""
    from ddl_hf.delta_reads import DeltaEmbedExpand, DeltaStateConv

    model = delta_model(seed=seed, **overrides)
    open_gates(model, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (DeltaStateConv, DeltaEmbedExpand)):
                module.weight.copy_(0.5 * torch.randn(module.weight.shape, generator=generator))
    return model


def scramble_delta_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """`open_gates`, and random read vectors and convolutions (TC / CC / EC, DeltaNet's short conv), so that every
    Delta parameter moves the logits: a tool that drops or misplaces one of them changes the output."""
    open_gates(model, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "read" in name or "conv" in name or "embed_expand" in name:
                param.copy_(0.5 + 0.5 * torch.randn(param.shape, generator=generator))


def enable_activation_checkpointing(model: torch.nn.Module, **checkpoint_kwargs: Any) -> None:
    """transformers' activation checkpointing under the installed release's name: `activation_checkpointing_enable`
    from transformers 5.23 (which deprecates `gradient_checkpointing_enable`), the old name before."""
    kwargs = checkpoint_kwargs or None
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def train_steps(model: torch.nn.Module, ids: torch.Tensor, output_dir: str | Path, **arguments: Any) -> TrainOutput:
    """transformers' `Trainer` on the rows of `ids` (each its own labels) on the CPU, saving and reporting nothing;
    `arguments`: further TrainingArguments (max_steps, per_device_train_batch_size, ...). What `train()` returns."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    dataset = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = TrainingArguments(output_dir=str(output_dir), use_cpu=True, save_strategy="no", report_to=[], **arguments)
    return Trainer(model=model, args=args, train_dataset=dataset).train()


def word_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the words of `texts` (id 0 = `<|endoftext|>`: BOS, EOS and padding, as GPT-2's),
    for tools that take text and a tokenizer (trl): a vocabulary of tens, so the tiny models stay tiny."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted({word for text in texts for word in text.split()})
    vocab = {"<|endoftext|>": 0, "[UNK]": 1} | {word: i + 2 for i, word in enumerate(words)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    end = "<|endoftext|>"
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=end, eos_token=end, pad_token=end, unk_token="[UNK]"
    )


def inspect_table(model_dir: str | Path, text: str | Path, png: str | Path) -> dict[str, list[str]]:
    """`ddl-hf inspect model_dir --text text --output png`, in this process, of a two-layer model whose blocks are set
    to four regimes: L0.attn keeps (closed), L0.mlp forgets (beta 1), L1.attn anything, L1.mlp reflects (beta =
    2 sigmoid(4) ~ 1.964). It exits 0, its table names those regimes and it draws the heat-map; the table's rows (each
    a row's fields), by block."""
    import contextlib
    import io

    import pytest

    import ddl_hf_cli

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = ddl_hf_cli.main(["inspect", str(model_dir), "--text", str(text), "--output", str(png)])
    assert code == 0
    rows = {line.split()[0]: line.split() for line in stdout.getvalue().splitlines() if line.startswith("L")}
    assert set(rows) == {"L0.attn", "L0.mlp", "L1.attn", "L1.mlp"}
    assert rows["L0.attn"][-1] == "keeps" and float(rows["L0.attn"][1]) == 0.0
    assert rows["L0.mlp"][-1] == "forgets" and float(rows["L0.mlp"][1]) == pytest.approx(1.0, abs=1e-3)
    assert rows["L1.mlp"][-1] == "reflects" and float(rows["L1.mlp"][1]) == pytest.approx(1.964, abs=1e-3)
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return rows


# ---- DeltaLlama: tiny Llama-family sources (transformers' own classes) and their conversions ----------------------

#: Each family with what makes it differ: RoPE scaling (Llama), a sliding window shorter than the test sequences
#: (Mistral everywhere, Qwen2/Qwen3 on their second layer), attention biases (Qwen2), QK-norm (Qwen3, built in).
LLAMA_FAMILIES = {
    "llama": (LlamaConfig, dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})),
    "mistral": (MistralConfig, dict(sliding_window=5)),
    "qwen2": (Qwen2Config, dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)),
    "qwen3": (Qwen3Config, dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)),
}


def build_source(family: str, seed: int = 0, **overrides):
    """A tiny random model of `family`, built by transformers' own class (the independent reference); `overrides`
    replace fields of LLAMA_TINY (e.g. a tokenizer's vocabulary)."""
    config_class, extra = LLAMA_FAMILIES[family]
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config_class(**{**LLAMA_TINY, **extra, **overrides})).eval()


def to_delta(source, **overrides) -> ddl_hf.DeltaLlamaForCausalLM:
    """The source's weights in a DeltaLlamaForCausalLM (the Delta parameters, which the source lacks, start exact)."""
    return ddl_hf.convert_llama(source, **overrides).eval()


def open_llama_gates(model: ddl_hf.DeltaLlamaForCausalLM, seed: int = 1) -> ddl_hf.DeltaLlamaForCausalLM:
    """Random gate weights and openings, so beta differs per token and every Delta term matters."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for residual in model.delta_residuals().values():
            weight = residual.gate_output.weight
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.5)
            residual.beta_open.fill_(0.8)
    return model


def random_ids(batch: int = 2, length: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def delta_net_inputs(batch=2, heads=3, seq_len=37, d_k=8, d_v=5, beta_max=1.0, dtype=torch.float32, seed=0):
    """The delta rule's inputs as the ops take them: unit-norm q, k `[B, H, T, d_k]`, v `[B, H, T, d_v]`, beta in
    (0, beta_max) `[B, H, T]`, a random initial state `[B, H, d_v, d_k]`."""
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(batch, heads, seq_len, d_k, generator=g, dtype=dtype), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(batch, heads, seq_len, d_k, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(batch, heads, seq_len, d_v, generator=g, dtype=dtype)
    beta = beta_max * torch.rand(batch, heads, seq_len, generator=g, dtype=dtype)
    state = torch.randn(batch, heads, d_v, d_k, generator=g, dtype=dtype)
    return q, k, v, beta, state


def delta_rule_inputs(seq_len: int, dtype=torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    """DeltaNet's inputs: unit-norm q, k `[B, H, T, d_k]`, v `[B, H, T, d_v]` (d_v != d_k: a transposed state shows),
    beta in (0, 2) (the negative-eigenvalue range), a random initial state `[B, H, d_v, d_k]`."""
    g = torch.Generator().manual_seed(seed)
    b, h, d_k, d_v = 2, 2, 16, 8
    q, k = (torch.nn.functional.normalize(torch.randn(b, h, seq_len, d_k, generator=g), dim=-1) for _ in range(2))
    return dict(
        q=q.to(dtype),
        k=k.to(dtype),
        v=torch.randn(b, h, seq_len, d_v, generator=g).to(dtype),
        beta=(2 * torch.rand(b, h, seq_len, generator=g)).to(dtype),
        initial_state=torch.randn(b, h, d_v, d_k, generator=g).to(dtype),
    )


#: The documents of `packed_row`: 32 tokens, some shorter than a convolution's window and than a DeltaNet chunk.
DOC_LENGTHS = [5, 11, 1, 3, 12]


def packed_row(seed: int = 0, vocab: int = 61) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random documents of DOC_LENGTHS packed into one row (a padding-free batch): the documents, the row `[1, 32]`,
    its position ids (restarting at each document) and the documents' cumulative lengths (`cu_seq_lens`)."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, vocab, (n,), generator=g) for n in DOC_LENGTHS]
    position_ids = torch.cat([torch.arange(n) for n in DOC_LENGTHS])[None]
    cu_seq_lens = torch.tensor([0, *itertools.accumulate(DOC_LENGTHS)], dtype=torch.int32)
    return docs, torch.cat(docs)[None], position_ids, cu_seq_lens


def llama_model() -> torch.nn.Module:
    """transformers' own LlamaForCausalLM of LLAMA_TINY (seed 0)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**LLAMA_TINY)).eval()


def delta_llama(**overrides) -> ddl_hf.DeltaLlamaForCausalLM:
    """`llama_model()` converted (the Delta parameters start exact)."""
    return ddl_hf.convert_llama(llama_model(), **overrides).eval()


def adapted_modules(model: torch.nn.Module, peft_config) -> list[str]:
    """Names (relative to the base model) of the modules that peft wrapped with an adapter."""
    from peft import get_peft_model

    peft_model = get_peft_model(model, peft_config)
    prefix = "base_model.model."
    return sorted(
        name.removeprefix(prefix)
        for name, module in peft_model.named_modules()
        if hasattr(module, "base_layer") and name.startswith(prefix)
    )
