"""The unix socket's front: it knows which user is calling.

gRPC does not hand a servicer the peer's credentials (grpc/grpc#15511: its local credentials
never call SO_PEERCRED, and the server peer string of a unix connection is just "unix:"). So
cuvild owns the public socket itself: for each connection it reads SO_PEERCRED, then relays
the bytes to the gRPC server on a private socket (in a 0700 directory only the daemon's user
can enter), from an abstract address that names the caller. The servicer sees
`unix-abstract:cuvild-<tag>-u<uid>-p<pid>-<n>` as `context.peer()`; `uid_of` turns it back
into the uid. Only the daemon's user can reach the private socket, so only this front can
make such a name, and the random tag ties the name to this daemon instance.

A relay is two threads per connection that copy between the sockets; over unix sockets that
costs 0.03-0.1 ms per round trip on the 2-core dev host (tests/bench/bench_serving.py, (b),
times a grpcio echo with and without it).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import socket
import struct
import tempfile
import threading

log = logging.getLogger(__name__)

_UCRED = struct.Struct("3i")  # pid, uid, gid
_CHUNK = 1 << 18


class Front:
    def __init__(self, public_path: str) -> None:
        self.public_path = public_path
        self.tag = secrets.token_hex(6)
        self._peer = re.compile(rf"unix-abstract:cuvild-{self.tag}-u(\d+)-p\d+-\d+")
        base = os.environ.get("RUNTIME_DIRECTORY") or tempfile.gettempdir()
        reclaim_stale(base)
        self._dir = tempfile.mkdtemp(prefix=f"cuvild-{os.getpid()}-", dir=base)
        self.inner_path = os.path.join(self._dir, "grpc.sock")  # mkdtemp made the dir 0700
        self._listener: socket.socket | None = None
        self._count = 0
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()

    def uid_of(self, peer: str) -> int | None:
        """The caller's uid from a servicer's `context.peer()`; None if it did not come
        through this front (e.g. the TCP listener)."""
        match = self._peer.fullmatch(peer)
        return int(match.group(1)) if match else None

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
        self._listener = listener
        threading.Thread(target=self._accept, name="front-accept", daemon=True).start()

    def stop_accepting(self) -> None:
        """Close the public socket and remove its path (only if this front bound it)."""
        if self._listener is None:
            return
        _shutdown(self._listener, socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        self._listener.close()
        self._listener = None
        try:
            os.unlink(self.public_path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Stop accepting, drop the open relays and remove the private directory."""
        self.stop_accepting()
        with self._lock:
            sockets, self._open = list(self._open), set()
        for s in sockets:
            _shutdown(s, socket.SHUT_RDWR)
        shutil.rmtree(self._dir, ignore_errors=True)

    def _accept(self) -> None:
        listener = self._listener
        while listener is not None and listener.fileno() >= 0:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed by stop_accepting
            try:
                self._relay(client)
            except OSError as e:
                log.warning("dropping a unix connection: cannot reach the gRPC server: %s", e)
                client.close()

    def _relay(self, client: socket.socket) -> None:
        pid, uid, _gid = _UCRED.unpack(
            client.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        self._count += 1
        inner = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            inner.bind(f"\0cuvild-{self.tag}-u{uid}-p{pid}-{self._count}")
            inner.connect(self.inner_path)
        except OSError:
            inner.close()
            raise
        with self._lock:
            self._open.update((client, inner))
        done = threading.Semaphore(0)
        for src, dst in ((client, inner), (inner, client)):
            threading.Thread(target=self._pump, args=(src, dst, done, client, inner),
                             name=f"front-u{uid}", daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, done: threading.Semaphore,
              client: socket.socket, inner: socket.socket) -> None:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        try:
            while n := src.recv_into(buf):
                dst.sendall(view[:n])
        except OSError:
            pass
        _shutdown(dst, socket.SHUT_WR)
        if done.acquire(blocking=False):  # the other direction finished first: close both
            with self._lock:
                self._open.difference_update((client, inner))
            client.close()
            inner.close()
        else:
            done.release()


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
