"""Defects a review of `msinfer serve` found (issue 38), each pinned by a test that failed
before its fix: choices and prompts admitted in one engine step, the bounds on prompts per
request and stop_token_ids, echo with max_tokens=0, lone surrogates, chat logprobs' bytes,
a peer that dies mid-request, a drain during warm-up and a second drain. Over the fake engine
of tests/fake_engine.py, as tests/server/test_serve_protocol.py."""
import json
import threading
import time

import httpx2 as httpx

import pytest

from msinfer.server import replicas
from msinfer.server.handoff import PeerGone
from msinfer.server.protocol import MAX_STOP_TOKEN_IDS

from fake_engine import stub_engine_config
from test_serve_limits import assert_openai_error, still_serving
from test_serve_protocol import MODEL, RunningServer, raw

MAX_QUEUE = 12


@pytest.fixture(scope="module")
def server():
    s = RunningServer(max_queue=MAX_QUEUE, max_num_seqs=8, num_blocks=64, step_delay=0.005)
    added_at = {}  # request id -> the engine step it was added before
    add = s.engine.add_request

    params = {}  # request id -> its SamplingParams

    def recording(request_id, ids, request_params, *args, **kwargs):
        added_at[request_id] = s.engine.step_count
        params[request_id] = request_params
        return add(request_id, ids, request_params, *args, **kwargs)
    s.engine.add_request = recording
    s.added_at, s.params = added_at, params
    yield s
    s.stop()


def test_n_choices_of_a_batch_of_prompts_are_admitted_in_one_step(server):
    response = raw(server, "/v1/completions", {"model": MODEL, "prompt": ["ab", "cd"], "n": 3,
                                                "max_tokens": 3})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 6
    steps = {server.added_at[rid] for rid in server.added_at
             if rid.startswith(response.json()["id"])}
    assert len(steps) == 1, steps  # one engine step took all six sequences


def test_best_of_sequences_are_admitted_in_one_step(server):
    response = raw(server, "/v1/completions", {"model": MODEL, "prompt": "ab", "n": 1,
                                                "best_of": 4, "max_tokens": 3})
    assert response.status_code == 200, response.text
    steps = {at for rid, at in server.added_at.items() if rid.startswith(response.json()["id"])}
    assert len(steps) == 1 and sum(r.startswith(response.json()["id"])
                                   for r in server.added_at) == 4


def test_more_sequences_in_one_request_than_max_queue_is_a_400_naming_prompt(server):
    response = raw(server, "/v1/completions", {"model": MODEL, "prompt": ["x"] * (MAX_QUEUE + 1),
                                                "max_tokens": 1})
    assert_openai_error(response, 400, "--max-queue", param="prompt")
    response = raw(server, "/v1/completions", {"model": MODEL, "prompt": ["x"] * 7, "n": 2,
                                                "max_tokens": 1})
    assert_openai_error(response, 400, "14 sequences", param="prompt")
    still_serving(server)


def test_stop_token_ids_beyond_their_bound_are_a_400_naming_the_field(server):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1,
            "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}
    assert_openai_error(raw(server, "/v1/completions", body), 400, "stop_token_ids",
                        param="stop_token_ids")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
            "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}
    assert_openai_error(raw(server, "/v1/chat/completions", chat), 400, "stop_token_ids",
                        param="stop_token_ids")
    body["stop_token_ids"] = list(range(MAX_STOP_TOKEN_IDS))
    assert raw(server, "/v1/completions", body).status_code == 200


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "salted"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "salted"}]})])
def test_cache_salt_reaches_the_engine_and_an_empty_one_is_a_400(server, path, body):
    body = dict(body, model=MODEL, max_tokens=1)
    response = raw(server, path, dict(body, cache_salt="tenant-7"))
    assert response.status_code == 200, response.text
    assert "x-msinfer-ignored-fields" not in response.headers
    assert server.params[response.json()["id"] + "-0"].cache_salt == "tenant-7"
    assert_openai_error(raw(server, path, dict(body, cache_salt="")), 400, "cache_salt",
                        param="cache_salt")


