"""`msinfer serve`: an OpenAI-compatible HTTP server over the engine, on one device or sharded.

    msinfer serve --model DIR --port 8000
    msinfer launch --nproc 4 --strategy strategies/qwen2_tp4.yaml -- serve --model DIR

Every rank of a sharded job runs this command. Rank 0 listens for HTTP and drives the engine
loop; the others follow it step for step (msinfer/server/lockstep.py). SIGTERM (or Ctrl-C)
on rank 0 drains: new requests get 503, in-flight ones have --shutdown-timeout seconds to
finish, then the job exits 0. A rank that disappears fails /health at once and takes the job
down (exit 1) within seconds.
"""
import os
import signal
import socket
import threading
import time

from .. import log
from ..errors import MsinferError
from .args import add_engine_arguments

_DEAD_RANK_GRACE = 2.0  # seconds /health reports the failure before rank 0 exits


def register(subparsers):
    p = subparsers.add_parser(
        "serve", help="serve a checkpoint over the OpenAI HTTP API",
        description="OpenAI-compatible server (/v1/completions, /v1/chat/completions, "
                    "/v1/models, /health, /metrics). Under mpirun/msrun every rank runs this "
                    "command; rank 0 listens.")
    p.add_argument("--model", required=True, help="checkpoint directory")
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
    p.add_argument("--strategy", default=None, help="strategy YAML (default: one device)")
    p.add_argument("--hardware", default="cpu", help="hardware profile (default: cpu)")
    p.add_argument("--parallel-mode", choices=("explicit", "semi_auto"), default=None)
    add_engine_arguments(p)
    p.add_argument("--dtype", default=None, help="compute dtype override")
    p.add_argument("--rank-table", default=None, help="HCCL rank table (Ascend rank-table mode)")
    p.set_defaults(func=run)


def _check_args(args):
    if not 0 < args.port < 65536:
        raise MsinferError(f"--port {args.port}: must be in 1..65535")
    if args.max_queue < 1:
        raise MsinferError(f"--max-queue {args.max_queue}: must be at least 1")
    if args.shutdown_timeout < 0:
        raise MsinferError(f"--shutdown-timeout {args.shutdown_timeout}: must be >= 0")


def run(args):
    from ..api import LLM
    from ..server.handoff import PeerGone, log_summary, open_channel
    from ..server.lockstep import follow

    _check_args(args)
    llm = LLM(args.model, strategy=args.strategy, hardware=args.hardware,
              parallel_mode=args.parallel_mode, max_len=args.max_len, dtype=args.dtype,
              rank_table=args.rank_table, kv_cache_memory=args.kv_cache_memory,
              block_size=args.block_size, max_prefill_tokens=args.max_prefill_tokens,
              max_num_seqs=args.max_num_seqs)
    logger = log.get()
    logger.info("serve: rank %d is process %d", llm.dist.rank, os.getpid())
    channel = open_channel(llm.dist)
    if llm.dist.rank != 0:
        # Rank 0 decides when the job stops (it drains first); a signal here waits for it.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: logger.info("signal: rank 0 decides when to stop"))
        channel.watch(_die)
        llm.engine.warmup()
        try:
            follow(llm.engine, channel)
        except PeerGone as e:
            _die(str(e))
        log_summary(channel)
        return 0
    return _lead(args, llm, channel)


def _die(message):
    log.get().error("%s: leaving the job", message)
    os._exit(1)


def _lead(args, llm, channel):
    import uvicorn

    from ..server.app import ServerConfig, build_app
    from ..server.handoff import log_summary
    from ..server.lockstep import EngineLoop
    from ..server.metrics import ServerMetrics

    logger = log.get()
    names = args.served_model_name or [args.model]
    try:
        listener = socket.create_server((args.host, args.port))
    except OSError as e:
        raise MsinferError(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from None
    metrics = ServerMetrics(names[0], llm.engine.stats())
    loop = EngineLoop(llm.engine, channel, metrics)
    config = ServerConfig(model_names=names, max_model_len=llm.engine.max_model_len,
                          api_key=args.api_key, max_queue=args.max_queue)
    app = build_app(loop, llm.tokenizer, config, metrics)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=5))
    http = threading.Thread(target=server.run, kwargs={"sockets": [listener]},
                            name="msinfer-http", daemon=True)
    http.start()

    def rank_gone(message):
        logger.error("%s: /health fails now, rank 0 exits in %.0fs", message,
                     _DEAD_RANK_GRACE)
        loop.fail(message)
        loop.fail_all(message)
        time.sleep(_DEAD_RANK_GRACE)
        os._exit(1)

    def drain(sig, frame):
        logger.info("%s: draining (new requests get 503; in-flight ones have %.0fs)",
                    signal.Signals(sig).name, args.shutdown_timeout)
        loop.drain(args.shutdown_timeout)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, drain)
    channel.watch(rank_gone)
    start = time.monotonic()
    llm.engine.warmup()
    loop.open()
    logger.info("serve: warm after %.1fs; listening on http://%s:%d (model %s)",
                time.monotonic() - start, args.host, listener.getsockname()[1], names[0])
    try:
        loop.run()
    except Exception as e:  # a rank vanished mid-step, or the engine failed
        logger.exception("engine loop stopped")
        rank_gone(f"engine loop stopped: {e}")
    channel.close()
    log_summary(channel)
    server.should_exit = True
    http.join(timeout=10)
    logger.info("serve: stopped after %d steps", loop.steps)
    return 0
