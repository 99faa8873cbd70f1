"""cuvild.intake.cuda_guard: torch's fake CUDA guard registered from a thread that outlives the
others. The crash it prevents needs a CUDA build of torch with no device (torch 2.11+cu130
here: a second thread's archive read after the first thread ended, SIGSEGV); the CPU wheel
never registers the guard, so these tests check the workaround's choices with torch's calls
recorded, and that archives read thread after thread in a fresh process survive."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from cuvild.intake import cuda_guard

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A CUDA build with no device, as hold() sees it; the threads that registered."""
    calls: list[str] = []
    monkeypatch.setattr(cuda_guard, "_held", False)
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: -1, raising=False)
    monkeypatch.setattr(torch._C, "_ensureCUDADeviceGuardSet",  # noqa: SLF001
                        lambda: calls.append(threading.current_thread().name))
    return calls


def test_the_main_thread_registers_it_itself(recorded: list[str]) -> None:
    cuda_guard.hold()
    cuda_guard.hold()  # once a process
    assert recorded == ["MainThread"]


def test_another_thread_leaves_it_to_a_parked_thread(recorded: list[str]) -> None:
    worker = threading.Thread(target=cuda_guard.hold, name="build")
    worker.start()
    worker.join()
    assert recorded == ["cuvild-cuda-guard"]
    parked = [t for t in threading.enumerate() if t.name == "cuvild-cuda-guard"]
    assert parked and parked[0].is_alive() and parked[0].daemon  # outlives the build thread


def test_nothing_is_registered_where_torch_has_no_cuda_or_sees_a_device(
        recorded: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: False)
    cuda_guard.hold()
    monkeypatch.setattr(cuda_guard, "_held", False)
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cuda_guard.hold()
    monkeypatch.setattr(cuda_guard, "_held", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("CUDA asked"))
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 1, raising=False)
    cuda_guard.hold()  # NVML sees a GPU: CUDA itself is not initialised here
    assert recorded == []


def test_archives_read_thread_after_thread_in_a_fresh_process(tmp_path: Path) -> None:
    """What crashed a worker on a CUDA build with no GPU: each archive read on a new thread
    that ends before the next starts (passes on the CPU wheel with or without the fix)."""
    archive = tmp_path / "m.pt2"
    torch.export.save(torch.export.export(torch.nn.Linear(4, 2), (torch.randn(1, 4),)), archive)
    code = textwrap.dedent(f"""
        import threading
        from cuvild.intake.safe_load import load_archive
        for _ in range(3):
            t = threading.Thread(target=load_archive, args=({str(archive)!r},))
            t.start()
            t.join()
        print("read 3")
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "read 3" in done.stdout, done.stderr[-2000:]
