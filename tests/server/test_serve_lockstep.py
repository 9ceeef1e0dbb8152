"""The ranks of a sharded server stay in lockstep, and a rank that leaves it is caught: the
leader's frames, sent over the host-side links, make every follower see the same requests,
aborts and decisions before the same steps; a follower whose schedule differs, that dies or
that goes silent is named; data replicas share requests through rank 0's router. Fake engines
(tests/fake_engine.py) stand in for the model; the sockets are real."""
import dataclasses
import socket
import threading
import time
import types

import pytest
from fake_engine import FakeEngine
from faults import drop_a_request

from msinfer.engine.sampling import SamplingParams
from msinfer.server import handoff
from msinfer.server.lockstep import EngineLoop, RanksDiverged, StepWatch, follow
from msinfer.server.replicas import RemoteReplica, ReplicaUplink, Router

pytestmark = pytest.mark.waits  # it mostly waits: the third xdist worker runs it (conftest.py)

TOKEN = 12345


def channels(followers, silence=handoff.DEFAULT_SILENCE):
    """A leader (rank 0) and its followers (ranks 1..), connected as open_links connects
    them."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    ends = {}

    def join(rank):
        conn = handoff._connect("127.0.0.1", port, {"token": TOKEN, "rank": rank})
        ends[rank] = handoff.Follower(handoff.Link(conn, 0), local=True, silence=silence)
    threads = [threading.Thread(target=join, args=(r,)) for r in range(1, followers + 1)]
    for t in threads:
        t.start()
    leader = handoff.Leader(handoff._accept(listener, list(range(1, followers + 1)), TOKEN),
                            silence=silence)
    for t in threads:
        t.join()
    return leader, [ends[r] for r in range(1, followers + 1)]


def wait_for(condition, seconds):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def run_group(leader, followers, engines, requests, abort_at=None):
    """Rank 0's loop and its followers over `engines`; submit `requests` ((id, prompt ids,
    max_tokens) each); returns ({id: (tokens, finish reason)}, follower errors)."""
    loop = EngineLoop(engines[0], leader)
    loop.open()
    errors, left = [], []

    def run_follower(engine, channel, rank):
        try:
            follow(engine, channel, rank)
        except RanksDiverged as e:
            errors.append(str(e))
            channel.report(str(e))
        except handoff.PeerGone as e:  # the job failed elsewhere: leave
            left.append(str(e))
    threads = [threading.Thread(target=run_follower, args=(e, f, r))
               for r, (e, f) in enumerate(zip(engines[1:], followers), start=1)]
    def lead():
        try:
            loop.run()
        except RuntimeError:  # failed: what the test does with it is the test's
            pass
    threads.append(threading.Thread(target=lead, daemon=True))
    for t in threads:
        t.start()
    finished = {}

    def sink(out):
        if not isinstance(out, Exception) and out.finished:
            finished[out.request_id] = (tuple(out.token_ids), out.finish_reason)
    for i, (request_id, ids, max_tokens) in enumerate(requests):
        loop.submit(request_id, ids, SamplingParams(max_tokens=max_tokens), None, sink)
        if abort_at is not None and i == abort_at[0]:
            loop.abort(abort_at[1])
        time.sleep(0.003 * i)
    return loop, threads, finished, errors


def test_followers_run_the_leaders_schedule_and_take_its_decisions():
    leader, followers = channels(3)
    engines = [FakeEngine(max_num_seqs=2, step_delay=0) for _ in range(4)]
    requests = [(f"r{i}", [i + 1] * (i + 1), 80 if i == 1 else 5 + i) for i in range(6)]
    loop, threads, finished, errors = run_group(leader, followers, engines, requests,
                                                abort_at=(3, "r1"))
    refused = loop.submit("bad", [], SamplingParams(), None, lambda out: None)
    wait_for(lambda: len(finished) == 6, 10)
    assert "empty" in str(refused.exception(timeout=5))  # refused by the leader alone
    loop.drain(5)
    threads[-1].join(10)
    leader.close(wait=0)  # in-process followers do not end their process
    for t in threads:
        t.join(10)
        assert not t.is_alive()
    assert errors == []
    assert finished["r1"][1] == "abort"
    history = [(e.steps, e.aborted_ids, e.prompt_tokens) for e in engines]
    assert all(h == history[0] for h in history), history
    assert engines[0].aborted_ids == ["r1"]
    # followers sampled nothing: every token they hold is one the leader decided
    assert all(e.generation_tokens <= engines[0].generation_tokens for e in engines[1:])
    assert leader.frames == engines[0].steps
    assert all(f.frames == engines[0].steps for f in followers)
    assert "us and" in leader.summary() and "latency from rank 0" in followers[0].summary()


def test_a_follower_that_drops_a_request_is_caught_at_that_step_and_named():
    """The planted divergence (tests/faults.py): follower 2 drops a request before step 4
    (as a rank that decided by itself that it finished would); it must not run step 4 and
    the leader hears which rank and step."""
    leader, followers = channels(2)
    reported = []
    leader.watch(reported.append)
    engines = [FakeEngine(max_num_seqs=4, step_delay=0.002) for _ in range(3)]
    drop_a_request(engines[2], 2, lambda step: step >= 4)
    requests = [(f"r{i}", [i + 1] * 3, 20) for i in range(3)]
    loop, threads, finished, errors = run_group(leader, followers, engines, requests)
    wait_for(lambda: errors and reported, 10)
    assert len(errors) == 1
    assert "rank 2 diverged from its leader, rank 0, at step 4" in errors[0]
    assert reported == errors  # what the leader's watch hears is the follower's own words
    wait_for(lambda: engines[1].steps >= 4, 5)  # the healthy follower ran step 4 ...
    assert engines[2].steps == 3  # ... rank 2 did not
    loop.fail(reported[0])
    loop.fail_all(reported[0])
    leader.fail(reported[0])
    threads[1].join(10)
    assert not threads[1].is_alive()  # the healthy follower left on the job's failure


def test_a_follower_that_dies_is_noticed_by_rank_0_within_a_second():
    leader, followers = channels(2)
    gone = []
    leader.watch(gone.append)
    start = time.monotonic()
    followers[1].link.conn.close()
    wait_for(lambda: gone, 5)
    assert "rank 2 is gone" in gone[0]
    assert time.monotonic() - start < 2 * handoff.WATCH_INTERVAL + 0.5
    with pytest.raises(handoff.PeerGone, match="rank 2"):
        for _ in range(100):  # the kernel may take one send before it reports the reset
            leader.send({"step": 1, "events": [], "schedule": ["", ""]})
            time.sleep(0.01)


def test_a_link_closed_in_this_process_ends_the_watch_with_a_reason_not_a_dead_thread():
    leader, _ = channels(1)
    leader.followers[0].close()  # as the job ends, or by mistake: select() refuses it
    gone = []
    handoff.watch_links(leader.followers, lambda: False, gone.append, 30)
    assert gone == ["a hand-off link was closed while the job still ran"]


def test_a_silent_follower_is_named_after_the_silence_bound_and_beating_ones_are_not():
    """A stopped process keeps its socket open but says nothing: heartbeats tell it apart."""
    leader, followers = channels(2, silence=1.5)
    followers[1]._done = True  # its heartbeat thread stops, as a SIGSTOPped rank's would
    gone = []
    leader.watch(gone.append)
    start = time.monotonic()
    wait_for(lambda: gone, 5)
    assert "rank 2 has said nothing for" in gone[0] and "rank 1" not in gone[0]
    assert 1.5 <= time.monotonic() - start + handoff.BEAT < 4


def test_rank_0_that_dies_is_noticed_by_followers_even_with_frames_unread():
    leader, followers = channels(1)
    gone = []
    followers[0].watch(gone.append)
    leader.send({"step": 1, "events": [], "schedule": ["", ""]})  # left unread (mid-step)
    leader.followers[0].close()  # no stop frame: rank 0 vanished
    wait_for(lambda: gone, 5)
    assert "rank 0 is gone" in gone[0]
    assert followers[0].recv()["step"] == 1
    with pytest.raises(handoff.PeerGone, match="rank 0"):
        followers[0].recv()


def test_a_follower_hears_a_silent_leader_and_a_stop_frame_ends_it_without_alarm():
    leader, followers = channels(1, silence=1.0)
    leader._done = True  # rank 0 stops beating
    with pytest.raises(handoff.PeerGone, match="rank 0 has said nothing for 1s"):
        followers[0].recv()
    leader, followers = channels(1)
    gone = []
    watching = followers[0].watch(gone.append)
    leader.close(wait=0)  # in-process followers do not end their process
    assert followers[0].recv() is None
    # the watch ends once it sees the follower done (or has raised the alarm): waited for,
    # with a bound, not slept on
    watching.join(10)
    assert not watching.is_alive() and gone == []


def test_a_leaders_close_ends_when_its_followers_read_the_stop_not_when_their_process_does():
    """Under mpirun a rank that left its loop waits in MPI_Finalize for every rank, its
    leader included: a leader that waited for its followers' processes to end waited out
    EXIT_WAIT (20 s) for each, and a dp2 x tp2 job overran the launcher's stop grace. Here
    the followers' "processes" live on after the stop, as MPI_Finalize holds them."""
    leader, followers = channels(2)
    stopped = []
    threads = [threading.Thread(target=lambda f=f: stopped.append(f.recv())) for f in followers]
    for t in threads:
        t.start()
    start = time.monotonic()
    leader.close(wait=30)
    assert time.monotonic() - start < 5
    for t in threads:
        t.join(5)
    assert stopped == [None, None]
    assert all(f.link.hung_up() for f in followers)


