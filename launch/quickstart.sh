#!/usr/bin/env bash
# The README's first command: set everything up on a fresh Debian/Ubuntu machine, then run
# the main job, a four-rank sharded Qwen2 generation under mpirun on a small model it makes.
#
#   1. OpenMPI (Debian packages openmpi-bin, libopenmpi-dev) and gcc when missing;
#   2. a virtualenv in .venv with msinfer and its test tools (MindSpore is about 2.5 GB), and
#      .venv-guidellm for guidellm (it needs NumPy 2);
#   3. models/tiny-qwen2: a random-weight Qwen2 checkpoint in Hugging Face layout;
#   4. `msinfer launch --nproc 4`: plan check, then four ranks each holding a quarter of it.
# Safe to run again: finished steps are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

if ! command -v mpirun >/dev/null || ! command -v mpicc >/dev/null || ! command -v gcc >/dev/null \
   || ! command -v g++ >/dev/null
then
  echo "== installing OpenMPI, gcc and g++ (Debian packages; mpi4py compiles against them, msinfer's CPU kernels with g++)"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev gcc g++
fi

if ! command -v prometheus >/dev/null; then
  echo "== installing Prometheus (Debian's; tests/server/test_fleet_server.py scrapes a server with it)"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    prometheus
fi

if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  if ! python3 -m venv .venv; then
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv python3-dev
    python3 -m venv .venv
  fi
fi
if ! .venv/bin/python -c "import msinfer, mindspore, mpi4py, torch, transformers, fastapi, uvicorn, prometheus_client, openai, httpx2, hypothesis, llguidance, jsonschema, lm_eval, tenacity, datasets, accelerate, xdist, zmq, msgpack, vllm_router, schemathesis" 2>/dev/null; then
  echo "== installing msinfer and its dependencies into .venv (MindSpore is about 2.5 GB)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[test]"
fi
# msModelSlim (Ascend's quantization tool; tests/models/test_quantized.py makes its checkpoints with
# it on CPU): --no-deps, since a plain install resolves torch again and pulls a CUDA build.
if ! .venv/bin/python -c "import msmodelslim, easydict, einops, wcmatch, pygtrie" 2>/dev/null; then
  echo "== installing msmodelslim 26.1.0 into .venv (no dependencies: torch is there)"
  .venv/bin/python -m pip install -q --no-deps msmodelslim==26.1.0 easydict==1.13 einops \
    wcmatch bracex pygtrie
fi

# guidellm (tests/server/test_client_guidellm.py, bench/guidellm_compare.py) needs NumPy 2, which
# MindSpore 2.10 cannot import with: its own venv. torch pinned to the CPU build (an unpinned
# one pulls a 6 GB CUDA build).
if [ ! -x .venv-guidellm/bin/guidellm ]; then
  echo "== installing guidellm 0.8.1 into .venv-guidellm (about 1.5 GB)"
  python3 -m venv .venv-guidellm
  .venv-guidellm/bin/python -m pip install -q torch==2.13.0 guidellm==0.8.1
fi

MODEL=models/tiny-qwen2
if [ ! -f "$MODEL/config.json" ]; then
  echo "== making $MODEL (random weights, trained tokenizer)"
  .venv/bin/msinfer make-tiny-model "$MODEL" --layers 4 --hidden 256 --heads 8 --kv-heads 2 \
    --vocab 2048 --seed 0
fi

echo "== main job: 4 ranks under mpirun, strategies/qwen2_tp4.yaml"
.venv/bin/msinfer launch --nproc 4 --strategy strategies/qwen2_tp4.yaml -- \
  generate --model "$MODEL" --prompt "The capital of France is" \
  --prompt "Tensor parallelism splits each layer" --max-tokens 24 --max-len 256
