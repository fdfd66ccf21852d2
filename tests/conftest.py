"""Shared fixtures and the compatibility subset; tiny configs and models come from `builders`."""

from __future__ import annotations

import pytest
import torch

from tests.builders import VOCAB

#: The compatibility subset (`pytest -m compat`), which CI also runs on the oldest supported transformers: the cache
#: under both names and the deprecation early warning, generation with and without the cache (DeltaGPT, the windowed
#: variants, DeltaNet, DeltaLlama), left padding, a batched pipeline, conversion of GPT-2 and of each Llama family and
#: export back, save and reload (with the Hub code, without ddl_hf), Trainer steps, the task heads against
#: transformers', the windows' static cache, and the names a save writes (old read names load-only, `key_mapping`).
#: Node-id prefixes from the file name on (the folder a file sits in does not matter; tests/test_repository.py checks
#: that every entry names a test).
COMPAT_SUBSET = (
    "test_compat.py",
    "test_deprecations.py",
    "test_model_behaviour.py::test_greedy_generation_with_cache_equals_without",
    "test_model_behaviour.py::test_left_padded_batch_equals_each_prompt_alone",
    "test_model_behaviour.py::test_save_and_auto_load_round_trip_bit_exactly",
    "test_gpt2_equivalence.py::test_additive_beta_zero_matches_gpt2",
    "test_variants.py::test_cached_generation_equals_uncached_and_stepwise_forward",
    "test_variants.py::test_beam_search_reorders_the_windows",
    "test_variants.py::test_assisted_decoding_crops_the_windows",
    "test_delta_net_model.py::test_greedy_generate_with_cache_equals_without",
    "test_delta_net_model.py::test_beam_search_with_cache_equals_without",
    "test_delta_llama.py::test_cached_generation_equals_uncached",
    "test_delta_llama.py::test_left_padded_batch_equals_each_prompt_alone",
    "test_delta_llama.py::test_save_and_load_in_a_fresh_process_without_ddl_hf",
    "test_delta_llama.py::test_trainer_step_moves_delta_parameters",
    "test_delta_llama_conversion.py::test_report_says_equivalent_bit_for_bit",
    "test_delta_llama_conversion.py::test_export_back_equals_the_source_bit_for_bit",
    "test_conversion.py::test_trained_gpt2_converts_equivalently",
    "test_conversion_cli.py::test_output_loads_in_a_fresh_process",
    "test_workflow_generation.py::test_pipeline_batched_left_padded_equals_generate_alone",
    "test_workflow_trainer.py::test_resume_from_checkpoint_is_bit_identical",
    "test_heads.py::test_a_head_equals_transformers_head_at_beta_zero",
    "test_generation_contract.py::test_static_cache_works_for_temporal_variants",
    "test_saved_checkpoints.py::test_a_new_model_saves_its_own_names_and_registers_no_conversion",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.rsplit("/", 1)[-1].startswith(COMPAT_SUBSET):
            item.add_marker(pytest.mark.compat)


@pytest.fixture(autouse=True)
def restores_global_settings():
    """Every test leaves torch's thread count and transformers' log verbosity as it found them: benchmark mains called
    from tests set both (one thread; errors only), and later tests depend on them (bit-exact resumes, log capture)."""
    from transformers.utils import logging as hf_logging

    threads, verbosity = torch.get_num_threads(), hf_logging.get_verbosity()
    yield
    torch.set_num_threads(threads)
    hf_logging.set_verbosity(verbosity)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run fastest on one intra-op thread, and do not slow down when the machine is busy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def token_batch() -> torch.Tensor:
    return torch.randint(1, VOCAB, (3, 12), generator=torch.Generator().manual_seed(1))