def test_a_step_that_outlives_the_stall_timeout_is_reported_once_with_rank_and_step():
    """On a clock of the test's own (no thread): what is a stall is decided by the step's
    times, not by how the machine schedules sleeping threads."""
    stalls, now = [], [100.0]
    watch = StepWatch(0.4, stalls.append, rank=3, clock=lambda: now[0], thread=False)
    watch.start(7)
    now[0] += 0.39
    assert not watch.check()
    watch.done()  # a quick step: nothing
    now[0] += 5
    assert not watch.check() and stalls == []
    watch.start(8)
    now[0] += 0.41
    assert watch.check() and watch.check()
    assert len(stalls) == 1 and stalls[0].startswith("rank 3: step 8 has not completed in")


def test_the_watch_thread_reports_a_stall():
    stalls = []
    StepWatch(0.2, stalls.append, rank=2).start(1)
    wait_for(lambda: stalls, 5)
    assert stalls[0].startswith("rank 2: step 1")


def test_a_stranger_without_the_token_is_turned_away():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stranger = threading.Thread(target=handoff._connect,
                                args=("127.0.0.1", port, {"token": 999, "rank": 1}))
    stranger.start()
    friend = []
    # the friend connects once the stranger has been turned away: an order, not a delay
    t = threading.Thread(target=lambda: (stranger.join(), friend.append(
        handoff._connect("127.0.0.1", port, {"token": 42, "rank": 1}))))
    t.start()
    accepted = handoff._accept(listener, [1], 42)
    stranger.join()
    t.join()
    assert [link.peer_rank for link in accepted] == [1]
    accepted[0].send({"x": 1})
    assert handoff._recv_frame(friend[0]) == {"x": 1}


