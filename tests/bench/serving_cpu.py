"""bench_serving.py (d): what a tiny request costs beyond the protocol's floor, in CPU per
request by process (user+sys from /proc: the daemon with all its threads, its worker
processes, the no-op servicer's process, this client), through cuvild's public socket (the
front), past it on the daemon's private gRPC socket, and to the no-op servicer; the paths in
turn, so the host's drift is shared out. CPU is less at the mercy of a shared host than
latency."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

TINY_CPU = 3000  # requests per path
CPU_TURNS = 10  # the paths in turn, TINY_CPU / CPU_TURNS requests a turn


def cpu_s(pid: int) -> float:
    """A process's user+sys CPU seconds so far, all its threads (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """The processes under `pid` (a daemon's forkserver and its workers)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def bench_cpu(daemon: Any, echo_pid: int, echo_target: str, n: int = TINY_CPU) -> dict[str, Any]:
    """(d): CPU per tiny request by process, through the front, past it, to the no-op."""
    import glob
    import tempfile

    import numpy as np
    import tritonclient.grpc as grpcclient

    pid = daemon.proc.pid
    base = os.environ.get("RUNTIME_DIRECTORY") or tempfile.gettempdir()
    private = glob.glob(f"{base}/cuvild-{pid}-*/grpc.sock")
    targets = {"through the front": daemon.target, "no-op servicer": echo_target}
    if private:  # (readable here: the bench runs the daemon as its own user)
        targets["past the front"] = f"unix://{private[0]}"
    xn = np.random.default_rng(0).standard_normal((1, 16), dtype=np.float32)
    with grpcclient.InferenceServerClient(url=daemon.target) as client:
        in_name = client.get_model_metadata("tiny").inputs[0].name
    workers = descendants(pid)
    clients = {label: grpcclient.InferenceServerClient(url=t) for label, t in targets.items()}
    totals = {label: dict.fromkeys(("wall", "client", "daemon", "workers", "noop"), 0.0)
              for label in targets}

    def one(client: Any) -> None:
        inp = grpcclient.InferInput(in_name, [1, 16], "FP32")
        inp.set_data_from_numpy(xn)
        client.infer("tiny", [inp])

    try:
        for client in clients.values():
            for _ in range(200):
                one(client)
        for _ in range(CPU_TURNS):  # the paths in turn, so the host's drift is shared out
            for label, client in clients.items():
                before = {p: cpu_s(p) for p in (pid, echo_pid, *workers)}
                me, t0 = time.process_time(), time.perf_counter()
                for _ in range(n // CPU_TURNS):
                    one(client)
                add = totals[label]
                add["wall"] += time.perf_counter() - t0
                add["client"] += time.process_time() - me
                used = {p: cpu_s(p) - v for p, v in before.items()}
                add["daemon"] += used[pid]
                add["workers"] += sum(used[p] for p in workers)
                add["noop"] += used[echo_pid]
    finally:
        for client in clients.values():
            client.close()
    count = n // CPU_TURNS * CPU_TURNS
    out = {label: {f"{k}_us": v / count * 1e6 for k, v in t.items()}
           for label, t in totals.items()}
    return out


def print_cpu(cpu: dict[str, Any]) -> None:
    print(f"\n(d) CPU per tiny request (user+sys us, by process), {TINY_CPU} back to back, "
          "process workers")
    print(f"{'path':<20} {'wall':>7} {'daemon':>7} {'workers':>8} {'no-op':>7} {'client':>7}")
    for name, r in cpu.items():
        print(f"{name:<20} {r['wall_us']:7.0f} {r['daemon_us']:7.0f} {r['workers_us']:8.0f} "
              f"{r['noop_us']:7.0f} {r['client_us']:7.0f}")
