"""ddl-hf's native vLLM route serves every variant exactly, TC and EC included (docs/serving.md).

With ddl-hf installed, its `vllm.general_plugins` entry point registers DeltaLlama and DeltaGPT as vLLM models
(`ddl_hf.vllm_models`): vLLM's own layers of the source family around the Delta modules, each TC / EC window a vLLM
state layer, one window per running sequence. The reference is `model.generate` of the same model in transformers
(greedy, each prompt alone), computed in this process; vLLM runs in a process of its own (`vllm_worker.py`), which
loads the plugin as a server does.

For TC and CC + EC DeltaLlama (the four families between them) and TC (+ EC) DeltaGPT at d_v = 4, gates open and
convolutions away from the identity: vLLM's greedy tokens equal generate's for prompts of different lengths in one
batch and for each prompt alone (one request after another, so state blocks are reused), eager and compiled
(`torch.compile`, vLLM's default), and with chunked prefill (chunks of 16 tokens: a prompt continues from its window)
and prefix caching (a prompt that shares a 40-token prefix with an earlier one starts from cached state). Two
deliberately wrong windows (every tap one token further back; a new sequence that keeps its block's old window)
must fail the same comparison, and the route taken is the native one.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

import ddl_hf
from tests.gpt2_fixtures import EOS
from tests.vllm_serving import (
    EXACT,
    LLAMA_SIZE,
    NEW_TOKENS,
    PROMPTS,
    build,
    check_completions,
    needs_vllm,
    run_worker,
    save,
    saved_cases,
    serving,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TC = dict(delta_value_channels=4, delta_state_read="temporal_conv")
#: id -> (source family, conversion overrides): TC and CC + EC over the four Llama families, TC (+ EC) for DeltaGPT.
NATIVE = {
    "llama-paper-dv4-tc": ("llama", dict(delta_mode="paper", **TC)),
    "qwen3-paper-dv4-cc-ec": (
        "qwen3",
        dict(delta_mode="paper", delta_value_channels=4, delta_state_read="channel_conv", delta_embed_expand="conv"),
    ),
    "mistral-additive-dv4-tc-ec-sigmoid": ("mistral", dict(delta_embed_expand="conv", delta_value="sigmoid", **TC)),
    "qwen2-additive-dv4-tc-shared-read": ("qwen2", dict(delta_shared_read=True, **TC)),
    "gpt2-paper-dv4-tc": ("gpt2", dict(delta_mode="paper", **TC)),
    "gpt2-additive-dv4-tc-ec": ("gpt2", dict(delta_embed_expand="conv", **TC)),
}
#: The issue's three: compiled too (vLLM's default mode, which compiles the backbone with its windows as custom ops).
COMPILED = ["llama-paper-dv4-tc", "qwen3-paper-dv4-cc-ec", "gpt2-paper-dv4-tc"]
#: Two prompts that share their first 40 tokens (prefix caching), besides the tests' four of 3 to 21 tokens.
SHARED = torch.randint(0, EOS, (40,), generator=torch.Generator().manual_seed(40)).tolist()
LONG = [[*SHARED, 7, 8, 9, 10, 11], [*SHARED, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
ALL_PROMPTS = PROMPTS + LONG
#: vLLM's own choice of implementation (ddl-hf's registered model when the plugin is loaded), without remote code:
#: ddl-hf's config classes read the config.
NATIVE_ENGINE = dict(model_impl="auto", trust_remote_code=False)
#: Chunks of at most 16 tokens (the long prompts continue from their windows) and prefix caching, in blocks of 32
#: (vLLM's CPU attention takes multiples of 32).
CHUNKED_AND_CACHED = dict(
    NATIVE_ENGINE, enable_chunked_prefill=True, max_num_batched_tokens=16, enable_prefix_caching=True, block_size=32
)


@pytest.fixture(scope="module")
def native_cases(tmp_path_factory) -> dict[str, dict]:
    """Every model saved, with generate's tokens for each prompt alone."""
    specs = [(case, family, overrides, True) for case, (family, overrides) in NATIVE.items()]
    return saved_cases(specs, tmp_path_factory, ALL_PROMPTS, first_seed=100)


