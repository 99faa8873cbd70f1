"""A worker reads a model's archive ahead of its Builds (protos/orders.py `Preload`: the daemon
asks where it is about to read the archive itself, a restored language model's first bucket):
the Build that splits it next takes that program, the archive read once; only the last
PRELOADS are kept."""

from __future__ import annotations

import pytest
import torch

import cuvild
from cuvild.client.samples import MLP
from cuvild.intake import safe_load
from cuvild.workers import build
from cuvild.workers.worker import Worker
from partitioner.profile import DeviceProfile
from protos.orders import Preload


@pytest.fixture
def archives(tmp_path):  # noqa: ANN001, ANN201
    torch.manual_seed(0)
    paths = []
    for i in range(3):
        ep = cuvild.export(MLP(width=8, depth=1).eval(), (torch.randn(2, 8),))
        paths.append(str(tmp_path / f"m{i}.pt2"))
        torch.export.save(ep, paths[-1])
    yield paths
    build._programs.clear()  # noqa: SLF001


def test_a_preloaded_archive_is_read_once_and_taken_by_its_build(archives, tmp_path,  # noqa: ANN001
                                                                 monkeypatch) -> None:
    reads: list[str] = []
    real = safe_load.load_exported_program

    def counted(path):  # noqa: ANN001, ANN202
        reads.append(str(path))
        return real(path)

    monkeypatch.setattr(safe_load, "load_exported_program", counted)
    worker = Worker(DeviceProfile(id="cpu0", kind="cpu", cores=[0]), str(tmp_path / "cache"))
    assert worker.handle(Preload(archives[0])) is None
    worker.handle(Preload(archives[0]))  # (asked twice: read once)
    assert reads == archives[:1]
    nodes = [n.name for n in real(archives[0]).graph.nodes if n.op == "call_function"]
    split = build.load_split("m0:1", archives[0], [("p0", nodes)])
    assert reads == archives[:1] and [p.id for p in split.parts] == ["p0"]
    assert archives[0] not in build._programs  # noqa: SLF001 - taken: held by the split only
    build.forget("m0:1")
    for path in archives:
        build.preload(path)
    assert list(build._programs) == archives[-build.PRELOADS:]  # noqa: SLF001


def test_a_model_planned_again_under_its_key_is_split_by_its_new_plan(archives) -> None:  # noqa: ANN001
    """A worker keeps a model's split while its parts build, under the model's key; a model
    planned again under that key (a failed build, cuvild/load/fallback.py; a second engine's
    thread workers in one process) gets its new plan's split, not the last one's."""
    nodes = [n.name for n in safe_load.load_exported_program(archives[0]).graph.nodes
             if n.op == "call_function"]
    one = build.load_split("m:1", archives[0], [("p0", nodes)])
    assert build.load_split("m:1", archives[0], [("p0", nodes)]) is one  # kept
    two = build.load_split("m:1", archives[0], [("p0", nodes[:1]), ("p1", nodes[1:])])
    assert [p.id for p in two.parts] == ["p0", "p1"]
    assert [p.id for p in build.load_split("m:1", archives[1], [("p0", nodes)]).parts] == ["p0"]
    build.forget("m:1")
    assert "m:1" not in build._splits  # noqa: SLF001
