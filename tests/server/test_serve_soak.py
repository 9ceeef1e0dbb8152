"""A bounded soak of `msinfer serve`'s HTTP side over two data replicas (replica 0 local,
replica 1 behind a real host link, each its own engine loop and fake engine,
tests/fake_engine.py): mixed lengths, completions and chat, streamed and whole, n = 1 or 2,
10% of clients leaving mid-stream, 5% invalid requests. Every valid request completes with
the text its prompt determines or gets a clean error; every invalid one gets an OpenAI
error; every engine request runs once, on one replica; afterwards no KV block is in use,
nothing is owed, nothing waits.

CI runs SOAK_REQUESTS (200); $MSINFER_SOAK_REQUESTS sets another size, and
$MSINFER_SOAK_RESULTS a JSON file for the figures (bench/results/soak_fake.json)."""
import asyncio
import collections
import dataclasses
import json
import os
import random
import socket
import threading
import time

import httpx2 as httpx
import pytest

from fake_engine import FakeEngine, expected_ids
from msinfer.server import handoff, replicas
from msinfer.server.lockstep import EngineLoop
from test_serve_protocol import MODEL, RunningServer

SOAK_REQUESTS = int(os.environ.get("MSINFER_SOAK_REQUESTS", "200"))
JOB_REQUESTS = int(os.environ.get("MSINFER_JOB_SOAK_REQUESTS", "40"))
CONCURRENCY = 16


def two_replicas():
    """A RunningServer whose front is a Router over its own loop and replica 1's."""
    listener = socket.create_server(("127.0.0.1", 0))
    b = socket.create_connection(listener.getsockname())
    a, _ = listener.accept()
    listener.close()
    front, uplink_link = handoff.Link(a, 1), handoff.Link(b, 0)
    engine = FakeEngine(step_delay=0.002, num_blocks=64, max_num_seqs=8, max_model_len=200)
    uplink = replicas.ReplicaUplink(uplink_link)
    remote_loop = EngineLoop(engine, handoff.Leader([]), on_step=uplink.on_step)
    remote = replicas.RemoteReplica(1, front)
    stop = threading.Event()
    threading.Thread(target=handoff.watch_links, daemon=True,
                     args=([front], stop.is_set, lambda m: None, 60, remote.on_frame)).start()

    def take():
        while not stop.is_set():
            try:
                uplink.take(remote_loop, uplink_link.recv(timeout=60))
            except handoff.PeerGone:
                return
    threading.Thread(target=take, daemon=True).start()
    remote_loop.open()
    threading.Thread(target=remote_loop.run, daemon=True).start()
    remote.on_frame(front, {"ready": dataclasses.astuple(engine.stats())})
    server = RunningServer(front=lambda loop: replicas.Router(loop, [remote], loop.engine),
                           max_queue=1024, step_delay=0.002, num_blocks=64, max_num_seqs=8,
                           max_model_len=200)
    return server, [server.engine, engine], remote_loop, stop


def wait_for(predicate, timeout=120):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def plan(count, rng):
    """The requests: (kind, body, how) with how in valid / leave / invalid."""
    requests = []
    for i in range(count):
        roll = rng.random()
        how = "invalid" if roll < 0.05 else "leave" if roll < 0.15 else "valid"
        chat = rng.random() < 0.4
        text = f"{i} " + "abcdefgh"[:rng.randint(1, 8)] * rng.randint(1, 6)
        body = {"model": MODEL, "max_tokens": rng.randint(1, 40), "n": rng.choice([1, 1, 2]),
                "stream": how == "leave" or rng.random() < 0.5, "ignore_eos": True}
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        if how == "invalid":
            body.update(rng.choice([{"max_tokens": -1}, {"model": "nope"},
                                    {"temperature": "hot"}, {"n": 99}]))
        if how == "leave":
            body["max_tokens"] = 60
        requests.append(("chat" if chat else "completions", body, how))
    return requests


def expected_text(kind, body):
    if kind == "chat":
        prompt = f"<user>{body['messages'][0]['content']}\n<assistant>"
    else:
        prompt = body["prompt"]
    return bytes(expected_ids(list(prompt.encode()), body["max_tokens"])).decode(
        errors="replace")


