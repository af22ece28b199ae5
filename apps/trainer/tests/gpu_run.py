"""`python gpu_run.py ARGS...` runs `titan-train ARGS` and then prints the CUDA caching
allocator's peak of the whole run, exact, in bytes (`cuda max_memory_allocated N`): the metric
line rounds it to 0.1 GiB."""

from __future__ import annotations

import sys

import torch

from titan_trainer.cli import main

if __name__ == "__main__":
    status = main(sys.argv[1:])
    if torch.cuda.is_available():
        print(f"cuda max_memory_allocated {torch.cuda.max_memory_allocated()}", flush=True)
    sys.exit(status)
