"""Associative recall with overwritten keys: where the delta rule's erase-and-replace matters.

    python -m ddl_lab.studies.assoc_recall      # trains 3 models, writes ddl_lab/studies/results/assoc_recall.{json,md}
    python -m ddl_lab.studies.assoc_recall --quick    # the pipeline in seconds: 4 steps each, 64 test sequences;
                                                      # writes only with --out (assoc_recall_quick.*)

Task (built by `build_dataset` as a `datasets.Dataset`): each sequence writes `n_keys` distinct keys
`writes_per_key` times each, every time with a fresh random value, in shuffled order (`k v k v ...`); then a query
marker and `n_queries` of the keys, each followed by its answer: the value written LAST for that key. Only the answer
tokens are trained and scored. An additive memory (S += v k^T) returns the sum of all values ever written under a
key, so the stale values drown the answer; the delta rule first erases what the memory holds for k, then writes.

Three DeltaGPT models of the same size, the same config except the token mixer, trained with `Trainer`:
`delta_net` (delta rule), `additive` (the same DeltaNet layer with `delta_net_rule="write_only"`: linear attention
without erase) and `attention` (GPT-2 softmax attention). Reported: answer accuracy on held-out sequences, and how
often the prediction is a stale (overwritten) value of the queried key.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset
from transformers import Trainer, TrainingArguments

import ddl_hf  # noqa: F401
from ddl_hf import DeltaGPTConfig, DeltaGPTForCausalLM
from ddl_lab.builders import gpt2_dropout
from ddl_lab.common import REPO_ROOT, provenance, write_results

#: The models' shape: the same for every token mixer.
MODEL = dict(n_embd=64, n_layer=2, n_head=4)
MIXERS = {
    "delta_net": {"token_mixer": "delta_net", "delta_net_rule": "delta"},
    "additive": {"token_mixer": "delta_net", "delta_net_rule": "write_only"},
    "attention": {"token_mixer": "attention"},
}


def build_dataset(
    n_sequences: int, *, n_keys: int, writes_per_key: int, n_queries: int, key_vocab: int, value_vocab: int, seed: int
) -> Dataset:
    """Token ids: keys 0..key_vocab-1, values key_vocab.., the query marker last. Labels: -100 except the answers."""
    rng = np.random.default_rng(seed)
    query_marker = key_vocab + value_vocab
    rows = {"input_ids": [], "labels": [], "stale_values": []}
    for _ in range(n_sequences):
        keys = rng.choice(key_vocab, size=n_keys, replace=False)
        order = rng.permutation(np.repeat(keys, writes_per_key))
        values = key_vocab + rng.integers(0, value_vocab, size=len(order))
        latest, history = {}, {}
        tokens = []
        for key, value in zip(order, values):
            tokens += [int(key), int(value)]
            history.setdefault(int(key), []).append(int(value))
            latest[int(key)] = int(value)
        labels = [-100] * (len(tokens) + 1)
        tokens.append(query_marker)
        stale = []
        for key in rng.choice(keys, size=n_queries, replace=False):
            answer = latest[int(key)]
            tokens += [int(key), answer]
            labels += [-100, answer]
            stale.append(sorted(set(history[int(key)][:-1]) - {answer}))  # overwritten values that differ
        rows["input_ids"].append(tokens)
        rows["labels"].append(labels)
        rows["stale_values"].append(stale)
    return Dataset.from_dict(rows)


def make_model(mixer: str, vocab_size: int, seq_len: int, seed: int) -> DeltaGPTForCausalLM:
    torch.manual_seed(seed)
    config = DeltaGPTConfig(
        vocab_size=vocab_size,
        n_positions=seq_len,
        **MODEL,
        **gpt2_dropout(0.0),
        bos_token_id=None,
        eos_token_id=None,
        **MIXERS[mixer],
    )
    return DeltaGPTForCausalLM(config)


@torch.no_grad()
def evaluate(model: DeltaGPTForCausalLM, test: Dataset, batch_size: int = 250) -> dict:
    model.eval()
    correct = stale = total = 0
    for start in range(0, len(test), batch_size):
        rows = test[start : start + batch_size]
        ids = torch.tensor(rows["input_ids"])
        labels = torch.tensor(rows["labels"])
        predictions = model(ids).logits[:, :-1].argmax(-1)  # position i predicts token i + 1
        targets = labels[:, 1:]
        answer = targets != -100
        correct += int((predictions == targets)[answer].sum())
        total += int(answer.sum())
        answered = predictions[answer].view(len(ids), -1)
        for row, stale_sets in enumerate(rows["stale_values"]):
            stale += sum(int(answered[row, q]) in set(values) for q, values in enumerate(stale_sets))
    return {"accuracy": correct / total, "stale_rate": stale / total, "n_answers": total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the pipeline, not a result: 4 Trainer steps per model, 64 held-out sequences; print, write only where "
        "--out is given",
    )
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mixers", nargs="+", choices=list(MIXERS), default=list(MIXERS))
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: ddl_lab/studies/results)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prov = provenance()
    steps = 4 if args.quick else args.steps

    task = dict(n_keys=8, writes_per_key=3, n_queries=4, key_vocab=16, value_vocab=16)
    train = build_dataset(64 * steps, seed=args.seed, **task).remove_columns("stale_values")
    test = build_dataset(64 if args.quick else 2000, seed=args.seed + 1, **task)
    vocab_size, seq_len = task["key_vocab"] + task["value_vocab"] + 1, len(test[0]["input_ids"])

    results = {"provenance": prov, "task": task, "seq_len": seq_len, "train_sequences": len(train), "steps": steps}
    results["models"] = {}
    for mixer in args.mixers:
        started = time.perf_counter()
        model = make_model(mixer, vocab_size, seq_len, args.seed)
        training_args = TrainingArguments(
            output_dir=str(REPO_ROOT / "outputs" / "assoc_recall" / mixer),
            max_steps=steps,
            per_device_train_batch_size=64,
            learning_rate=3e-3,
            warmup_steps=steps // 20,
            lr_scheduler_type="cosine",
            weight_decay=0.01,
            logging_steps=max(1, steps // 10),
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            seed=args.seed,
            disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=training_args, train_dataset=train)
        train_loss = trainer.train().training_loss
        metrics = evaluate(model, test)
        metrics |= {
            "parameters": sum(p.numel() for p in model.parameters()),
            "mean_train_loss": train_loss,
            "train_minutes": (time.perf_counter() - started) / 60,
        }
        results["models"][mixer] = metrics
        print(mixer, metrics, flush=True)

    report = markdown(results)
    print(report)
    if not args.quick:
        write_results(args.out or Path(__file__).parent / "results", "assoc_recall", results, report)
    elif args.out is not None:  # a smoke run writes only where asked, and never over the real results' names
        write_results(args.out, "assoc_recall_quick", results, report)


def markdown(results: dict) -> str:
    task = results["task"]
    lines = [
        "# Associative recall with overwritten keys",
        "",
        f"Each sequence writes {task['n_keys']} distinct keys "
        f"{task['writes_per_key']} times each (fresh random value each time; {task['key_vocab']} possible keys, "
        f"{task['value_vocab']} values), then queries {task['n_queries']} keys; the answer is the value written last. "
        f"Sequence length {results['seq_len']}; {results['steps']} Trainer steps of batch 64 per model; accuracy over "
        "held-out answers. "
        f"Models: DeltaGPT, {MODEL['n_layer']} layers, n_embd {MODEL['n_embd']}, {MODEL['n_head']} heads, identical "
        "except the token mixer.",
        "",
        "| token mixer | parameters | answer accuracy | stale (overwritten) value predicted | mean train loss |",
        "|---|---:|---:|---:|---:|",
    ]
    names = {"delta_net": "DeltaNet (delta rule)", "additive": "additive linear attention", "attention": "softmax"}
    for mixer, m in results["models"].items():
        lines.append(
            f"| {names[mixer]} | {m['parameters']:,} | {100 * m['accuracy']:.1f}% | {100 * m['stale_rate']:.1f}% "
            f"| {m['mean_train_loss']:.3f} |"
        )
    lines += ["", f"Chance: {100 / task['value_vocab']:.1f}%."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
