"""Model intake figures: upload throughput of a ~100 MB archive over the unix socket, and
the load time of ResNet-18 (cold daemon, warm daemon, a fresh daemon sharing the cache, and
read back after a restart)."""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

# The repo root first (tests/runtimes, tests/partitioner must not shadow the packages), tests/
# for daemons.py.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.append(str(Path(__file__).resolve().parents[1]))
from daemons import DaemonProcess, daemon_config, one_cpu, worker_processes  # noqa: E402

import cuvild  # noqa: E402
from cuvild.client import Client  # noqa: E402
from cuvild.client.samples import MLP, reference  # noqa: E402
from cuvild.intake.registry import Registry  # noqa: E402
from cuvild.intake.summary import inspect_archive  # noqa: E402
from protos import cuvil_pb2, cuvil_pb2_grpc  # noqa: E402
from runtimes.cache import KEY_ENV  # noqa: E402


def transfer_only(target: str, path: Path) -> float:
    """Stream the archive with a wrong digest: the daemon receives and hashes every byte,
    then refuses before inspecting it. The time is the pure transfer."""
    import grpc

    size = path.stat().st_size

    def requests():
        yield cuvil_pb2.LoadModelRequest(header=cuvil_pb2.LoadModelHeader(
            name="transfer", sha256="0" * 64, size_bytes=size))
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                yield cuvil_pb2.LoadModelRequest(chunk=block)

    with grpc.insecure_channel(target) as channel:
        t0 = time.perf_counter()
        try:
            cuvil_pb2_grpc.ControlStub(channel).LoadModel(requests(), timeout=600)
        except grpc.RpcError as err:
            assert "sha256 mismatch" in err.details(), err.details()
        return time.perf_counter() - t0


def fresh_daemon(root: Path, cache_dir: str, archive: Path) -> dict[str, Any]:
    """A daemon with a state directory of its own sharing the first's cache and key (a pod
    of the same ServingRuntime): the bytes inspected there are not inspected again
    (cuvild/intake/verdicts.py) and, their load record there too, the model is READY with no
    torch in any of its processes."""
    work = root / "w1"
    work.mkdir()
    config = daemon_config(work, root / "state-1", root)
    config["devices"], config["cache_dir"] = one_cpu(), cache_dir
    daemon = DaemonProcess(work, config)
    daemon.env[KEY_ENV] = str(root / "cache.key")
    daemon.start()
    try:
        with Client(daemon.target) as client:
            t0 = time.perf_counter()
            client.load_file("resnet18", archive)  # registered, then waited for READY
            ready = time.perf_counter() - t0
        pids = [daemon.proc.pid] + [int(p.name) for p in worker_processes(daemon.proc.pid)]
        torch_free = all("libtorch" not in Path(f"/proc/{pid}/maps").read_text()
                         for pid in pids)
        return {"resnet18_fresh_daemon_ready_s": ready,
                "fresh_daemon_inspected_again": "inspected before" not in daemon.log(),
                "fresh_daemon_torch_free": torch_free}
    finally:
        daemon.stop()
        daemon.close()


def main() -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="cuvil-bench-") as tmp:
        root = Path(tmp)
        big = root / "big.pt2"
        torch.manual_seed(0)
        torch.export.save(cuvild.export(MLP(width=2500, depth=4).eval(), (torch.randn(1, 2500),)),
                          big)
        res = root / "resnet18.pt2"
        model, inputs = reference("resnet18")
        torch.export.save(cuvild.export(model, inputs), res)
        work = root / "w0"
        work.mkdir()
        config = daemon_config(work, root / "state", root)
        config["devices"] = one_cpu()
        daemon = DaemonProcess(work, config)
        daemon.env[KEY_ENV] = str(root / "cache.key")  # (shared with the fresh daemon below)
        daemon.start()
        with Client(daemon.target) as client:
            t0 = time.perf_counter()
            cold = client.load_file("resnet18", res, wait=False)  # the upload only
            out["resnet18_load_cold_s"] = time.perf_counter() - t0
            out["resnet18_daemon_cold_s"] = cold["seconds"]
            t0 = time.perf_counter()
            warm = client.load_file("resnet18", res, version="2", wait=False)
            out["resnet18_load_warm_s"] = time.perf_counter() - t0
            out["resnet18_daemon_warm_s"] = warm["seconds"]
            size = big.stat().st_size
            out["big_archive_mb"] = size / 1e6
            seconds = transfer_only(daemon.target, big)
            out["upload_transfer_mb_s"] = size / 1e6 / seconds
            t0 = time.perf_counter()
            client.load_file("big", big, wait=False)
            out["upload_with_validation_mb_s"] = size / 1e6 / (time.perf_counter() - t0)
            client.wait_ready("resnet18", timeout=600)  # (its load record written)
        daemon.stop()
        daemon.close()
        out.update(fresh_daemon(root, config["cache_dir"], res))
        # After a restart the registry is read from disk and the archive loaded back.
        t0 = time.perf_counter()
        registry = Registry(root / "state", 1 << 31)
        record = registry.get("resnet18", "1")
        out["restart_index_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        inspect_archive(registry.archive_path(record.sha256), 1 << 31)
        out["resnet18_reload_after_restart_s"] = time.perf_counter() - t0
        out["resnet18_archive_mb"] = record.size_bytes / 1e6
        digest = hashlib.sha256(res.read_bytes()).hexdigest()
        assert digest == record.sha256
    return out


if __name__ == "__main__":
    result = main()
    if "--json" in sys.argv:
        print(json.dumps(result, indent=2))
    else:
        r = result
        print(f"upload {r['big_archive_mb']:.0f} MB archive over the unix socket: "
              f"{r['upload_transfer_mb_s']:.0f} MB/s transfer, "
              f"{r['upload_with_validation_mb_s']:.0f} MB/s including safe validation")
        print(f"resnet18 ({r['resnet18_archive_mb']:.0f} MB) load: cold daemon "
              f"{r['resnet18_load_cold_s']:.2f} s (daemon side {r['resnet18_daemon_cold_s']:.2f} s,"
              f" first torch import included), warm {r['resnet18_load_warm_s']:.2f} s "
              f"(daemon {r['resnet18_daemon_warm_s']:.2f} s)")
        print(f"resnet18 uploaded to a fresh daemon sharing the cache: READY in "
              f"{r['resnet18_fresh_daemon_ready_s']:.2f} s (inspected again: "
              f"{r['fresh_daemon_inspected_again']}, torch in no process: "
              f"{r['fresh_daemon_torch_free']})")
        print(f"after restart: index read {r['restart_index_s'] * 1e3:.1f} ms, archive loaded back "
              f"safely in {r['resnet18_reload_after_restart_s']:.2f} s (torch already imported)")
