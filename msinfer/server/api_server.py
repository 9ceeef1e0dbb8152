"""Running `msinfer serve` on one rank: `serve(llm, options)`, until the job stops.

Every rank of a sharded job runs it. Rank 0 listens for HTTP and drives the engine loop; the
others follow it step for step (lockstep.py) over the hand-off channel (handoff.py). SIGTERM
(or Ctrl-C) on rank 0 drains: new requests get 503, in-flight ones have `shutdown_timeout`
seconds to finish, then the job exits 0. A rank that disappears fails /health at once and
takes the job down (exit 1) within seconds.
"""
import dataclasses
import os
import signal
import socket
import threading
import time

from .. import log
from ..errors import MsinferError
from .handoff import PeerGone, log_summary, open_channel
from .lockstep import follow

_DEAD_RANK_GRACE = 2.0  # seconds /health reports the failure before rank 0 exits


@dataclasses.dataclass
class ServeOptions:
    model_names: list  # names clients use; the first is reported back in responses
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str = None  # None: /v1 is open
    max_queue: int = 1024  # waiting requests beyond which new ones get 503 + Retry-After
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish after SIGTERM
    max_request_bytes: int = None  # larger request bodies get 413; None: 4 MiB (serving.py)


def serve(llm, options):
    """Serve `llm` (an api.LLM) on this rank until the job stops; returns the exit code (0).
    A rank of the job that disappears ends this process with exit code 1."""
    logger = log.get()
    logger.info("serve: rank %d is process %d", llm.dist.rank, os.getpid())
    channel = open_channel(llm.dist)
    if llm.dist.rank != 0:
        return _follow(llm, channel)
    return _lead(llm, channel, options)


def _follow(llm, channel):
    logger = log.get()
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


def _die(message):
    log.get().error("%s: leaving the job", message)
    os._exit(1)


def _lead(llm, channel, options):
    import uvicorn

    from .app import build_app
    from .lockstep import EngineLoop
    from .metrics import ServerMetrics
    from .serving import DEFAULT_MAX_REQUEST_BYTES, ServerConfig

    logger = log.get()
    names = options.model_names
    try:
        listener = socket.create_server((options.host, options.port))
    except OSError as e:
        raise MsinferError(f"cannot listen on {options.host}:{options.port}: "
                           f"{e.strerror}") from None
    metrics = ServerMetrics(names[0], llm.engine.stats(),
                            max_model_len=llm.engine.max_model_len)
    loop = EngineLoop(llm.engine, channel, metrics)
    config = ServerConfig(model_names=names, max_model_len=llm.engine.max_model_len,
                          api_key=options.api_key, max_queue=options.max_queue,
                          max_request_bytes=options.max_request_bytes
                          or DEFAULT_MAX_REQUEST_BYTES,
                          root=getattr(llm, "model_dir", None),
                          vocab_size=getattr(getattr(llm, "config", None), "vocab_size", None))
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
                    signal.Signals(sig).name, options.shutdown_timeout)
        loop.drain(options.shutdown_timeout)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, drain)
    channel.watch(rank_gone)
    start = time.monotonic()
    llm.engine.warmup()
    loop.open()
    logger.info("serve: warm after %.1fs; listening on http://%s:%d (model %s)",
                time.monotonic() - start, options.host, listener.getsockname()[1], names[0])
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