def job(directory, engine: dict, mutant: str | None = None) -> dict:
    return dict(
        model=str(directory), prompts=ALL_PROMPTS, max_tokens=NEW_TOKENS, alone=True, engine=engine, mutant=mutant
    )


#: (case, mode) of every engine the tests start, and the mutants (on the Llama TC model).
RUNS = [(case, "eager") for case in NATIVE] + [(case, "chunked+cached") for case in NATIVE]
RUNS += [(case, "compiled") for case in COMPILED]
#: mutant -> the engine it runs in: the one whose schedule reaches the broken path (a reused state block in any
#: engine; a continued chunk or a prefix-cache hit only with chunked prefill and prefix caching).
MUTANTS = {"shifted": "eager", "not_reset": "eager", "no_initial_state": "chunked+cached"}
ENGINES = {
    "eager": NATIVE_ENGINE,
    "chunked+cached": CHUNKED_AND_CACHED,
    "compiled": dict(NATIVE_ENGINE, enforce_eager=False),
}


@pytest.fixture(scope="module")
def native_served(native_cases, tmp_path_factory) -> dict:
    """vLLM's tokens for every run and mutant, from one worker process per mutant (a mutant patches the module)."""
    jobs = [job(native_cases[case]["directory"], ENGINES[mode]) for case, mode in RUNS]
    results = run_worker(jobs, tmp_path_factory.mktemp("vllm-native"), native=True)
    served = dict(zip(RUNS, results["results"]))
    for mutant, mode in MUTANTS.items():
        directory = native_cases["llama-paper-dv4-tc"]["directory"]
        mutant_job = job(directory, ENGINES[mode], mutant)
        mutated = run_worker([mutant_job], tmp_path_factory.mktemp(mutant), native=True)
        served[mutant] = mutated["results"][0]
    return served


def agreement(got: list[list[int]], expected: list[list[int]]) -> list[str]:
    return [
        f"{len(prompt)}-token prompt: {sum(a == b for a, b in zip(g, e))}/{len(e)} equal"
        for prompt, g, e in zip(ALL_PROMPTS, got, expected)
    ]


@needs_vllm
@pytest.mark.parametrize(("case", "mode"), RUNS, ids=[f"{case}-{mode}" for case, mode in RUNS])
def test_native_vllm_greedy_tokens_equal_generate(case, mode, native_cases, native_served):
    result, reference = native_served[(case, mode)], native_cases[case]["reference"]
    assert "error" not in result, f"vLLM could not serve {case} ({mode}): {result['error']}"
    expected = "VllmDeltaGPTForCausalLM" if case.startswith("gpt2") else "VllmDeltaLlamaForCausalLM"
    assert result["model_class"] == f"ddl_hf.vllm_models.{expected}", "not ddl-hf's native route"
    assert result["tokens"] == reference, f"batched: {agreement(result['tokens'], reference)}"
    assert result["alone"] == reference, f"one request at a time: {agreement(result['alone'], reference)}"
    if mode == "chunked+cached":
        # The second long prompt, alone after the first, starts from the cached state of their shared blocks.
        # Alone, each long prompt starts from the cached state of its first block of 32 (computed in the batch).
        hits = result["alone_cached"][len(PROMPTS) :]
        assert all(hit >= 32 for hit in hits), f"prefix-cache hits of the long prompts, alone: {hits}"


@pytest.fixture(scope="module")
def stateless_cases(tmp_path_factory) -> dict[str, dict]:
    """test_vllm.py's variants without state across tokens (which the Transformers backend serves), as it saves them."""
    return saved_cases([(case, *spec, False) for case, spec in EXACT.items()], tmp_path_factory)


@pytest.fixture(scope="module")
def stateless_served(stateless_cases, tmp_path_factory) -> dict[str, dict]:
    """vLLM's tokens on the native route for each of them."""
    directories = [str(stateless_cases[name]["directory"]) for name in EXACT]
    jobs = [dict(model=d, prompts=PROMPTS, max_tokens=NEW_TOKENS, engine=NATIVE_ENGINE) for d in directories]
    results = run_worker(jobs, tmp_path_factory.mktemp("vllm-native-stateless"), native=True)
    return dict(zip(EXACT, results["results"]))


