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
