"""The unix socket's front: it knows which user is calling.

gRPC does not hand a servicer the peer's credentials (grpc/grpc#15511: its local credentials
never call SO_PEERCRED, and the server peer string of a unix connection is just "unix:"). So
cuvild owns the public socket itself: for each connection it reads SO_PEERCRED, then relays
the bytes to the gRPC server on a private socket (in a 0700 directory only the daemon's user
can enter), from an abstract address with a random name: `unix-abstract:cuvild-<tag>-<nonce>`
is what the servicer sees as `context.peer()`, and `uid_of` looks the nonce up in this
front's table. Only the daemon's user can reach the private socket, so a name that is not in
the table is nobody's; the nonce is drawn before bind, so it cannot be squatted, and the
name says nothing about who is connected.

One thread relays every connection (an epoll loop; an idle connection costs two sockets and
no thread). Over unix sockets the relay costs 0.03-0.1 ms per round trip on the 2-core dev host
(tests/bench/bench_serving.py, (b), times a grpcio echo with and without it). Limits, so one
local user cannot lock the others out: at most `max_connections` relayed at once and
`max_per_uid` for any one uid (past either a connection is closed at once, and logged, with
at most one line a second). Idle connections are closed by gRPC behind the front (the
daemon sets its max_connection_idle and handshake timeout): only gRPC knows whether a silent
connection still waits on a call, and its GOAWAY lets a client reconnect cleanly. When a uid's
last connection closes, `on_last_close(uid)` runs (the daemon drops that uid's regions).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import select
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from protos.fastpath import MAGIC

log = logging.getLogger(__name__)

_UCRED = struct.Struct("3i")  # pid, uid, gid
_CHUNK = 1 << 18
READ, WRITE = select.EPOLLIN, select.EPOLLOUT
MAX_CONNECTIONS = 256
MAX_PER_UID = 64


@dataclass(eq=False)
class _Link:
    """One relayed connection: the client's socket, ours to gRPC, and what waits to be sent."""
    client: socket.socket
    inner: socket.socket
    uid: int
    nonce: str
    pending: dict[socket.socket, bytearray] = field(default_factory=dict)
    shut: set[socket.socket] = field(default_factory=set)  # read ends that saw EOF
    seen: bool = False  # the client's first bytes came (a fast-path session's are its magic)

    def other(self, s: socket.socket) -> socket.socket:
        return self.inner if s is self.client else self.client

    def held(self) -> bool:
        """gRPC greets first (its SETTINGS frame): that waits until the client spoke (a
        fast-path client must never get it) or gRPC closed (a silent client gets both)."""
        return not self.seen and self.inner not in self.shut


