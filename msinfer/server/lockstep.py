"""The engine loop of a tensor group: its leader drives and decides, the others follow, step
for step.

The leader (`EngineLoop.run`, on its main thread) takes what arrived since the last step
(requests submitted and aborted from other threads), applies it to its engine, schedules the
step and sends its followers one frame: the step's number, the events since the last frame
(adds, aborts, and the tokens and finishes the leader decided in its last step) and a digest
of the schedule. Then it runs the step and samples. Each follower (`follow`) applies the
events in the same order, schedules, and runs the step only if its schedule is the leader's:
followers never sample nor decide when a request ends, so a rank cannot drift from its leader
by deciding differently, and anything else that makes it drift (a lost event, a bug) is caught
before the step whose collectives it would corrupt, named by rank and step.

Every frame is exactly one step on every rank of the group: the leader sends a frame only
when it runs a step. A watchdog (`StepWatch`) ends a step that does not complete in time.
"""
import concurrent.futures
import dataclasses
import threading
import time

from ..engine.sampling import SamplingParams
from ..errors import MsinferError


class ServerBusy(Exception):
    """Not taking requests now (still warming up, shutting down, or a rank is gone)."""


class RanksDiverged(MsinferError):
    """A follower's state is no longer its leader's."""


@dataclasses.dataclass
class _Submission:
    request_id: str
    prompt_token_ids: list
    params: SamplingParams
    prompt: str
    sink: object  # called with each RequestOutput, on the loop's thread
    accepted: concurrent.futures.Future


# A step that compiles a graph (its first use) may run this many stall timeouts before the
# watch calls it a stall: compiling on a slow device takes minutes, a stall timeout is set
# for steps
COMPILE_GRACE = 10


class StepWatch:
    """Calls `on_stall(message)` once one step has run longer than `timeout` seconds: a peer
    stopped, or a collective waits for a rank that will not come. While `compiling()` (the
    runner compiles a graph in this step) it waits up to COMPILE_GRACE timeouts. A thread of
    its own checks (`check`) every quarter timeout (at most 0.5 s); `clock` and `thread`
    are for tests that decide the times themselves."""

    def __init__(self, timeout, on_stall, rank, compiling=None, clock=time.monotonic,
                 thread=True):
        self.timeout, self.on_stall, self.rank = timeout, on_stall, rank
        self.compiling = compiling
        self._clock = clock
        self._since = None  # start of the step in progress, on `clock`
        self._step = None
        self._reported = False
        if thread:
            threading.Thread(target=self._watch, daemon=True, name="msinfer-step-watch").start()

    def start(self, step):
        self._step, self._since = step, self._clock()

    def done(self):
        self._since = None

    def stalled_for(self):
        since = self._since
        return 0.0 if since is None else self._clock() - since

    def check(self):
        """Report the step in progress if it has stalled; True once reported (only once)."""
        if self._reported:
            return True
        stalled = self.stalled_for()
        if stalled <= self.timeout:
            return False
        if self.compiling is not None and self.compiling():
            if stalled <= self.timeout * COMPILE_GRACE:
                return False
            message = (f"rank {self.rank}: step {self._step} has been compiling a graph for "
                       f"{stalled:.0f}s ({COMPILE_GRACE} x --stall-timeout)")
        else:
            message = (f"rank {self.rank}: step {self._step} has not completed in "
                       f"{self.timeout:.0f}s (a rank of its group stopped or stalled; "
                       f"--stall-timeout)")
        self._reported = True
        self.on_stall(message)
        return True

    def _watch(self):
        while not self.check():
            time.sleep(min(0.5, self.timeout / 4))


