"""The ranks of a sharded server stay in lockstep: rank 0's frames, sent over the host-side
channel, make every follower's engine see the same requests and aborts before the same steps.
Fake engines (tests/fake_engine.py) stand in for the model; the sockets are real."""
import socket
import threading
import time

import pytest
from fake_engine import FakeEngine

from msinfer.engine.sampling import SamplingParams
from msinfer.server import handoff
from msinfer.server.lockstep import EngineLoop, follow


def channels(followers, token=12345):
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    ends = {}

    def join(rank):
        ends[rank] = handoff.Follower(handoff._connect("127.0.0.1", port, token, rank),
                                      local=True)
    threads = [threading.Thread(target=join, args=(r,)) for r in range(1, followers + 1)]
    for t in threads:
        t.start()
    leader = handoff.Leader(handoff._accept_followers(listener, followers, token))
    for t in threads:
        t.join()
    return leader, [ends[r] for r in range(1, followers + 1)]


def test_followers_step_through_the_same_requests_and_aborts_as_rank_0():
    leader, followers = channels(3)
    engines = [FakeEngine(max_num_seqs=2, step_delay=0) for _ in range(4)]
    loop = EngineLoop(engines[0], leader)
    loop.open()
    threads = [threading.Thread(target=follow, args=(e, f)) for e, f in zip(engines[1:],
                                                                            followers)]
    threads.append(threading.Thread(target=loop.run))
    for t in threads:
        t.start()
    finished = []
    done = threading.Event()

    def sink(out):
        if out.finished:
            finished.append((out.request_id, tuple(out.token_ids), out.finish_reason))
            if len(finished) == 6:
                done.set()
    for i in range(6):
        long = 80 if i == 1 else 5 + i  # r1 is still running when its abort comes
        loop.submit(f"r{i}", [i + 1] * (i + 1), SamplingParams(max_tokens=long), None, sink)
        if i == 3:
            loop.abort("r1")
        time.sleep(0.003 * i)
    refused = loop.submit("bad", [], SamplingParams(), None, sink)  # refused on every rank
    assert done.wait(10)
    assert "empty" in str(refused.exception(timeout=5))
    loop.drain(5)
    leader_done = threads[-1]
    leader_done.join(10)
    leader.close()
    for t in threads:
        t.join(10)
        assert not t.is_alive()
    history = [(e.steps, e.aborted_ids, e.generation_tokens, e.prompt_tokens) for e in engines]
    assert all(h == history[0] for h in history), history
    assert engines[0].aborted_ids == ["r1"]
    assert ("r1", "abort") in [(r, why) for r, _, why in finished]
    assert leader.frames == engines[0].steps
    assert all(f.frames == engines[0].steps for f in followers)
    assert "us and" in leader.summary() and "latency from rank 0" in followers[0].summary()


def test_a_follower_that_dies_is_noticed_by_rank_0_within_a_second():
    leader, followers = channels(2)
    gone = []
    leader.watch(gone.append)
    start = time.monotonic()
    followers[1].conn.close()
    while not gone and time.monotonic() - start < 5:
        time.sleep(0.01)
    assert gone and "rank 2 is gone" in gone[0]
    assert time.monotonic() - start < 2 * handoff.WATCH_INTERVAL + 0.5
    with pytest.raises(handoff.PeerGone, match="rank 2"):
        for _ in range(100):  # the kernel may take one send before it reports the reset
            leader.send({"add": [], "abort": []})
            time.sleep(0.01)


def test_rank_0_that_dies_is_noticed_by_followers():
    leader, followers = channels(1)
    gone = []
    followers[0].watch(gone.append)
    leader.followers[0].close()  # no stop frame: rank 0 vanished
    with pytest.raises(handoff.PeerGone, match="rank 0"):
        followers[0].recv()
    start = time.monotonic()
    while not gone and time.monotonic() - start < 5:
        time.sleep(0.05)
    assert gone and "rank 0 is gone" in gone[0]


def test_a_stop_frame_ends_followers_without_alarm():
    leader, followers = channels(1)
    gone = []
    followers[0].watch(gone.append)
    leader.close()
    assert followers[0].recv() is None
    time.sleep(2 * handoff.WATCH_INTERVAL + 1.2)
    assert gone == []


def test_a_stranger_without_the_token_is_turned_away():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stranger = threading.Thread(target=handoff._connect, args=("127.0.0.1", port, 999, 1))
    stranger.start()
    friend = []
    t = threading.Thread(target=lambda: (time.sleep(0.3), friend.append(
        handoff._connect("127.0.0.1", port, 42, 1))))
    t.start()
    accepted = handoff._accept_followers(listener, 1, 42)
    stranger.join()
    t.join()
    assert len(accepted) == 1
    accepted[0].sendall(b"\x00\x00\x00\x02{}")
    assert handoff._recv_frame(friend[0]) == {}
