#!/usr/bin/env bash
# An OpenAI-compatible server for a Qwen2 checkpoint: one process, or NPROC ranks under mpirun.
#
# When to use: serving a model to HTTP clients (curl, the openai package, LangChain, ...).
# With NPROC > 1 every rank runs `msinfer serve`; rank 0 listens on HOST:PORT and keeps the
# others in step. Stop it with Ctrl-C or SIGTERM: new requests get 503, in-flight ones finish.
#
# Knobs (environment variables):
#   MODEL        checkpoint directory (required)
#   NPROC        processes (default 1: one device; 4 with STRATEGY for tensor parallel x4)
#   STRATEGY     strategy file when NPROC > 1 (default strategies/qwen2_tp4.yaml)
#   HARDWARE     hardware profile: cpu, atlas-300i-duo, atlas-800i-a2 ... (default cpu)
#   HOST, PORT   where rank 0 listens (default 127.0.0.1:8000; 0.0.0.0 for other machines)
#   MODEL_NAME   the name clients send as "model" (default: MODEL)
#   API_KEY      require "Authorization: Bearer API_KEY" (default: open)
#   MAX_LEN      longest prompt + output (default: the model's, at most the planner's default)
#   HOSTFILE     an mpirun hostfile for several servers (see hostfile.example)
# Extra arguments are passed to `msinfer serve`, e.g. --max-num-seqs 16 --max-queue 64.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
MSINFER=${MSINFER:-"$here/.venv/bin/msinfer"}
[ -x "$MSINFER" ] || MSINFER=msinfer
: "${MODEL:?set MODEL to a Qwen2 checkpoint directory}"
serve=(serve --model "$MODEL" --host "${HOST:-127.0.0.1}" --port "${PORT:-8000}")
[ -n "${MODEL_NAME:-}" ] && serve+=(--served-model-name "$MODEL_NAME")
[ -n "${API_KEY:-}" ] && serve+=(--api-key "$API_KEY")
[ -n "${MAX_LEN:-}" ] && serve+=(--max-len "$MAX_LEN")
if [ "${NPROC:-1}" = 1 ]; then
  exec "$MSINFER" "${serve[@]}" --hardware "${HARDWARE:-cpu}" "$@"
fi
hostfile=()
[ -n "${HOSTFILE:-}" ] && hostfile=(--hostfile "$HOSTFILE")
exec "$MSINFER" launch --nproc "$NPROC" --strategy "${STRATEGY:-$here/strategies/qwen2_tp4.yaml}" \
  --hardware "${HARDWARE:-cpu}" "${hostfile[@]}" -- "${serve[@]}" "$@"