def test_echo_with_max_tokens_0_and_no_logprobs_returns_the_prompt(server):
    response = raw(server, "/v1/completions", {"model": MODEL, "prompt": "héllo", "echo": True,
                                                "max_tokens": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["text"] == "héllo"
    assert body["choices"][0]["logprobs"] is None
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens"] == len("héllo".encode())


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", '{"model": "fake-model", "prompt": "a\\ud800b", "max_tokens": 1}',
     "prompt"),
    ("/v1/completions", '{"model": "fake-model", "prompt": ["ok", "\\udfff"], "max_tokens": 1}',
     "prompt"),
    ("/v1/chat/completions", '{"model": "fake-model", "max_tokens": 1, "messages": '
                             '[{"role": "user", "content": "x\\ud83d"}]}', "messages"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(server, path, body, param):
    assert_openai_error(raw(server, path, body), 400, "surrogate", param=param)
    still_serving(server)


def test_chat_logprobs_bytes_are_the_tokens_own_bytes(server):
    # the fake's tokens are UTF-8 bytes: "ö" is 0xC3 0xB6, each a token that alone is no
    # character (its text U+FFFD); `bytes` must be the token's byte, not U+FFFD's three
    response = raw(server, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "w"}], "max_tokens": 40,
        "logprobs": True, "top_logprobs": 1, "ignore_eos": True})
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["logprobs"]["content"]
    joined = bytes(b for entry in content for b in entry["bytes"])
    text = response.json()["choices"][0]["message"]["content"]
    assert joined.decode() == text and any(ord(c) > 127 for c in text)
    assert all(len(entry["bytes"]) == 1 for entry in content)
    assert all(len(top["bytes"]) == 1 for entry in content for top in entry["top_logprobs"])


class _ReplicaLink:
    """Rank 0's link to replica 1's leader, played by the test: it records the frames sent,
    and once `die()` is called every send raises PeerGone, as a reset connection does."""
    peer_rank = 2

    def __init__(self):
        self.frames, self.dead = [], False

    def send(self, frame, timeout=None):
        if self.dead:
            raise PeerGone("rank 2 is gone (connection reset)")
        self.frames.append(frame)

    def tell(self, frame, timeout=1.0):
        return False

    def die(self):
        self.dead = True


def _remote_server(route=None):
    """A server whose requests go to replica 1, behind a link the test plays (or to the
    replicas `route` lists, in turn)."""
    link = _ReplicaLink()
    remote = replicas.RemoteReplica(1, link)
    remote.ready = True
    turns = iter(route or [])

    def front(loop):
        router = replicas.Router(loop, [remote], loop.engine)
        router._choose = lambda names: next(turns, 1)
        return router
    s = RunningServer(front=front)
    return s, remote, link


def _accept_first_add(remote, link, text="ab"):
    """Replica 1's leader: takes the request sent and reports its first tokens."""
    wait_for(lambda: any("add" in f for f in link.frames))
    request_id = next(f["add"][0] for f in link.frames if "add" in f)
    remote.on_frame(link, {"report": {
        "accepted": [request_id], "outputs": [[request_id, list(text.encode()), 0, text, False,
                                               None, None, None, 0, None]],
        "stats": [1, 0, 32, 1, 0, 2, 2], "handoff": 0.0, "step_seconds": 0.01}})
    return request_id


def test_a_replica_that_dies_mid_stream_ends_it_with_503_event_then_done():
    """n=2: choice 0 on replica 0, choice 1 on replica 1, which dies; rank 0 fails replica
    0's requests first (Router.fail_all), so the stream ends while choice 1 is still owed to
    the dead replica, whose abort cannot be sent."""
    s, remote, link = _remote_server(route=[0, 1])
    replica_1 = threading.Thread(target=_accept_first_add, args=(remote, link))
    replica_1.start()  # the response starts once both replicas took their choice
    try:
        with httpx.Client(base_url=s.url, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json={
                    "model": MODEL, "prompt": "p", "max_tokens": 90, "n": 2,
                    "stream": True}) as r:
                assert r.status_code == 200
                replica_1.join()
                lines = r.iter_lines()
                assert json.loads(next(lines)[6:])["choices"]
                link.die()  # rank 0's watch of the links sees it and fails every request
                s.front.local.fail_all("rank 2 is gone")
                rest = [line for line in lines if line]
                s.front.fail_all("rank 2 is gone")
        assert rest[-1] == "data: [DONE]", rest
        error = json.loads(rest[-2][6:])["error"]
        assert error["type"] == "service_unavailable" and "rank 2" in error["message"]
    finally:
        s.stop()


