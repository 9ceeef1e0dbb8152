"""The host-side links between the ranks of a sharded server: who talks to whom, and how a
rank that dies, stalls or goes silent is noticed.

A job of `data` replicas x `tensor` ranks has one leader per tensor group (its first rank) and
followers. Each leader sends its followers one frame (length-prefixed JSON over TCP) before
every step it runs with them; rank 0, the front end, also talks to the leaders of the other
replicas (server/replicas.py). Nothing travels device to device, so it works on cards without
P2P copy, under mpirun and msrun alike.

Start-up: rank 0 listens and tells every rank its address and a random token through one
AllReduce over the job (the only collective used); every rank connects to it. A replica leader
says where it listens, and the followers of its group are sent there.

Liveness, in both directions: every link carries a heartbeat at least every `BEAT` seconds.
A peer that closes its end (it died) is noticed within `WATCH_INTERVAL`; one that says nothing
for `silence` seconds (stopped, or its host is gone) is declared silent. A follower that finds
itself out of step with its leader reports why before it leaves.
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
BEAT = 1.0  # seconds between heartbeats on an otherwise quiet link
DEFAULT_SILENCE = 60.0  # seconds without a word after which a peer counts as stalled
EXIT_WAIT = 20.0  # seconds a leader waits for its peers to hang up after the last step
_HEADER = struct.Struct(">I")
_CONNECT_TIMEOUT = 120.0


class PeerGone(RuntimeError):
    """Another rank of the job has disappeared, stalled, or left with an error."""


class Link:
    """One connection to another rank: framed JSON, sends serialised by a lock (the engine
    loop, the heartbeat and failure reports share it), heartbeats while quiet."""

    def __init__(self, conn, peer_rank):
        self.conn = conn
        self.peer_rank = peer_rank
        self.bytes = 0
        self.heard = time.monotonic()  # when the peer last said anything (reader's side)
        self._sent = time.monotonic()
        self._lock = threading.Lock()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, obj, timeout=None):
        """Send one frame; PeerGone when the peer is gone. With `timeout`, give up (False)
        instead of waiting longer for the lock (a failure report must not hang)."""
        body = json.dumps(obj, separators=(",", ":")).encode()
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            return False
        try:
            self.conn.sendall(_HEADER.pack(len(body)) + body)
        except OSError as e:
            raise PeerGone(f"rank {self.peer_rank} is gone ({e})") from None
        finally:
            self._lock.release()
        self.bytes += _HEADER.size + len(body)
        self._sent = time.monotonic()
        return True

    def recv(self, timeout=None):
        """The next frame that is not a heartbeat. PeerGone when the peer closed, or said
        nothing for `timeout` seconds."""
        while True:
            self.conn.settimeout(timeout)
            try:
                frame = _recv_frame(self.conn)
            except socket.timeout:
                raise PeerGone(f"rank {self.peer_rank} has said nothing for {timeout:.0f}s "
                               f"(stalled or unreachable)") from None
            except OSError as e:
                raise PeerGone(f"rank {self.peer_rank} is gone ({e})") from None
            if frame is None:
                raise PeerGone(f"rank {self.peer_rank} is gone (its connection closed)")
            self.heard = time.monotonic()
            if "beat" not in frame:
                return frame

    def tell(self, obj, timeout=1.0):
        """Send `obj` if the peer is still there and the link is free within `timeout`
        (heartbeats, stop, failure reports); False otherwise: the watchers report a gone
        peer, this must not hang or raise on the way out."""
        try:
            return self.send(obj, timeout=timeout)
        except PeerGone:
            return False

    def beat_if_quiet(self):
        if time.monotonic() - self._sent >= BEAT:
            self.tell({"beat": 1}, timeout=BEAT)

    def hung_up(self):
        """True once the peer has closed its end, even with frames still unread (or once
        this end is closed)."""
        if self.conn.fileno() < 0:
            return True
        poller = select.poll()
        poller.register(self.conn, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        return bool(poller.poll(0))

    def close(self):
        try:
            self.conn.close()
        except OSError:
            pass


def wait_hung_up(links, timeout):
    """Wait until every peer of `links` has closed its end (it left its loop: a rank hangs up
    when told to stop, or its process ended), at most `timeout` seconds; then close ours."""
    deadline = time.monotonic() + timeout
    for link in links:
        while not link.hung_up() and time.monotonic() < deadline:
            time.sleep(0.05)
        link.close()


def start_heartbeats(links, stopped):
    """One thread beating on every link in `links` (a list, or a callable giving it) while
    nothing else is sent, until `stopped()`."""
    def beat():
        while not stopped():
            for link in (links() if callable(links) else links):
                link.beat_if_quiet()
            time.sleep(BEAT / 4)
    threading.Thread(target=beat, daemon=True, name="msinfer-heartbeat").start()


class Leader:
    """A tensor group's leader: one `send(frame)` per step to each follower of its group;
    watches them (gone, silent, or reporting an error)."""

    def __init__(self, followers, silence=DEFAULT_SILENCE):
        self.followers = followers  # Links, in rank order
        self.silence = silence
        self.frames = 0
        self.bytes = 0
        self.seconds = 0.0
        self._done = False
        if followers:
            start_heartbeats(followers, lambda: self._done)

    def send(self, frame):
        """Hand one step's frame to every follower; returns the seconds it took (0 alone)."""
        if not self.followers:
            return 0.0
        start = time.perf_counter()
        frame = dict(frame, sent_at=time.monotonic())
        for link in self.followers:
            link.send(frame)
        elapsed = time.perf_counter() - start
        self.frames += 1
        self.seconds += elapsed
        return elapsed

    def close(self, wait=EXIT_WAIT):
        """Tell every follower to leave its loop (after the last step), and wait up to `wait`
        seconds for them to hang up, which each does as it reads the stop: a leader leaves
        its loop after its followers. Not for their processes to end: under mpirun a rank's
        exit waits in MPI_Finalize (a fence over the job) until every rank has reached it,
        so a leader that waited for that waited out `wait` for each follower in turn. The
        fence also keeps rank 0 (whose process runs the CPU cluster's scheduler) there until
        every rank is done with MindSpore's teardown, which may crash once it is gone."""
        self._done = True
        for link in self.followers:
            link.tell({"stop": True})
        wait_hung_up(self.followers, wait)

    def fail(self, message):
        """The job is failing: tell every follower why (best effort, never blocks long)."""
        self._done = True
        for link in self.followers:
            link.tell({"fail": message})

    def watch(self, on_gone):
        """Call `on_gone(message)` (from a thread) once a follower dies, goes silent for
        `silence` seconds, or reports an error."""
        if self.followers:
            threading.Thread(target=watch_links, daemon=True, name="msinfer-watch-ranks",
                             args=(self.followers, lambda: self._done, on_gone,
                                   self.silence)).start()

    def summary(self):
        if not self.frames:
            return "hand-off: no other ranks"
        return (f"hand-off to {len(self.followers)} ranks: {self.frames} steps, "
                f"{1e6 * self.seconds / self.frames:.1f} us and "
                f"{self.bytes_sent() / self.frames / len(self.followers):.0f} bytes per step "
                f"and rank on the leader")

    def bytes_sent(self):
        return sum(link.bytes for link in self.followers)


