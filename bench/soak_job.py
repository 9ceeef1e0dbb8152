"""The full-size soak of a real dp2 x tp2 job (issue 38): `msinfer launch --nproc 4 --strategy
strategies/qwen2_dp2_tp2.yaml -- serve` on a tiny Qwen2 checkpoint, sent --requests mixed
requests (completions and chat, prompts of 4-70 tokens, max_tokens up to what the context
leaves, streamed and whole, n = 1 or 2, greedy or seeded sampling) with --concurrency in
flight; 10% of the clients leave after the first event of a stream, 5% of the requests are
invalid (each must get an OpenAI 4xx error object).

Once half the requests have completed, replica 1's leader (rank 2) is killed. No request is
sent after the kill; every one in flight must get a clean answer (a 200, an OpenAI 503, an
error event and `data: [DONE]`, or the connection refused once rank 0 has gone), and the job
must end non-zero within --exit-bound seconds. The script's supervisor loop then starts the
job again and sends what did not complete. At the end every valid request has completed
exactly once with its n choices of max_tokens tokens (none lost; none run twice: the restarted
job's own count of finished engine requests matches what it was sent), the restarted job's KV
pool is back to full and nothing runs or waits, and no process of either job is left.

    python bench/soak_job.py --requests 100          # a check of the harness, ~3-5 minutes
    python bench/soak_job.py                         # 2000 requests

Writes bench/results/soak_job.json (every figure) and .md (the table, also printed); the
jobs' logs go to bench/results/logs/. Exits 1 if any check failed (the files say which).
The CI-sized version is tests/server/test_serve_soak.py (40 requests)."""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx2 as httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from msinfer.cli.launch import _session_members, die_with_parent  # noqa: E402
from msinfer.engine.tokenizer import Tokenizer  # noqa: E402
from msinfer.parallel.distributed import free_port  # noqa: E402

from machine import machine_record, record_load_at_end  # noqa: E402

NAME = "tiny"
MAX_LEN = 128
# tests/servers.py's SERVE_ARGS and TINY_SERVE_MODEL: the job of the CI-sized soak
SERVE_ARGS = ["--served-model-name", NAME, "--max-len", str(MAX_LEN), "--max-num-seqs", "4",
              "--max-prefill-tokens", "32", "--stall-timeout", "5"]
TINY_SERVE_MODEL = dict(layers=2, hidden=128, heads=4, kv_heads=2, vocab=512)
WORDS = ("the cat sat on a mat and then it ran to see what the dog had found in the old "
         "barn near river where we used to play when summer came").split()
INVALID = [{"max_tokens": -1}, {"model": "nope"}, {"temperature": "hot"}, {"n": 99},
           {"max_tokens": 1000}, {"surrogate": True}]
RETRY = ("503", "stream error event", "refused")  # clean answers that ask for a resend


