#!/usr/bin/env bash
# Launch titan-train under torchrun on this machine.
#   NGPU=8 CONFIG_FILE=configs/llama3_8b.toml ./run_train.sh --training.steps 100
# NGPU: processes to start (default: the CUDA devices, else 1). CONFIG_FILE: a TOML file, or a
# config shipped with titan-trainer by name (llama3_8b, configs/llama3_8b.toml; default
# debug_model; `titan-train --list-configs`). LOG_RANK: ranks whose output is shown (default 0).
# Extra arguments override the TOML. The run writes under the current folder (job.dump_folder).
set -euo pipefail

# Resolved the way titan-train resolves it; a name that finds nothing fails here, before torchrun.
CONFIG_FILE=$(python -m titan_trainer --config-path "${CONFIG_FILE:-debug_model}")
if [ -z "${NGPU:-}" ]; then
    NGPU=$(python -c "import torch; print(torch.cuda.device_count() or 1)" 2>/dev/null || echo 1)
fi
LOG_RANK=${LOG_RANK:-0}

exec torchrun --nproc_per_node="$NGPU" --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
    --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
    -m titan_trainer --job.config_file "$CONFIG_FILE" "$@"
