"""Runs vLLM for `tests/integrations/test_vllm.py`, in a process of its own:
`python tests/vllm_worker.py JOBS.json RESULTS.json`.

Each job is `{"model": directory, "prompts": [[token ids], ...], "max_tokens": N}`; for each, in order, an offline
engine `LLM(model=directory, model_impl="transformers", trust_remote_code=True)` is built and greedily decodes every
prompt in one batch (vLLM packs them into one row), then is shut down before the next job. A job's result is
`{"tokens": [[generated ids], ...]}`, or `{"error": "ExceptionType: message"}` when building the engine or decoding
raised. The results file also says whether `ddl_hf` was imported: it must not be, so that vLLM runs the Hub code
that `save_pretrained` wrote next to the weights, as on a machine without this package.

Why a process of its own: vLLM's CPU backend binds the process's threads and memory to cores and NUMA nodes and sets
the global seed; the test process that builds the models and runs `model.generate` keeps its own settings. The engine
runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so one process serves every job and an error at build
time reaches the job's result as the exception that vLLM raised.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

#: What every engine of the tests is built with: the tiny models' float32 (bit-comparable with transformers on the
#: CPU), eager mode (no torch.compile: each engine starts in seconds; the `vllm serve` test runs the compiled default),
#: a small context, and a KV cache of a fixed size instead of a fraction of the machine's memory.
ENGINE_ARGS = dict(
    model_impl="transformers",
    trust_remote_code=True,
    dtype="float32",
    enforce_eager=True,
    max_model_len=128,
    kv_cache_memory_bytes=64 * 2**20,
    seed=0,
)


def error_line(error: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(error), error)).strip()


def run(jobs: list[dict]) -> list[dict]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    results = []
    for job in jobs:
        n = job["max_tokens"]
        # Greedy, exactly n tokens: min_tokens masks the end-of-sequence token as generate's min_new_tokens does.
        params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)
        llm = None
        try:
            llm = LLM(model=job["model"], **ENGINE_ARGS)
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params, use_tqdm=False)
            results.append({"tokens": [list(output.outputs[0].token_ids) for output in outputs]})
        except Exception as error:  # the test reads the error
            traceback.print_exc()
            results.append({"error": error_line(error)})
        finally:
            if llm is not None:
                llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
    return results


def main(argv: list[str]) -> int:
    jobs = json.loads(Path(argv[1]).read_text())
    results = run(jobs)
    Path(argv[2]).write_text(json.dumps({"results": results, "ddl_hf_imported": "ddl_hf" in sys.modules}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
