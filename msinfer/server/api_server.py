"""Running `msinfer serve` on one rank: `serve(llm, config)`, until the job stops.

Every rank of a sharded job runs it, in one of three roles (handoff.py connects them):
- rank 0, the front end (`FrontEnd`): listens for HTTP, routes each request to a data
  replica (replicas.py) and leads replica 0's tensor group (lockstep.py);
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
from .lockstep import EngineLoop, RanksDiverged, StepWatch, follow

_DEAD_RANK_GRACE = 2.0  # seconds /health reports the failure before rank 0 exits
_REPORT_WAIT = _DEAD_RANK_GRACE + 3.0  # seconds a failing rank waits for its leader to go


def serve(llm, config):
    """Serve `llm` (an api.LLM; its engine's settings are `llm.engine_config`) on this rank
    until the job stops, with the server's settings `config` (a ServerConfig); returns the
    exit code (0). A failure anywhere in the job ends this process with exit code 1."""
    logger = log.get()
    rank = llm.dist.rank
    logger.info("serve: rank %d is process %d", rank, os.getpid())
    group = llm.dist.world_size // llm.replicas
    links = open_links(llm.dist, group, silence=config.stall_timeout)
    if rank == 0:
        front = FrontEnd(llm, links, config)
        front.start()
        front.run()
        return front.stop()
    if rank % group == 0:
        return _replica(llm, links, config)
    return _follow(llm, links.channel, config)


def _warmup(llm, config, on_shape=None):
    if not config.lazy_warmup:
        llm.warmup(on_shape)
        return
    log.get().warning("lazy warm-up: ready at once; each graph compiles on its first use "
                      "(warm-up would run %d calls), and the requests of that step wait for it "
                      "(development only)", llm.engine.warmup_calls())


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


def _follow(llm, channel, config):
    rank = llm.dist.rank

    def leave(message):
        channel.report(message)
        _die_after(channel.link, message)
    _ignore_signals()
    channel.watch(lambda message: _die_after_rank0(channel, message))
    watch = StepWatch(config.stall_timeout, leave, rank, llm.engine.compiling)
    _warmup(llm, config)
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


def _replica(llm, links, config):
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
    if config.kv_events:
        from .kv_events import publish
        publish(llm.engine, config.kv_events, rank=replica)
    loop = EngineLoop(llm.engine, channel, on_step=uplink.on_step, replica=replica,
                      watch=StepWatch(config.stall_timeout, fail, rank, llm.engine.compiling))
    channel.watch(fail)
    start_heartbeats([front], stopped.is_set)
    _warmup(llm, config)
    loop.open()
    reader = threading.Thread(target=_take_requests, daemon=True, name="msinfer-front-link",
                              args=(front, channel, uplink, loop, stopped,
                                    config.stall_timeout))
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
    reader.join(timeout=config.stall_timeout)  # until rank 0 says stop: then it expects us gone
    stopped.set()
    front.close()  # rank 0 waits for this hang-up, not for this process's end (Leader.close)
    log.get().info("serve: replica %d stopped after %d steps", replica, loop.steps)
    return 0


def _take_requests(front, channel, uplink, loop, stopped, timeout):
    """A replica leader's reader of rank 0's frames (`front`): requests, aborts and drains
    to its engine `loop` (through `uplink`), until rank 0 says stop; rank 0 failing or gone
    (unless `stopped`: expected) ends the process."""
    while True:
        try:
            frame = front.recv(timeout=timeout)
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


class FrontEnd:
    """Rank 0: the HTTP server, the router over the data replicas, and the engine loop of
    replica 0. `start` listens, warms up and waits until every replica is ready; `run` steps
    replica 0 until drained; `drain` (the handler of SIGTERM and SIGINT) stops taking
    requests; `stop` waits for the other replicas, then closes the links and the server. A
    failure anywhere in the job (`fail`) fails /health, then ends the process non-zero."""

    def __init__(self, llm, links, config):
        from .metrics import ServerMetrics
        from .replicas import RemoteReplica, Router

        self.llm, self.config, self.channel = llm, config, links.channel
        self.listener = _listen(config)
        engine = llm.engine
        self.metrics = ServerMetrics(config.model_names[0], llm.engine_config, engine.stats(),
                                     replicas=llm.replicas)
        self.remotes = [RemoteReplica(i, link, on_step=self.metrics.observer(i))
                        for i, link in enumerate(links.replicas, start=1)]
        self.loop = EngineLoop(engine, self.channel, replica=0,
                               on_step=self.metrics.observer(0),
                               watch=StepWatch(config.stall_timeout, self.fail, 0,
                                               engine.compiling))
        self.router = Router(self.loop, self.remotes, engine)
        self._stopping = threading.Event()  # the job's last step ran: replicas may go
        self._failing = threading.Lock()  # held by the one thread that ends the process
        self._warm = threading.Event()
        self._signals = []
        self._server = self._http = None

    def start(self):
        """Serve HTTP (503 until ready), watch every rank, warm up, and take requests once
        every replica is warm (or return at once on a failure or a drain)."""
        config, router = self.config, self.router
        if config.kv_events:
            from .kv_events import publish
            publish(self.llm.engine, config.kv_events)
        self._serve_http()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.drain)
        self.channel.watch(self.fail)
        self._watch_replicas()
        started = time.monotonic()
        _warmup(self.llm, config,
                lambda text: setattr(router, "warming", f"warming up: {text}"))
        router.warming = None
        self._warm.set()
        self.loop.open()
        # the other replicas warm up too; a drain (a signal during warm-up) does not wait
        while not (router.ready or router.failure or router.draining):
            time.sleep(0.1)
        log.get().info("serve: warm after %.1fs; listening on http://%s:%d (model %s, %d "
                       "replica%s)", time.monotonic() - started, config.host,
                       self.listener.getsockname()[1], config.model_names[0], router.replicas,
                       "s" if router.replicas > 1 else "")

    def _serve_http(self):
        import uvicorn

        from .app import build_app

        app = build_app(self.router, self.llm.tokenizer, self.config, self.llm.engine_config,
                        self.metrics)
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                                     access_log=False,
                                                     timeout_graceful_shutdown=5))
        self._http = threading.Thread(target=self._server.run,
                                      kwargs={"sockets": [self.listener]},
                                      name="msinfer-http", daemon=True)
        self._http.start()

    def _watch_replicas(self):
        """Heartbeats to the other replicas' leaders, and a thread that takes their frames
        and notices when one goes silent."""
        if not self.remotes:
            return
        by_link = {remote.link: remote for remote in self.remotes}
        start_heartbeats(list(by_link), self._stopping.is_set)
        threading.Thread(target=watch_links, daemon=True, name="msinfer-watch-replicas",
                         args=(list(by_link), self._stopping.is_set, self.fail,
                               self.config.stall_timeout,
                               lambda link, frame: by_link[link].on_frame(link, frame))).start()

    def run(self):
        """Step replica 0 until drained; a failure ends the process (`fail`)."""
        try:
            self.loop.run()
        except Exception as e:  # the job is failing (a rank's report), or the engine failed
            if not self.router.failure:
                log.get().exception("engine loop stopped")
            self.fail(f"engine loop stopped: {e}")  # returns at once when already failing
            threading.Event().wait()  # for the failing thread to end the process

    def drain(self, sig, frame=None):
        """The first signal drains; a second ends the drain: in-flight requests are aborted
        at once, or, still warming up, the job ends (non-zero) without waiting for it."""
        self._signals.append(sig)
        name = signal.Signals(sig).name
        if len(self._signals) == 1:
            log.get().info("%s: draining %d requests in flight (new requests get 503; they "
                           "have %.0fs)", name, self.router.in_flight(),
                           self.config.shutdown_timeout)
            self.router.drain(self.config.shutdown_timeout)
        elif not self._warm.is_set():
            _die(f"{name}: a second signal during warm-up")
        else:
            log.get().info("%s: a second signal: aborting in-flight requests now", name)
            self.router.drain(0)

    def fail(self, message):
        """A rank is gone, stalled or out of step: /health fails now; every waiting client
        and every other replica hears it; the process exits 1 after `_DEAD_RANK_GRACE` s."""
        if not self._failing.acquire(blocking=False):
            return  # already going down
        log.get().error("%s: /health fails now, rank 0 exits in %.0fs", message,
                        _DEAD_RANK_GRACE)
        self.router.fail(message)
        self.router.fail_all(message)
        self.channel.fail(message)
        for remote in self.remotes:
            remote.stop(message)
        time.sleep(_DEAD_RANK_GRACE)
        os._exit(1)

    def stop(self):
        """After the drain: wait for the other replicas to drain and stop (rank 0 leaves
        last), then close the links and the HTTP server; returns the exit code (0)."""
        config = self.config
        for remote in self.remotes:  # they drain as long as replica 0 did, then report done
            if not remote.done.wait(timeout=config.shutdown_timeout + config.stall_timeout):
                self.fail(f"replica {remote.index} did not stop after draining")
        self._stopping.set()
        for remote in self.remotes:
            remote.stop()
        wait_hung_up([remote.link for remote in self.remotes], EXIT_WAIT)
        self.channel.close()
        log_summary(self.channel)
        self._server.should_exit = True
        self._http.join(timeout=10)
        log.get().info("serve: stopped after %d steps", self.loop.steps)
        return 0


def _listen(config):
    try:
        return socket.create_server((config.host, config.port))
    except OSError as e:
        raise MsinferError(f"cannot listen on {config.host}:{config.port}: "
                           f"{e.strerror}") from None
