"""Running `msinfer serve` on one rank: `serve(llm, options)`, until the job stops.

Every rank of a sharded job runs it, in one of three roles (handoff.py connects them):
- rank 0, the front end: listens for HTTP, routes each request to a data replica
  (replicas.py) and leads replica 0's tensor group (lockstep.py);
- the first rank of every other tensor group leads its replica: it takes rank 0's requests,
  steps its group and reports the outputs back;
- every other rank follows its group's leader step for step.

SIGTERM (or Ctrl-C) on rank 0 drains: new requests get 503, in-flight ones have
`shutdown_timeout` seconds to finish, then the job exits 0. A rank that dies, stalls (a step
longer than `stall_timeout`, or silence that long) or falls out of step fails /health at once
and ends the job non-zero within `stall_timeout` + a few seconds, with a message naming it.
"""
import dataclasses
import os
import signal
import socket
import threading
import time

from .. import log
from ..errors import MsinferError
from .handoff import (EXIT_WAIT, PeerGone, log_summary, open_links, start_heartbeats,
                      wait_hung_up, watch_links)
from .lockstep import EngineLoop, RanksDiverged, ServerBusy, StepWatch, follow

_DEAD_RANK_GRACE = 2.0  # seconds /health reports the failure before rank 0 exits
_REPORT_WAIT = _DEAD_RANK_GRACE + 3.0  # seconds a failing rank waits for its leader to go


@dataclasses.dataclass
class ServeOptions:
    model_names: list  # names clients use; the first is reported back in responses
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str = None  # None: /v1 is open
    max_queue: int = 1024  # waiting requests beyond which new ones get 503 + Retry-After
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish after SIGTERM
    max_request_bytes: int = None  # larger request bodies get 413; None: 4 MiB (serving.py)
    stall_timeout: float = 60.0  # a step or a silence longer than this ends the job
    reasoning_parser: str = None  # "qwen3": chat answers' <think> part as reasoning_content
    lazy_warmup: bool = False  # ready at once, graphs compiled on first use (development)
    kv_events_config: dict = None  # vLLM's KVEventsConfig: publish KV-cache events (kv_events.py)


def serve(llm, options):
    """Serve `llm` (an api.LLM) on this rank until the job stops; returns the exit code (0).
    A failure anywhere in the job ends this process with exit code 1."""
    logger = log.get()
    rank = llm.dist.rank
    logger.info("serve: rank %d is process %d", rank, os.getpid())
    group = llm.dist.world_size // llm.replicas
    links = open_links(llm.dist, group, silence=options.stall_timeout)
    if rank == 0:
        return _front(llm, links, options)
    if rank % group == 0:
        return _replica(llm, links, options)
    return _follow(llm, links.channel, options)


def _warmup(llm, options, on_shape=None):
    if not options.lazy_warmup:
        llm.warmup(on_shape)
        return
    log.get().warning("lazy warm-up: ready at once; each graph compiles on its first use "
                      "(warm-up would run %d calls), and the requests of that step wait for it "
                      "(development only)", len(llm.engine.runner.shapes()))


def _compiling(llm):
    """Whether this rank's runner compiles a graph in the step in progress (None: cannot
    say): the stall watch waits for a compile (lockstep.StepWatch)."""
    runner = getattr(llm.engine, "runner", None)
    if runner is None:
        return None
    return lambda: runner.compiling_since is not None


def _die(message):
    log.get().error("%s: leaving the job", message)
    os._exit(1)


def _die_after(link, message):
    """Leave once the leader at the other end of `link` has gone (at most `_REPORT_WAIT` s),
    after reporting `message` to it: the launcher aborts the whole job as soon as any rank
    exits non-zero, so rank 0 must go first, once it has answered its clients."""
    # said now: the launcher may kill this rank as soon as its leader exits
    log.get().error("%s: leaving the job once its leader has gone (at most %.0fs)", message,
                    _REPORT_WAIT)
    deadline = time.monotonic() + _REPORT_WAIT
    while not link.hung_up() and time.monotonic() < deadline:
        time.sleep(0.05)
    os._exit(1)


