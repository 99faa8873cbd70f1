"""Dynamic batching through the daemon: a load asks for it (Client.load, cuvilctl load), the
protocol's concurrent requests share runs with and without shared memory and each gets its
own rows, status and metrics say what ran, and a model that cannot be batched is refused or
served unbatched with the reason."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from test_observability import free_port, scrape, series

import cuvild
from cuvild.client import Client, InvalidArgument
from cuvild.client.samples import MLP
from cuvild.run.batching import padded_rows


def wait_ready(client: Client, name: str) -> dict:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        found = [m for m in client.models() if m["name"] == name]
        if found and found[0]["state"] != "loading":
            return found[0]
        time.sleep(0.2)
    raise TimeoutError(name)


def test_concurrent_protocol_requests_share_runs(make_daemon):
    torch.manual_seed(0)
    model = MLP(width=16, depth=2).eval()
    batch = torch.export.Dim("batch", min=1, max=32)
    port = free_port()
    d = make_daemon(metrics={"listen": port})
    with Client(d.target) as client:
        client.load("b", model, (torch.randn(2, 16),), dynamic_shapes=({0: batch},),
                    batching={"max_batch": 8, "max_delay_us": 20_000})
        served = wait_ready(client, "b")
        assert served["state"] == "ready", d.log()[-2000:]
        assert served["batching"]["state"] == "on"
        assert served["batching"]["max_batch"] == 8
    count, rounds = 8, 3
    xs = [[torch.randn(1 + (i + k) % 2, 16) for k in range(rounds)] for i in range(count)]
    got: dict[tuple[int, int], torch.Tensor] = {}
    errors: list[BaseException] = []
    gate = threading.Barrier(count)

    def one(i: int) -> None:
        try:
            with Client(d.target) as mine:
                for k in range(rounds):
                    gate.wait(60)
                    got[(i, k)] = mine.infer("b", xs[i][k], shm=bool(i % 2))["output0"]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for (i, k), out in got.items():
        with torch.no_grad():
            torch.testing.assert_close(out, model(xs[i][k]), rtol=1e-4, atol=1e-5)
    assert len(got) == count * rounds
    with Client(d.target) as client:
        stats = next(m for m in client.models() if m["name"] == "b")["batching"]
        assert stats["requests"] == count * rounds
        assert max(stats["sizes"]) > 1, stats
        status = subprocess.run([sys.executable, "-m", "cuvild.client.cli", "--target",
                                 d.target, "status"], capture_output=True, text=True,
                                timeout=60)
        assert "b:1 batching on: max_batch 8" in status.stdout, status.stdout
        plan = client.plan("b")  # which bucket runs where
        sizes = sorted(b["shapes"][0][0] for b in plan["plan"]["buckets"])
        # each merged size ran in its padded bucket (the next power of two rows)
        assert {padded_rows(n, 8) for n in stats["sizes"]} | {1, 2} <= set(sizes), (sizes,
                                                                                  stats)
        assert all(p["runtime"] for b in plan["plan"]["buckets"] for p in b["parts"])
        assert "buckets (built per input shape" in plan["explain"]
    samples = scrape(port)
    assert series(samples, "cuvil_batch_size_count", model="b") == sum(stats["sizes"].values())
    assert series(samples, "cuvil_batch_size_sum", model="b") == sum(
        len(x) for row in xs for x in row)
    assert series(samples, "cuvil_batch_queue_duration_seconds_count", model="b") == \
        count * rounds
    mine = f"cuvil-client-{os.getpid()}-"  # (this process's clients: cuvild/client/infer_io.py)
    assert not [p for p in Path("/dev/shm").iterdir() if p.name.startswith(mine)]


def test_a_model_that_cannot_be_batched_says_why(make_daemon, tmp_path):
    d = make_daemon(cache_dir=str(tmp_path / "cache"))
    with Client(d.target) as client:
        with pytest.raises(InvalidArgument) as err:  # a static first dimension: refused
            client.load("static", MLP(width=8, depth=1).eval(), (torch.randn(2, 8),),
                        batching={"max_batch": 4})
        assert "no dynamic first dimension" in err.value.message
        assert "torch.export.Dim" in err.value.message

        class Centered(torch.nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return x - x.mean(0, keepdim=True)

        batch = torch.export.Dim("batch", min=1, max=8)
        path = tmp_path / "centered.pt2"
        torch.export.save(cuvild.export(Centered(), (torch.randn(2, 8),),
                                        dynamic_shapes=({0: batch},)), path)
        ctl = subprocess.run([sys.executable, "-m", "cuvild.client.cli", "--target", d.target,
                              "load", "centered", str(path), "--max-batch", "4", "--json"],
                             capture_output=True, text=True, timeout=300,
                             env={**os.environ})
        assert ctl.returncode == 0, ctl.stderr
        served = wait_ready(client, "centered")
        assert served["state"] == "ready"
        assert served["batching"]["state"].startswith("off: output 0: rows run together "
                                                      "differ"), served["batching"]
        x = torch.randn(3, 8)
        torch.testing.assert_close(client.infer("centered", x)["output0"], Centered()(x))
        net = MLP(width=8, depth=1).eval()
        client.load("rows", net, (torch.randn(2, 8),), dynamic_shapes=({0: batch},),
                    batching={"max_batch": 4})
        assert wait_ready(client, "rows")["batching"]["state"] == "on"
        client.infer("rows", x)
    d.stop()
    # A restart serves both from their load records, batched or not as the load found
    # (nothing checked on torch again), and a bucket built before is restored, not built.
    again = make_daemon(state_dir=d.state_dir, cache_dir=str(tmp_path / "cache"))
    with Client(again.target) as client:
        assert wait_ready(client, "centered")["batching"]["state"].startswith("off: output 0")
        assert wait_ready(client, "rows")["batching"]["state"] == "on"
        torch.testing.assert_close(client.infer("centered", x)["output0"], Centered()(x))
        with torch.no_grad():
            torch.testing.assert_close(client.infer("rows", x)["output0"], net(x))
    log = again.log()
    for name in ("centered", "rows"):
        assert re.search(rf"model {name}:1 ready in [\d.]+ s \(from its load record\)",
                         log), log[-4000:]
    assert "restored rows:1 for input shapes [[3, 8]] from its load record" in log, log[-4000:]
