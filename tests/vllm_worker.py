"""Runs vLLM for `tests/integrations/test_vllm.py`, in a process of its own:
`python tests/vllm_worker.py JOBS.json RESULTS.json`.

Each job is `{"model": directory, "prompts": [[token ids], ...], "max_tokens": N}`; for each, in order, an offline
engine `LLM(model=directory, model_impl="transformers", trust_remote_code=True)` is built and greedily decodes every
prompt in one batch (vLLM packs them into one row), then is shut down before the next job. A job's result is
`{"tokens": [[generated ids], ...]}`, or `{"error": "ExceptionType: message"}` when building the engine or decoding
raised. The results file also says whether `ddl_hf` was imported: for the Transformers backend it must not be (the
test runs this worker with vLLM's plugins off), so that vLLM runs the Hub code that `save_pretrained` wrote next to
the weights, as on a machine without this package.

Optional keys, for ddl-hf's native route (tests/integrations/test_vllm_native.py): `"engine"`, arguments that
replace the defaults below (`{"model_impl": "auto"}` takes the route vLLM picks, ddl-hf's plugin when it is loaded);
`"alone": true` also decodes each prompt in a request of its own, one after another, into `"alone"`; `"mutant"`, a
deliberately wrong window in `ddl_hf.vllm_windows` ("shifted": every tap one token further back; "not_reset": a new
sequence starts from whatever its state block held; "no_initial_state": a continued chunk or a prefix-cache hit starts
from zeros), which the tests must catch. `"cached"` / `"alone_cached"`: each request's prompt tokens served from
vLLM's prefix cache (`RequestOutput.num_cached_tokens`).

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


def mutate(mutant: str) -> None:
    """Make ddl-hf's vLLM window wrong on purpose (in this process, where the engine runs)."""
    import torch

    from ddl_hf import vllm_windows

    if mutant == "shifted":
        exchange = vllm_windows.DeltaWindow.exchange

        def shifted(self, x, metadata):
            past = exchange(self, x, metadata)
            return torch.cat([torch.zeros_like(past[:, :1]), past[:, :-1]], dim=1)

        vllm_windows.DeltaWindow.exchange = shifted
    elif mutant in ("not_reset", "no_initial_state"):
        # not_reset: has_initial_states_p read as all true (a new sequence keeps its block's old window);
        # no_initial_state: all false (a continued chunk or a prefix-cache hit restarts from zeros).
        fill = torch.ones_like if mutant == "not_reset" else torch.zeros_like

        class Overridden:
            def __init__(self, metadata):
                self.metadata = metadata

            def __getattr__(self, name):
                value = getattr(self.metadata, name)
                return fill(value) if name == "has_initial_states_p" and value is not None else value

        exchange = vllm_windows.DeltaWindow.exchange
        vllm_windows.DeltaWindow.exchange = lambda self, x, metadata: exchange(self, x, Overridden(metadata))
    else:
        raise ValueError(f"unknown mutant {mutant!r}")


def built(llm) -> str | None:
    """The class of the model the engine built (`module.Class`), read from the engine in this process."""
    try:
        model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.get_model()
    except AttributeError:
        return None
    return f"{type(model).__module__}.{type(model).__qualname__}"


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
            if job.get("mutant"):
                mutate(job["mutant"])
            llm = LLM(model=job["model"], **{**ENGINE_ARGS, **job.get("engine", {})})
            prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
            outputs = llm.generate(prompts, params, use_tqdm=False)
            result = {"tokens": [list(output.outputs[0].token_ids) for output in outputs], "model_class": built(llm)}
            result["cached"] = [output.num_cached_tokens or 0 for output in outputs]
            if job.get("alone"):
                alone = [llm.generate([prompt], params, use_tqdm=False)[0] for prompt in prompts]
                result["alone"] = [list(output.outputs[0].token_ids) for output in alone]
                result["alone_cached"] = [output.num_cached_tokens or 0 for output in alone]
            results.append(result)
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
