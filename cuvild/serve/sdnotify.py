"""systemd's notify protocol (sd_notify(3)) in a few lines: READY=1, STATUS=, WATCHDOG=1,
STOPPING=1 sent as datagrams to $NOTIFY_SOCKET. Without that variable every call is a no-op,
so the daemon behaves the same under systemd, in a terminal and in tests."""

from __future__ import annotations

import os
import socket
import threading


def notify(message: str) -> bool:
    """Send one notification; False when not run by systemd (or the socket is gone)."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
        return True
    except OSError:
        return False


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings (half systemd's timeout), or None when not asked."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 1e6 / 2


def start_watchdog(alive: threading.Event, stop: threading.Event) -> threading.Thread | None:
    """Ping systemd while `alive` is set; a daemon that hangs stops pinging and is restarted."""
    interval = watchdog_interval()
    if interval is None:
        return None

    def loop() -> None:
        while not stop.wait(interval):
            if alive.is_set():
                notify("WATCHDOG=1")

    thread = threading.Thread(target=loop, name="watchdog", daemon=True)
    thread.start()
    return thread