def _die_after_rank0(channel, message):
    """A follower whose leader or job is gone leaves once rank 0 has had the time to answer
    its clients (it exits `_DEAD_RANK_GRACE` s after hearing of a failure): the launcher ends
    every rank as soon as one exits non-zero, and a follower that went at once cut rank 0's
    clients off mid-response. Its leader rank 0: until rank 0 hangs up; another leader (gone
    itself): `_REPORT_WAIT` s."""
    if channel.leader_rank == 0:
        _die_after(channel.link, message)
    log.get().error("%s: leaving the job in %.0fs, after rank 0", message, _REPORT_WAIT)
    time.sleep(_REPORT_WAIT)
    _die(message)


def _ignore_signals():
    """Rank 0 decides when the job stops (it drains first); a signal elsewhere waits for it."""
    logger = log.get()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: logger.info("signal: rank 0 decides when to stop"))


def _follow(llm, channel, options):
    rank = llm.dist.rank

    def leave(message):
        channel.report(message)
        _die_after(channel.link, message)
    _ignore_signals()
    channel.watch(lambda message: _die_after_rank0(channel, message))
    watch = StepWatch(options.stall_timeout, leave, rank, _compiling(llm))
    _warmup(llm, options)
    try:
        follow(llm.engine, channel, rank, watch)
    except PeerGone as e:
        _die_after_rank0(channel, str(e))
    except RanksDiverged as e:
        leave(str(e))
    except Exception as e:  # noqa: BLE001 - whatever it is, the leader must hear it
        log.get().exception("rank %d failed", rank)
        leave(f"rank {rank} failed: {type(e).__name__}: {e}")
    log_summary(channel)
    return 0


def _replica(llm, links, options):
    """Lead replica `rank // group`: rank 0's requests in, this group's outputs out."""
    from .replicas import ReplicaUplink

    rank, front, channel = llm.dist.rank, links.front, links.channel
    replica = llm.shard_plan.data_rank(rank)
    uplink = ReplicaUplink(front)
    stopped = threading.Event()

    def fail(message):
        channel.fail(message)
        stopped.set()  # rank 0 going is expected from now on
        front.tell({"error": message})
        _die_after(front, message)
    _ignore_signals()
    if options.kv_events_config:
        from .kv_events import publish
        publish(llm.engine, options.kv_events_config, rank=replica)
    loop = EngineLoop(llm.engine, channel, on_step=uplink.on_step, replica=replica,
                      watch=StepWatch(options.stall_timeout, fail, rank,
                                           _compiling(llm)))
    channel.watch(fail)
    start_heartbeats([front], stopped.is_set)

    def take_requests():
        while True:
            try:
                frame = front.recv(timeout=options.stall_timeout)
            except PeerGone as e:
                if not stopped.is_set():
                    channel.fail(str(e))
                    _die(str(e))
                return
            if uplink.take(loop, frame):
                continue
            if "fail" in frame:  # rank 0 answers its clients, then goes: after it
                channel.fail(frame["fail"])
                _die_after(front, f"the job failed: {frame['fail']}")
            elif "stop" in frame:
                return
    _warmup(llm, options)
    loop.open()
    reader = threading.Thread(target=take_requests, daemon=True, name="msinfer-front-link")
    reader.start()
    front.send({"ready": dataclasses.astuple(llm.engine.stats())})
    try:
        loop.run()
    except Exception as e:  # noqa: BLE001 - rank 0 must hear it
        if not loop.failure:
            log.get().exception("replica %d's engine loop stopped", replica)
        fail(f"replica {replica} (rank {rank}): engine loop stopped: {e}")
    channel.close()
    log_summary(channel)
    front.send({"done": 1})
    reader.join(timeout=options.stall_timeout)  # until rank 0 says stop: then it expects us gone
    stopped.set()
    log.get().info("serve: replica %d stopped after %d steps", replica, loop.steps)
    return 0