def test_a_replica_that_dies_mid_request_is_a_503_and_a_dead_one_refuses_with_503():
    s, remote, link = _remote_server()
    try:
        with httpx.Client(base_url=s.url, timeout=30) as c:
            result = {}
            t = threading.Thread(target=lambda: result.setdefault("r", c.post(
                "/v1/completions", json={"model": MODEL, "prompt": "p", "max_tokens": 50})))
            t.start()
            _accept_first_add(remote, link)
            link.die()
            s.front.fail_all("rank 2 is gone")
            t.join(10)
            assert_openai_error(result["r"], 503, "rank 2 is gone")
            # a request sent to the dead replica before rank 0 noticed: 503, not 500
            response = c.post("/v1/completions", json={"model": MODEL, "prompt": "q",
                                                       "max_tokens": 5})
            assert_openai_error(response, 503, "rank 2 is gone")
        assert not s.front._owed  # nothing owed to the dead replica is left counted
    finally:
        s.stop()


def wait_for(predicate, timeout=10):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _replica_pair(**engine_options):
    """Replica 0 local and replica 1 behind a real link, with its own loop, uplink and fake
    engine, its leader's reader taking rank 0's frames as api_server._replica does; the
    router sends everything to replica 1. Returns (router, remote loop, stop event)."""
    import socket

    from fake_engine import FakeEngine
    from msinfer.server import handoff
    from msinfer.server.lockstep import EngineLoop

    listener = socket.create_server(("127.0.0.1", 0))
    b = socket.create_connection(listener.getsockname())
    a, _ = listener.accept()
    listener.close()
    front, uplink_link = handoff.Link(a, 1), handoff.Link(b, 0)
    engines = [FakeEngine(**engine_options) for _ in range(2)]
    uplink = replicas.ReplicaUplink(uplink_link)
    remote_loop = EngineLoop(engines[1], handoff.Leader([]), on_step=uplink.on_step)
    remote = replicas.RemoteReplica(1, front)
    router = replicas.Router(EngineLoop(engines[0], handoff.Leader([])), [remote], engines[0])
    router._choose = lambda names: 1
    router.local.open()
    stop = threading.Event()
    threading.Thread(target=handoff.watch_links, daemon=True,
                     args=([front], stop.is_set, pytest.fail, 30, remote.on_frame)).start()

    def take():
        while not stop.is_set():
            try:
                frame = uplink_link.recv(timeout=30)
            except PeerGone:
                return
            uplink.take(remote_loop, frame)  # as api_server._replica's reader
    threading.Thread(target=take, daemon=True).start()
    remote.ready = True
    return router, remote_loop, stop


def test_a_remote_replicas_refusals_reach_the_client_and_leave_nothing_owed():
    from msinfer.engine.sampling import SamplingParams
    from msinfer.errors import MsinferError
    from msinfer.server.lockstep import ServerBusy

    router, remote_loop, stop = _replica_pair(step_delay=0.001)
    loop_thread = threading.Thread(target=remote_loop.run, daemon=True)
    try:
        remote_loop.open()
        loop_thread.start()
        params = SamplingParams(max_tokens=30)
        first = router.submit("dup", [5, 6], params, None, lambda out: None)
        assert first.result(5) == 1
        again = router.submit("dup", [5, 6], params, None, lambda out: None)  # same id
        with pytest.raises(MsinferError, match="already running"):
            again.result(5)
        remote_loop.drain(30)  # replica 1 stops taking requests
        busy = router.submit("late", [7], params, None, lambda out: None)
        with pytest.raises(ServerBusy):
            busy.result(5)
        wait_for(lambda: set(router._owed) <= {"dup"})
        assert "late" not in router._owed
    finally:
        remote_loop.drain(0)
        loop_thread.join(5)  # before the links go
        stop.set()


