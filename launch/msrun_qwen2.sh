#!/usr/bin/env bash
# Sharded Qwen2 generation under msrun, MindSpore's own launcher (no MPI needed).
#
# When to use: MindSpore installations without OpenMPI, or to match MindFormers' scripts.
# `msinfer launch --launcher msrun` checks the plan, then msrun starts its scheduler and NPROC
# workers, each running `msinfer generate`; worker logs go to LOG_DIR (worker_N.log) and are
# echoed to the console while the job runs.
#
# Knobs (environment variables): MODEL (required), STRATEGY (default strategies/qwen2_tp4.yaml),
# NPROC (default 4), HARDWARE (default cpu), PROMPT, MAX_TOKENS (default 32),
# LOG_DIR (default msrun_log). Extra arguments are passed to `msinfer generate`.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
MSINFER=${MSINFER:-"$here/.venv/bin/msinfer"}
[ -x "$MSINFER" ] || MSINFER=msinfer
: "${MODEL:?set MODEL to a Qwen2 checkpoint directory}"
exec "$MSINFER" launch --launcher msrun --log-dir "${LOG_DIR:-msrun_log}" --nproc "${NPROC:-4}" \
  --strategy "${STRATEGY:-$here/strategies/qwen2_tp4.yaml}" --hardware "${HARDWARE:-cpu}" -- \
  generate --model "$MODEL" --prompt "${PROMPT:-The capital of France is}" \
  --max-tokens "${MAX_TOKENS:-32}" "$@"
