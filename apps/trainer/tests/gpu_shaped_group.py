"""`python gpu_shaped_group.py ARGS...` runs `titan-train ARGS` in a process group built the
way titan-core builds a CUDA job's (`process_group_backend("cuda")`), with NCCL's part played
by gloo so that it runs on a CPU: gloo registered for the accelerator only, plus whatever the
CUDA job's group carries beside it. A backend named without a device serves the devices that
backend serves (NCCL: CUDA only), so a group made as `nccl` alone becomes `cuda:gloo` here,
which has no CPU backend, just as `nccl` has none."""

from __future__ import annotations

import sys

import torch.distributed as dist

from titan_core.device import process_group_backend
from titan_trainer.cli import main


def played_by_gloo(spec: str) -> str:
    parts = [part if ":" in part else f"cuda:{part}" for part in spec.split(",")]
    return ",".join(part.replace(":nccl", ":gloo") for part in parts)


if __name__ == "__main__":
    cuda_spec = process_group_backend("cuda")
    spec = played_by_gloo(cuda_spec)
    dist.init_process_group(spec, store=dist.HashStore(), rank=0, world_size=1)
    print(f"process group: {cuda_spec} on CUDA, {spec} here", flush=True)
    sys.exit(main(sys.argv[1:]))
