"""HTTP listeners a client cannot hold open: a cap on connections, and a deadline on each.

aiohttp closes an idle keep-alive connection only after an hour (3630 s) and sets no limit
on a request that arrives slowly or not at all; prometheus_client's metrics server gives each
connection a thread and no timeout. 400 half-sent requests held 400 of the daemon's files,
300 idle metrics connections 300 threads (issue 49). Every HTTP listener of the daemon (the
protocol's, `listen.http`, and the metrics port, `metrics.listen`) is a `Listener`: aiohttp
on an event loop of its own thread, its connections counted and swept (limits.http,
`HttpLimits`):

- past `max_connections` open, a new connection gets a 503 and is closed;
- a request's line and headers must arrive within `header_timeout_s` of its first byte, its
  body within `body_timeout_s` (the handler reads it with `body`), else the connection goes;
- a connection idle between requests goes after `keepalive_s`;
- request bodies are never inflated (a gzip body of 16 KB was 16 MiB of JSON): a
  Content-Encoding is refused with 415.

Slowloris-style clients are handled as nginx's client_header_timeout / client_body_timeout
and keepalive_timeout do; gRPC's listeners have their own (cuvild/serve/front.py, limits).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from cuvild.config import HttpLimits

log = logging.getLogger(__name__)
SWEEP_S = 0.5


@dataclass
class Connection:
    opened: float
    since: float  # the last response's end (or the connection's start)
    first_byte: float | None = None  # of a request not yet handed to its handler
    busy: int = 0  # requests in a handler


def _busy_reply(message: str) -> bytes:
    body = orjson.dumps({"error": message})
    return (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
            + body)


class Guarded(asyncio.Protocol):
    """aiohttp's protocol for one connection, behind the listener's count and deadlines:
    each event is passed on as it comes."""

    def __init__(self, guard: Guard, inner: asyncio.Protocol) -> None:
        self.guard, self.inner = guard, inner
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        if not self.guard.admit(transport):
            transport.write(_busy_reply(f"{len(self.guard.open)} connections open, the "
                                        f"listener's limit (limits.http.max_connections)"))
            transport.close()
            return
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        state = self.guard.open.get(self.transport)
        if state is None:
            return  # refused at the door
        if not state.busy and state.first_byte is None:
            state.first_byte = time.monotonic()
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self.transport not in self.guard.open:
            return None
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.guard.open.pop(self.transport, None) is not None:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class Guard:
    """The connections of one listener: counted at the door, swept for deadlines."""

    def __init__(self, limits: HttpLimits, name: str) -> None:
        self.limits, self.name = limits, name
        self.open: dict[Any, Connection] = {}
        self.closed = {"busy": 0, "header": 0, "idle": 0}  # connections closed, by why

    def admit(self, transport: Any) -> bool:
        if len(self.open) >= self.limits.max_connections:
            self.closed["busy"] += 1
            return False
        now = time.monotonic()
        self.open[transport] = Connection(now, now)
        return True

    def factory(self, make: Callable[[], asyncio.Protocol]) -> Callable[[], Guarded]:
        return lambda: Guarded(self, make())

    @contextlib.contextmanager
    def handling(self, request: web.Request) -> Any:
        """Around a request's handler: the connection is busy, not idle or slow."""
        state = self.open.get(request.transport)
        if state is None:  # (a connection closed under us)
            yield
            return
        state.busy += 1
        state.first_byte = None
        try:
            yield
        finally:
            state.busy -= 1
            state.since = time.monotonic()

    def sweep(self) -> None:
        now, limits = time.monotonic(), self.limits
        for transport, state in list(self.open.items()):
            if state.busy:
                continue
            if state.first_byte is not None:
                if now - state.first_byte > limits.header_timeout_s:
                    self._close(transport, "header")
            elif now - state.since > limits.keepalive_s:
                self._close(transport, "idle")

    def _close(self, transport: Any, why: str) -> None:
        self.closed[why] += 1
        log.debug("%s: closing a connection (%s past its limit)", self.name, why)
        transport.close()


async def body(request: web.Request, limits: HttpLimits) -> bytes:
    """The request's body within limits.http.body_timeout_s, never inflated (415 for a
    Content-Encoding), at most max_body_bytes (413, aiohttp's client_max_size)."""
    if request.headers.get("Content-Encoding", "identity").lower() != "identity":
        raise web.HTTPUnsupportedMediaType(
            reason="compressed request bodies are not accepted (Content-Encoding); send it "
                   "uncompressed")
    try:
        return await asyncio.wait_for(request.read(), limits.body_timeout_s)
    except TimeoutError:
        raise web.HTTPRequestTimeout(
            reason=f"the body did not arrive within {limits.body_timeout_s:g} s "
                   "(limits.http.body_timeout_s)") from None


class Listener:
    """An aiohttp application on HOST:PORT, served from an event loop of its own thread
    behind a Guard. `start` binds (raises OSError when it cannot); `stop` drains."""

    def __init__(self, app: web.Application, host: str, port: int, limits: HttpLimits,
                 name: str, tls: ssl.SSLContext | None = None, drain_s: float = 10.0) -> None:
        self.app, self.host, self.port, self.tls = app, host, port, tls
        self.limits, self.drain_s, self.name = limits, drain_s, name
        self.guard = Guard(limits, name)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.runner: web.AppRunner | None = None
        self.server: Any = None
        self.sweeper: Any = None

    def start(self) -> None:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=30)

    async def _start(self) -> None:
        self.runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=self.drain_s,
                                    auto_decompress=False,
                                    keepalive_timeout=self.limits.keepalive_s)
        await self.runner.setup()
        self.server = await self.loop.create_server(
            self.guard.factory(self.runner.server), self.host, self.port, ssl=self.tls,
            reuse_address=True)
        self.port = self.server.sockets[0].getsockname()[1]  # a port of 0: the one given
        self.sweeper = self.loop.create_task(self._sweep())

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            self.guard.sweep()

    async def _stop(self) -> None:
        if self.sweeper is not None:
            self.sweeper.cancel()
        if self.server is not None:
            self.server.close()  # no new connections; those open drain
        if self.runner is not None:
            await self.runner.cleanup()

    def stop(self) -> None:
        if self.thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(
                timeout=self.drain_s + 10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)