def test_a_dp2_tp2_job_connects_each_follower_to_its_own_replica_leader(monkeypatch):
    """open_links over 4 ranks (threads here; the start-up broadcast stubbed): rank 0 leads
    rank 1 and reaches replica 1's leader, rank 2, which leads rank 3."""
    shared = {}
    ready = threading.Event()

    def broadcast(dist, values):
        if dist.rank == 0:
            shared["values"] = values
            ready.set()
        ready.wait(10)
        return shared["values"]
    monkeypatch.setattr(handoff, "broadcast_from_rank0", broadcast)
    links = {}

    def rank(r):
        links[r] = handoff.open_links(types.SimpleNamespace(rank=r, world_size=4), tensor=2,
                                      silence=5)
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert [link.peer_rank for link in links[0].channel.followers] == [1]
    assert [link.peer_rank for link in links[0].replicas] == [2]
    assert [link.peer_rank for link in links[2].channel.followers] == [3]
    assert links[2].front.peer_rank == 0
    assert links[1].channel.leader_rank == 0 and links[3].channel.leader_rank == 2
    links[2].channel.send({"step": 1})
    assert links[3].channel.recv() == {"step": 1, "sent_at": pytest.approx(time.monotonic(),
                                                                           abs=5)}
    links[0].replicas[0].send({"add": 1})
    assert links[2].front.recv(timeout=5) == {"add": 1}