class EngineLoop:
    """A tensor group's leader: turns submissions into engine steps and frames.

    on_step(handoff_seconds, step_seconds, stats) is called after each pass, step_seconds None
    when no step ran (the metrics of rank 0, or the report a replica's leader sends rank 0)."""

    def __init__(self, engine, channel, on_step=None, replica=0, watch=None):
        self.engine = engine
        self.channel = channel
        self.on_step = on_step
        self.replica = replica
        self.watch = watch
        self.stats = engine.stats()
        self.steps = 0
        self._cond = threading.Condition()
        self._adds = []
        self._aborts = []
        self._events = []  # applied here, not yet sent to the followers
        self._resets = []  # futures of reset_prefix_cache() calls not yet applied
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

    @property
    def not_ready_reason(self):
        return "shutting down: draining in-flight requests" if self._stop_at is not None \
            else "warming up"

    def queue_depth(self):
        """Requests not yet running: submitted but not taken, plus the engine's waiting."""
        with self._cond:
            return len(self._adds) + self.stats.num_waiting

    def submit(self, request_id, prompt_token_ids, params, prompt, sink):
        """Queue a request for the next step; the returned future resolves once the engine has
        taken it (to this loop's replica index) or refused it (MsinferError). Raises
        ServerBusy when not accepting."""
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

    def reset_prefix_cache(self):
        """Forget the prefix cache before the next step, on every rank of the group; the
        future resolves to whether it was (False: requests hold blocks)."""
        done = concurrent.futures.Future()
        with self._cond:
            self._resets.append(done)
            self._cond.notify()
        return done

    def drain(self, timeout):
        """Stop accepting; in-flight requests get `timeout` seconds, then are aborted. A drain
        already under way keeps its deadline if that is nearer (a second SIGTERM ends it
        sooner, never later)."""
        with self._cond:
            self._accepting = False
            deadline = time.monotonic() + timeout
            self._stop_at = deadline if self._stop_at is None else min(self._stop_at, deadline)
            self._cond.notify()

    @property
    def draining(self):
        return self._stop_at is not None

    def fail(self, message):
        """A rank is gone or out of step: refuse everything from now on."""
        with self._cond:
            if self._failed is None:
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
                resets, self._resets = self._resets, []
                if self._stop_at is not None and time.monotonic() > self._stop_at:
                    aborts += [r for r in self._live if r not in aborts]
                    aborts += [s.request_id for s in adds]
            self._reset_prefix_cache(resets)
            self._step(adds, aborts)

    def _has_work(self):
        return bool(self._adds or self._aborts or self._live or self._resets)

    def _reset_prefix_cache(self, resets):
        if not resets:
            return
        done = self.engine.reset_prefix_cache()
        if done:  # the followers forget theirs before the next step
            self._events.append(["reset_prefix_cache"])
        for future in resets:
            future.set_result(done)

    def _step(self, adds, aborts):
        engine, live, events = self.engine, self._live, self._events
        for s in adds:
            try:
                engine.add_request(s.request_id, s.prompt_token_ids, s.params, prompt=s.prompt)
            except MsinferError as e:  # refused here; the followers never see it
                s.accepted.set_exception(e)
                continue
            live[s.request_id] = s.sink
            events.append(["add", s.request_id, s.prompt_token_ids, dataclasses.asdict(s.params),
                           s.prompt])
            s.accepted.set_result(self.replica)
        for request_id in dict.fromkeys(aborts):
            if request_id in live:
                engine.abort_request(request_id)
                events.append(["abort", request_id])
        aborted, schedule = engine.begin_step()
        self._deliver(aborted)
        if schedule.empty:  # the events wait for the next frame
            if self.on_step is not None:
                self.on_step(0.0, None, engine.stats())
            return
        step = engine.step_count + 1
        if self.watch is not None:
            self.watch.start(step)
        handoff = 0.0
        if self.channel.followers:
            handoff = self.channel.send({"step": step, "events": events,
                                         "schedule": [schedule.digest(), schedule.describe()]})
        self._events = []
        start = time.perf_counter()
        outputs = engine.run_step(schedule)
        step_seconds = time.perf_counter() - start
        if self.watch is not None:
            self.watch.done()
        if engine.decisions:
            self._events.append(["decided", engine.decisions])
        self.steps += 1
        self._deliver(outputs)
        stats = engine.stats()
        with self._cond:
            self.stats = stats
        if self.on_step is not None:
            self.on_step(handoff, step_seconds, stats)

    def _deliver(self, outputs):
        live = self._live
        for out in outputs:
            sink = live.get(out.request_id)
            if out.finished:
                live.pop(out.request_id, None)
            if sink is not None:
                sink(out)

    def fail_all(self, message):
        """After a fatal error: every client still waiting hears about it."""
        with self._cond:
            pending, self._adds = self._adds, []
            live, self._live = self._live, {}
        for s in pending:
            s.accepted.set_exception(ServerBusy(message))
        for sink in live.values():
            sink(ServerBusy(message))


def follow(engine, channel, rank, watch=None):
    """A follower: apply its leader's frames, check that each step's schedule is the
    leader's, run it; until told to stop. RanksDiverged when it is not."""
    leader = channel.leader_rank
    while True:
        frame = channel.recv()
        if frame is None:
            return
        step = frame["step"]
        try:
            for event in frame["events"]:
                if event[0] == "add":
                    _, request_id, ids, params, prompt = event
                    engine.add_request(request_id, ids, SamplingParams(**params), prompt=prompt)
                elif event[0] == "abort":
                    engine.abort_request(event[1])
                elif event[0] == "reset_prefix_cache":
                    engine.reset_prefix_cache()
                else:
                    engine.apply_decisions(event[1])
        except MsinferError as e:
            raise RanksDiverged(f"rank {rank} diverged from its leader, rank {leader}, before "
                                f"step {step}: {e}") from None
        _, schedule = engine.begin_step()
        digest, described = frame["schedule"]
        if engine.step_count + 1 != step or schedule.digest() != digest:
            raise RanksDiverged(
                f"rank {rank} diverged from its leader, rank {leader}, at step {step}: the "
                f"leader runs {described}, this rank would run {schedule.describe()} as its "
                f"step {engine.step_count + 1} (schedule digests {digest} and "
                f"{schedule.digest()})")
        if watch is not None:
            watch.start(step)
        engine.run_step(schedule, sample=False)
        if watch is not None:
            watch.done()