def watch_links(links, done, on_gone, silence, on_frame=None):
    """Read what `links`' peers send: heartbeats (noted), {"error": ...} reports (on_gone),
    other frames (on_frame(link, frame)); a closed or silent peer is on_gone too. Returns
    after the first on_gone, or once `done()`."""
    by_conn = {link.conn: link for link in links}
    while not done():
        try:
            readable, _, _ = select.select(list(by_conn), [], [], WATCH_INTERVAL)
        except (OSError, ValueError):  # a link was closed in this process meanwhile
            if not done():
                on_gone("a hand-off link was closed while the job still ran")
            return
        for conn in readable:
            link = by_conn[conn]
            try:
                conn.settimeout(_CONNECT_TIMEOUT)
                frame = _recv_frame(conn)
            except OSError:
                frame = None
            if done():
                return
            if frame is None:
                on_gone(f"rank {link.peer_rank} is gone (its connection closed)")
                return
            link.heard = time.monotonic()
            if "error" in frame:
                on_gone(frame["error"])
                return
            if "beat" not in frame and on_frame is not None:
                on_frame(link, frame)
        now = time.monotonic()
        for link in links:
            if now - link.heard > silence and not done():
                on_gone(f"rank {link.peer_rank} has said nothing for {now - link.heard:.0f}s "
                        f"(stalled: stopped, or stuck outside msinfer; --stall-timeout "
                        f"{silence:.0f})")
                return


class Follower:
    """A follower's end: `recv()` the next step's frame (None once told to stop); reports
    an error to its leader before leaving; beats while it lives."""

    def __init__(self, link, local, silence=DEFAULT_SILENCE):
        self.link = link
        self.local = local  # same host as the leader: its monotonic clock is ours
        self.silence = silence
        self.frames = 0
        self.latency = []  # seconds from the leader's send to this rank's receipt, same host
        self._done = False
        start_heartbeats([link], lambda: self._done)

    @property
    def leader_rank(self):
        return self.link.peer_rank

    def recv(self):
        """The next step's frame; None once told to stop, having hung up: the leader waits
        for that (Leader.close), and this process's end may wait for the leader's."""
        frame = self.link.recv(timeout=self.silence)
        if frame.get("stop"):
            self._done = True
            self.link.close()
            return None
        if "fail" in frame:
            self._done = True
            raise PeerGone(f"the job failed: {frame['fail']}")
        if self.local:
            self.latency.append(time.monotonic() - frame["sent_at"])
        self.frames += 1
        return frame

    def report(self, message):
        """Tell the leader why this rank leaves (best effort)."""
        self._done = True
        self.link.tell({"error": message})

    def watch(self, on_gone):
        """Call `on_gone(message)` once the leader disappears, even mid-step (in a
        collective, when frames are not being read). Returns the watching thread, which
        ends once it called on_gone or this end is done."""
        def watch():
            while not self._done:
                time.sleep(WATCH_INTERVAL)
                if self.link.hung_up():
                    time.sleep(1.0)  # a stop frame just read: let the loop mark itself done
                    if not self._done:
                        on_gone(f"rank {self.leader_rank} is gone (its connection closed)")
                    return
        thread = threading.Thread(target=watch, daemon=True, name="msinfer-watch-leader")
        thread.start()
        return thread

    def summary(self):
        if not self.latency:
            return f"hand-off: {self.frames} steps received"
        lat = sorted(self.latency)
        return (f"hand-off: {self.frames} steps received, latency from rank "
                f"{self.leader_rank} mean {1e6 * sum(lat) / len(lat):.0f} us, "
                f"p50 {1e6 * lat[len(lat) // 2]:.0f} us, "
                f"p99 {1e6 * lat[min(len(lat) - 1, int(0.99 * len(lat)))]:.0f} us")


