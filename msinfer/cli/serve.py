"""`msinfer serve`: an OpenAI-compatible HTTP server over the engine, on one device or sharded.

    msinfer serve --model DIR --port 8000
    msinfer launch --nproc 4 --strategy strategies/qwen2_tp4.yaml -- serve --model DIR

Every rank of a sharded job runs this command; rank 0 listens. What each rank then does, and
how the job drains and stops: msinfer/server/api_server.py.
"""
import os

from ..errors import MsinferError
from ..parallel.strategy import PARALLEL_MODES
from ..engine_config import parse_bytes
from ..server.reasoning import PARSERS
from .args import add_llm_arguments


def register(subparsers):
    p = subparsers.add_parser(
        "serve", help="serve a checkpoint over the OpenAI HTTP API",
        description="OpenAI-compatible server (/v1/completions, /v1/chat/completions, "
                    "/v1/models, /health, /metrics). Under mpirun/msrun every rank runs this "
                    "command; rank 0 listens.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: "
                   "127.0.0.1, this host only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", action="append", default=None, metavar="NAME",
                   help="model name clients use (repeatable; default: the --model argument)")
    p.add_argument("--api-key", default=os.environ.get("MSINFER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: "
                        "$MSINFER_API_KEY, else open)")
    p.add_argument("--max-queue", type=int, default=1024,
                   help="waiting requests beyond which new ones get 503 + Retry-After")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    p.add_argument("--stall-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="a step that runs longer, or a rank silent for longer, fails /health "
                        "and ends the job non-zero (default 60; docs/deploy-300i-duo.md)")
    p.add_argument("--reasoning-parser", choices=PARSERS, default=None,
                   help="split chat answers of a thinking model into reasoning_content and "
                        "content, as vLLM's --reasoning-parser (qwen3: <think>...</think>)")
    p.add_argument("--max-request-bytes", type=request_bytes, default=None, metavar="BYTES",
                   help="largest request body; larger ones get 413 unread (default 4MiB; "
                        "units as --kv-cache-memory)")
    p.add_argument("--kv-events-config", type=kv_events_config, default=None, metavar="JSON",
                   help="publish KV-cache events as vLLM does (vLLM's KVEventsConfig, e.g. "
                        "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
                        "\"endpoint\": \"tcp://*:5557\"}'; docs/fleet.md)")
    add_llm_arguments(p, PARALLEL_MODES)
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="keep warm-up's compiled graphs here; a restart of the same "
                        "configuration loads them (default: $MSINFER_COMPILE_CACHE, else "
                        "~/.cache/msinfer/compile; one entry per model, plan, rank, dtype and "
                        "version: docs/engine.md)")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="compile every graph at start, keep none")
    p.add_argument("--lazy-warmup", action="store_true",
                   help="development: ready at once, each graph compiled on its first use "
                        "(the requests of that step wait for it)")
    p.set_defaults(func=run)


def kv_events_config(text):
    from ..server.kv_events import parse_config
    return parse_config(text)


def request_bytes(text):
    return parse_bytes(text, "--max-request-bytes")


def _check_args(args):
    if not 0 < args.port < 65536:
        raise MsinferError(f"--port {args.port}: must be in 1..65535")
    if args.max_queue < 1:
        raise MsinferError(f"--max-queue {args.max_queue}: must be at least 1")
    if args.shutdown_timeout < 0:
        raise MsinferError(f"--shutdown-timeout {args.shutdown_timeout}: must be >= 0")
    if not args.stall_timeout > 0:
        raise MsinferError(f"--stall-timeout {args.stall_timeout}: must be > 0 seconds")


def run(args):
    from ..api import LLM
    from ..engine_config import EngineConfig
    from ..server.api_server import serve
    from ..server.server_config import ServerConfig

    _check_args(args)
    config = ServerConfig.from_args(args)
    return serve(LLM(EngineConfig.from_args(args)), config)