def _front(llm, links, options):
    import uvicorn

    from .app import build_app
    from .metrics import ServerMetrics
    from .replicas import RemoteReplica, Router
    from .serving import DEFAULT_MAX_REQUEST_BYTES, ServerConfig

    logger = log.get()
    names = options.model_names
    try:
        listener = socket.create_server((options.host, options.port))
    except OSError as e:
        raise MsinferError(f"cannot listen on {options.host}:{options.port}: "
                           f"{e.strerror}") from None
    channel = links.channel
    metrics = ServerMetrics(names[0], llm.engine.stats(), replicas=llm.replicas,
                            max_model_len=llm.engine.max_model_len,
                            speculative=getattr(llm.engine, "speculative", None))
    remotes = [RemoteReplica(i, link, on_step=metrics.observer(i))
               for i, link in enumerate(links.replicas, start=1)]
    stopping = threading.Event()
    failing = threading.Lock()

    def rank_gone(message):
        if not failing.acquire(blocking=False):
            return  # already going down
        logger.error("%s: /health fails now, rank 0 exits in %.0fs", message,
                     _DEAD_RANK_GRACE)
        router.fail(message)
        router.fail_all(message)
        channel.fail(message)
        for remote in remotes:
            remote.stop(message)
        time.sleep(_DEAD_RANK_GRACE)
        os._exit(1)

    loop = EngineLoop(llm.engine, channel, replica=0,
                      on_step=metrics.observer(0),
                      watch=StepWatch(options.stall_timeout, rank_gone, 0,
                                      _compiling(llm)))
    router = Router(loop, remotes, llm.engine)
    kv_endpoints = ()
    if options.kv_events_config:
        from .kv_events import offset_endpoint, publish
        publish(llm.engine, options.kv_events_config)
        kv_endpoints = tuple(offset_endpoint(options.kv_events_config["endpoint"], r)
                             for r in range(llm.replicas))
    config = ServerConfig(model_names=names, max_model_len=llm.engine.max_model_len,
                          api_key=options.api_key, max_queue=options.max_queue,
                          max_request_bytes=options.max_request_bytes
                          or DEFAULT_MAX_REQUEST_BYTES,
                          root=getattr(llm, "model_dir", None),
                          vocab_size=getattr(getattr(llm, "config", None), "vocab_size", None),
                          reasoning_parser=options.reasoning_parser,
                          max_num_seqs=getattr(llm.engine, "max_num_seqs", None),
                          kv_events=options.kv_events_config, kv_events_endpoints=kv_endpoints)
    app = build_app(router, llm.tokenizer, config, metrics)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=5))
    http = threading.Thread(target=server.run, kwargs={"sockets": [listener]},
                            name="msinfer-http", daemon=True)
    http.start()

    warm, signals = threading.Event(), []

    def drain(sig, frame):
        """The first signal drains; a second ends the drain: in-flight requests are aborted
        at once, or, still warming up, the job ends (non-zero) without waiting for it."""
        signals.append(sig)
        name = signal.Signals(sig).name
        if len(signals) == 1:
            logger.info("%s: draining (new requests get 503; in-flight ones have %.0fs)",
                        name, options.shutdown_timeout)
            router.drain(options.shutdown_timeout)
        elif not warm.is_set():
            _die(f"{name}: a second signal during warm-up")
        else:
            logger.info("%s: a second signal: aborting in-flight requests now", name)
            router.drain(0)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, drain)
    channel.watch(rank_gone)
    if remotes:
        by_link = {remote.link: remote for remote in remotes}
        start_heartbeats(list(by_link), stopping.is_set)
        threading.Thread(target=watch_links, daemon=True, name="msinfer-watch-replicas",
                         args=(list(by_link), stopping.is_set, rank_gone,
                               options.stall_timeout,
                               lambda link, frame: by_link[link].on_frame(link, frame))).start()
    start = time.monotonic()
    _warmup(llm, options, lambda text: setattr(router, "warming", f"warming up: {text}"))
    router.warming = None
    warm.set()
    loop.open()
    # the other replicas warm up too; a drain (a signal during warm-up) does not wait for them
    while not (router.ready or router.failure or router.draining):
        time.sleep(0.1)
    logger.info("serve: warm after %.1fs; listening on http://%s:%d (model %s, %d replica%s)",
                time.monotonic() - start, options.host, listener.getsockname()[1], names[0],
                router.replicas, "s" if router.replicas > 1 else "")
    try:
        loop.run()
    except Exception as e:  # the job is failing (a rank's report), or the engine failed
        if not router.failure:
            logger.exception("engine loop stopped")
        rank_gone(f"engine loop stopped: {e}")  # returns at once when already failing
        threading.Event().wait()  # for the failing thread to end the process
    for remote in remotes:  # they drain as long as replica 0 did, then report done
        if not remote.done.wait(timeout=options.shutdown_timeout + options.stall_timeout):
            rank_gone(f"replica {remote.index} did not stop after draining")
    stopping.set()
    for remote in remotes:
        remote.stop()
    wait_hung_up([remote.link for remote in remotes], EXIT_WAIT)  # rank 0 leaves last
    channel.close()
    log_summary(channel)
    server.should_exit = True
    http.join(timeout=10)
    logger.info("serve: stopped after %d steps", loop.steps)
    return 0