class Job:
    """One launched job (its own session) that answers /health 200."""

    def __init__(self, model, log_path, cache, ready_timeout):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        argv = [sys.executable, "-m", "msinfer", "launch", "--nproc", "4", "--strategy",
                os.path.join(ROOT, "strategies", "qwen2_dp2_tp2.yaml"), "--", "serve",
                "--model", model, *SERVE_ARGS, "--max-queue", "1024", "--compile-cache", cache,
                "--port", str(self.port)]
        env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1", "GLOG_v": "3",
               "MS_RETRY_INTERVAL_LOWER": "1", "MS_RETRY_INTERVAL_UPPER": "1"}
        self.log = open(log_path, "w")
        began = time.monotonic()
        self.process = subprocess.Popen(argv, env=env, stdout=self.log,
                                        stderr=subprocess.STDOUT, start_new_session=True,
                                        preexec_fn=die_with_parent)
        self.sessions = {self.process.pid}
        while not self.healthy():
            if self.process.poll() is not None or time.monotonic() - began > ready_timeout:
                self.kill()
                raise SystemExit(f"the job did not start (exit {self.process.returncode}): "
                                 f"{log_path}")
            time.sleep(0.5)
        self.ready_s = time.monotonic() - began
        # mpirun runs in a session of its own (launch.py): the ranks' sessions are watched too
        self.sessions |= {session_of(self.rank_pid(r)) for r in range(4)}

    def healthy(self):
        try:
            return httpx.get(self.url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def rank_pid(self, rank):
        with open(self.log_path) as f:
            return int(re.search(rf"serve: rank {rank} is process (\d+)", f.read()).group(1))

    def metric(self, name, where=""):
        """The sum of `name`'s samples whose labels contain `where`."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if (line.startswith(name + "{") or line.startswith(name + " "))
                   and where in line)

    def stop(self, timeout=60):
        """Ctrl-C to the job (the launcher stops its ranks, rank 0 drains): its exit code and
        seconds to it (None: still running after `timeout`)."""
        began = time.monotonic()
        os.killpg(self.process.pid, signal.SIGINT)
        try:
            return self.process.wait(timeout), round(time.monotonic() - began, 1)
        except subprocess.TimeoutExpired:
            return None, None

    def kill(self):
        """SIGKILL to the job's process group if the launcher still runs; then the processes
        of its session still there after 10 s (left behind: listed, then killed)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.log.close()
        deadline = time.monotonic() + 10
        while self.left() and time.monotonic() < deadline:
            time.sleep(0.2)
        left = self.left()
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return left

    def left(self):
        return [pid for sid in self.sessions if sid is not None
                for pid, _ in _session_members(sid)]


def session_of(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[3])
    except OSError:
        return None


def prompt_pool(tokenizer, rng, size=64):
    """`size` texts of 4-70 prompt tokens (chat: with the template's), each with both counts."""
    pool = []
    while len(pool) < size:
        want = rng.randint(4, 70)
        words = [rng.choice(WORDS)]
        while len(tokenizer.encode(" ".join(words))) < want:
            words.append(rng.choice(WORDS))
        text = " ".join(words)
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        counts = {"completions": len(tokenizer.encode(text)),
                  "chat": len(tokenizer.encode(chat))}
        if max(counts.values()) <= MAX_LEN - 16:
            pool.append((text, counts))
    return pool


def plan(count, pool, rng):
    """The requests: dicts of kind, body, how (valid / leave / invalid) and prompt_tokens."""
    requests = []
    for i in range(count):
        roll = rng.random()
        how = "invalid" if roll < 0.05 else "leave" if roll < 0.15 else "valid"
        kind = "chat" if rng.random() < 0.4 else "completions"
        text, counts = rng.choice(pool)
        room = MAX_LEN - counts[kind]
        body = {"model": NAME, "n": rng.choice([1, 1, 2]), "ignore_eos": True,
                "max_tokens": room if how == "leave" else rng.randint(1, min(40, room)),
                "stream": how == "leave" or rng.random() < 0.5}
        if rng.random() < 0.3:
            body.update(temperature=0.8, seed=rng.randint(0, 3))
        else:
            body["temperature"] = 0
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
        if kind == "chat":
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        if how == "invalid":
            body.update(rng.choice(INVALID))
            if body.pop("surrogate", False):
                body["messages" if kind == "chat" else "prompt"] = (
                    [{"role": "user", "content": "\ud800"}] if kind == "chat" else "\ud800")
        requests.append({"id": i, "kind": kind, "body": body, "how": how,
                         "prompt_tokens": counts[kind]})
    return requests


async def send(client, request):
    """One attempt: (outcome, status, reply); reply: the answer's choices and usage."""
    body, kind = request["body"], request["kind"]
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    content = json.dumps(body)  # ASCII escapes: a lone surrogate travels as "\ud800"
    headers = {"content-type": "application/json"}
    try:
        if not body.get("stream"):
            r = await client.post(path, content=content, headers=headers)
            return classify(request, r.status_code, json_of(r))
        async with client.stream("POST", path, content=content, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                return classify(request, r.status_code, json_of(r))
            events = []
            async for line in r.aiter_lines():
                if not line:
                    continue
                events.append(line)
                if request["how"] == "leave" and line.startswith("data: {"):
                    if json.loads(line[6:]).get("error"):
                        return "stream error event", 200, line
                    return "left", 200, None  # leave after the first event
            return classify(request, 200, stream_reply(kind, events))
    except httpx.ConnectError:
        return "refused", None, None
    except httpx.TimeoutException as e:
        return "fault: no answer in time", None, f"{type(e).__name__}: {e}"
    except httpx.HTTPError as e:  # the connection broke with the answer unfinished
        return "cut", None, f"{type(e).__name__}: {e}"


def json_of(response):
    try:
        return response.json()
    except ValueError:
        return {"not_json": response.text[:200]}


def stream_reply(kind, events):
    """A stream's events as a whole answer: choices' text and finish_reason, usage, error."""
    if not events or events[-1] != "data: [DONE]":
        return {"cut": events[-3:]}
    texts, finish, usage, error = collections.defaultdict(str), {}, None, None
    for line in events[:-1]:
        event = json.loads(line[6:])
        error = error or event.get("error")
        usage = event.get("usage") or usage
        for choice in event.get("choices", []):
            piece = choice.get("text") if kind == "completions" else (
                choice.get("delta", {}).get("content"))
            texts[choice["index"]] += piece or ""
            finish[choice["index"]] = choice.get("finish_reason") or finish.get(
                choice["index"])
    return {"stream_error": error, "usage": usage,
            "choices": [{"text": texts[i], "finish_reason": finish.get(i)}
                        for i in sorted(set(texts) | set(finish))]}


def classify(request, status, reply):
    """What an answer was: completed, invalid 4xx, a clean refusal, or a fault named."""
    body, how = request["body"], request["how"]
    if status == 503 and (reply.get("error") or {}).get("type") == "service_unavailable":
        return "503", status, reply
    if how == "invalid":
        ok = 400 <= status < 500 and (reply.get("error") or {}).get("message")
        return ("invalid 4xx" if ok else "fault: invalid request answered"), status, reply
    if status != 200:
        return f"fault: status {status}", status, reply
    if "cut" in reply:
        return "cut", status, reply
    if reply.get("stream_error"):
        return "stream error event", status, reply
    if how == "leave":  # the stream ended before its first event was read
        return "fault: a leaving stream had no event", status, reply
    want = (body["n"], body["max_tokens"], request["prompt_tokens"])
    choices, usage = reply["choices"], reply.get("usage") or {}
    got = (len(choices), usage.get("completion_tokens", 0) / max(1, len(choices)),
           usage.get("prompt_tokens"))
    if got != want or any(c["finish_reason"] != "length" for c in choices):
        return "fault: wrong answer", status, {"want": want, "got": got, "reply": reply}
    return "completed", status, reply


def text_of(choice):
    return choice["text"] if "text" in choice else choice["message"]["content"]


class Soak:
    """What every attempt got: the final outcome of each request, counts, latencies."""

    def __init__(self, requests):
        self.requests = requests
        self.final = {}  # id -> (outcome, start)
        self.attempts = collections.Counter()  # "start N: outcome"
        self.at_kill = collections.Counter()  # outcomes of the requests in flight at the kill
        self.latencies = []  # seconds of each completed request's attempt
        self.faults = []  # (id, outcome, detail), at most 20 kept
        self.fault_count = 0
        self.answers = collections.defaultdict(list)  # (prompt, settings, choice) -> texts
        self.taken = collections.Counter()  # start -> requests / choices its engine took

    def record(self, start, request, answer, seconds, in_flight_at_kill):
        outcome, status, reply = answer
        self.attempts[f"start {start}: {request['how']} {outcome}"] += 1
        if in_flight_at_kill:
            self.at_kill[outcome] += 1
        if status == 200 and request["how"] != "invalid":  # its engine took it
            self.taken[f"{start} requests"] += 1
            self.taken[f"{start} choices"] += request["body"]["n"]
        if outcome.startswith("fault") or outcome == "cut":
            self.fault_count += 1
            if len(self.faults) < 20:
                self.faults.append((request["id"], outcome, str(reply)[:400]))
        if outcome in RETRY or outcome == "cut":
            return  # sent again to the next job
        self.final[request["id"]] = (outcome, start)
        if outcome == "completed":
            self.latencies.append(seconds)
            self.remember(request, reply)

    def remember(self, request, reply):
        body = request["body"]
        key = json.dumps({k: body.get(k) for k in
                          ("prompt", "messages", "max_tokens", "temperature", "seed")})
        for j, choice in enumerate(reply["choices"]):
            # greedy: every choice alike; seeded: choice j draws from seed + j
            self.answers[(key, 0 if body["temperature"] == 0 else j)].append(text_of(choice))


async def wave(soak, job, start, ids, concurrency, kill_after):
    """Send `ids` with `concurrency` in flight; with `kill_after`, kill rank 2 once that many
    requests have a final answer and send nothing more. Returns the kill's facts (or {})."""
    gate = asyncio.Semaphore(concurrency)
    stop = asyncio.Event()
    in_flight, kill = set(), {}
    limits = httpx.Limits(max_connections=2 * concurrency)
    async with httpx.AsyncClient(base_url=job.url, timeout=300, limits=limits) as client:
        async def one(request):
            async with gate:
                if stop.is_set():
                    return
                in_flight.add(request["id"])
                began = time.monotonic()
                answer = await send(client, request)
                in_flight.discard(request["id"])
                soak.record(start, request, answer, time.monotonic() - began,
                            request["id"] in kill.get("in_flight", ()))
                if kill_after and not kill and len(soak.final) >= kill_after:
                    stop.set()
                    kill_rank2(job, in_flight, kill)
                if answer[0] == "refused" and job.process.poll() is not None:
                    stop.set()  # the job has gone: the rest waits for the next one
        await asyncio.gather(*(one(soak.requests[i]) for i in ids))
    return kill


def kill_rank2(job, in_flight, facts):
    """SIGKILL to replica 1's leader; a thread times /health's failing answers and the exit
    (into `facts`)."""
    pid = job.rank_pid(2)
    os.kill(pid, signal.SIGKILL)
    facts.update(pid=pid, at=time.monotonic(), in_flight=set(in_flight))
    facts["watch"] = threading.Thread(target=watch_failing, args=(job, facts), daemon=True)
    facts["watch"].start()


def watch_failing(job, facts):
    """How long after the kill /health failed, how long rank 0 answered failing before it
    went, and when the job exited."""
    first = None
    while time.monotonic() - facts["at"] < 120:
        try:
            status = httpx.get(job.url + "/health", timeout=5).status_code
        except httpx.ConnectError:
            break
        except httpx.HTTPError:
            continue
        if status != 200 and first is None:
            first = time.monotonic()
        time.sleep(0.02)
    gone = time.monotonic()
    facts["kill_to_health_failing_s"] = None if first is None else first - facts["at"]
    facts["rank0_answered_failing_s"] = 0.0 if first is None else gone - first
    try:
        facts["exit_code"] = job.process.wait(120)
    except subprocess.TimeoutExpired:
        facts["exit_code"] = None
    facts["kill_to_exit_s"] = time.monotonic() - facts["at"]


def settle(job, timeout=30):
    """The job's pool and queues once idle: KV blocks used, requests running and waiting
    (disconnected streams are aborted at the next step), waited for up to `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        state = {"kv_blocks_used": job.metric("msinfer_kv_blocks_used"),
                 "kv_blocks_total": job.metric("msinfer_kv_blocks_total"),
                 "requests_running": job.metric("vllm:num_requests_running"),
                 "requests_waiting": job.metric("vllm:num_requests_waiting")}
        idle = not (state["kv_blocks_used"] or state["requests_running"]
                    or state["requests_waiting"])
        if idle or time.monotonic() > deadline:
            return state
        time.sleep(0.5)


def engine_counts(job):
    """What the job's engines took and finished: requests and their choices (n) taken,
    choices finished by reason."""
    return {"requests_taken": job.metric("vllm:request_params_n_count"),
            "choices_taken": job.metric("vllm:request_params_n_sum"),
            "choices_finished": job.metric("vllm:request_success_total"),
            "choices_finished_length": job.metric("vllm:request_success_total", '"length"'),
            "choices_finished_abort": job.metric("vllm:request_success_total", '"abort"')}


def supervise(args, model, cache, soak):
    """Start the job, send what has no final answer, kill rank 2 half-way through the first
    job, start it again while anything is left: the facts of each start."""
    starts = []
    while len(soak.final) < len(soak.requests) and len(starts) < args.max_starts:
        number = len(starts) + 1
        job = Job(model, os.path.join(args.logs, f"soak_job{number}.log"), cache,
                  args.ready_timeout)
        start = {"ready_s": round(job.ready_s, 1)}
        try:
            pending = [r["id"] for r in soak.requests if r["id"] not in soak.final]
            kill_after = len(soak.requests) // 2 if number == 1 else None
            began = time.monotonic()
            kill = asyncio.run(wave(soak, job, number, pending, args.concurrency, kill_after))
            start["serving_s"] = round(time.monotonic() - began, 1)
            start["pending"] = len(pending)  # without a final answer when the job started
            start["attempted"] = sum(v for k, v in soak.attempts.items()
                                     if k.startswith(f"start {number}:"))
            if kill:
                kill["watch"].join(150)
                start["kill"] = {k: round(v, 2) if isinstance(v, float) else v
                                 for k, v in kill.items()
                                 if k not in ("watch", "in_flight", "at")}
                start["kill"]["in_flight"] = len(kill["in_flight"])
            elif job.process.poll() is None:
                start["settled"] = settle(job)
                start["engine"] = engine_counts(job)
                start["stop_exit_code"], start["stop_s"] = job.stop()
        finally:
            start["processes_left"] = job.kill()
            start["exit_code"] = job.process.returncode
        starts.append(start)
    return starts


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def checks(soak, starts, args):
    """(what, held, detail) of everything the soak promises."""
    by_how = collections.Counter(r["how"] for r in soak.requests)
    final = collections.Counter(f"{soak.requests[i]['how']} {o}" for i, (o, _) in
                                soak.final.items())
    kill = starts[0].get("kill", {})
    last = starts[-1]
    engine, settled = last.get("engine", {}), last.get("settled", {})
    last_start = [(soak.requests[i], o) for i, (o, s) in soak.final.items() if s == len(starts)]
    done_choices = sum(r["body"]["n"] for r, o in last_start if o == "completed")
    left = sum(r["body"]["n"] for r, o in last_start if o == "left")
    disagree = [k for k, texts in soak.answers.items() if len(set(texts)) > 1]
    return [
        ("every valid request completed once", final["valid completed"] == by_how["valid"],
         f"{final['valid completed']} of {by_how['valid']}"),
        ("every leaving client left after its first event", final["leave left"] ==
         by_how["leave"], f"{final['leave left']} of {by_how['leave']}"),
        ("every invalid request got an OpenAI 4xx", final["invalid invalid 4xx"] ==
         by_how["invalid"], f"{final['invalid invalid 4xx']} of {by_how['invalid']}"),
        ("no fault (wrong answer, cut connection, 5xx other than 503)", soak.fault_count == 0,
         f"{soak.fault_count}: {soak.faults[:5]}"),
        ("rank 2 was killed with requests in flight", kill.get("in_flight", 0) > 0,
         f"{kill.get('in_flight')} in flight"),
        ("the killed job ended non-zero within the bound", bool(kill.get("exit_code")) and
         kill.get("kill_to_exit_s", 1e9) < args.exit_bound,
         f"exit {kill.get('exit_code')} after {kill.get('kill_to_exit_s')} s"),
        ("rank 0 answered failing for its grace before it went",
         kill.get("rank0_answered_failing_s", 0) > 1.2,
         f"{kill.get('rank0_answered_failing_s')} s"),
        ("the restarted job's pool is back to full and nothing runs or waits",
         settled and not (settled["kv_blocks_used"] or settled["requests_running"]
                          or settled["requests_waiting"]), str(settled)),
        ("the restarted job took each request it answered once, and ran each choice once",
         engine.get("requests_taken") == soak.taken[f"{len(starts)} requests"] and
         engine.get("choices_taken") == soak.taken[f"{len(starts)} choices"] and
         done_choices <= engine.get("choices_finished_length", -1) <= done_choices + left,
         f"{engine}; answered 200: {soak.taken[f'{len(starts)} requests']} requests, "
         f"{soak.taken[f'{len(starts)} choices']} choices; of which completed {done_choices} "
         f"choices, left {left} (aborted, or ran to length first)"),
        ("the same prompt and settings gave the same text (greedy; seeded per choice)",
         not disagree, f"{len(disagree)} of {len(soak.answers)} groups differ "
         f"({sum(len(t) > 1 for t in soak.answers.values())} answered more than once)"),
        ("the restarted job stopped on Ctrl-C with exit 0", last.get("stop_exit_code") == 0,
         f"exit {last.get('stop_exit_code')} after {last.get('stop_s')} s"),
        ("no process of any job left", not any(s["processes_left"] for s in starts),
         str([s["processes_left"] for s in starts])),
    ]


def report(args, soak, starts, wall_s, machine):
    held = checks(soak, starts, args)
    lat = soak.latencies
    serving = sum(s["serving_s"] for s in starts if "serving_s" in s)
    return {
        "command": " ".join(["python bench/soak_job.py", *sys.argv[1:]]),
        "requests": len(soak.requests), "concurrency": args.concurrency, "seed": args.seed,
        "planned": dict(collections.Counter(r["how"] for r in soak.requests)),
        "final": dict(sorted(collections.Counter(
            f"{soak.requests[i]['how']} {o}" for i, (o, _) in soak.final.items()).items())),
        "no_final_answer": len(soak.requests) - len(soak.final),
        "attempts": dict(sorted(soak.attempts.items())),
        "in_flight_at_kill": dict(soak.at_kill), "starts": starts, "restarts": len(starts) - 1,
        "wall_s": round(wall_s, 1), "serving_s": round(serving, 1),
        "requests_per_s": round(len(soak.requests) / wall_s, 2),
        "requests_per_serving_s": round(len(soak.requests) / serving, 2) if serving else None,
        "latency_completed_ms": {"p50": round(1000 * percentile(lat, 0.5)) if lat else None,
                                 "p99": round(1000 * percentile(lat, 0.99)) if lat else None,
                                 "count": len(lat)},
        "same_prompt_groups": {
            "with_repeats": sum(len(texts) > 1 for texts in soak.answers.values()),
            "differing": sum(len(set(texts)) > 1 for texts in soak.answers.values())},
        "machine": record_load_at_end(machine),
        "checks": [{"check": c, "held": bool(ok), "detail": d} for c, ok, d in held],
        "faults": soak.faults}


def table(r):
    kill = r["starts"][0].get("kill", {})
    lines = [f"# Soak of a dp2 x tp2 job: {r['requests']} requests, {r['concurrency']} in flight",
             "", f"`{r['command']}` at {r['machine']['commit']}, {r['machine']['cpu']}, "
             f"{r['machine']['cores']} cores; load average "
             f"{r['machine']['load_average_at_start']} at the start, "
             f"{r['machine']['load_average_at_end']} at the end.", "",
             "| figure | value |", "|---|---|"]
    rows = [("requests planned (valid / leave / invalid)", " / ".join(
        str(r["planned"].get(k, 0)) for k in ("valid", "leave", "invalid"))),
        ("final answers", ", ".join(f"{k}: {v}" for k, v in r["final"].items())),
        ("starts of the job (restarts)", f"{len(r['starts'])} ({r['restarts']})"),
        ("ready after start (s)", ", ".join(str(s["ready_s"]) for s in r["starts"])),
        ("in flight when rank 2 was killed", f"{kill.get('in_flight')}: " + ", ".join(
            f"{k} {v}" for k, v in r["in_flight_at_kill"].items())),
        ("kill to /health failing (s)", kill.get("kill_to_health_failing_s")),
        ("rank 0 answered failing before it went (s)", kill.get("rank0_answered_failing_s")),
        ("kill to the job's exit (s), exit code", f"{kill.get('kill_to_exit_s')}, "
                                                   f"{kill.get('exit_code')}"),
        ("wall time (s), serving only", f"{r['wall_s']}, {r['serving_s']}"),
        ("requests/s over the wall time, over serving", f"{r['requests_per_s']}, "
                                                        f"{r['requests_per_serving_s']}"),
        ("latency of completed requests p50 / p99 (ms)",
         f"{r['latency_completed_ms']['p50']} / {r['latency_completed_ms']['p99']}")]
    lines += [f"| {a} | {b} |" for a, b in rows]
    lines += ["", "| check | held | detail |", "|---|---|---|"]
    lines += [f"| {c['check']} | {'yes' if c['held'] else '**NO**'} | {c['detail']} |"
              for c in r["checks"]]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    p.add_argument("--seed", type=int, default=38)
    p.add_argument("--model", help="checkpoint (default: a tiny Qwen2 as tests/servers.py's "
                                   "TINY_SERVE_MODEL, made in a temporary directory)")
    p.add_argument("--exit-bound", type=float, default=30,
                   help="seconds after the kill by which the job must have exited")
    p.add_argument("--max-starts", type=int, default=4)
    p.add_argument("--ready-timeout", type=float, default=900)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--logs", default=os.path.join(ROOT, "bench", "results", "logs"))
    p.add_argument("--name", default="soak_job", help="file name of the results")
    args = p.parse_args(argv)
    machine = machine_record()
    began = time.monotonic()
    os.makedirs(args.logs, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="msinfer-soak-") as work:
        model = args.model or os.path.join(work, "model")
        if not args.model:
            from msinfer.tools.tiny_model import make_tiny_model
            make_tiny_model(model, **TINY_SERVE_MODEL)
        rng = random.Random(args.seed)
        soak = Soak(plan(args.requests, prompt_pool(Tokenizer.from_model_dir(model), rng),
                         rng))
        starts = supervise(args, model, os.path.join(work, "compile-cache"), soak)
    result = report(args, soak, starts, time.monotonic() - began, machine)
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, args.name)
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1, default=str)
    text = table(result)
    with open(base + ".md", "w") as f:
        f.write(text)
    print(text)
    return 0 if all(c["held"] for c in result["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
