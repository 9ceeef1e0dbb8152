#!/usr/bin/env bash
# Sharded Qwen2 generation under msrun, MindSpore's own launcher (no MPI needed).
#
# When to use: MindSpore installations without OpenMPI, or to match MindFormers' scripts.
# msrun starts its scheduler and NPROC workers; each worker runs `msinfer generate`.
# Logs of every worker go to LOG_DIR (worker_N.log); rank 0's results are printed from there.
#
# Knobs: MODEL (required), STRATEGY (default strategies/qwen2_tp4.yaml), NPROC (default 4),
# HARDWARE (default cpu), PROMPT, MAX_TOKENS, MASTER_PORT (default: a free port),
# LOG_DIR (default msrun_log). Extra arguments go to `msinfer generate`.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-"$here/.venv/bin/python"}
[ -x "$PYTHON" ] || PYTHON=python3
: "${MODEL:?set MODEL to a Qwen2 checkpoint directory}"
NPROC=${NPROC:-4}
LOG_DIR=${LOG_DIR:-msrun_log}
MASTER_PORT=${MASTER_PORT:-$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}
MSRUN=$(dirname "$PYTHON")/msrun
[ -x "$MSRUN" ] || MSRUN=msrun
"$MSRUN" --worker_num="$NPROC" --local_worker_num="$NPROC" --master_port="$MASTER_PORT" \
  --log_dir="$LOG_DIR" --join=True --cluster_time_out=300 \
  "$here/launch/msinfer_generate.py" --model "$MODEL" \
  --strategy "${STRATEGY:-$here/strategies/qwen2_tp4.yaml}" --hardware "${HARDWARE:-cpu}" \
  --prompt "${PROMPT:-The capital of France is}" --max-tokens "${MAX_TOKENS:-32}" "$@"
status=$?
grep -v '^\[' "$LOG_DIR/worker_0.log" | grep -v -e WARNING -e '^$' || true
exit $status
