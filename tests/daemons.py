"""A real cuvild subprocess on a real unix socket, with a NOTIFY_SOCKET: what the daemon
tests, the OIP tests and the benchmarks start (the fixtures are in conftest.py)."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 120.0


def free_port() -> int:
    """A loopback TCP port free now (for a test's listener)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_core_layout() -> dict[str, Any]:
    """CPU worker on the first core, an emulated NPU on the second (the demo layout)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return {"cpu": {"cores": cores}}
    return {
        "cpu": {"cores": [cores[0]]},
        "emulated": [{"id": "npu0", "kind": "npu", "runtime": "openvino", "cores": [cores[1]]}],
    }


def one_cpu() -> dict[str, Any]:
    """One CPU device on every core, and no GPU: the benchmarks compare CPU runtimes (on a
    GPU host a fresh state dir would also measure the GPU, AOTInductor's check included)."""
    return {"cpu": {"cores": None}, "gpu": {"enabled": False}}


def read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def worker_processes(daemon_pid: int, marker: str = "") -> list[Path]:
    """/proc entries of a daemon's worker processes (named `cuvil-<device>`; spawned by the
    daemon, or forked by its forkserver), or with `marker`, of its children whose command line
    holds it ("forkserver": the uploads' inspector, which workers may fork from)."""
    def parent(proc: Path) -> int:
        try:
            return int(read_text(proc / "stat").rsplit(")", 1)[1].split()[1])
        except (IndexError, ValueError):
            return -1

    procs = [p for p in Path("/proc").iterdir() if p.name.isdigit()]
    children = [p for p in procs if parent(p) == daemon_pid]
    if marker:
        return [p for p in children if marker in read_text(p / "cmdline")]
    servers = {int(p.name) for p in children if "forkserver" in read_text(p / "cmdline")}
    return [p for p in procs if (p in children or parent(p) in servers)
            and read_text(p / "comm").startswith("cuvil-")]


class DaemonProcess:
    """One cuvild subprocess; records the sd_notify messages it sends."""

    def __init__(self, workdir: Path, config: dict[str, Any],
                 profiles: Path | None = None) -> None:
        """`profiles`: the session's state dir of measured device profiles. A daemon whose own
        state dir has none is seeded from it, and the first daemon to measure fills it, so that
        a session measures the devices once (5-9 s a time on the 2-core host)."""
        self.workdir = workdir
        self.profiles = profiles
        self.config_path = workdir / "cuvild.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.socket_path = Path(config["listen"]["unix"])
        self.target = f"unix://{self.socket_path}"
        self.notify_path = workdir / "notify.sock"
        self.notify_path.unlink(missing_ok=True)
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(self.notify_path))
        self.messages: list[str] = []
        self.log_path = workdir / "cuvild.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready_s: float | None = None
        self.state_dir = Path(config["state_dir"])
        self.wrap: list[str] = []  # a command the daemon runs under (unshare, ...)
        # more of its environment (None: unset). Started as a user's shell or systemd starts
        # it: not with this process's inductor and Triton cache directories, which inductor
        # writes into this environment at its first use here (/tmp/torchinductor_<user>, warm
        # from every earlier run): the daemon keeps them under its cache_dir, and a restart's
        # or a first load's compile times are its own
        self.env: dict[str, str | None] = {"TORCHINDUCTOR_CACHE_DIR": None,
                                           "TRITON_CACHE_DIR": None}

    def start(self, wait: bool = True) -> DaemonProcess:
        if self.profiles is None or not wait:
            return self._start(wait)
        # one start at a time across the run's pytest workers (whose session profiles are one
        # folder: tests/conftest.py state_root), so that a new device layout is measured once
        # and never by two daemons on the same cores at once
        with open((self.profiles / "profiles").resolve().parent / "daemon-start.lock",
                  "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return self._start(wait)

    def _start(self, wait: bool) -> DaemonProcess:
        mine = self.state_dir / "profiles"
        session = None if self.profiles is None else self.profiles / "profiles"
        if session is not None and session.exists() and not mine.exists():
            shutil.copytree(session, mine)
        had = set(mine.iterdir()) if mine.exists() else set()
        env = {k: v for k, v in {**os.environ, "NOTIFY_SOCKET": str(self.notify_path),
                                 "PYTHONUNBUFFERED": "1", **self.env}.items()
               if v is not None}  # (None in self.env: a variable this process has, unset)
        log = open(self.log_path, "ab")  # noqa: SIM115 - kept open for the child's lifetime
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            [*self.wrap, sys.executable, "-m", "cuvild", "--config", str(self.config_path)],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        if wait:
            self.wait_for("READY=1")
            self.ready_s = time.perf_counter() - t0
            if session is not None and mine.exists():  # what this start measured (devices
                session.mkdir(parents=True, exist_ok=True)  # of another config: another file)
                for path in set(mine.iterdir()) - had:
                    if not (session / path.name).exists():
                        shutil.copy2(path, session / path.name)
        return self

    def wait_for(self, needle: str, timeout: float = START_TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout
        self.notify.settimeout(0.1)
        while time.monotonic() < deadline:
            try:
                self.messages.append(self.notify.recv(4096).decode())
            except TimeoutError:
                assert self.proc is not None
                if self.proc.poll() is not None:  # exited and nothing left to read
                    break
            for message in self.messages:
                if needle in message:
                    return message
        raise AssertionError(f"no {needle!r} from cuvild (exit {self.proc and self.proc.poll()})"
                             f" within {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
            # A killed daemon cannot remove its arena (its next start would reclaim it): the
            # harness that killed it does, so that a test run leaves no shared memory.
            for leftover in Path("/dev/shm").glob(f"cuvil-{self.proc.pid}-*"):
                leftover.unlink(missing_ok=True)
        self.notify.close()


# What a test daemon's `auto` may build a part with, unless the test says otherwise: OpenVINO
# alone (about 1 s for a small part), rather than every runtime in turn (ONNX Runtime's export
# and IREE's compile add 3-4 s to each small part). The choice between runtimes is tested by
# tests/runtimes/test_select.py and by the daemons that set engine.runtimes themselves.
TEST_RUNTIMES = {"cpu": ["openvino"], "npu": ["openvino"]}


def daemon_config(workdir: Path, state_dir: Path, sock_dir: Path,
                  **extra: Any) -> dict[str, Any]:
    config = {
        "listen": {"unix": str(sock_dir / f"{uuid.uuid4().hex[:8]}.sock")},
        "state_dir": str(state_dir),
        "cache_dir": str(workdir / "cache"),
        "log_level": "debug",
        "devices": two_core_layout(),
    }
    for key, value in extra.items():  # sections merge, so listen={"tcp": ...} keeps the socket
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


def suite_config(workdir: Path, state_dir: Path, sock_dir: Path, **extra: Any) -> dict[str, Any]:
    """daemon_config for a test's daemon: `auto` builds with TEST_RUNTIMES unless the test
    names engine.runtimes itself (the benchmarks keep every runtime, as users do), OpenMP
    waits passive, decode steps are not compiled."""
    engine = {"runtimes": TEST_RUNTIMES, "omp_wait": "passive",
              # (a language model's decode step compiled at its first use: ~10 s a model,
              # tested by tests/runtimes/test_compiled_step.py)
              "sequences": {"compile_steps": False}, **extra.pop("engine", {})}
    # (passive: two pytest workers share the 2 cores; spinning pools slow the other's daemons)
    return daemon_config(workdir, state_dir, sock_dir, engine=engine, **extra)


def own_registry_daemon(workdir: Path, state_root: Path, sock_dir: Path) -> DaemonProcess:
    """A started daemon with its own registry under `workdir`, seeded with the session's
    measured device profiles (in `state_root`) when there are some."""
    state_dir = workdir / "state"
    return DaemonProcess(workdir, suite_config(workdir, state_dir, sock_dir),
                         profiles=state_root).start()
