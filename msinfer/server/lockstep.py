"""The engine loop of a server: rank 0 drives, every other rank follows, step for step.

Rank 0's HTTP handlers `submit` requests and `abort` them from the event loop's thread; the
loop (`EngineLoop.run`, on the main thread) collects what arrived since the last step into one
frame, hands the frame to the other ranks, applies it to its own engine and steps. Each other
rank (`follow`) applies the same frames in the same order and steps too. The engine is
deterministic, so every rank then holds the same tokens; only rank 0 delivers them.

Every frame is exactly one step on every rank: rank 0 sends a frame only when it will step.
"""
import concurrent.futures
import dataclasses
import threading
import time

from .. import log
from ..engine.sampling import SamplingParams
from ..errors import MsinferError


class ServerBusy(Exception):
    """Not taking requests now (still warming up, shutting down, or a rank is gone)."""


@dataclasses.dataclass
class _Submission:
    request_id: str
    prompt_token_ids: list
    params: SamplingParams
    prompt: str
    sink: object  # called with each RequestOutput, on the loop's thread
    accepted: concurrent.futures.Future


def _apply(engine, adds, aborts, on_refused=None):
    """What every rank does with one frame before its step, in the same order."""
    for request_id, prompt_token_ids, params, prompt in adds:
        try:
            engine.add_request(request_id, prompt_token_ids, params, prompt=prompt)
        except MsinferError as e:  # every rank refuses it alike; rank 0 tells the client
            if on_refused:
                on_refused(request_id, e)
    for request_id in aborts:
        engine.abort_request(request_id)


class EngineLoop:
    """Rank 0's side: turns submissions from HTTP handlers into engine steps."""

    def __init__(self, engine, channel, metrics=None):
        self.engine = engine
        self.channel = channel
        self.metrics = metrics
        self.stats = engine.stats()
        self.steps = 0
        self._cond = threading.Condition()
        self._adds = []
        self._aborts = []
        self._live = {}  # request_id -> sink, requests the engine holds
        self._accepting = False
        self._stop_at = None  # monotonic deadline once draining
        self._failed = None

    # -- called from the HTTP side (any thread) ---------------------------------------------
    def open(self):
        """Start taking requests (once the graphs are warm)."""
        with self._cond:
            self._accepting = self._stop_at is None and self._failed is None

    @property
    def ready(self):
        return self._accepting and self._failed is None

    @property
    def failure(self):
        return self._failed

    def queue_depth(self):
        """Requests not yet running: submitted but not handed over, plus the engine's waiting."""
        with self._cond:
            return len(self._adds) + self.stats.num_waiting

    def submit(self, request_id, prompt_token_ids, params, prompt, sink):
        """Queue a request for the next step; the returned future resolves once the engine has
        taken it (None) or refused it (MsinferError). Raises ServerBusy when not accepting."""
        accepted = concurrent.futures.Future()
        with self._cond:
            if not self.ready:
                raise ServerBusy(self._failed or "the server is not accepting requests")
            self._adds.append(_Submission(request_id, list(prompt_token_ids), params, prompt,
                                          sink, accepted))
            self._cond.notify()
        return accepted

    def abort(self, request_id):
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    def drain(self, timeout):
        """Stop accepting; in-flight requests get `timeout` seconds, then are aborted."""
        with self._cond:
            self._accepting = False
            self._stop_at = time.monotonic() + timeout
            self._cond.notify()

    def fail(self, message):
        """A rank is gone: refuse everything from now on."""
        with self._cond:
            self._failed = message
            self._accepting = False
            self._cond.notify()

    # -- the loop (main thread) -------------------------------------------------------------
    def run(self):
        """Step until drained (returns) or failed (raises)."""
        while True:
            with self._cond:
                while not self._has_work():
                    if self._stop_at is not None and not self._live and not self._adds:
                        return
                    if self._failed:
                        raise RuntimeError(self._failed)
                    self._cond.wait(timeout=0.5)
                if self._failed:
                    raise RuntimeError(self._failed)
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
                if self._stop_at is not None and time.monotonic() > self._stop_at:
                    aborts += [r for r in self._live if r not in aborts]
                    aborts += [s.request_id for s in adds]
            self._step(adds, aborts)

    def _has_work(self):
        return bool(self._adds or self._aborts or self._live)

    def _step(self, adds, aborts):
        live = self._live
        aborts = [r for r in aborts
                  if r in live or any(s.request_id == r for s in adds)]
        frame = {"add": [[s.request_id, s.prompt_token_ids, dataclasses.asdict(s.params),
                          s.prompt] for s in adds],
                 "abort": aborts}
        handoff = self.channel.send(frame)
        refused = {}
        _apply(self.engine, [(s.request_id, s.prompt_token_ids, s.params, s.prompt)
                             for s in adds], aborts,
               on_refused=lambda rid, e: refused.__setitem__(rid, e))
        for s in adds:
            if s.request_id in refused:
                s.accepted.set_exception(refused[s.request_id])
            else:
                live[s.request_id] = s.sink
                s.accepted.set_result(None)
        start = time.perf_counter()
        outputs = self.engine.step()
        step_seconds = time.perf_counter() - start
        self.steps += 1
        for out in outputs:
            sink = live.get(out.request_id)
            if out.finished:
                live.pop(out.request_id, None)
            if sink is not None:
                sink(out)
        stats = self.engine.stats()
        with self._cond:
            self.stats = stats
        if self.metrics is not None:
            self.metrics.observe_step(handoff, step_seconds, stats)

    def fail_all(self, message):
        """After a fatal error: every client still waiting hears about it."""
        with self._cond:
            pending, self._adds = self._adds, []
            live, self._live = self._live, {}
        for s in pending:
            s.accepted.set_exception(ServerBusy(message))
        for sink in live.values():
            sink(ServerBusy(message))


def follow(engine, channel):
    """Every rank but 0: apply rank 0's frames and step, until told to stop."""
    while True:
        frame = channel.recv()
        if frame is None:
            return
        adds = [(rid, ids, SamplingParams(**params), prompt)
                for rid, ids, params, prompt in frame["add"]]
        _apply(engine, adds, frame["abort"],
               on_refused=lambda rid, e: log.get().debug("request %s refused: %s", rid, e))
        engine.step()