def test_a_remote_replicas_queue_depth_counts_what_rank_0_sent_it():
    """Replica 1 not stepping yet: what rank 0 sent it waits there, and rank 0 counts it."""
    from msinfer.engine.sampling import SamplingParams

    router, remote_loop, stop = _replica_pair()
    try:
        remote_loop.open()  # taking requests, but its loop does not run: nothing is stepped
        for i in range(3):
            router.submit(f"w{i}", [i + 1], SamplingParams(max_tokens=4), None, lambda out: None)
        assert router.queue_depth() == 3
    finally:
        stop.set()


class _FakeServeProcess:
    """tests/fake_serve.py: rank 0's serve() over the fake engine, warm-up held until
    `release()`."""

    def __init__(self, tmp_path, step_delay=0.1):
        import os
        import subprocess
        import sys

        from msinfer.parallel.distributed import free_port
        self.dir, self.port = tmp_path, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
        self.log = open(tmp_path / "serve.log", "w")
        self.process = subprocess.Popen(
            [sys.executable, os.path.join(here, "fake_serve.py"), str(self.port), str(tmp_path),
             str(step_delay)], stdout=self.log, stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONPATH=os.path.dirname(here)))
        wait_for(lambda: (tmp_path / "warming").exists() or self.process.poll() is not None, 60)
        assert self.process.poll() is None, self.output()

    def release(self):
        (self.dir / "release").touch()

    def signal(self):
        import signal
        self.process.send_signal(signal.SIGTERM)

    def exit_code(self, within):
        import subprocess
        try:
            return self.process.wait(within)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            pytest.fail(f"still running {within}s after the signal:\n{self.output()}")

    def output(self):
        self.log.flush()
        return (self.dir / "serve.log").read_text()


def test_sigterm_during_warm_up_ends_the_server_once_warm(tmp_path):
    server = _FakeServeProcess(tmp_path)
    server.signal()  # during warm-up: drains as soon as it is warm, with nothing in flight
    server.release()
    assert server.exit_code(within=20) == 0, server.output()
    assert "draining" in server.output()


def test_a_second_sigterm_during_warm_up_ends_it_at_once(tmp_path):
    server = _FakeServeProcess(tmp_path)
    server.signal()
    wait_for(lambda: "draining" in server.output())
    server.signal()  # warm-up never released: only the second signal ends it
    assert server.exit_code(within=20) != 0
    assert "second signal" in server.output()


