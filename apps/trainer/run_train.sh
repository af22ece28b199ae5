#!/usr/bin/env bash
# Launch titan-train under torchrun on this machine, or on this machine as one node of several.
#   NGPU=8 CONFIG_FILE=configs/llama3_8b.toml ./run_train.sh --training.steps 100
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 NGPU=8 ./run_train.sh    # on 10.0.0.1, the head
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 NGPU=8 ./run_train.sh    # on the other host
# NGPU: processes to start (default: the CUDA devices, else 1). CONFIG_FILE: a TOML file, or a
# config shipped with titan-trainer by name (llama3_8b, configs/llama3_8b.toml; default
# debug_model; `titan-train --list-configs`). LOG_RANK: ranks whose INFO lines reach the console
# (default 0; e.g. 0,3 or all; every rank shows warnings and errors, and writes all its lines to
# <dump_folder>/logs/rank_<n>.log; the [logging] section of the config says the same).
# MAX_RESTARTS: how often torchrun restarts every rank after one fails (default 0); each restart
# resumes from the newest complete checkpoint.
# PYTHON: the interpreter of the environment that holds titan-trainer (default: in a Titan
# checkout with uv installed, the workspace's environment, which `uv run` installs on first use
# as the README's commands do; else python3 on PATH).
# NNODES (default 1), NODE_RANK, MASTER_ADDR, MASTER_PORT (default 29500, and the port after it):
# a job across NNODES hosts without a scheduler, the same command on each with its own NODE_RANK
# (0 on the head, whose address on the hosts' shared network MASTER_ADDR is: never a loopback
# one); each host runs NGPU ranks through titan_trainer.launch, which names a host that never
# arrives (RDZV_TIMEOUT, default 600 s) or falls silent (LOST_NODE_TIMEOUT, default 60 s) and
# ends the job on every host.
# Extra arguments override the TOML. The run writes under the current folder (job.dump_folder).
# Exit status: torchrun's, 0 only when every rank finished; a rank that SIGTERM stopped (after
# saving a checkpoint) exits 143 and one that Ctrl-C stopped 130 (torchrun's report shows them).
set -euo pipefail

# The python of the environment a folder belongs to: the one whose site-packages hold it (an
# installed titan-trainer), else that of the uv project it is in (UV_PROJECT, as for `uv run`,
# else the nearest uv.lock above it; `uv run` installs the workspace on first use), if uv is here.
environment_python() {
    local dir=$1
    case "$dir" in
    */site-packages/*)
        local prefix=${dir%%/lib/python*/site-packages/*}
        if [ -x "$prefix/bin/python" ]; then
            echo "$prefix/bin/python"
            return
        fi
        ;;
    esac
    command -v uv >/dev/null 2>&1 || return 1
    if [ -n "${UV_PROJECT:-}" ]; then # the project `uv run` itself would use
        uv run --quiet --project "$UV_PROJECT" python -c 'import sys; print(sys.executable)'
        return
    fi
    while [ "$dir" != "/" ] && [ -n "$dir" ]; do
        if [ -f "$dir/uv.lock" ]; then
            uv run --quiet --project "$dir" python -c 'import sys; print(sys.executable)'
            return
        fi
        dir=$(dirname "$dir")
    done
    return 1
}

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
PY=${PYTHON:-$(environment_python "$HERE" || command -v python3 || command -v python || true)}
if [ -z "$PY" ] || ! "$PY" -c "import titan_trainer" 2>/dev/null; then
    echo "run_train.sh: ${PY:-no python} cannot import titan_trainer" >&2
    echo "       set PYTHON to the python of the environment where titan-trainer is installed," >&2
    echo "       or run this script from a Titan checkout with uv installed (pip install uv)" >&2
    exit 1
fi

# Resolved the way titan-train resolves it; a name that finds nothing fails here, before torchrun.
CONFIG_FILE=$("$PY" -m titan_trainer --config-path "${CONFIG_FILE:-debug_model}")
if [ -z "${NGPU:-}" ]; then
    NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count() or 1)" 2>/dev/null || echo 1)
fi
export LOG_RANK=${LOG_RANK:-0}

NNODES=${NNODES:-1}
if [ "$NNODES" -gt 1 ]; then
    : "${NODE_RANK:?run_train.sh: NNODES=$NNODES needs NODE_RANK (0 on the head host, 1 .. NNODES-1 on the others)}"
    : "${MASTER_ADDR:?run_train.sh: NNODES=$NNODES needs MASTER_ADDR: the address of the head host that every host reaches}"
    case "$MASTER_ADDR" in
    127.* | ::1 | localhost)
        echo "run_train.sh: MASTER_ADDR=$MASTER_ADDR is a loopback address: the other hosts cannot reach it;" >&2
        echo "       set it to the head host's address on the network the hosts share" >&2
        exit 1
        ;;
    esac
fi

# Once, before torchrun starts any rank: the checks every run makes (the config for the job's
# NNODES x NGPU processes, the tokenizer, each dataset's first document read). A problem is said
# once, here (on each host of a multi-host job: each reads its own copy of the data).
WORLD_SIZE=$((NNODES * NGPU)) "$PY" -m titan_trainer --check --job.config_file "$CONFIG_FILE" "$@"
export TITAN_DATA_CHECKED=1

if [ "$NNODES" -gt 1 ]; then
    exec "$PY" -m titan_trainer.launch --nnodes "$NNODES" --node-rank "$NODE_RANK" \
        --nproc-per-node "$NGPU" --master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-29500}" \
        --max-restarts "${MAX_RESTARTS:-0}" --join-timeout "${RDZV_TIMEOUT:-600}" \
        --lost-after "${LOST_NODE_TIMEOUT:-60}" -- --job.config_file "$CONFIG_FILE" "$@"
fi
exec "$PY" -m torch.distributed.run --nproc_per_node="$NGPU" --max-restarts="${MAX_RESTARTS:-0}" \
    --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
    -m titan_trainer --job.config_file "$CONFIG_FILE" "$@"
