"""The host-side channel that keeps the ranks of a sharded server in lockstep.

Rank 0 serves HTTP and decides what each engine step starts with (new requests, aborts);
every other rank must call the same `add_request` / `abort_request` in the same order before
the same `step()`, or the collectives inside the step would mix different batches. Before
each step rank 0 sends one frame (length-prefixed JSON) over TCP to every other rank; nothing
travels device to device, so it works on cards without P2P copy, under mpirun and msrun alike.

Rank 0 listens on a free port and tells the others its address, and a random token they must
present, once at start-up through one AllReduce over the job (the only collective used). A
rank that dies closes its socket: the others see it within `WATCH_INTERVAL` and leave, so the
job never hangs in a collective that can no longer complete.
"""
import json
import os
import select
import socket
import struct
import threading
import time

from .. import log
from ..errors import MsinferError
from ..parallel.distributed import broadcast_from_rank0, rank0_host

WATCH_INTERVAL = 0.5  # seconds between checks that the peers are still there
_HEADER = struct.Struct(">I")
_CONNECT_TIMEOUT = 120.0


def open_channel(dist):
    """Rank 0 gets a `Leader` (with no followers on one device), the others a `Follower`."""
    if dist.world_size == 1:
        return Leader([])
    listener = None
    mine = [0] * 7
    if dist.rank == 0:
        # loopback when the whole job is on this host, else this host's address as the others
        # reach it (where the mpirun bridge's scheduler listens); MSINFER_HANDOFF_HOST overrides
        host = rank0_host(override="MSINFER_HANDOFF_HOST")
        listener = socket.create_server((host, 0), backlog=dist.world_size)
        port = listener.getsockname()[1]
        token = int.from_bytes(os.urandom(6), "little")
        # broadcast_from_rank0 carries integers below 2**24: the token travels in two halves
        mine = [*socket.inet_aton(host), port, token >> 24, token & 0xFFFFFF]
    agreed = broadcast_from_rank0(dist, mine)
    host, port = socket.inet_ntoa(bytes(agreed[:4])), agreed[4]
    token = (agreed[5] << 24) | agreed[6]
    if dist.rank == 0:
        return Leader(_accept_followers(listener, dist.world_size - 1, token))
    return Follower(_connect(host, port, token, dist.rank), local=host == "127.0.0.1")


def _accept_followers(listener, count, token):
    listener.settimeout(_CONNECT_TIMEOUT)
    followers = {}
    try:
        while len(followers) < count:
            conn, _ = listener.accept()
            conn.settimeout(_CONNECT_TIMEOUT)
            hello = _recv_frame(conn)
            if not isinstance(hello, dict) or hello.get("token") != token:
                conn.close()  # not one of ours
                continue
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            followers[hello["rank"]] = conn
    except socket.timeout:
        missing = sorted(set(range(1, count + 1)) - set(followers))
        raise MsinferError(f"hand-off channel: ranks {missing} did not connect to rank 0 "
                           f"within {_CONNECT_TIMEOUT:.0f}s") from None
    finally:
        listener.close()
    return [followers[r] for r in sorted(followers)]


def _connect(host, port, token, rank):
    deadline = time.monotonic() + _CONNECT_TIMEOUT
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=_CONNECT_TIMEOUT)
            break
        except OSError as e:
            if time.monotonic() > deadline:
                raise MsinferError(f"hand-off channel: cannot reach rank 0 at {host}:{port}: "
                                   f"{e}") from None
            time.sleep(0.2)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    _send_frame(conn, {"token": token, "rank": rank})
    conn.settimeout(None)
    return conn


def _send_frame(conn, obj):
    body = json.dumps(obj, separators=(",", ":")).encode()
    conn.sendall(_HEADER.pack(len(body)) + body)
    return _HEADER.size + len(body)


