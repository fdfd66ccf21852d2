"""Generation with DeltaGPT: batched left-padded pipeline with sampling, TextStreamer, beam search.

    python examples/generation.py --model outputs/demo/delta-gpt       # the demo's fine-tuned model
    python examples/generation.py                                       # the small base, converted

Decoder-only models pad on the LEFT for batched generation, so every prompt's last real token is at the end;
DeltaGPT takes the attention mask (and derives position ids from it in `generate`) like GPT-2.
"""

from __future__ import annotations

import argparse

import torch
from transformers import TextStreamer, pipeline, set_seed

import ddl_hf
from ddl_hf.training import add_base_arguments, base_gpt2

PROMPTS = ["Enter VIOLA.\n\nVIOLA\n", "It is a truth universally acknowledged", "O, what a"]


def load(args: argparse.Namespace):
    """The model to generate with: `--model` (a saved DeltaGPT), else the base GPT-2 converted to DeltaGPT."""
    if args.model:
        from ddl_hf.inspection import load_model_and_tokenizer

        return load_model_and_tokenizer(args.model)
    gpt2, tokenizer, _ = base_gpt2(args.base, cache_dir=args.cache_dir)
    return ddl_hf.convert_gpt2(gpt2).eval(), tokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_base_arguments(parser)
    parser.add_argument("--model", default=None, help="a saved DeltaGPT directory or Hub id")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--num-beams", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    model, tokenizer = load(args)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    tokenizer.padding_side = "left"
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    # 1. pipeline: a batch of prompts of different lengths, left-padded, sampled.
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    set_seed(args.seed)
    sampled = generator(
        PROMPTS,
        batch_size=len(PROMPTS),
        max_new_tokens=args.max_new_tokens,
        do_sample=True,
        top_p=0.95,
        temperature=0.9,
    )
    print("== pipeline, batched, left-padded, sampling")
    for out in sampled:
        print(repr(out[0]["generated_text"]))

    # 2. TextStreamer: tokens are printed as they are generated.
    print("\n== TextStreamer (greedy)")
    inputs = tokenizer(PROMPTS[1], return_tensors="pt")
    streamer = TextStreamer(tokenizer, skip_prompt=False)
    streamed = model.generate(**inputs, streamer=streamer, max_new_tokens=args.max_new_tokens, do_sample=False)

    # 3. Beam search, scores returned: with length_penalty=0 a beam's score is the sum of its token log-probs.
    print(f"\n== beam search ({args.num_beams} beams)")
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    beams = model.generate(
        **batch,
        num_beams=args.num_beams,
        num_return_sequences=1,
        max_new_tokens=args.max_new_tokens,
        do_sample=False,
        length_penalty=0.0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    for text, score in zip(tokenizer.batch_decode(beams.sequences, skip_special_tokens=True), beams.sequences_scores):
        print(f"[log-prob {float(score):.2f}] {text!r}")
    return {"model": model, "tokenizer": tokenizer, "sampled": sampled, "streamed": streamed, "beams": beams}


if __name__ == "__main__":
    with torch.no_grad():
        main()
