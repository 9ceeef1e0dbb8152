#!/usr/bin/env bash
# Ascend rank-table mode: one process per device, each told its place by RANK_TABLE_FILE.
#
# When to use: an Ascend server whose HCCL setup comes from a rank table (setups that already
# use hccl_tools-style tables, or no MPI installed). This script starts the ranks of a
# one-server table; for several servers use mpirun (launch/mpirun_qwen2.sh with HOSTFILE and
# RANK_TABLE, which checks the table against the job before it starts). Make
# the table first:  msinfer ranktable generate 0-3 --no-device-ip -o rank_table_4p.json
# (310P hosts without /etc/hccn.conf; see rank_tables/README.md for the other sources).
# Each process gets RANK_TABLE_FILE, RANK_ID and RANK_SIZE here, and msinfer sets DEVICE_ID
# from the table (a DEVICE_ID exported here that disagrees with the table is refused);
# MindSpore's own mpirun mode is not involved, so OMPI_* variables must not be set here.
#
# Knobs: MODEL (required), RANK_TABLE (required), STRATEGY (default
# strategies/qwen2_tp4.yaml), HARDWARE (default atlas-300i-duo), PROMPT, MAX_TOKENS,
# LOG_DIR (default ranktable_log). Extra arguments go to `msinfer generate`.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
MSINFER=${MSINFER:-"$here/.venv/bin/msinfer"}
[ -x "$MSINFER" ] || MSINFER=msinfer
PYTHON=${PYTHON:-"$here/.venv/bin/python"}
[ -x "$PYTHON" ] || PYTHON=python3
: "${MODEL:?set MODEL to a Qwen2 checkpoint directory}"
: "${RANK_TABLE:?set RANK_TABLE to an HCCL rank table (msinfer ranktable generate ...)}"
LOG_DIR=${LOG_DIR:-ranktable_log}
mkdir -p "$LOG_DIR"
"$MSINFER" ranktable check "$RANK_TABLE"
size=$("$PYTHON" -c 'import sys; from msinfer.parallel.ranktable import load
t = load(sys.argv[1]); print(sum(len(s["device"]) for s in t["server_list"]))' "$RANK_TABLE")
pids=()
for ((rank = 0; rank < size; rank++)); do
  RANK_TABLE_FILE="$RANK_TABLE" RANK_ID=$rank RANK_SIZE=$size \
    "$MSINFER" generate --model "$MODEL" --strategy "${STRATEGY:-$here/strategies/qwen2_tp4.yaml}" \
    --hardware "${HARDWARE:-atlas-300i-duo}" --rank-table "$RANK_TABLE" \
    --prompt "${PROMPT:-The capital of France is}" --max-tokens "${MAX_TOKENS:-32}" "$@" \
    > "$LOG_DIR/rank_$rank.log" 2>&1 &
  pids+=($!)
done
# One failed rank stops the job: the others would wait for it in their first collective.
status=0
while [ ${#pids[@]} -gt 0 ]; do
  if wait -n; then :; else status=$?; kill "${pids[@]}" 2>/dev/null || true; break; fi
  alive=(); for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive+=("$p"); done; pids=("${alive[@]}")
done
wait || true
cat "$LOG_DIR/rank_0.log"
exit $status
