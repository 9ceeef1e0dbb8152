"""Data-parallel replicas behind one front end: each request runs on one replica.

Rank 0 serves HTTP and leads replica 0; the first rank of every other tensor group leads its
replica. The `Router` on rank 0 gives each request to the least loaded replica (tokens still
to compute for its requests, then free KV blocks), or to the replica that was given the
request's prefix before, when the prefix saves more than the extra load; locally to its own `EngineLoop` or over the
host link to that replica's leader (`RemoteReplica`). A replica's leader runs its own engine
loop (`ReplicaUplink` turns its outputs into one report per step: what is new of each
request, and its stats) and its tensor group steps with it alone: replicas never step
together and no collective spans them.
"""
import collections
import concurrent.futures
import dataclasses
import threading

from ..engine import EngineStats, RequestOutput
from ..engine.block_manager import block_names
from ..engine.sampling import SamplingParams
from ..engine.sequence import Prefix
from ..engine.text import GrowingText
from ..errors import MsinferError
from .handoff import PeerGone
from .lockstep import ServerBusy

_PREFIX_MEMORY = 1 << 16  # block names the router remembers a replica for (LRU)


class Router:
    """The engine loop as the HTTP side sees it, over every replica of the job."""

    def __init__(self, local, remotes, engine):
        self.local = local  # replica 0's EngineLoop
        self.remotes = remotes  # RemoteReplica for replicas 1..
        self.engine = engine  # replica 0's, for the refusals every replica makes alike
        # every replica's settings (the prefix cache's block size, whether it is on)
        self.engine_config = engine.config
        self._lock = threading.Lock()
        self._owed = {}  # request id -> (replica, tokens it may still compute)
        self._cached_at = collections.OrderedDict()  # block name -> replica last given it
        self._failed = None
        self.warming = None  # warm-up's progress, while it runs (api_server.FrontEnd)

    @property
    def replicas(self):
        return 1 + len(self.remotes)

    def open(self):
        self.local.open()

    @property
    def ready(self):
        return self.local.ready and all(r.ready for r in self.remotes) and not self._failed

    @property
    def not_ready_reason(self):
        """Why /health is 503 while nothing failed: warm-up's progress, replicas still
        warming, or draining."""
        if self.warming:
            return self.warming
        waiting = sum(not r.ready for r in self.remotes)
        if waiting and self.local.ready:
            return f"warming up: waiting for {waiting} of {len(self.remotes)} other replicas"
        return self.local.not_ready_reason

    @property
    def failure(self):
        return self._failed or self.local.failure

    @property
    def draining(self):
        return self.local.draining

    def queue_depth(self):
        return self.local.queue_depth() + sum(r.queue_depth() for r in self.remotes)

    def in_flight(self):
        """Engine requests given to a replica and not finished. Without the lock: a signal
        handler reads it, on the thread that may hold the lock."""
        return len(self._owed)

    def stats(self, replica):
        return self.local.stats if replica == 0 else self.remotes[replica - 1].stats

    def submit(self, request_id, prompt_token_ids, params, prompt, sink):
        """As EngineLoop.submit, on the replica chosen; the future resolves to its index."""
        if not self.ready:
            raise ServerBusy(self.failure or "the server is not accepting requests")
        try:  # refused before it is routed: every replica has the same limits
            self.engine.check_request(prompt_token_ids, params, name=f"request {request_id!r}")
        except MsinferError as e:
            refused = concurrent.futures.Future()
            refused.set_exception(e)
            return refused
        names = self._prefix_names(prompt_token_ids, params.cache_salt)
        with self._lock:
            replica = self._choose(names)
            self._owed[request_id] = (replica, len(prompt_token_ids) + params.max_tokens)
            for name in names:  # where this prompt's prefix will be cached
                self._cached_at[name] = replica
                self._cached_at.move_to_end(name)
            while len(self._cached_at) > _PREFIX_MEMORY:
                self._cached_at.popitem(last=False)
        total = len(prompt_token_ids) + params.max_tokens

        def counted(out):
            with self._lock:
                if isinstance(out, Exception) or out.finished:
                    self._owed.pop(request_id, None)
                elif request_id in self._owed:
                    self._owed[request_id] = (replica, total - len(out.token_ids))
            sink(out)
        target = self.local if replica == 0 else self.remotes[replica - 1]
        try:
            accepted = target.submit(request_id, prompt_token_ids, params, prompt, counted)
        except ServerBusy:
            self._forget(request_id)
            raise

        def refused(future):  # a refused request is owed nothing
            if future.exception() is not None:
                self._forget(request_id)
        accepted.add_done_callback(refused)
        return accepted

    def _forget(self, request_id):
        with self._lock:
            self._owed.pop(request_id, None)

    def _prefix_names(self, ids, salt=None):
        """The names of the prompt's full blocks a replica's prefix cache could hold
        (engine/block_manager.py names them alike, with the request's cache_salt)."""
        if self.replicas == 1 or not self.engine_config.enable_prefix_caching:
            return []
        size = self.engine_config.limits.block_size
        return block_names(ids, size, (len(ids) - 1) // size, salt=salt)

    def _choose(self, names):
        """The least loaded replica (tokens still owed, then free KV blocks), unless one that
        was given this prompt's prefix is loaded by no more than what the prefix saves."""
        load = [0] * self.replicas
        for replica, tokens in self._owed.values():
            load[replica] += tokens

        def free_blocks(replica):
            stats = self.stats(replica)
            return stats.num_blocks_total - stats.num_blocks_used if stats else 0
        least = min(range(self.replicas), key=lambda r: (load[r], -free_blocks(r), r))
        for depth in range(len(names), 0, -1):
            holder = self._cached_at.get(names[depth - 1])
            if holder is not None:
                saved = depth * self.engine_config.limits.block_size
                return holder if load[holder] - load[least] <= saved else least
        return least

    def abort(self, request_id):
        with self._lock:
            replica = self._owed.get(request_id, (None,))[0]
        if replica == 0:
            self.local.abort(request_id)
        elif replica is not None:
            self.remotes[replica - 1].abort(request_id)

    def drain(self, timeout):
        self.local.drain(timeout)
        for remote in self.remotes:
            remote.drain(timeout)

    def reset_prefix_cache(self):
        """Every replica forgets its prefix cache (and this router where prefixes went); the
        future says whether replica 0's was (the others' are told, not awaited)."""
        with self._lock:
            self._cached_at.clear()
        for remote in self.remotes:
            remote.link.send({"reset_prefix_cache": True})
        return self.local.reset_prefix_cache()

    def fail(self, message):
        if self._failed is None:
            self._failed = message
        self.local.fail(message)

    def fail_all(self, message):
        self.local.fail_all(message)
        for remote in self.remotes:
            remote.fail_all(message)


class RemoteReplica:
    """Rank 0's handle on another replica's leader, over their Link. Its frames arrive on
    the thread that watches the links (`on_frame`), which calls the requests' sinks."""

    def __init__(self, index, link, on_step=None):
        self.index, self.link, self.on_step = index, link, on_step
        self.stats = None  # the replica's EngineStats after its last step
        self.ready = False  # warm, taking requests
        self.done = threading.Event()  # drained and stopped
        self._requests = {}  # request id -> _Mirror
        self._pending = {}  # request id -> Future: sent, not yet taken or refused
        self._lock = threading.Lock()

    def queue_depth(self):
        """What waits there: sent since its last report, plus its engine's waiting then."""
        with self._lock:
            sent = len(self._pending)
        return sent + (self.stats.num_waiting if self.stats else 0)

    def submit(self, request_id, prompt_token_ids, params, prompt, sink):
        """The future resolves when the replica's report says it took the request, or fails
        with its refusal (MsinferError: the request's fault; ServerBusy: the replica's)."""
        accepted = concurrent.futures.Future()
        with self._lock:
            self._requests[request_id] = _Mirror(prompt, list(prompt_token_ids), sink)
            self._pending[request_id] = accepted
        try:
            self.link.send({"add": [request_id, list(prompt_token_ids),
                                    dataclasses.asdict(params), prompt]})
        except PeerGone as e:
            self._drop(request_id)
            raise ServerBusy(f"replica {self.index}: {e}") from None
        return accepted

    def _drop(self, request_id):
        with self._lock:
            return (self._requests.pop(request_id, None),
                    self._pending.pop(request_id, None))

    def abort(self, request_id):
        try:
            self.link.send({"abort": request_id})
        except PeerGone:
            pass  # a replica that is gone runs nothing; rank 0 fails its requests

    def drain(self, timeout):
        try:
            self.link.send({"drain": timeout})
        except PeerGone:
            pass

    def stop(self, message=None):
        """After the job's last step (or its failure: `message`), best effort."""
        self.link.tell({"fail": message} if message else {"stop": True})

    def fail_all(self, message):
        with self._lock:
            requests, self._requests = self._requests, {}
            pending, self._pending = self._pending, {}
        for request_id, mirror in requests.items():
            future = pending.get(request_id)
            if future is not None:
                future.set_exception(ServerBusy(message))
            else:
                mirror.sink(ServerBusy(message))

    def on_frame(self, link, frame):
        if "report" in frame:
            report = frame["report"]
            for request_id in report.get("accepted", ()):
                future = self._drop_pending(request_id)
                if future is not None:
                    future.set_result(self.index)
            for entry in report["outputs"]:
                self._apply(entry)
            self.stats = EngineStats(*report["stats"])
            if self.on_step is not None:
                self.on_step(report["handoff"], report["step_seconds"], self.stats)
        elif "refused" in frame:
            request_id, message, kind = frame["refused"]
            mirror, future = self._drop(request_id)
            error = (MsinferError(message) if kind == "invalid"
                     else ServerBusy(f"replica {self.index}: {message}"))
            if future is not None:
                future.set_exception(error)
            elif mirror is not None:
                mirror.sink(error)
        elif "ready" in frame:
            self.stats = EngineStats(*frame["ready"])
            self.ready = True
        elif "done" in frame:
            self.done.set()

    def _drop_pending(self, request_id):
        with self._lock:
            return self._pending.pop(request_id, None)

    def _apply(self, entry):
        """One request's report: appended to its mirror, whose output the sink gets as views
        of it (Prefix, TextSoFar: no copy per step) while it runs, as lists once finished."""
        (request_id, tokens, keep, text, finished, reason, logprobs, error, cached,
         prompt_logprobs) = entry
        with self._lock:
            mirror = self._requests.get(request_id)
            if mirror is None:
                return
            if finished:
                del self._requests[request_id]
        mirror.token_ids += tokens
        if logprobs is not None:
            if mirror.logprobs is None:
                mirror.logprobs = []
            mirror.logprobs += [{int(t): v for t, v in row} for row in logprobs]
        if prompt_logprobs is not None:
            mirror.prompt_logprobs = [row and {int(t): v for t, v in row}
                                      for row in prompt_logprobs]
        if finished:  # the one join of its text (cut before a stop string at `keep`)
            text, view = mirror.text[:keep] + text, list
        else:
            mirror.text.append(text)
            text, view = mirror.text.view(), Prefix
        mirror.sink(RequestOutput(
            request_id=request_id, prompt=mirror.prompt,
            prompt_token_ids=mirror.prompt_token_ids, token_ids=view(mirror.token_ids),
            text=text, finished=finished, finish_reason=reason,
            logprobs=view(mirror.logprobs) if mirror.logprobs is not None else None,
            error=error, cached_tokens=cached, prompt_logprobs=mirror.prompt_logprobs))


@dataclasses.dataclass
class _Mirror:
    prompt: str
    prompt_token_ids: list
    sink: object
    token_ids: list = dataclasses.field(default_factory=list)
    text: GrowingText = dataclasses.field(default_factory=GrowingText)  # so far, in pieces
    logprobs: list = None
    prompt_logprobs: list = None


class ReplicaUplink:
    """A replica leader's side: its engine loop's outputs, one report per step to rank 0 with
    only what is new of each request (tokens, text beyond what rank 0 has, logprobs)."""

    def __init__(self, link):
        self.link = link
        self._outputs = []
        self._accepted = []  # request ids taken since the last report
        self._sent = {}  # request id -> (tokens sent, text sent)

    def take(self, loop, frame):
        """Apply one of rank 0's frames (add, abort, drain, reset_prefix_cache) to this
        replica's engine `loop`;
        False for a frame that is not one of those (stop, fail: the caller's)."""
        if "add" in frame:
            self.add(loop, frame["add"])
        elif "abort" in frame:
            loop.abort(frame["abort"])
        elif "drain" in frame:
            loop.drain(frame["drain"])
        elif "reset_prefix_cache" in frame:
            loop.reset_prefix_cache()
        else:
            return False
        return True

    def add(self, loop, add):
        """Submit rank 0's `add` frame to this replica's engine `loop`; rank 0 hears that it
        was taken (in the next report) or refused (at once)."""
        request_id, ids, params, prompt = add
        try:
            accepted = loop.submit(request_id, ids, SamplingParams(**params), prompt, self.sink)
        except ServerBusy as e:
            self.link.send({"refused": [request_id, str(e), "busy"]})
            return
        accepted.add_done_callback(lambda future: self._taken(request_id, future))

    def _taken(self, request_id, future):
        error = future.exception()
        if error is None:  # on the loop's thread, before the step's report
            self._accepted.append(request_id)
            return
        kind = "invalid" if isinstance(error, MsinferError) else "busy"
        self.link.send({"refused": [request_id, str(error), kind]})

    def sink(self, out):
        if isinstance(out, Exception):
            return  # the loop failed: rank 0 hears it from the failure itself
        self._outputs.append(out)

    def on_step(self, handoff, step_seconds, stats):
        """After each pass of the loop (step_seconds None when no step ran)."""
        if not self._outputs and not self._accepted and step_seconds is None:
            return
        outputs, self._outputs = self._outputs, []
        accepted, self._accepted = self._accepted, []
        self.link.send({"report": {"accepted": accepted,
                                   "outputs": [self._entry(out) for out in outputs],
                                   "stats": dataclasses.astuple(stats),
                                   "step_seconds": step_seconds, "handoff": handoff}})

    def _entry(self, out):
        """What rank 0 lacks of `out`: its new tokens and logprobs, the prompt's logprobs in
        its first report, and its text beyond what was sent. While it runs, the text sent
        stops before a trailing U+FFFD (a character still incomplete, which a later token may
        complete), so what rank 0 holds only grows; once finished, rank 0 keeps `keep`
        characters (fewer when a stop string was cut off) and adds the rest."""
        first = out.request_id not in self._sent
        tokens, chars = self._sent.pop(out.request_id, (0, 0))
        text = out.text
        if out.finished:
            keep, end = min(chars, len(text)), len(text)
        else:
            keep, end = chars, len(text)
            while end > chars and text[end - 1] == "\ufffd":
                end -= 1
            end = max(end, chars)
            self._sent[out.request_id] = (len(out.token_ids), end)
        logprobs = prompt_logprobs = None
        if out.logprobs is not None:
            logprobs = [list(row.items()) for row in out.logprobs[tokens:]]
        if out.prompt_logprobs is not None and first:
            prompt_logprobs = [row and list(row.items()) for row in out.prompt_logprobs]
        return [out.request_id, out.token_ids[tokens:], keep, text[keep:end], out.finished,
                out.finish_reason, logprobs, out.error, out.cached_tokens, prompt_logprobs]
