#!/usr/bin/env bash
# Four-process sharded Qwen2 generation under mpirun: the usual way to run msinfer.
#
# When to use: one server with NPROC devices (Ascend NPUs, or CPU processes for a try-out).
# mpirun only spawns the processes; msinfer joins them into one MindSpore job (on CPU through
# MindSpore's dynamic cluster, on Ascend through HCCL) and checks the plan before loading.
#
# Knobs (environment variables):
#   MODEL       checkpoint directory (required)
#   STRATEGY    strategy file (default strategies/qwen2_tp4.yaml)
#   NPROC       processes = the strategy's world_size (default 4)
#   HARDWARE    hardware profile: cpu, atlas-300i-duo, atlas-800i-a2 ... (default cpu)
#   PROMPT      the prompt (default "The capital of France is")
#   MAX_TOKENS  tokens to generate (default 32)
#   HOSTFILE    an mpirun hostfile for several servers (see hostfile.example)
#   RANK_TABLE  an HCCL rank table: Ascend rank-table mode, each rank on the table's device
#               (an exported RANK_TABLE_FILE does the same on Ascend)
# Extra arguments are passed to `msinfer generate`, e.g. --json or --temperature 0.7.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
MSINFER=${MSINFER:-"$here/.venv/bin/msinfer"}
[ -x "$MSINFER" ] || MSINFER=msinfer
: "${MODEL:?set MODEL to a Qwen2 checkpoint directory}"
hostfile=()
[ -n "${HOSTFILE:-}" ] && hostfile=(--hostfile "$HOSTFILE")
rank_table=()
[ -n "${RANK_TABLE:-}" ] && rank_table=(--rank-table "$RANK_TABLE")
exec "$MSINFER" launch --nproc "${NPROC:-4}" --strategy "${STRATEGY:-$here/strategies/qwen2_tp4.yaml}" \
  --hardware "${HARDWARE:-cpu}" "${hostfile[@]}" "${rank_table[@]}" -- \
  generate --model "$MODEL" --prompt "${PROMPT:-The capital of France is}" \
  --max-tokens "${MAX_TOKENS:-32}" "$@"
