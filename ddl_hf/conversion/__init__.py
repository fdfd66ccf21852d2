"""Turn a GPT-2 checkpoint into a DeltaGPT, or a Llama-family one into a DeltaLlama, that starts equivalent to it,
and back.

Three layers, each usable on its own:

* `convert_gpt2(source, **overrides)` (`converting`): in memory, GPT-2 weights -> `DeltaGPTForCausalLM` (Delta
  gates at `delta_beta_init`, default beta = 0 exactly, so the additive model computes the source's function).
* `convert_checkpoint(source, output, ...)` (`hub`): the whole job behind the CLI (`cli`), for every family: the
  source's config picks the conversion (`families`). Writes a complete Hub repository (config with `auto_map`, the
  custom-code files, safetensors, tokenizer, generation config, model card) into an `atomic_directory` (`atomic`),
  verifies the written files against the source (`verifying`), and only then renames the directory into place, so
  a failure at any point leaves no partial output.
* `export_to_gpt2(model)` (`exporting`): the exact way back, allowed only when every Delta gate is closed.
* `convert_llama(source)` / `export_to_llama(model)` (`llama`): the same two for Llama, Mistral, Qwen2 and Qwen3
  (DeltaLlama).
"""

from .atomic import atomic_directory
from .cli import run_cli
from .converting import DTYPES, convert_gpt2, load_gpt2
from .errors import ConversionError
from .exporting import beta_upper_bounds, export_to_gpt2
from .hub import DEFAULT_MAX_SHARD_SIZE, convert_checkpoint, model_card, push_converted_to_hub
from .llama import convert_llama, export_to_llama, load_llama_family
from .verifying import SAMPLE_TEXT, EquivalenceReport, equivalence_report, equivalence_tolerance, sample_input_ids

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "DTYPES",
    "SAMPLE_TEXT",
    "ConversionError",
    "EquivalenceReport",
    "atomic_directory",
    "beta_upper_bounds",
    "convert_checkpoint",
    "convert_gpt2",
    "convert_llama",
    "equivalence_report",
    "equivalence_tolerance",
    "export_to_gpt2",
    "export_to_llama",
    "load_gpt2",
    "load_llama_family",
    "model_card",
    "push_converted_to_hub",
    "run_cli",
    "sample_input_ids",
]