async def one(client, kind, body, how):
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    if how == "leave":
        async with client.stream("POST", path, json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    return "left", r.status_code, None  # leave after the first chunk
        return "left", r.status_code, None
    if not body["stream"]:
        r = await client.post(path, json=body)
        return how, r.status_code, r.json()
    texts = collections.defaultdict(str)
    events = []
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return how, r.status_code, r.json()
        async for line in r.aiter_lines():
            if line:
                events.append(line)
    assert events[-1] == "data: [DONE]", events[-3:]
    finish = {}
    for line in events[:-1]:
        event = json.loads(line[6:])
        for choice in event.get("choices", []):
            piece = choice.get("text") if kind == "completions" else (
                choice["delta"].get("content") or "")
            texts[choice["index"]] += piece or ""
            if choice.get("finish_reason"):
                finish[choice["index"]] = choice["finish_reason"]
    return how, r.status_code, {"choices": [{"text": texts[i], "finish_reason": finish.get(i)}
                                            for i in sorted(texts)]}


def test_a_soak_of_mixed_requests_over_two_replicas_loses_and_leaks_nothing():
    server, engines, remote_loop, stop = two_replicas()
    added = collections.Counter()
    for engine in engines:
        add = engine.add_request

        def counting(request_id, *args, add=add, **kwargs):
            added[request_id] += 1
            return add(request_id, *args, **kwargs)
        engine.add_request = counting
    requests = plan(SOAK_REQUESTS, random.Random(38))
    outcomes = collections.Counter()

    async def run():
        gate = asyncio.Semaphore(CONCURRENCY)
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            async def guarded(request):
                async with gate:
                    return await one(client, *request)
            return await asyncio.gather(*(guarded(r) for r in requests))
    start = time.monotonic()
    try:
        results = asyncio.run(run())
        seconds = time.monotonic() - start
        for (kind, body, how), (_, status, reply) in zip(requests, results):
            outcomes[f"{how} {status}"] += 1
            if how == "invalid":
                assert 400 <= status < 500 and reply["error"]["message"], (body, reply)
            elif how == "valid":
                assert status == 200, (body, reply)
                want = expected_text(kind, body)
                choices = reply["choices"]
                assert len(choices) == body["n"], (body, reply)
                for choice in choices:
                    text = choice["text"] if "text" in choice else choice["message"]["content"]
                    assert text == want and choice["finish_reason"] == "length", (body, choice)
        # every engine request ran once, on one replica; none is left anywhere
        assert max(added.values()) == 1
        valid = sum(body["n"] for _, body, how in requests if how == "valid")
        assert len(added) >= valid
        deadline = time.monotonic() + 10
        while any(e.running or e.waiting for e in engines) or server.front._owed:
            assert time.monotonic() < deadline, "requests still held after the soak"
            time.sleep(0.05)
        assert all(e.stats().num_blocks_used == 0 for e in engines)
        assert server.front.queue_depth() == 0
        per_replica = [e.prompt_tokens > 0 for e in engines]
        assert all(per_replica), "both replicas served"
    finally:
        remote_loop.drain(0)
        stop.set()
        server.stop()
    figures = {"requests": len(requests), "seconds": round(seconds, 2),
               "requests_per_second": round(len(requests) / seconds, 1),
               "engine_requests": len(added), "outcomes": dict(sorted(outcomes.items()))}
    print("\nsoak:", json.dumps(figures))
    if os.environ.get("MSINFER_SOAK_RESULTS"):
        with open(os.environ["MSINFER_SOAK_RESULTS"], "w") as f:
            json.dump(figures, f, indent=1)


# Seconds from the last in-flight request's end to the job's exit on Ctrl-C: its ranks leave
# their loops at once and end together (8 s measured at load 13 on 2 cores). A leader that
# waited for its followers' processes waited handoff.EXIT_WAIT, 20 s, for each, one after
# the other (an idle job overran the launcher's 45 s): one such wait alone overruns it.
STOP_BOUND = 20


def stop_while_streaming(job):
    """Ctrl-C to the launcher with a stream in flight on each replica: both finish (drained,
    not aborted) and the job exits 0 within STOP_BOUND of the last one's end. The seconds
    from the signal to the streams' end and to the exit."""
    import re

    from servers import NAME

    streams = []
    with httpx.Client(base_url=job.url, timeout=120) as c:
        for _ in range(2):  # the second goes to the replica the first left idle
            # sampled: the job's n-gram proposals are then rarely accepted, one token a step
            # (greedy, the tiny model repeats itself and a step accepts several: done too soon)
            r = c.send(c.build_request("POST", "/v1/completions", json={
                "model": NAME, "prompt": "last words", "max_tokens": 110, "stream": True,
                "ignore_eos": True, "temperature": 1.0, "seed": 1}), stream=True)
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            streams.append((r, lines))
        signalled = job.interrupt()
        for r, lines in streams:
            events = [line for line in lines if line]
            r.close()
            assert events[-1] == "data: [DONE]"
            assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
    drained = time.monotonic()
    code = job.process.wait(STOP_BOUND + 60)
    exited = time.monotonic()
    assert code == 0 and exited - drained < STOP_BOUND, (code, exited - drained)
    # both were still running when rank 0 heard the signal (their tokens come in ~1 s)
    assert re.search(r"SIGTERM: draining 2 requests in flight", job.output())
    return {"drained": round(drained - signalled, 1), "exited": round(exited - signalled, 1)}


@pytest.mark.multirank
def test_a_soak_of_a_dp2_tp2_job_whose_replica_is_killed_and_the_job_restarted(
        qwen3_serve_model, tmp_path):
    """The real job (servers.dp2_tp2_job: tiny Qwen3, dp2 x tp2, 4 ranks, n-gram
    speculation; its graphs from test_serve's start of it when both run): JOB_REQUESTS mixed requests; half-way,
    replica 1's leader (rank 2) is killed. The job must end non-zero within its bound, every
    request in flight then gets a clean answer (a 200, an OpenAI 503, or the connection
    refused once rank 0 has gone), and the test's supervisor restarts the job and sends what
    did not complete again: every request completes once, and the restarted job's KV pool
    is back to full. Ctrl-C then drains a stream on each replica and the job exits 0 within
    STOP_BOUND of their end."""
    import re
    import signal

    from servers import NAME, dp2_tp2_job

    rng = random.Random(7)
    todo = {i: {"model": NAME, "prompt": f"{i} " + "word " * rng.randint(1, 12),
                "max_tokens": rng.randint(8, 40), "temperature": 0, "n": rng.choice([1, 2]),
                "stream": rng.random() < 0.5} for i in range(JOB_REQUESTS)}
    done, answers = {}, collections.Counter()
    starts = 0

    def start():
        nonlocal starts
        starts += 1
        return dp2_tp2_job(qwen3_serve_model, str(tmp_path / f"job{starts}.log"), stall=5)

    errors = []  # what a sending thread found wrong (its assertions do not fail the test)

    def send(job, i):
        try:
            sent(job, i)
        except Exception as e:  # noqa: BLE001 - reported by the test's own thread
            errors.append(f"request {i}: {type(e).__name__}: {e}")

    def sent(job, i):
        body = todo[i]
        try:
            with httpx.Client(base_url=job.url, timeout=120) as c:
                if not body["stream"]:
                    r = c.post("/v1/completions", json=body)
                    ok = r.status_code == 200
                    answers[r.status_code] += 1
                    assert ok or r.json()["error"]["type"] == "service_unavailable", r.text
                else:
                    with c.stream("POST", "/v1/completions", json=body) as r:
                        lines = [line for line in r.iter_lines() if line]
                    answers[r.status_code] += 1
                    if r.status_code != 200:  # refused before the stream opened
                        error = json.loads(lines[0])["error"]
                        assert error["type"] == "service_unavailable", lines
                        return
                    assert lines[-1] == "data: [DONE]", lines[-3:]
                    ok = '"error"' not in lines[-2]
                    answers["stream error event"] += not ok
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
            answers["refused"] += 1  # rank 0 has gone: sent again to the restarted job
            return
        if ok:
            assert i not in done, f"request {i} completed twice"
            done[i] = True

    failing_for = []

    def answered_failing(job):
        """How long rank 0 answered (/health 503, naming the failure) before it went."""
        first = None
        while True:
            try:
                status = job.http.get("/health", timeout=5).status_code
            except httpx.HTTPError:
                return 0.0 if first is None else time.monotonic() - first
            if status != 200 and first is None:
                first = time.monotonic()
            time.sleep(0.02)

    def wave(job, indices, kill=False):
        """Send `indices` at once; with `kill`, kill rank 2 once all are sent (in flight)."""
        threads = [threading.Thread(target=send, args=(job, i)) for i in indices]
        for t in threads:
            t.start()
        killed_at = None
        if kill:
            wait_for(lambda: answers[200] >= 2)  # the job is serving them
            pid = int(re.search(r"rank 2 is process (\d+)", job.output()).group(1))
            os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
            failing_for.append(answered_failing(job))
        for t in threads:
            t.join(300)
        return killed_at

    job = start()
    try:
        killed_at = wave(job, list(todo), kill=True)
        assert not errors, errors
        # every request in flight got an answer from rank 0 (a 200, a 503 or an error event),
        # none a cut connection: the other ranks leave after rank 0, not before it
        assert answers["refused"] == 0, answers
        # rank 0 answers for its grace (2 s) before it goes, the other ranks after it: a
        # follower that left at once made the launcher end rank 0 1.05 s after it (mpirun's
        # kill delay); 1.46 s was measured for the 2 s grace on a loaded 2-core machine
        assert failing_for[0] > 1.2, failing_for
        code = job.process.wait(60)
        assert code != 0 and time.monotonic() - killed_at < 30, code
        job.kill()
        job = start()  # the supervisor
        wave(job, [i for i in todo if i not in done])
        assert not errors, errors
        assert sorted(done) == sorted(todo)
        assert job.metric("msinfer_kv_blocks_used") == 0
        assert job.metric("vllm:num_requests_running") == 0
        stopped = stop_while_streaming(job)
    finally:
        job.kill()
    print("\njob soak:", json.dumps({"requests": JOB_REQUESTS, "starts": starts,
                                     "rank0_answered_failing_s": round(failing_for[0], 2),
                                     "stop_s": stopped,
                                     "answers": {str(k): v for k, v in answers.items()}}))
