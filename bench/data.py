"""Data-pipeline throughput per rank, for each way titan-data reads: raw text tokenized with the
Llama 3 tokenizer (the embedded corpus, sharded local jsonl files, parquet through Hugging Face
`datasets`), pre-tokenized shards (memory map), and a mixture of them, in the training process
and with worker processes; as JSON lines.

    uv run python bench/data.py [--seq-len 2048] [--batch-size 8] [--batches 40] [--workers 0,1,2]

Each line: {"bench": "data", "path": ..., "workers": ..., "tokens_per_s": ..., "vs_target": ...}.
The reference is what one H100 consumes training Llama 3.1 8B at 40% MFU, about 8,000 tokens/s
per GPU; the target is 20x that per rank (160,000 tokens/s), so that data loading never limits
a step. `tokens_per_s` counts the input tokens of the batches after the first two (which also
pay for building the loader and starting the workers: `first_batch_s`). All paths run side by
side in one process; the machine's load average is printed with each line, since a loaded
machine slows every path (compare ratios between lines of one run).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--workers", default="0,1,2", help="worker counts to run each path with")
    parser.add_argument("--tokenizer", default="llama3")
    parser.add_argument("--copies", type=int, default=4, help="copies of the corpus in the files")
    return parser.parse_args(argv)


# The flags are read before the imports below load torch (seconds): `--help` and a bad flag
# answer at once.
if __name__ == "__main__":
    ARGS = parse_args()

import pyarrow as pa
import pyarrow.parquet as pq

from titan_data import build_dataloader, load_tokenizer, pydocs_documents
from titan_data.pretokenize import tokenize_source

H100_8B_TOKENS_PER_S = 8_000
TARGET = 20 * H100_8B_TOKENS_PER_S


def write_corpus(folder: str, copies: int) -> dict[str, str]:
    """The embedded corpus `copies` times over, as 8 jsonl shards and 8 parquet files."""
    documents = list(pydocs_documents("train")) * copies
    jsonl, parquet = os.path.join(folder, "jsonl"), os.path.join(folder, "parquet")
    os.makedirs(jsonl)
    os.makedirs(parquet)
    for shard in range(8):
        part = documents[shard::8]
        with open(os.path.join(jsonl, f"part-{shard:02d}.jsonl"), "w") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in part)
        pq.write_table(pa.table({"text": part}), os.path.join(parquet, f"part-{shard:02d}.parquet"))
    return {"jsonl": jsonl, "parquet": parquet}


def bench(path: str, dataset: str, tokenizer, name: str, workers: int, args) -> dict:
    start = time.perf_counter()
    loader = build_dataloader(
        dataset=dataset,
        dataset_path=None,
        tokenizer=tokenizer,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        num_workers=workers,
    )
    batches = iter(loader)
    next(batches)
    next(batches)
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(args.batches):
        inputs, _labels = next(batches)
    elapsed = time.perf_counter() - start
    tokens = args.batches * inputs.numel()
    del batches, loader  # stops the workers before the next path starts its own
    rate = tokens / elapsed
    return {
        "bench": "data",
        "path": path,
        "tokenizer": name,
        "workers": workers,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "tokens": tokens,
        "seconds": round(elapsed, 4),
        "tokens_per_s": round(rate),
        "vs_target": round(rate / TARGET, 2),
        "h100_8b_multiple": round(rate / H100_8B_TOKENS_PER_S, 1),
        "first_batch_s": round(first, 3),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
    }


def main(args: argparse.Namespace) -> None:
    tokenizer = load_tokenizer(args.tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        files = write_corpus(tmp, args.copies)
        tokens = os.path.join(tmp, "tokens")
        manifest = tokenize_source(
            dataset=files["jsonl"],
            dataset_path=None,
            tokenizer=args.tokenizer,
            out=tokens,
            shard_tokens=1_000_000,
            workers=os.cpu_count() or 1,
            progress=False,
        )
        print(
            json.dumps(
                {
                    "bench": "data",
                    "stage": "tokenize",
                    "documents": manifest["documents"],
                    "tokens": manifest["tokens"],
                    "seconds": round(time.perf_counter() - start, 2),
                }
            ),
            flush=True,
        )
        paths = {
            "raw pydocs": "pydocs",
            "raw jsonl shards": files["jsonl"],
            "raw parquet (datasets)": files["parquet"],
            "pre-tokenized": tokens,
            "mixture jsonl:2,tokens:1,pydocs:1": f"{files['jsonl']}:2,{tokens}:1,pydocs:1",
        }
        for workers in (int(w) for w in args.workers.split(",")):
            for path, dataset in paths.items():
                print(
                    json.dumps(bench(path, dataset, tokenizer, args.tokenizer, workers, args)),
                    flush=True,
                )


if __name__ == "__main__":
    main(ARGS)
