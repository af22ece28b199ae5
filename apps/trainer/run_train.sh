#!/usr/bin/env bash
# Launch titan-train under torchrun on this machine.
#   NGPU=8 CONFIG_FILE=configs/llama3_8b.toml ./run_train.sh --training.steps 100
# NGPU: processes to start (default 8 with CUDA, else 1). CONFIG_FILE: the TOML to read.
# LOG_RANK: ranks whose output is shown (default 0). Extra arguments override the TOML.
set -euo pipefail
cd "$(dirname "$0")"

CONFIG_FILE=${CONFIG_FILE:-"configs/debug_model.toml"}
if [ -z "${NGPU:-}" ]; then
    NGPU=$(python -c "import torch; print(torch.cuda.device_count() or 1)" 2>/dev/null || echo 1)
fi
LOG_RANK=${LOG_RANK:-0}

exec torchrun --nproc_per_node="$NGPU" --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
    --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
    -m titan_trainer --job.config_file "$CONFIG_FILE" "$@"