def test_the_router_sends_each_request_to_one_replica_and_a_remote_one_returns_it_whole():
    """Replica 0 local, replica 1 behind a real link (its own loop, uplink and fake engine):
    requests alternate by load, each runs once, and what comes back over the link (tokens,
    text cut at a stop string, finish reason, logprobs with int keys) equals a local run."""
    listener = socket.create_server(("127.0.0.1", 0))
    b = socket.create_connection(listener.getsockname())
    a, _ = listener.accept()
    listener.close()
    front, uplink_link = handoff.Link(a, 1), handoff.Link(b, 0)
    engines = [FakeEngine(step_delay=0.001) for _ in range(2)]
    local = EngineLoop(engines[0], handoff.Leader([]))
    uplink = ReplicaUplink(uplink_link)
    remote_loop = EngineLoop(engines[1], handoff.Leader([]), on_step=uplink.on_step)
    remote = RemoteReplica(1, front)
    router = Router(local, [remote], engines[0])
    stop = threading.Event()
    threading.Thread(target=handoff.watch_links, daemon=True,
                     args=([front], stop.is_set, pytest.fail, 30, remote.on_frame)).start()

    def take():  # the replica leader's reader (api_server._replica)
        while not stop.is_set():
            try:
                frame = uplink_link.recv(timeout=30)
            except handoff.PeerGone:  # the test is over
                return
            if "add" in frame:
                uplink.add(remote_loop, frame["add"])
    threading.Thread(target=take, daemon=True).start()
    for loop in (local, remote_loop):
        loop.open()
        threading.Thread(target=loop.run, daemon=True).start()
    remote.on_frame(front, {"ready": dataclasses.astuple(engines[1].stats())})
    assert router.ready
    params = SamplingParams(max_tokens=20, stop=["ok"], logprobs=2)
    got, where = {}, {}
    for i in range(6):
        rid = f"q{i}"
        accepted = router.submit(rid, [i + 3] * 4, params, f"p{i}",
                                 lambda out, rid=rid: got.__setitem__(rid, out))
        where[rid] = accepted.result(5)
    wait_for(lambda: len(got) == 6 and all(o.finished for o in got.values()), 10)
    assert set(where.values()) == {0, 1}
    assert engines[0].prompt_tokens + engines[1].prompt_tokens == 6 * 4  # each request once
    alone = FakeEngine(step_delay=0)
    for rid, out in got.items():
        i = int(rid[1:])
        alone.add_request(rid, [i + 3] * 4, params, prompt=f"p{i}")
        while alone.has_unfinished_requests():
            expected = [o for o in alone.step() if o.request_id == rid][-1]
        assert out == expected, (rid, where[rid])
    assert any(o.finish_reason == "stop" for o in got.values())
    assert router.queue_depth() == 0
    # a prompt whose prefix replica 0 was given goes there again while the prefix saves more
    # than the extra load; least loaded, replica 1 would get it
    first = router.submit("a", [9] * 40 + [1], SamplingParams(max_tokens=2), None,
                          lambda out: None).result(5)
    wait_for(lambda: not router._owed, 10)
    busy = router.submit("b", [7] * 3, SamplingParams(max_tokens=20), None,
                         lambda out: None).result(5)
    again = router.submit("c", [9] * 40 + [2], SamplingParams(max_tokens=2), None,
                          lambda out: None).result(5)
    assert first == busy == again == 0
    other = router.submit("d", [8] * 40 + [2], SamplingParams(max_tokens=2), None,
                          lambda out: None).result(5)
    assert other == 1
    stop.set()
    local.drain(0)
    remote_loop.drain(0)
    front.close()


def test_a_prefix_cache_reset_reaches_every_follower_before_the_next_step():
    leader, followers = channels(2)
    engines = [FakeEngine(max_num_seqs=2, step_delay=0) for _ in range(3)]
    loop, threads, finished, errors = run_group(leader, followers, engines,
                                                [("r0", [1, 2], 3)])
    wait_for(lambda: len(finished) == 1, 10)
    assert loop.reset_prefix_cache().result(timeout=5) is True
    # the reset travels with the next step's frame: run one
    loop.submit("r1", [3], SamplingParams(max_tokens=2), None,
                lambda out: finished.update({out.request_id: out}) if out.finished else None)
    wait_for(lambda: len(finished) == 2, 10)
    loop.drain(5)
    threads[-1].join(10)
    leader.close(wait=0)
    for t in threads:
        t.join(10)
    assert errors == [] and [e.resets for e in engines] == [1, 1, 1]
