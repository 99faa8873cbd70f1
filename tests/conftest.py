"""Fixtures shared by the tests: real cuvild daemons (see daemons.py), and the `daemon`
marker put on every test that starts one, so `pytest -m "not daemon"` runs the fast tests."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemons import DaemonProcess, suite_config

from runtimes.cache import KEY_ENV

# A language model's decode step is not compiled at its first use in the tests' own engines
# and workers (inductor, ~10 s a model): tests/runtimes/test_compiled_step.py turns it on.
os.environ["CUVILD_COMPILE_STEPS"] = "0"

# Fixtures that start a cuvild and serve it to a test (the `env` and `lm_daemon` of
# tests/serve/ included).
DAEMON_FIXTURES = {"daemon", "make_daemon", "env", "lm_daemon"}


# Files that share a session daemon run on one worker, so that it is started (and its models
# built) once: test_oip_shm.py uses test_oip.py's `env`, test_fuzz.py test_hardening.py's
# `hardened`, test_openai_generation.py test_generation.py's `lm_daemon` (all in
# tests/serve/conftest.py).
# test_docs.py (2 tests, ~40 s) goes with test_transformers.py: sent out by its own count it
# came last, one worker running it alone at the end of the suite (530 s against 504).
SAME_WORKER = {"tests/serve/test_oip_shm.py": "tests/serve/test_oip.py",
               "tests/serve/test_newcomer.py": "tests/serve/test_oip.py",
               "tests/serve/test_fuzz.py": "tests/serve/test_hardening.py",
               "tests/serve/test_docs.py": "tests/models/test_transformers.py",
               "tests/serve/test_openai_generation.py": "tests/serve/test_generation.py",
               "tests/serve/test_tokenize.py": "tests/serve/test_generation.py",
               "tests/serve/test_reasoning.py": "tests/serve/test_generation.py",
               "tests/serve/test_embeddings.py": "tests/serve/test_generation.py"}


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's loadfile (`make test`), with the files of SAME_WORKER together. Files go out
    most tests first (xdist's default), so the daemon-heavy files of tests/serve run beside
    many short ones (sending tests/serve first had both workers start daemons at once: the
    suite took 568 s instead of 482 s here)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return SAME_WORKER.get(path, path)

    return ByFile(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if DAEMON_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.daemon)


@pytest.fixture(scope="session")
def state_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One state dir for the session, so devices are measured once and then cached; under
    xdist its profiles are the run's, shared by the workers (daemons.py: their first starts
    take turns, so one measures and the other reads)."""
    root = tmp_path_factory.mktemp("state")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "profiles"
        shared.mkdir(exist_ok=True)
        (root / "profiles").symlink_to(shared)
    return root


@pytest.fixture(scope="session")
def sock_dir() -> Iterator[Path]:
    # Socket paths are limited to ~107 bytes: keep them short, outside deep pytest dirs.
    path = Path(tempfile.mkdtemp(prefix="cuvil-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The compile cache (builds and load records) of the session's make_daemon daemons."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def make_daemon(tmp_path: Path, state_root: Path, sock_dir: Path,
                shared_cache: Path) -> Iterator[Any]:
    """Factory: make_daemon(state_dir=None, **config) -> started DaemonProcess.

    Each daemon gets its own state dir (pass one back to restart on the same state), seeded
    with the session's cached device profiles so only the first start of a session measures.
    Unless the test names a cache_dir, they share the session's compile cache (and the key
    that signs it, state_root's cache.key: with a key of its own a daemon refuses the others'
    builds, and every load built again): a model that
    an earlier test built (the same archive, policy and devices) comes back from its load
    record, with no torch imported, nothing planned or compiled. A test about a cold build,
    or one that counts what a load did, names a cache_dir of its own.
    """
    started: list[DaemonProcess] = []

    def make(start: bool = True, state_dir: Path | None = None, **extra: Any) -> DaemonProcess:
        workdir = tmp_path / f"d{len(started)}"
        workdir.mkdir()
        if state_dir is None:
            state_dir = workdir / "state"
        shared = "cache_dir" not in extra
        extra.setdefault("cache_dir", str(shared_cache))
        daemon = DaemonProcess(workdir, suite_config(workdir, state_dir, sock_dir, **extra),
                               profiles=state_root)
        if shared:  # the session's signing key: each daemon's own refused the others' builds
            daemon.env[KEY_ENV] = str(state_root / "cache.key")
        daemon.state_dir = state_dir
        started.append(daemon)
        return daemon.start() if start else daemon

    yield make
    for daemon in started:
        daemon.close()


@pytest.fixture(scope="session")
def daemon(tmp_path_factory: pytest.TempPathFactory, state_root: Path,
           sock_dir: Path) -> Iterator[DaemonProcess]:
    """A daemon shared by the read-only tests of a session."""
    workdir = tmp_path_factory.mktemp("shared")
    proc = DaemonProcess(workdir, suite_config(workdir, state_root, sock_dir),
                         profiles=state_root).start()
    yield proc
    proc.close()