@needs_vllm
@pytest.mark.parametrize("case", list(EXACT))
def test_native_route_serves_the_stateless_variants_exactly(case, stateless_cases, stateless_served):
    """With ddl-hf installed, the variants the Transformers backend serves take the native route, exactly as well."""
    result, reference = stateless_served[case], stateless_cases[case]["reference"]
    assert "error" not in result, f"vLLM could not serve {case}: {result['error']}"
    assert result["model_class"].startswith("ddl_hf.vllm_models."), result["model_class"]
    assert result["tokens"] == reference, agreement(result["tokens"], reference)


@needs_vllm
@pytest.mark.parametrize("mutant", MUTANTS)
def test_a_wrong_window_fails_the_comparison(mutant, native_cases, native_served):
    """The comparison above sees the windows: one shifted by a token, one not reset for a new sequence (seen once a
    state block is reused: the requests one at a time), one that restarts a continued chunk or a prefix-cache hit from
    zeros (seen with chunked prefill and prefix caching) each change the tokens."""
    result, reference = native_served[mutant], native_cases["llama-paper-dv4-tc"]["reference"]
    assert "error" not in result, result["error"]
    assert result["tokens"] + result["alone"] != reference + reference


@needs_vllm
def test_delta_net_is_refused_on_the_native_route_with_one_line(tmp_path):
    """The DeltaNet mixer (a matrix state per layer) is refused while vLLM builds the model, by a line that names it
    and the route that serves it (transformers)."""
    model = build("gpt2", dict(token_mixer="delta_net"), seed=7)
    directory = save(model, tmp_path / "delta-net")
    result = run_worker([job(directory, NATIVE_ENGINE)], tmp_path, native=True)["results"][0]
    message = result.get("error", "")
    assert "\n" not in message and "token_mixer='delta_net'" in message, message
    assert "generate with transformers" in message, message


@needs_vllm
def test_vllm_serve_answers_with_generates_tokens_for_a_tc_model(native_cases, tmp_path):
    """`vllm serve dir` as a user with ddl-hf installed runs it: no `--model-impl`, vLLM's default (compiled) mode,
    the OpenAI-compatible server on localhost. A TC model, refused by the Transformers backend, answers a completion
    request of three text prompts with generate's tokens."""
    case, log = native_cases["llama-paper-dv4-tc"], tmp_path / "server.log"
    with serving(case["directory"], log, native=True) as process:
        check_completions(process.url, case["directory"], case["model"])
    assert "ddl-hf: serving DeltaLlamaForCausalLM natively" in log.read_text()


