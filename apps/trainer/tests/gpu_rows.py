"""The dry run's prediction for each GPU measurement of issue 31, printed as one JSON line.

    python gpu_rows.py [row ...]

Each row is simulated at its real shapes on fake tensors (no memory), for one GPU (a fake
process group of one), with CUDA's kernels where they keep less than the CPU's:

- Llama 3.1 8B's widths (dim 4096, 32 heads, 8 KV heads, vocabulary 128256) cut to 4 or 8
  blocks, seq 8192, batch 1, AdamW, measured as bench/throughput.py runs them on one GPU
  (`--fsdp-one-device`: FSDP over a one-device mesh, bf16 parameters, float32 reductions);
- the debug model as tests/test_gpu.py runs it (`titan-train` on one GPU: float32 parameters
  under bf16 autocast).

The rows run one after the other in this one process (a fresh fake group each): importing torch
and inductor once is most of the cost.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from titan_core import init_logging, load_config, plugins, resolve
from titan_parallel.memory_estimate import GiB, fake_process_group
from titan_trainer.config import JobConfig
from titan_trainer.dry_run import measure_rank

CUT_8B = [
    "--model.name", "cut_llama3:spec", "--training.seq_len", "8192",
    "--training.local_batch_size", "1", "--training.mixed_precision_param", "bfloat16",
    "--parallelism.data_parallel_shard_degree", "1",
]  # fmt: skip
ROWS: dict[str, list[str]] = {
    "4 layers, no AC, compiled": [
        *CUT_8B, "--model.flavor", "8B-4", "--activation_checkpoint.mode", "none",
        "--compile.enable",
    ],
    "8 layers, selective AC, compiled": [
        *CUT_8B, "--model.flavor", "8B-8", "--activation_checkpoint.mode", "selective",
        "--compile.enable",
    ],
    "8 layers, selective AC, compiled, Float8 tensorwise": [
        *CUT_8B, "--model.flavor", "8B-8", "--activation_checkpoint.mode", "selective",
        "--compile.enable", "--model.converters", "quantize.linear.float8",
    ],
    "4 layers, no AC, eager": [
        *CUT_8B, "--model.flavor", "8B-4", "--activation_checkpoint.mode", "none",
    ],
    # tests/test_gpu.py's run: the debug model, eager, bf16 by autocast on one GPU.
    "debug model, bf16, eager": [
        "--model.flavor", "debugmodel", "--training.seq_len", "2048",
        "--training.local_batch_size", "8", "--training.mixed_precision_param", "bfloat16",
        "--activation_checkpoint.mode", "none",
    ],
}  # fmt: skip


def predict(row: str) -> dict:
    config = load_config(JobConfig, ROWS[row])
    # The 8B cut flavors keep Llama 3's vocabulary; the debug model reads bytes.
    vocab = 128256 if "8B" in " ".join(ROWS[row]) else _byte_vocab()
    start = time.perf_counter()
    with fake_process_group(1):
        result = measure_rank(
            config,
            1,
            vocab,
            "every rank",
            fake=True,
            kernels="cuda",
            after_build=fsdp_one_device if "8B" in " ".join(ROWS[row]) else None,
        )
    return {
        "row": row,
        "predicted_gib": round(result.step.total / GiB, 3),
        "seconds": round(time.perf_counter() - start, 1),
    }


def fsdp_one_device(runtime, parts) -> None:
    """bench/throughput.py's `--fsdp-one-device`: FSDP over a mesh of one device, parameters
    gathered in bf16 and gradients reduced in float32, no autocast."""
    from torch.distributed.device_mesh import init_device_mesh

    from titan_parallel import apply_fsdp

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
    for part in parts:
        apply_fsdp(part, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    runtime.autocast = None


def _byte_vocab() -> int:
    return resolve(plugins.DATA, "titan").build_tokenizer("byte").vocab_size


def main() -> None:
    init_logging(rank=0)
    rows = sys.argv[1:] or list(ROWS)
    print(json.dumps([predict(row) for row in rows]), flush=True)


if __name__ == "__main__":
    main()