def test_a_second_sigterm_ends_the_drain_and_aborts_what_runs(tmp_path):
    server = _FakeServeProcess(tmp_path, step_delay=0.1)
    server.release()
    wait_for(lambda: _healthy(server.url), 30)
    with httpx.Client(base_url=server.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={
                "model": "fake", "prompt": "x", "max_tokens": 150, "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)
            server.signal()  # drains: 60 s for the request (15 s of steps) to finish
            wait_for(lambda: "draining" in server.output())  # two at once would be one
            next(lines)
            server.signal()  # ends the drain: the request is aborted now
            rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "abort"
    assert server.exit_code(within=20) == 0, server.output()


def _healthy(url):
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_unseeded_requests_draw_their_replicas_own_stream_and_seeded_ones_do_not():
    """dp2: each replica's engine numbers its arrivals from 1; with the job's seed alone as
    the key, the first unseeded request on either replica drew the same stream (n=2 gave two
    identical choices). Seeded requests draw from their seed alone, on any replica."""
    import numpy as np

    from msinfer.engine.llm_engine import LLMEngine
    from msinfer.engine.sampling import SamplingParams
    from msinfer.engine_config import EngineLimits
    from msinfer.parallel.distributed import replica_seed
    from msinfer.planning.kv_layout import CacheLayout

    layout = CacheLayout(num_layers=1, kv_heads=1, head_dim=1, block_size=8, num_blocks=9,
                         dtype_bytes=1)
    job_seed = 0xABCDEF  # job_seed's range: below 2**24

    def draws(replica, params):
        limits = EngineLimits(max_model_len=64, max_num_seqs=4, max_prefill_tokens=16)
        engine = LLMEngine(None, layout, stub_engine_config(limits, 300), eos_token_ids=(),
                           seed=replica_seed(job_seed, replica))
        engine.add_request("r", [1, 2, 3], params)
        return engine._requests["r"].generator.random(8)
    unseeded = SamplingParams(temperature=1.0)
    assert not np.array_equal(draws(0, unseeded), draws(1, unseeded))
    assert np.array_equal(draws(1, unseeded), draws(1, unseeded))  # a replica is reproducible
    seeded = SamplingParams(temperature=1.0, seed=7)
    assert np.array_equal(draws(0, seeded), draws(1, seeded))
    assert replica_seed(job_seed, 0) == job_seed  # one replica: the streams it always drew
    assert len({replica_seed(s, r) for s in (0, 1, 2 ** 24 - 1) for r in range(8)}) == 24


def test_a_step_that_compiles_a_graph_is_not_a_stall_until_the_compile_bound():
    """The first use of a graph (a head graph of prompt logprobs' rows, never warmed up)
    compiles within the step; on a slow device that outlives --stall-timeout and used to end
    the job. While the runner says it compiles, the watch waits, up to COMPILE_GRACE times
    the timeout; a step that is not compiling is reported as before."""
    from msinfer.server.lockstep import COMPILE_GRACE, StepWatch

    stalls, compiling, now = [], [True], [0.0]
    watch = StepWatch(1.0, stalls.append, rank=1, compiling=lambda: compiling[0],
                      clock=lambda: now[0], thread=False)
    watch.start(4)
    now[0] = 3.0  # three timeouts into the step, compiling: no stall
    assert not watch.check() and stalls == []
    compiling[0] = False  # compiled; the step has outlived its bound: a stall
    assert watch.check()
    assert stalls[0].startswith("rank 1: step 4 has not completed in")
    stalls.clear()
    compiling[0] = True
    watch = StepWatch(1.0, stalls.append, rank=1, compiling=lambda: compiling[0],
                      clock=lambda: now[0], thread=False)
    watch.start(5)
    now[0] += COMPILE_GRACE - 0.01
    assert not watch.check()
    now[0] += 0.02  # a compile that outlives its own bound is a stall too
    assert watch.check() and "compiling a graph" in stalls[0]


def test_the_runner_says_when_a_call_compiles(tiny_checkpoint):
    """ExplicitRunner: a call that builds a graph (the first prompt-logprobs head after a
    lazy start) is `compiling` while it runs; a call of graphs already built is not."""
    from msinfer import LLM, SamplingParams

    model_dir, _ = tiny_checkpoint(layers=2, hidden=64, heads=4, kv_heads=2, vocab=512)
    llm = LLM(model_dir, max_len=64, max_num_seqs=2, max_prefill_tokens=16,
              compile_cache=False)
    runner = llm.engine.runner
    seen = []
    run = runner._run

    def watched(*args, **kwargs):
        out = run(*args, **kwargs)
        seen.append(runner.compiling_since is not None)  # before the call's end clears it
        return out
    runner._run = watched
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1)
    llm.generate([list(range(3, 15))], params)
    assert seen[0] and runner.compiling_since is None
    seen.clear()
    llm.generate([list(range(3, 15))], params)
    assert seen and not any(seen)


def test_rank_0s_abort_and_drain_reach_a_remote_replica():
    """A client that leaves (Serving aborts through the router) frees its request on the
    replica that runs it; a drain reaches the replica, whose loop aborts what still runs at
    the deadline and stops; rank 0 hears both ends (finish_reason abort)."""
    from msinfer.engine.sampling import SamplingParams

    router, remote_loop, stop = _replica_pair(step_delay=0.02)
    engine = remote_loop.engine
    finished = {}

    def sink(out):
        if not isinstance(out, Exception) and out.finished:
            finished[out.request_id] = out.finish_reason
    try:
        remote_loop.open()
        loop_thread = threading.Thread(target=remote_loop.run, daemon=True)
        loop_thread.start()
        params = SamplingParams(max_tokens=80)
        for rid in ("leaves", "stays"):
            assert router.submit(rid, [3, 4], params, None, sink).result(5) == 1
        wait_for(lambda: engine.steps >= 2)
        router.abort("leaves")
        wait_for(lambda: finished.get("leaves") == "abort")
        assert engine.aborted_ids == ["leaves"] and "leaves" not in router._owed
        router.drain(0)
        wait_for(lambda: finished.get("stays") == "abort")
        loop_thread.join(5)
        assert not loop_thread.is_alive()  # drained: the replica's loop returned
        assert engine.stats().num_blocks_used == 0 and not router._owed
    finally:
        stop.set()