@needs_vllm
@pytest.mark.parametrize("size", [2, 3, 4, 6])
@pytest.mark.parametrize("dim_first", [False, True], ids=["SD", "DS"])
@pytest.mark.parametrize("indices_2d", [False, True], ids=["1d", "2d"])
def test_window_exchange_equals_a_recurrent_reference(size, dim_first, indices_2d):
    """`DeltaWindow.exchange` against its definition, one sequence at a time, over 40 random steps of the kinds vLLM
    schedules: decode rows first (padding rows naming the null block 0), then prefill chunks of 1 to 7 tokens of new
    and continued sequences; state blocks reused and left full of NaN; the state in either of vLLM's layouts, indices
    1-D or one column per speculative token. Each token gets its sequence's K - 1 inputs before it (zeros before its
    start), exactly."""
    from ddl_hf.vllm_windows import DeltaWindow

    rng, width, blocks = random.Random(size), 5, 10
    storage = torch.full((blocks, width + 2, size - 1) if dim_first else (blocks, size - 1, width + 2), float("nan"))
    window = SimpleNamespace(size=size, windows=lambda: storage.transpose(-1, -2) if dim_first else storage)
    history, block, free = {}, {}, list(range(1, blocks))  # sequence -> its inputs so far, its state block
    zeros, new_id = [torch.zeros(width)] * (size - 1), 0

    def indices(rows: list[int], padding: int = 0) -> torch.Tensor:
        index = torch.tensor(rows + [0] * padding, dtype=torch.int32)
        return torch.stack([index, torch.full_like(index, -1)], 1) if indices_2d else index

    for _ in range(40):
        running = list(history)
        rng.shuffle(running)
        decodes = running[: rng.randint(0, len(running))]
        prefills = [s for s in running if s not in decodes and rng.random() < 0.5]
        while free and rng.random() < 0.5:
            history[new_id], block[new_id] = [], free.pop(rng.randrange(len(free)))
            prefills.append(new_id)
            new_id += 1
        lengths = [rng.randint(1, 7) for _ in prefills]
        if not decodes and not prefills:
            continue
        x = torch.randn(len(decodes) + sum(lengths), width)
        starts = [0]
        for length in lengths:
            starts.append(starts[-1] + length)
        metadata = SimpleNamespace(
            num_decode_tokens=len(decodes),
            num_prefill_tokens=sum(lengths),
            state_indices_tensor_d=indices([block[s] for s in decodes], padding=2),
            state_indices_tensor_p=indices([block[s] for s in prefills]),
            query_start_loc_p=torch.tensor(starts, dtype=torch.int32),
            has_initial_states_p=torch.tensor([len(history[s]) > 0 for s in prefills]),
        )
        past = DeltaWindow.exchange(window, x, metadata)
        expected, row = [], 0
        for sequence, length in [(s, 1) for s in decodes] + list(zip(prefills, lengths)):
            for _ in range(length):
                expected.append(torch.stack((zeros + history[sequence])[len(history[sequence]) :]))
                history[sequence].append(x[row])
                row += 1
        assert torch.equal(past, torch.stack(expected))
        for sequence in list(history):  # some sequences finish; their blocks return to the pool, NaN-filled
            if history[sequence] and rng.random() < 0.15:
                storage.view(blocks, -1)[block[sequence]] = float("nan")
                free.append(block.pop(sequence))
                del history[sequence]


def serving_config(config, **changes) -> SimpleNamespace:
    """The parts of a vLLM config that `check_servable` reads, as one engine on one device would have them."""
    settings = dict(tensor=1, pipeline=1, speculative=None, cache_mode="align", v2=False) | changes
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_config=config),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=settings["tensor"], pipeline_parallel_size=settings["pipeline"]
        ),
        speculative_config=settings["speculative"],
        cache_config=SimpleNamespace(mamba_cache_mode=settings["cache_mode"]),
        use_v2_model_runner=settings["v2"],
    )


REFUSED = {
    "delta-net": ("gpt2", dict(token_mixer="delta_net"), {}, "token_mixer='delta_net'"),
    "unscaled-attention": ("gpt2", dict(scale_attn_weights=False), {}, "scale_attn_weights=False"),
    "tensor-parallel": ("llama", {}, dict(tensor=2), "tensor and pipeline parallelism"),
    "speculative": ("llama", TC, dict(speculative=object()), "speculative decoding"),
    "mamba-cache-all": ("llama", TC, dict(cache_mode="all"), "mamba_cache_mode='all'"),
    "v2-runner": ("gpt2", TC, dict(v2=True), "VLLM_USE_V2_MODEL_RUNNER=0"),
}


@needs_vllm
@pytest.mark.parametrize("case", list(REFUSED))
def test_what_the_native_route_cannot_serve_is_refused_with_one_line(case):
    """`check_servable` (called while vLLM builds the model) refuses, with one line naming it, a config the route
    does not serve or a setting it does not support; the same model on one device, V1 runner, passes where only a
    setting was the problem."""
    from ddl_hf.vllm_models import check_servable

    family, fields, settings, named = REFUSED[case]
    if family == "gpt2":
        config = ddl_hf.DeltaGPTConfig(n_embd=64, n_head=2, n_layer=2, **fields)
    else:
        config = ddl_hf.DeltaLlamaConfig(**LLAMA_SIZE, num_hidden_layers=2, **fields)
    if settings:
        check_servable(serving_config(config))
    with pytest.raises(ValueError, match="cannot serve") as raised:
        check_servable(serving_config(config, **settings))
    assert "\n" not in str(raised.value) and named in str(raised.value), str(raised.value)