class Front:
    def __init__(self, public_path: str, max_connections: int | None = None,
                 max_per_uid: int | None = None,
                 on_last_close: Callable[[int], None] | None = None,
                 on_session: Callable[[socket.socket, int, bytes, Callable[[], None]], None]
                 | None = None, scratch_base: str | None = None) -> None:
        """`on_session(sock, uid, first_bytes, done)` takes a connection that opens a
        fast-path session (cuvild/serve/fast.py); it calls `done()` once it closed it.
        `scratch_base`: where to make the workers' scratch directory (`scratch_dir`), on disk
        beside the compile cache, reclaimed as the private one is."""
        self.public_path = public_path
        self.on_session = on_session
        self._count_lock = threading.Lock()  # sessions end on their own threads
        self.max_connections = max_connections or MAX_CONNECTIONS
        self.max_per_uid = max_per_uid or MAX_PER_UID
        self.on_last_close = on_last_close
        self.tag = secrets.token_hex(6)
        self._prefix = f"unix-abstract:cuvild-{self.tag}-"
        self._uids: dict[str, int] = {}  # nonce -> uid, while the connection is open
        self._per_uid: dict[int, int] = {}
        base = os.environ.get("RUNTIME_DIRECTORY") or tempfile.gettempdir()
        reclaim_stale(base)
        self._dir = tempfile.mkdtemp(prefix=f"cuvild-{os.getpid()}-", dir=base)
        self.scratch_dir = ""
        if scratch_base:
            os.makedirs(scratch_base, exist_ok=True)
            reclaim_stale(scratch_base)
            self.scratch_dir = tempfile.mkdtemp(prefix=f"cuvild-{os.getpid()}-", dir=scratch_base)
        self.inner_path = os.path.join(self._dir, "grpc.sock")  # mkdtemp made the dir 0700
        self._listener: socket.socket | None = None
        self._links: dict[socket.socket, _Link] = {}  # both sockets of each link
        self._epoll = select.epoll()
        self._events: dict[int, int] = {}  # fd -> events registered
        self._sockets: dict[int, socket.socket] = {}
        self._thread: threading.Thread | None = None
        self._closed = False
        self._refused_logged = 0.0
        self._buf = bytearray(_CHUNK)  # the loop's one receive buffer
        self._view = memoryview(self._buf)
        self.refused = 0

    def uid_of(self, peer: str) -> int | None:
        """The caller's uid from a servicer's `context.peer()`; None if the call did not come
        through this front or its connection is closed."""
        if not peer.startswith(self._prefix):
            return None
        return self._uids.get(peer[len(self._prefix):])

    def caller(self, peer: str) -> int:
        """uid_of for the unix listener's servicers: -1 (a uid that owns nothing and has no
        regions) when the caller cannot be told."""
        uid = self.uid_of(peer)
        return -1 if uid is None else uid

    def connections(self) -> int:
        """Connections relayed now."""
        return len(self._uids)

    def start(self) -> None:
        """Listen on the public path (mode 0660); call once gRPC serves `inner_path`."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o117)  # bind creates the socket 0660, no window before chmod
        try:
            listener.bind(self.public_path)
        finally:
            os.umask(old_umask)
        os.chmod(self.public_path, 0o660)
        listener.listen(128)
        listener.setblocking(False)
        self._listener = listener
        self._arm(listener, READ)
        self._thread = threading.Thread(target=self._loop, name="front", daemon=True)
        self._thread.start()

    def stop_accepting(self) -> None:
        """Close the public socket and remove its path (only if this front bound it); open
        connections keep being relayed (they drain)."""
        listener, self._listener = self._listener, None
        if listener is None:
            return
        try:
            os.unlink(self.public_path)
        except FileNotFoundError:
            pass
        if self._thread is None:
            listener.close()

    @property
    def private_dir(self) -> str:
        """The daemon's private directory (0700): removed at close, and by the next daemon's
        start where this one was killed (`reclaim_stale`)."""
        return self._dir

    def close(self) -> None:
        """Stop accepting, drop the open relays and remove the private directory."""
        self.stop_accepting()
        self._closed = True
        if self._thread is not None:
            self._thread.join(timeout=5)
        shutil.rmtree(self._dir, ignore_errors=True)
        if self.scratch_dir:
            shutil.rmtree(self.scratch_dir, ignore_errors=True)

    # -- the loop --------------------------------------------------------------------------
    def _loop(self) -> None:
        listener = self._listener
        while not self._closed:
            if listener is not None and self._listener is None:  # stop_accepting
                self._arm(listener, 0)
                listener.close()
                listener = None
            for fd, events in self._epoll.poll(0.2):
                sock = self._sockets.get(fd)
                if sock is None:
                    continue
                try:
                    if sock is listener:
                        self._accept(sock)
                    else:
                        self._service(sock, events)
                except Exception as e:  # noqa: BLE001 - one bad connection must not stop the rest
                    log.warning("dropping a unix connection: %s", e)
                    link = self._links.get(sock)
                    if link is not None:
                        self._drop(link)
        if listener is not None:
            listener.close()
        for link in list({id(v): v for v in self._links.values()}.values()):
            self._drop(link)
        self._epoll.close()

    def _accept(self, listener: socket.socket) -> None:
        try:
            client, _ = listener.accept()
        except BlockingIOError:
            return
        except OSError as e:  # EMFILE, ENOMEM: retry on the next wake-up
            log.warning("unix socket accept failed: %s; retrying", e)
            time.sleep(0.05)
            return
        _pid, uid, _gid = _UCRED.unpack(
            client.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        refused = (f"{self.max_connections} connections are open (limits.max_connections)"
                   if len(self._uids) >= self.max_connections else
                   f"uid {uid} has {self.max_per_uid} connections open "
                   "(limits.max_connections_per_uid)"
                   if self._per_uid.get(uid, 0) >= self.max_per_uid else None)
        if refused:
            client.close()
            self.refused += 1
            now = time.monotonic()
            if now - self._refused_logged >= 1.0:
                self._refused_logged = now
                log.warning("refusing a connection of uid %d: %s (%d refused so far)", uid,
                            refused, self.refused)
            return
        inner = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        nonce = secrets.token_hex(12)
        try:
            inner.bind(f"\0cuvild-{self.tag}-{nonce}")
            inner.connect(self.inner_path)
        except OSError as e:
            inner.close()
            client.close()
            raise OSError(f"cannot reach the gRPC server: {e}") from None
        client.setblocking(False)
        inner.setblocking(False)
        link = _Link(client, inner, uid, nonce)
        with self._count_lock:
            self._uids[nonce] = uid
            self._per_uid[uid] = self._per_uid.get(uid, 0) + 1
        for s in (client, inner):
            self._links[s] = link
            self._arm(s, READ)

    def _service(self, s: socket.socket, events: int) -> None:  # noqa: C901 - a branch per refusal, each with its status
        link = self._links.get(s)
        if link is None:
            return
        if events & (WRITE | select.EPOLLERR | select.EPOLLHUP):
            self._flush(link, s)
        if not events & (READ | select.EPOLLERR | select.EPOLLHUP) or s not in self._links:
            return
        dst = link.other(s)
        try:
            n = s.recv_into(self._buf)
        except BlockingIOError:
            return
        except OSError:
            n = 0
        if not n:
            link.shut.add(s)
            link.seen = link.seen or s is link.client
            self._flush(link, dst)
            return
        if not link.seen and s is link.client:
            link.seen = True
            if (self.on_session is not None and n >= len(MAGIC)
                    and self._view[:len(MAGIC)] == MAGIC):
                self._hand_off(link, bytes(self._view[:n]))
                return
            self._flush(link, s)  # gRPC's greeting, held until now
            if s not in self._links:
                return
        elif link.held():
            link.pending.setdefault(dst, bytearray()).extend(self._view[:n])
            self._watch(link, s)
            return
        if not link.pending.get(dst):  # the usual case: straight through, no copy
            try:
                sent = dst.send(self._view[:n])
            except BlockingIOError:
                sent = 0
            except OSError:
                self._drop(link)
                return
            if sent == n:
                return
            link.pending[dst] = bytearray(self._view[sent:n])
        else:
            link.pending[dst].extend(self._view[:n])
        self._flush(link, dst)

    def _hand_off(self, link: _Link, first: bytes) -> None:
        """A fast-path session: the client's socket leaves the relay (gRPC never sees it);
        it keeps counting as the uid's connection until the session calls `done`."""
        for s in (link.client, link.inner):
            self._links.pop(s, None)
            self._arm(s, 0)
        link.inner.close()
        assert self.on_session is not None
        try:
            self.on_session(link.client, link.uid, first, lambda: self._release(link))
        except BaseException:  # (no thread to start): it left the links, so close it here
            link.client.close()
            self._release(link)
            raise

    def _flush(self, link: _Link, dst: socket.socket) -> None:
        """Send what waits for dst; pass an EOF on once its bytes are out; re-arm both."""
        buf = link.pending.get(dst)
        if buf:
            try:
                del buf[:dst.send(buf)]
            except BlockingIOError:
                pass
            except OSError:
                self._drop(link)
                return
        src = link.other(dst)
        if src in link.shut and not buf:
            _shutdown(dst, socket.SHUT_WR)
            if dst in link.shut and not link.pending.get(src):
                self._drop(link)  # both directions done
                return
        self._watch(link, dst)
        self._watch(link, src)

    def _watch(self, link: _Link, s: socket.socket) -> None:
        """Read s unless it saw EOF or its bytes still wait for the other side (backpressure);
        write s while bytes wait for it."""
        events, held = 0, link.held()
        if s not in link.shut and (held or not link.pending.get(link.other(s))):
            events |= READ
        if link.pending.get(s) and not held:
            events |= WRITE
        self._arm(s, events)

    def _arm(self, s: socket.socket, events: int) -> None:
        """Have epoll report `events` on s (0: nothing, s leaves the set)."""
        fd = s.fileno()
        current = self._events.get(fd, 0)
        if events == current or fd < 0:
            return
        if not events:
            self._epoll.unregister(fd)
            del self._events[fd], self._sockets[fd]
        elif current:
            self._epoll.modify(fd, events)
            self._events[fd] = events
        else:
            self._epoll.register(fd, events)
            self._events[fd], self._sockets[fd] = events, s

    def _drop(self, link: _Link) -> None:
        for s in (link.client, link.inner):
            if self._links.pop(s, None) is not None:
                self._arm(s, 0)
            _shutdown(s, socket.SHUT_RDWR)
            s.close()
        self._release(link)

    def _release(self, link: _Link) -> None:
        """The link's connection is closed: it counts no more; a uid's last one runs
        on_last_close."""
        with self._count_lock:
            if self._uids.pop(link.nonce, None) is None:
                return
            left = self._per_uid[link.uid] - 1
            if left:
                self._per_uid[link.uid] = left
                return
            del self._per_uid[link.uid]
        if self.on_last_close is not None:
            try:
                self.on_last_close(link.uid)
            except Exception:  # noqa: BLE001
                log.exception("on_last_close(%d) failed", link.uid)


def reclaim_stale(base: str) -> None:
    """Remove the private directories of daemons that died without cleaning up (SIGKILL)."""
    for entry in os.scandir(base):
        match = re.fullmatch(r"cuvild-(\d+)-\w+", entry.name)
        if not match or not entry.is_dir(follow_symlinks=False):
            continue
        if entry.stat(follow_symlinks=False).st_uid != os.getuid():
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            log.info("removing %s left by a stopped daemon", entry.path)
            shutil.rmtree(entry.path, ignore_errors=True)
        except PermissionError:
            pass  # alive, someone else's


def _shutdown(s: socket.socket, how: int) -> None:
    try:
        s.shutdown(how)
    except OSError:
        pass
