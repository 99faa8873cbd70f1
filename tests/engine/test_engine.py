"""The engine on emulated devices: parts in worker processes, tensors through the arena."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from engine_helpers import CORES, chunked_plan, device, prepare

import cuvild
from cuvild.client.samples import MLP, Encoder, ResNet18
from cuvild.core.arena import SHM_DIR, Arena
from cuvild.core.errors import InferError
from cuvild.core.layout import BadInput
from cuvild.core.loaded import part_stats
from cuvild.engine.engine import Engine
from cuvild.intake.summary import summarize
from cuvild.run.request import FEEDBACK_RUNS
from partitioner.corrections import Corrections, prior
from partitioner.profile import DeviceProfile
from protos.orders import Unload

DEVICES = [device(d) for d in ["cpu0", "npu0", "npu1"]]


@pytest.fixture
def engine(tmp_path):
    arena = Arena(f"{os.getpid()}-eng")
    eng = Engine(DEVICES, tmp_path / "cache", arena)
    yield eng
    eng.close()
    arena.close()
    assert not list(SHM_DIR.glob(f"cuvil-{os.getpid()}-eng-*"))


def reference_models():
    torch.manual_seed(0)
    return {
        "resnet": (ResNet18(num_classes=10, width=16).eval(), (torch.randn(1, 3, 64, 64),)),
        "encoder": (Encoder(layers=2, hidden=64, heads=4).eval(), (torch.randn(2, 16, 64),)),
        "mlp": (MLP(width=128, depth=4).eval(), (torch.randn(3, 128),)),
    }


@pytest.mark.parametrize("devices", [["cpu0", "npu0"], ["npu0", "cpu0", "npu1"]])
def test_multi_part_plans_match_eager(engine, tmp_path, devices):
    for name, (model, inputs) in reference_models().items():
        loaded = prepare(engine, tmp_path, name, model, inputs, devices)
        assert [r.device for r in loaded.routes] == devices
        assert loaded.footprint <= loaded.total_bytes
        with torch.no_grad():
            expected = model(*inputs)
        (out,) = engine.infer(name, inputs)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
        stats = part_stats(engine.runner.served.models[name])
        assert all(s["measured_ms"] is not None for s in stats.values())
    assert engine.arena.in_use() == 0


def test_concurrent_requests_are_not_mixed(engine, tmp_path):
    model, (x,) = reference_models()["mlp"]
    prepare(engine, tmp_path, "mlp", model, (x,), ["cpu0", "npu0"])
    batches = [torch.randn(3, 128) for _ in range(24)]
    with torch.no_grad():
        expected = [model(b) for b in batches]
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda b: engine.infer("mlp", (b,))[0], batches))
    for got, want in zip(results, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert engine.arena.in_use() == 0


def test_bad_inputs_are_named(engine, tmp_path):
    model, (x,) = reference_models()["mlp"]
    prepare(engine, tmp_path, "mlp", model, (x,), ["cpu0"])
    with pytest.raises(BadInput, match="expected shape"):
        engine.infer("mlp", (torch.randn(4, 128),))
    with pytest.raises(BadInput, match="dtype"):
        engine.infer("mlp", (x.double(),))
    with pytest.raises(BadInput, match="takes 1 inputs"):
        engine.infer("mlp", (x, x))


def test_failing_part_names_itself_and_leaks_nothing(engine, tmp_path):
    model, (x,) = reference_models()["mlp"]
    prepare(engine, tmp_path, "mlp", model, (x,), ["cpu0", "npu0"])
    engine.workers["npu0"].call(Unload("mlp")).result(10)  # p1 now fails
    with pytest.raises(InferError, match=r"part p1 on npu0 .* not built here"):
        engine.infer("mlp", (x,))
    assert engine.arena.in_use() == 0


def test_killed_worker_is_restarted_and_its_requests_retried(engine, tmp_path):
    """Inference is idempotent: a request whose worker dies runs once more on the restarted
    worker (tests/engine/test_hardening.py covers the retry's limits)."""
    model, (x,) = reference_models()["resnet"]
    prepare(engine, tmp_path, "resnet", model, (x,), ["cpu0", "npu0"])
    with torch.no_grad():
        expected = model(x)
    outputs: list[torch.Tensor] = []
    errors: list[str] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            try:
                outputs.append(engine.infer("resnet", (x,))[0])
            except InferError as e:
                errors.append(str(e))

    thread = threading.Thread(target=load)
    thread.start()
    time.sleep(0.5)
    os.kill(engine.workers["npu0"].process.pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while engine.workers["npu0"].restarts < 1 or len(outputs) < 5:
        assert time.monotonic() < deadline, "worker did not come back"
        time.sleep(0.2)
    stop.set()
    thread.join(60)
    assert errors == []  # the request in flight when it died was retried
    for out in outputs:
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    assert engine.workers["npu0"].restarts == 1
    assert engine.arena.in_use() == 0


def test_dynamic_batch_builds_per_shape_and_checks_the_range(engine, tmp_path):
    torch.manual_seed(0)
    model = MLP(width=32, depth=2).eval()
    batch = torch.export.Dim("batch", min=1, max=8)
    ep = cuvild.export(model, (torch.randn(2, 32),), dynamic_shapes=({0: batch},))
    path = tmp_path / "dyn.pt2"
    torch.export.save(ep, path)
    specs = summarize(ep)["inputs"]
    assert specs[0]["shape"] == [-1, 32]
    loaded = engine.prepare("dyn", "dyn", "1", path, specs, plan=chunked_plan(ep, ["cpu0", "npu0"]))
    assert loaded.dynamic == [(0, 0, 1, 8)]
    for n in (1, 5, 5, 8):
        x = torch.randn(n, 32)
        (out,) = engine.infer("dyn", (x,))
        with torch.no_grad():
            torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)
    assert sorted(s[0][0] for s in loaded.family.buckets) == [1, 5, 8]  # one build per bucket
    with pytest.raises(BadInput, match=r"dim 0 is 9, outside the exported range \[1, 8\]"):
        engine.infer("dyn", (torch.randn(9, 32),))
    with pytest.raises(BadInput, match="dim 1 must be 32"):
        engine.infer("dyn", (torch.randn(2, 31),))
    assert engine.arena.in_use() == 0


def test_measured_parts_teach_the_cost_model_and_survive_a_restart(tmp_path):
    """FEEDBACK_RUNS requests teach the corrections (on their own thread, kept on disk); an
    engine started on the same file plans with them, and its plan says so."""
    cpu = DeviceProfile(id="cpu0", kind="cpu", cores=CORES[:1], runtimes=["torch"],
                        peak_gflops={"fp32": 5000.0}, mem_bw_gbs=500.0, link_bw_gbs=50.0,
                        launch_us=1.0)  # a profile far too fast: the parts must teach it
    path = tmp_path / "corrections" / "fingerprint.json"
    model, (x,) = reference_models()["mlp"]
    ep = cuvild.export(model, (x,))
    archive = tmp_path / "mlp.pt2"
    torch.export.save(ep, archive)
    specs = summarize(ep)["inputs"]
    arena = Arena(f"{os.getpid()}-learn")
    try:
        before = set(threading.enumerate())
        engine = Engine([cpu], tmp_path / "cache", arena, corrections_path=path)
        first = engine.prepare("mlp", "mlp", "1", archive, specs)
        for _ in range(FEEDBACK_RUNS):
            engine.infer("mlp", (x,))
        deadline = time.monotonic() + 30
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        lessons = [t for t in set(threading.enumerate()) - before
                   if t.name.startswith("feedback")]
        engine.close()
        for thread in lessons:  # the lessons' thread ends with its engine
            thread.join(5)
        assert lessons and not any(t.is_alive() for t in lessons)
        learned = Corrections.from_dict(json.loads(path.read_text()))
        assert learned.describe("cpu0")
        assert not any(n.startswith("cost corrections") for n in first.plan.notes)
        (route,) = first.routes
        (part,) = first.plan.parts
        measured = sorted(route.measured_ms[:FEEDBACK_RUNS])[FEEDBACK_RUNS // 2]
        assert learned.price("cpu0", "torch", part.class_ms, part.kernels,
                             prior(cpu)) == pytest.approx(
            measured, rel=0.01)
        again = Engine([cpu], tmp_path / "cache", arena, corrections_path=path)
        second = again.prepare("mlp", "mlp", "1", archive, specs)
        again.close()
        assert any(n.startswith("cost corrections learned") for n in second.plan.notes)
        assert second.plan.parts[0].predicted_ms == pytest.approx(measured, rel=0.01)
        assert part.predicted_ms < 0.5 * measured  # what the profile alone predicted
    finally:
        arena.close()


def test_a_worker_sizes_torch_for_its_own_cores_when_torch_came_first():
    """A worker spawned by a program that imported torch gets torch with the spawning
    module, its thread pool sized for every core; pinned to fewer, that pool's threads
    share a core and each parallel op waits a scheduler slice (a tiny MLP took 8 ms a run
    instead of 0.1 ms on one core of the dev host). The worker sizes it for its own cores."""
    import subprocess

    code = ("import os, torch\n"
            "from cuvild.workers.worker import _pin\n"
            "from partitioner.profile import DeviceProfile\n"
            f"_pin(DeviceProfile(id='cpu0', kind='cpu', cores=[{CORES[0]}]))\n"
            "print(torch.get_num_threads(), sorted(os.sched_getaffinity(0)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2], timeout=120, check=True)
    assert out.stdout.split() == ["1", f"[{CORES[0]}]"]
