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

A relay is two threads per connection that copy between the sockets; over unix sockets that
costs 0.03-0.1 ms per round trip on the 2-core dev host (tests/bench/bench_serving.py, (b),
times a grpcio echo with and without it). At most MAX_CONNECTIONS are relayed at once; past
that a connection is closed at once (and logged), so a flood cannot exhaust the daemon's fds.
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
import time

log = logging.getLogger(__name__)

_UCRED = struct.Struct("3i")  # pid, uid, gid
_CHUNK = 1 << 18
MAX_CONNECTIONS = 256


class Front:
    def __init__(self, public_path: str) -> None:
        self.public_path = public_path
        self.tag = secrets.token_hex(6)
        self._prefix = f"unix-abstract:cuvild-{self.tag}-"
        self._uids: dict[str, int] = {}  # nonce -> uid, while the connection is open
        base = os.environ.get("RUNTIME_DIRECTORY") or tempfile.gettempdir()
        reclaim_stale(base)
        self._dir = tempfile.mkdtemp(prefix=f"cuvild-{os.getpid()}-", dir=base)
        self.inner_path = os.path.join(self._dir, "grpc.sock")  # mkdtemp made the dir 0700
        self._listener: socket.socket | None = None
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()

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
        listener, self._listener = self._listener, None
        if listener is None:
            return
        _shutdown(listener, socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        listener.close()
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
        while self._listener is listener and listener is not None:
            try:
                client, _ = listener.accept()
            except OSError as e:
                if self._listener is not listener:
                    return  # closed by stop_accepting
                log.warning("unix socket accept failed: %s; retrying", e)  # EMFILE, ENOMEM
                time.sleep(0.1)
                continue
            try:
                self._relay(client)
            except Exception as e:  # noqa: BLE001 - one bad connection must not stop the rest
                log.warning("dropping a unix connection: %s", e)
                client.close()

    def _relay(self, client: socket.socket) -> None:
        _pid, uid, _gid = _UCRED.unpack(
            client.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        with self._lock:
            if len(self._open) >= 2 * MAX_CONNECTIONS:
                raise OSError(f"{MAX_CONNECTIONS} connections are open already (uid {uid} "
                              "refused)")
        inner = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        nonce = secrets.token_hex(12)
        try:
            inner.bind(f"\0cuvild-{self.tag}-{nonce}")
            inner.connect(self.inner_path)
        except OSError as e:
            inner.close()
            raise OSError(f"cannot reach the gRPC server: {e}") from None
        with self._lock:
            self._open.update((client, inner))
            self._uids[nonce] = uid
        done = threading.Semaphore(0)
        try:
            for src, dst in ((client, inner), (inner, client)):
                threading.Thread(target=self._pump, args=(src, dst, done, client, inner, nonce),
                                 name=f"front-u{uid}", daemon=True).start()
        except RuntimeError:  # no thread to be had: drop this connection
            self._drop(client, inner, nonce)
            raise

    def _pump(self, src: socket.socket, dst: socket.socket, done: threading.Semaphore,
              client: socket.socket, inner: socket.socket, nonce: str) -> None:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        try:
            while n := src.recv_into(buf):
                dst.sendall(view[:n])
        except OSError:
            pass
        _shutdown(dst, socket.SHUT_WR)
        if done.acquire(blocking=False):  # the other direction finished first: close both
            self._drop(client, inner, nonce)
        else:
            done.release()

    def _drop(self, client: socket.socket, inner: socket.socket, nonce: str) -> None:
        with self._lock:
            self._open.difference_update((client, inner))
            self._uids.pop(nonce, None)
        _shutdown(client, socket.SHUT_RDWR)
        _shutdown(inner, socket.SHUT_RDWR)
        client.close()
        inner.close()


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