def _recv_exactly(conn, n):
    chunks = []
    while n:
        chunk = conn.recv(min(n, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _recv_frame(conn):
    """The next frame, or None once the peer has closed the connection."""
    header = _recv_exactly(conn, _HEADER.size)
    if header is None:
        return None
    body = _recv_exactly(conn, _HEADER.unpack(header)[0])
    return None if body is None else json.loads(body)


def _closed(conn):
    """True when the peer closed its end (it only ever sends the hello, so readable = gone)."""
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


class Leader:
    """Rank 0's end: one `send(frame)` per engine step to every other rank."""

    def __init__(self, followers):
        self.followers = followers
        self.frames = 0
        self.bytes = 0
        self.seconds = 0.0
        self._done = False

    def send(self, frame):
        """Hand one step's frame to every rank; returns the seconds it took (0 alone)."""
        if not self.followers:
            return 0.0
        start = time.perf_counter()
        frame = dict(frame, sent_at=time.monotonic())
        for rank, conn in enumerate(self.followers, start=1):
            try:
                self.bytes += _send_frame(conn, frame)
            except OSError as e:
                raise PeerGone(f"rank {rank} is gone ({e})") from None
        elapsed = time.perf_counter() - start
        self.frames += 1
        self.seconds += elapsed
        return elapsed

    def close(self):
        """Tell every rank to leave its loop (after the last step)."""
        self._done = True
        for conn in self.followers:
            try:
                _send_frame(conn, {"stop": True})
                conn.close()
            except OSError:
                pass

    def watch(self, on_gone):
        """Call `on_gone(message)` (from a thread) once any other rank disappears."""
        if self.followers:
            threading.Thread(target=self._watch, args=(on_gone,), daemon=True,
                             name="msinfer-watch-ranks").start()

    def _watch(self, on_gone):
        ranks = {conn: r for r, conn in enumerate(self.followers, start=1)}
        while not self._done:
            readable, _, _ = select.select(list(ranks), [], [], WATCH_INTERVAL)
            for conn in readable:
                if _closed(conn) and not self._done:
                    on_gone(f"rank {ranks[conn]} is gone (its hand-off connection closed)")
                    return

    def summary(self):
        if not self.frames:
            return "hand-off: no other ranks"
        return (f"hand-off to {len(self.followers)} ranks: {self.frames} steps, "
                f"{1e6 * self.seconds / self.frames:.1f} us and "
                f"{self.bytes / self.frames / len(self.followers):.0f} bytes per step and rank "
                "on rank 0")


class PeerGone(RuntimeError):
    """Another rank of the job has disappeared."""


class Follower:
    """The end of every rank but 0: `recv()` the next step's frame, None once told to stop."""

    def __init__(self, conn, local):
        self.conn = conn
        self.local = local  # same host as rank 0: its monotonic clock is ours
        self.frames = 0
        self.latency = []  # seconds from rank 0's send to this rank's receipt, same host only
        self._done = False

    def recv(self):
        frame = _recv_frame(self.conn)
        if frame is None:
            raise PeerGone("rank 0 is gone (its hand-off connection closed)")
        if frame.get("stop"):
            self._done = True
            return None
        if self.local:
            self.latency.append(time.monotonic() - frame["sent_at"])
        self.frames += 1
        return frame

    def watch(self, on_gone):
        """Call `on_gone(message)` once rank 0 disappears, even mid-step (in a collective)."""
        def watch():
            while not self._done:
                time.sleep(WATCH_INTERVAL)
                if _closed(self.conn):
                    time.sleep(1.0)  # a stop frame just read: let the loop mark itself done
                    if not self._done:
                        on_gone("rank 0 is gone (its hand-off connection closed)")
                    return
        threading.Thread(target=watch, daemon=True, name="msinfer-watch-rank0").start()

    def summary(self):
        if not self.latency:
            return f"hand-off: {self.frames} steps received"
        lat = sorted(self.latency)
        return (f"hand-off: {self.frames} steps received, latency from rank 0 mean "
                f"{1e6 * sum(lat) / len(lat):.0f} us, p50 {1e6 * lat[len(lat) // 2]:.0f} us, "
                f"p99 {1e6 * lat[min(len(lat) - 1, int(0.99 * len(lat)))]:.0f} us")


def log_summary(channel):
    log.get().info("%s", channel.summary())
