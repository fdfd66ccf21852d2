"""The supported transformers / torch range (delta_compat.py): the cache under both of its names, the model outputs
transformers reads, one clear error below the minimum, and the torch internals that no public API replaces.

transformers' own models are the reference: `GPT2LMHeadModel` and `LlamaForCausalLM` of the installed release say
which name the cache has in a forward and in an output."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from transformers import DynamicCache

import ddl_hf
from ddl_hf import delta_compat
from ddl_hf.delta_compat import CACHE_ARG, cache_of, release
from ddl_hf.delta_net import DeltaNetCache
from ddl_hf.delta_reads import DeltaStateCache
from tests.builders import (
    CLIENT_VARIANTS,
    VOCAB,
    build_source,
    delta_model,
    gpt2_model,
    random_ids,
    scramble_delta_weights,
    to_delta,
)
from tests.builders import open_llama_gates as open_gates

VARIANTS = ["additive-dv1", "paper-dv4", "delta_net-dv1", "tc-ec-paper-dv4", "cc-dv4"]


def scrambled(variant: str) -> ddl_hf.DeltaGPTForCausalLM:
    model = delta_model(CLIENT_VARIANTS[variant])
    scramble_delta_weights(model)
    return model


def new_cache(model) -> DynamicCache:
    """The cache `generate` would give this model."""
    config = model.config
    if getattr(config, "token_mixer", "attention") == "delta_net":
        return DeltaNetCache(config)
    return DeltaStateCache(config) if config.delta_temporal else DynamicCache(config=config)


def old_name_warns(cache_name: str) -> contextlib.AbstractContextManager:
    """`past_key_values=` warns from transformers 5.24 on, as GPT2LMHeadModel's does (test_transformers_contracts.py
    compares the two), and is the installed name, with no warning, before."""
    if cache_name == "past_key_values" and CACHE_ARG == "cache":
        return pytest.warns(FutureWarning, match="past_key_values")
    return contextlib.nullcontext()


def prefill_then_step(model, ids: torch.Tensor, cache_name: str, call=None) -> tuple[torch.Tensor, object]:
    """Logits of the last token, fed one step after a prefill of the others, with the cache passed as `cache_name`."""
    call = call or model
    cache = new_cache(model)
    with torch.no_grad():
        with old_name_warns(cache_name):
            first = call(ids[:, :-1], use_cache=True, **{cache_name: cache})
        assert cache_of(first) is cache
        with old_name_warns(cache_name):
            step = call(ids[:, -1:], use_cache=True, **{cache_name: cache})
    assert cache_of(step) is cache
    assert cache.get_seq_length() == ids.shape[1]
    return step.logits[:, -1], cache


@pytest.mark.parametrize("cache_name", ["cache", "past_key_values"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_both_cache_names_continue_the_cache_like_a_full_forward(variant, cache_name):
    """The step after a cached prefill equals the full forward without a cache (the independent reference), under
    either name of the cache argument, and the output hands the same cache back."""
    model = scrambled(variant)
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits[:, -1]
    step, _ = prefill_then_step(model, ids, cache_name)
    torch.testing.assert_close(step, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_name", ["cache", "past_key_values"])
def test_both_cache_names_in_the_base_model_and_the_classification_heads(cache_name):
    model = scrambled("paper-dv4")
    ids = torch.randint(1, VOCAB, (1, 7), generator=torch.Generator().manual_seed(4))
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), old_name_warns(cache_name):
        out = model.transformer(ids, use_cache=True, **{cache_name: cache})
    assert cache_of(out) is cache and cache.get_seq_length() == 7
    for head_class in (ddl_hf.DeltaGPTForSequenceClassification, ddl_hf.DeltaGPTForTokenClassification):
        head = head_class(model.config).eval()
        head.transformer.load_state_dict(model.transformer.state_dict())
        cache = DynamicCache(config=model.config)
        with torch.no_grad(), old_name_warns(cache_name):
            head(ids, use_cache=True, **{cache_name: cache})
        assert cache.get_seq_length() == 7, head_class.__name__


@pytest.mark.parametrize("cache_name", ["cache", "past_key_values"])
@pytest.mark.parametrize("variant", [dict(), dict(delta_value_channels=4, delta_state_read="temporal_conv")])
def test_both_cache_names_in_delta_llama(variant, cache_name):
    model = open_gates(to_delta(build_source("qwen3"), **variant))
    ids = random_ids(2, 9)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits[:, -1]
        with old_name_warns(cache_name):
            base = model.model(ids, use_cache=True, **{cache_name: new_cache(model)})
    assert cache_of(base).get_seq_length() == 9
    step, _ = prefill_then_step(model, ids, cache_name)
    torch.testing.assert_close(step, full, rtol=1e-5, atol=1e-5)


def both_names(model) -> tuple[str, int, int]:
    """What `model` does with a different cache under each name: the warnings or error, and each cache's length."""
    ids = torch.ones(1, 3, dtype=torch.long)
    first, second = DynamicCache(config=model.config), DynamicCache(config=model.config)
    with torch.no_grad(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            model(ids, cache=first, past_key_values=second)
            outcome = ""
        except (TypeError, ValueError) as error:
            outcome = type(error).__name__
    messages = sorted(
        {str(w.message).replace(type(model).__name__, "MODEL") for w in seen if "cache" in str(w.message)}
    )
    return outcome + "; ".join(messages), first.get_seq_length(), second.get_seq_length()


@pytest.mark.skipif(CACHE_ARG != "cache", reason="before transformers 5.24 GPT-2 takes only past_key_values")
def test_two_caches_under_both_names_are_taken_as_gpt2_takes_them():
    assert both_names(scrambled("additive-dv1")) == both_names(gpt2_model())


@pytest.mark.skipif(CACHE_ARG == "cache", reason="from transformers 5.24 on, as GPT-2 (the test above)")
def test_two_different_caches_are_refused_before_5_24():
    model = scrambled("additive-dv1")
    ids = torch.ones(1, 3, dtype=torch.long)
    first, second = DynamicCache(config=model.config), DynamicCache(config=model.config)
    with pytest.raises(ValueError, match="Both cache= and past_key_values="):
        model(ids, cache=first, past_key_values=second)
    model(ids, cache=first, past_key_values=first)  # the same cache under both names is one argument
    assert first.get_seq_length() == 3


def test_outputs_name_the_cache_as_transformers_own_models_do():
    """The installed GPT2LMHeadModel's output fields, cache included, under the same names; `generate` reads them."""
    ids = torch.ones(1, 4, dtype=torch.long)
    with torch.no_grad():
        reference = gpt2_model()(ids, use_cache=True)
        ours = delta_model()(ids, use_cache=True)
    assert CACHE_ARG in reference
    assert set(reference.keys()) <= set(ours.keys())
    assert isinstance(ours[CACHE_ARG], DynamicCache)


def test_trainer_evaluation_drops_the_cache_from_the_predictions(tmp_path):
    """`Trainer.predict` returns the logits alone: the config names the cache output under both names
    (`keys_to_ignore_at_inference`), so it is dropped on either side of the rename."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    ids = torch.randint(1, VOCAB, (4, 8), generator=torch.Generator().manual_seed(0))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = TrainingArguments(tmp_path, per_device_eval_batch_size=2, report_to=[], use_cpu=True)
    predictions = Trainer(model=delta_model(), args=args).predict(data).predictions
    assert predictions.shape == (4, 8, VOCAB)


def test_the_logits_slice_equals_what_gpt2_computes():
    """`slice_logits_to_keep` (transformers' own from 5.21, `slice_logits_to_keep_before_5_21` before) against the
    installed GPT2LMHeadModel's `logits_to_keep`, for what `generate` passes: 0 (all), 1, and indices."""
    gpt2 = gpt2_model()
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = gpt2.transformer(ids).last_hidden_state
        for keep in (0, 1, 3, torch.tensor([0, 4, 6])):
            expected = gpt2(ids, logits_to_keep=keep).logits
            for slice_fn in (delta_compat.slice_logits_to_keep, delta_compat.slice_logits_to_keep_before_5_21):
                torch.testing.assert_close(gpt2.lm_head(slice_fn(hidden, keep)), expected, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------------------------
# The supported range: one clear error below it.
# ----------------------------------------------------------------------------------------------------------------


def test_release_numbers_compare_as_numbers():
    assert release("5.24.0") > release("5.9.1") > release("5.9")
    assert release("5.25.0.dev0") == (5, 25, 0)
    assert release("2.13.0+cpu") == (2, 13, 0)
    assert release("4.57.6") < release(delta_compat.MINIMUM_TRANSFORMERS)


LOAD_SAVED = """
import sys
sys.modules["ddl_hf"] = None  # the saved directory's own code, as for a user without this package
import torch, transformers
{fake}
from transformers import AutoModelForCausalLM
AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
print("loaded")
"""


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("saved")
    delta_model().save_pretrained(path)
    return path


def load_saved(saved_model, python: str = sys.executable, fake: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    script = textwrap.dedent(LOAD_SAVED.format(fake=fake))
    return subprocess.run([python, "-c", script, str(saved_model)], capture_output=True, text=True, env=env)


@pytest.mark.parametrize(
    ("package", "installed", "minimum"),
    [
        ("transformers", "4.57.6", delta_compat.MINIMUM_TRANSFORMERS),
        ("torch", "2.5.1", delta_compat.MINIMUM_TORCH),
    ],
)
def test_below_the_minimum_loading_ends_with_one_clear_error(saved_model, package, installed, minimum):
    """A saved directory loaded with `trust_remote_code=True` under an older release (its `__version__` faked here;
    CI also runs the real transformers 4.57.6, see `test_real_old_transformers_ends_with_one_clear_error`)."""
    result = load_saved(saved_model, fake=f"{package}.__version__ = {installed!r}")
    assert result.returncode != 0 and "loaded" not in result.stdout
    assert result.stderr.strip().splitlines()[-1] == (
        f"ImportError: DeltaGPT's model code needs {package}>={minimum}, but {package} {installed} is installed. "
        f'Upgrade it: pip install -U "{package}>={minimum}"'
    )


def test_real_old_transformers_ends_with_one_clear_error(saved_model):
    """With `DDL_HF_OLD_TRANSFORMERS_PYTHON` (set by .ci/run): a Python whose transformers is 4.57.6, the last 4.x.
    Without it, the installed transformers must load the directory (the same script, the other side of the gate)."""
    python = os.environ.get("DDL_HF_OLD_TRANSFORMERS_PYTHON")
    if python is None:
        result = load_saved(saved_model)
        assert result.returncode == 0 and "loaded" in result.stdout, result.stderr
        return
    version = subprocess.run(
        [python, "-c", "import transformers; print(transformers.__version__)"], capture_output=True, text=True
    ).stdout.strip()
    assert release(version) < release(delta_compat.MINIMUM_TRANSFORMERS), version
    result = load_saved(saved_model, python=python)
    minimum = delta_compat.MINIMUM_TRANSFORMERS
    assert result.stderr.strip().splitlines()[-1] == (
        f"ImportError: DeltaGPT's model code needs transformers>={minimum}, but transformers {version} is installed. "
        f'Upgrade it: pip install -U "transformers>={minimum}"'
    )


# ----------------------------------------------------------------------------------------------------------------
# Module hooks: every Delta module call runs them (no fast path reads torch's private hook registries any more).
# ----------------------------------------------------------------------------------------------------------------


def test_every_module_call_runs_its_hooks_while_generating():
    """A global forward hook sees every Delta residual's call while generating (prefill and each decoding step)."""
    model = scrambled("additive-dv1")
    prompt = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(5))
    calls = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, output: calls.append(1) if isinstance(module, ddl_hf.DeltaResidual) else None
    )
    try:
        model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    finally:
        handle.remove()
    assert len(calls) == 4 * 2 * model.config.n_layer  # prefill + 3 decoding steps, 2 residuals per layer
