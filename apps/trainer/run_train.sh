#!/usr/bin/env bash
# Launch titan-train under torchrun on this machine.
#   NGPU=8 CONFIG_FILE=configs/llama3_8b.toml ./run_train.sh --training.steps 100
# NGPU: processes to start (default: the CUDA devices, else 1). CONFIG_FILE: a TOML file, or a
# config shipped with titan-trainer by name (llama3_8b, configs/llama3_8b.toml; default
# debug_model; `titan-train --list-configs`). LOG_RANK: ranks whose INFO lines reach the console
# (default 0; e.g. 0,3 or all; every rank shows warnings and errors, and writes all its lines to
# <dump_folder>/logs/rank_<n>.log; the [logging] section of the config says the same).
# MAX_RESTARTS: how often torchrun restarts every rank after one fails (default 0); each restart
# resumes from the newest complete checkpoint.
# Extra arguments override the TOML. The run writes under the current folder (job.dump_folder).
# Exit status: torchrun's, 0 only when every rank finished; a rank that SIGTERM stopped (after
# saving a checkpoint) exits 143 and one that Ctrl-C stopped 130 (torchrun's report shows them).
set -euo pipefail

# Resolved the way titan-train resolves it; a name that finds nothing fails here, before torchrun.
CONFIG_FILE=$(python -m titan_trainer --config-path "${CONFIG_FILE:-debug_model}")
if [ -z "${NGPU:-}" ]; then
    NGPU=$(python -c "import torch; print(torch.cuda.device_count() or 1)" 2>/dev/null || echo 1)
fi
export LOG_RANK=${LOG_RANK:-0}

exec torchrun --nproc_per_node="$NGPU" --max-restarts="${MAX_RESTARTS:-0}" --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
    -m titan_trainer --job.config_file "$CONFIG_FILE" "$@"
