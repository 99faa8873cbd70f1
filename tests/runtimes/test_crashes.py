"""runtimes/crashes.py: a compile marked while it runs is remembered as a crash only where
its process died of a crash signal (not where it was ended: SIGKILL, an exit)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from pathlib import Path

import pytest

from runtimes import crashes


def _compile_and_die(root: str, runtime: str, how: int) -> None:
    with crashes.attempt(Path(root), "k" * 32, runtime):
        os.kill(os.getpid(), how)


@pytest.mark.parametrize(("how", "remembered"), [(signal.SIGFPE, True), (signal.SIGSEGV, True),
                                                 (signal.SIGKILL, False)])
def test_only_a_crash_signal_marks_the_compile(tmp_path: Path, how: int,
                                               remembered: bool) -> None:
    process = mp.get_context("spawn").Process(target=_compile_and_die,
                                              args=(str(tmp_path), "llvm-cpu", how))
    process.start()
    process.join()
    assert process.exitcode == -how
    assert not crashes.crashed(tmp_path, "k" * 32, "llvm-cpu")
    named = crashes.confirm(tmp_path, process.pid, process.exitcode)
    assert named == ([f"{'k' * 32}-llvm-cpu"] if remembered else [])
    assert crashes.crashed(tmp_path, "k" * 32, "llvm-cpu") is remembered
    assert not crashes.crashed(tmp_path, "k" * 32, "openvino")
    assert crashes.describe(process.exitcode) == f"killed by {signal.Signals(how).name}"


def test_a_compile_that_returns_or_raises_leaves_no_marker(tmp_path: Path) -> None:
    with crashes.attempt(tmp_path, "a" * 32, "openvino"):
        pass
    with pytest.raises(RuntimeError), crashes.attempt(tmp_path, "a" * 32, "openvino"):
        raise RuntimeError("a compiler's own error")
    assert not list((tmp_path / crashes.FOLDER).iterdir())
    assert crashes.confirm(tmp_path, os.getpid(), -signal.SIGSEGV) == []
    assert crashes.describe(3) == "exit code 3" and crashes.describe(None) == ""


def _watched_compile_and_die(root: str, runtime: str, how: int) -> None:
    crashes.watch(Path(root))  # a daemon whose workers are its threads
    with crashes.attempt(Path(root), "t" * 32, runtime):
        os.kill(os.getpid(), how)


@pytest.mark.parametrize(("how", "remembered"), [(signal.SIGFPE, True), (signal.SIGKILL, False)])
def test_a_dead_daemons_fault_marks_its_compile_at_the_next_start(
        tmp_path: Path, how: int, remembered: bool) -> None:
    """Thread workers die with the daemon: no one reads their signal, so faulthandler's file
    tells the next start (a systemd restart that compiled the same thing died again)."""
    process = mp.get_context("spawn").Process(target=_watched_compile_and_die,
                                              args=(str(tmp_path), "openvino", how))
    process.start()
    process.join()
    assert process.exitcode == -how
    (fault,) = (tmp_path / crashes.FOLDER).glob("*.fault")
    assert fault.name == f"{process.pid}.fault"
    found = crashes.left_by_the_dead(tmp_path)
    if remembered:
        assert found == [crashes.Fault(process.pid, "Fatal Python error: Floating point "
                                       "exception", [f"{'t' * 32}-openvino"])], found
    else:  # (SIGKILL: hung, out of memory, stopped; faulthandler wrote nothing)
        assert found == []
    assert crashes.crashed(tmp_path, "t" * 32, "openvino") is remembered
    assert not fault.exists()


def test_a_live_daemons_fault_file_is_left_alone(tmp_path: Path) -> None:
    """Another daemon on the same cache directory, alive: its file is its own. One of this
    process's pid is a dead one's (a container's daemon is pid 1 at every start)."""
    folder = tmp_path / crashes.FOLDER
    folder.mkdir()
    other = mp.get_context("spawn").Process(target=signal.pause)
    other.start()
    try:
        (folder / f"{other.pid}.fault").write_text("Fatal Python error: Segmentation fault")
        (folder / f"{os.getpid()}.fault").write_text("Fatal Python error: Aborted\n\nstack")
        (folder / f"{'s' * 32}-openvino.trying").write_text(str(os.getpid()))
        (found,) = crashes.left_by_the_dead(tmp_path)
        assert found == crashes.Fault(os.getpid(), "Fatal Python error: Aborted",
                                      [f"{'s' * 32}-openvino"])
        assert (folder / f"{other.pid}.fault").exists()
    finally:
        other.kill()
        other.join()


def test_a_clean_stop_leaves_no_fault_file(tmp_path: Path) -> None:
    import faulthandler

    was = faulthandler.is_enabled()  # (pytest's own, given back below)
    out = crashes.watch(tmp_path)
    assert Path(out.name).exists()
    crashes.unwatch(out)
    assert not list((tmp_path / crashes.FOLDER).glob("*.fault"))
    if was:
        faulthandler.enable()