# ---- start-up ------------------------------------------------------------------------------

class JobLinks:
    """What one rank of a serving job holds: `channel` (a Leader for a group's first rank,
    else a Follower), and on rank 0 `replicas` (Links to the other replicas' leaders, in
    replica order) or on another replica's leader `front` (its Link to rank 0)."""

    def __init__(self, channel, replicas=(), front=None):
        self.channel, self.replicas, self.front = channel, list(replicas), front


def open_links(dist, tensor, silence=DEFAULT_SILENCE):
    """Connect the ranks of a job of `dist.world_size // tensor` replicas of `tensor` ranks
    (consecutive ranks form a group; the first leads it)."""
    if dist.world_size == 1:
        return JobLinks(Leader([], silence))
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
    local = host.startswith("127.")
    rank, leads = dist.rank, dist.rank % tensor == 0
    if rank == 0:
        return _front_end(listener, dist.world_size, tensor, token, silence)
    if leads:  # another replica's leader: listen for its group, register with rank 0
        group = socket.create_server((host if local else "0.0.0.0", 0), backlog=tensor)
        front = Link(_connect(host, port, {"token": token, "rank": rank,
                                           "listen": group.getsockname()[1]}), 0)
        followers = _accept(group, list(range(rank + 1, rank + tensor)), token)
        return JobLinks(Leader(followers, silence), front=front)
    conn = _connect(host, port, {"token": token, "rank": rank})
    leader = rank - rank % tensor
    if leader:  # rank 0 says where this group's leader listens
        where = _recv_frame(conn)
        conn.close()
        conn = _connect(where["host"], where["port"], {"token": token, "rank": rank})
    return JobLinks(Follower(Link(conn, leader), local, silence))


def _front_end(listener, world_size, tensor, token, silence):
    """Rank 0: accept every rank once; keep its own group's followers and the other
    replicas' leaders; send every other follower to its leader."""
    hellos = _accept(listener, list(range(1, world_size)), token, keep_hello=True)
    followers, replicas, elsewhere = [], [], []
    for rank, (conn, hello) in sorted(hellos.items()):
        if rank < tensor:
            followers.append(Link(conn, rank))
        elif rank % tensor == 0:
            host = conn.getpeername()[0]
            replicas.append((rank, Link(conn, rank), host, hello["listen"]))
        else:
            elsewhere.append((rank, conn))
    where = {rank: (host, port) for rank, _, host, port in replicas}
    for rank, conn in elsewhere:
        host, port = where[rank - rank % tensor]
        _send_frame(conn, {"host": host, "port": port})
        conn.close()
    return JobLinks(Leader(followers, silence), replicas=[link for _, link, _, _ in replicas])


def _accept(listener, ranks, token, keep_hello=False):
    """Connections from `ranks` (each presenting `token`), as {rank: Link} in rank order, or
    {rank: (socket, hello)} with keep_hello."""
    listener.settimeout(_CONNECT_TIMEOUT)
    got = {}
    try:
        while len(got) < len(ranks):
            conn, _ = listener.accept()
            conn.settimeout(_CONNECT_TIMEOUT)
            try:
                hello = _recv_frame(conn)
            except OSError:
                hello = None
            if (not isinstance(hello, dict) or hello.get("token") != token
                    or hello.get("rank") not in ranks):
                conn.close()  # not one of ours
                continue
            conn.settimeout(None)
            got[hello["rank"]] = (conn, hello)
    except socket.timeout:
        missing = sorted(set(ranks) - set(got))
        raise MsinferError(f"hand-off channel: ranks {missing} did not connect within "
                           f"{_CONNECT_TIMEOUT:.0f}s") from None
    finally:
        listener.close()
    if keep_hello:
        return got
    return [Link(conn, rank) for rank, (conn, _) in sorted(got.items())]


def _connect(host, port, hello):
    deadline = time.monotonic() + _CONNECT_TIMEOUT
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=_CONNECT_TIMEOUT)
            break
        except OSError as e:
            if time.monotonic() > deadline:
                raise MsinferError(f"hand-off channel: cannot reach {host}:{port}: "
                                   f"{e}") from None
            time.sleep(0.2)
    _send_frame(conn, hello)
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


def log_summary(channel):
    log.get().info("%s", channel.summary())
