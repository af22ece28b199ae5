"""Data-pipeline throughput (tokenize + pack + batch) on the embedded `pydocs` corpus, for the
byte and Llama 3 tokenizers, as JSON lines.

    uv run python bench/data.py [--seq-len 2048] [--batch-size 8] [--batches 40]

Each line: {"bench": "data", "dataset": "pydocs", "tokenizer": ..., "tokens_per_s": ...,
"first_batch_s": ..., ...}. `first_batch_s` includes building the source (the corpus itself is
built once per process, before the first tokenizer is timed); `tokens_per_s` counts the
tokens in the batches that followed. Compare the two tokenizers as a ratio: both ran side by
side in one process.
"""

from __future__ import annotations

import argparse
import json
import time

from titan_data import build_dataloader, load_tokenizer, pydocs_documents


def bench_tokenizer(name: str, args) -> dict:
    tokenizer = load_tokenizer(name)
    start = time.perf_counter()
    loader = build_dataloader(
        dataset="pydocs",
        dataset_path=None,
        tokenizer=tokenizer,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
    )
    batches = iter(loader)
    next(batches)
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(args.batches):
        inputs, _labels = next(batches)
    elapsed = time.perf_counter() - start
    tokens = args.batches * inputs.numel()
    return {
        "bench": "data",
        "dataset": "pydocs",
        "tokenizer": name,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "batches": args.batches,
        "tokens": tokens,
        "seconds": round(elapsed, 4),
        "tokens_per_s": round(tokens / elapsed, 1),
        "first_batch_s": round(first, 4),
        "epochs": loader.state_dict()["epoch"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--tokenizers", default="byte,llama3")
    args = parser.parse_args()
    start = time.perf_counter()
    documents = pydocs_documents()
    corpus = {
        "bench": "data",
        "dataset": "pydocs",
        "stage": "build_corpus",
        "documents": len(documents),
        "chars": sum(map(len, documents)),
        "seconds": round(time.perf_counter() - start, 4),
    }
    print(json.dumps(corpus), flush=True)
    for name in args.tokenizers.split(","):
        print(json.dumps(bench_tokenizer(name, args)), flush=True)


if __name__ == "__main__":
    main()
