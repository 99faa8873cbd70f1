"""What an operator sees: Prometheus metrics moving by exactly what was sent, a trace per
request with a span per part, the plan as an SVG timeline, cuvilctl stats."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
import xml.etree.ElementTree as ET

import grpc
import pytest
import torch
from daemons import free_port

from cuvild import config
from cuvild.client import Client, InvalidArgument
from cuvild.client.samples import MLP, reference
from protos import inference_pb2 as pb
from protos import inference_pb2_grpc


def scrape(port: int) -> dict[str, float]:
    """Every sample of /metrics as 'name{labels}' -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    out = {}
    for line in text.decode().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def series(samples: dict[str, float], name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    total = 0.0
    for key, value in samples.items():
        metric, _, rest = key.partition("{")
        found = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        if metric == name and all(found.get(k) == v for k, v in labels.items()):
            total += value
    return total


def wait_ready(client: Client, name: str) -> None:
    deadline = time.monotonic() + 300
    while next(m for m in client.models() if m["name"] == name)["state"] == "loading":
        assert time.monotonic() < deadline, f"{name} still loading"
        time.sleep(0.2)


def test_metrics_move_by_exactly_what_was_sent(make_daemon):
    port = free_port()
    d = make_daemon(metrics={"listen": port})
    torch.manual_seed(0)
    model, x = MLP(width=16, depth=1).eval(), torch.randn(2, 16)
    with Client(d.target) as client:
        client.load("mlp", model, (x,))
        wait_ready(client, "mlp")
        before = scrape(port)
        for _ in range(7):
            client.infer("mlp", x)
        for _ in range(3):  # the wrong shape: refused, counted as failures
            with pytest.raises(InvalidArgument):
                client.infer("mlp", torch.randn(3, 16))
        with grpc.insecure_channel(d.target) as channel, pytest.raises(grpc.RpcError):
            inference_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
                pb.ModelInferRequest(model_name="nope"), timeout=30)
        after = scrape(port)
    model_labels = {"model": "mlp", "version": "1"}

    def moved(name: str, **labels: str) -> float:
        return series(after, name, **labels) - series(before, name, **labels)

    assert moved("cuvil_inference_request_success_total", **model_labels) == 7
    assert moved("cuvil_inference_request_failure_total", code="INVALID_ARGUMENT",
                 **model_labels) == 3
    assert moved("cuvil_inference_request_failure_total", model="", code="NOT_FOUND") == 1
    assert moved("cuvil_inference_count_total", **model_labels) == 14  # batch 2, 7 times
    for histogram in ("request", "compute", "queue"):
        assert moved(f"cuvil_inference_{histogram}_duration_seconds_count", **model_labels) == 7
    parts = moved("cuvil_part_run_duration_seconds_count", **model_labels)
    assert parts == 7 * len(client_plan_parts(d.target))
    assert moved("cuvil_device_busy_seconds_total") > 0
    assert series(after, "cuvil_models", state="READY") == 1
    assert "cuvil_arena_bytes_in_use" in after and "cuvil_shm_regions" in after
    host = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)
    assert host.status == 200

    # The fast path: a one-part model's requests are run by its worker, which the daemon
    # never sees; they are counted in the session's page, and stay counted once it closed.
    assert len(client_plan_parts(d.target)) == 1
    with Client(d.target, fast=True) as client:
        for _ in range(5):
            client.infer("mlp", x)
        during = scrape(port)
    after_fast = scrape(port)
    for took in (during, after_fast):
        assert series(took, "cuvil_fast_path_requests_total", outcome="success",
                      **model_labels) == 5
        assert series(took, "cuvil_fast_path_request_duration_seconds_count",
                      **model_labels) == 5
        assert 0 < series(took, "cuvil_fast_path_request_duration_seconds_sum",
                          **model_labels) < 5 * 60
        bucket = "cuvil_fast_path_request_duration_seconds_bucket"
        bounds = set(re.findall(r'le="([^"]+)"', " ".join(k for k in took if bucket in k)))
        counts = [series(took, bucket, le=le, **model_labels) for le in sorted(bounds, key=float)]
        assert counts == sorted(counts) and counts[-1] == 5  # cumulative, +Inf holds all
    assert series(after_fast, "cuvil_inference_request_success_total", **model_labels) == \
        series(after, "cuvil_inference_request_success_total", **model_labels)
    with Client(d.target) as client:  # cuvilctl stats: their quantiles, as bucket bounds
        key = f"{model_labels['model']}:{model_labels['version']}"
        fast = client.stats(0.01)["models"][key]["fast_latency_ms"]
    assert fast["n"] == 5 and 0 < fast["p50"] <= fast["p99"] <= 60_000, fast


def client_plan_parts(target: str) -> list[dict]:
    with Client(target) as client:
        return client.plan("mlp")["plan"]["parts"]


def test_a_trace_holds_the_request_and_one_span_per_part(make_daemon, tmp_path):
    path = tmp_path / "traces.jsonl"
    d = make_daemon(tracing={"exporter": "file", "path": str(path)})
    model, inputs = reference("demo")  # two parts on two devices
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    with Client(d.target) as client:
        client.load("demo", model, inputs)
        wait_ready(client, "demo")
        parts = client.plan("demo")["plan"]["parts"]
    with grpc.insecure_channel(d.target) as channel:  # a caller that is itself traced
        request = pb.ModelInferRequest(model_name="demo")
        request.inputs.add(name="x", datatype="FP32", shape=list(inputs[0].shape))
        request.raw_input_contents.append(inputs[0].numpy().tobytes())
        inference_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            request, timeout=60,
            metadata=[("traceparent", f"00-{trace_id}-00f067aa0ba902b7-01")])
    assert d.stop() == 0  # the batch processor exports what it holds on the way out
    spans = [json.loads(line) for line in path.read_text().splitlines()]
    requests = [s for s in spans if s["name"] == "ModelInfer"]
    assert len(requests) == 1
    root = requests[0]
    assert root["context"]["trace_id"] == f"0x{trace_id}"  # the caller's trace continues
    children = [s for s in spans if s.get("parent_id") == root["context"]["span_id"]]
    part_spans = [s for s in children if s["name"].startswith("part ")]
    assert sorted(s["attributes"]["cuvil.part"] for s in part_spans) == sorted(
        p["id"] for p in parts)
    assert {s["attributes"]["cuvil.device"] for s in part_spans} == {p["device"] for p in parts}
    cuts = [s for s in children if s["name"].startswith("cut ")]
    assert len(cuts) == 1 and cuts[0]["attributes"]["cuvil.bytes"] > 0


def test_svg_timeline_and_stats(make_daemon, tmp_path):
    d = make_daemon()
    model, inputs = reference("demo")
    with Client(d.target) as client:
        client.load("demo", model, inputs)
        wait_ready(client, "demo")
        for _ in range(5):
            client.infer("demo", *inputs)
        parts = client.plan("demo")["plan"]["parts"]
        stats = client.stats(0.3)
    assert stats["models"]["demo:1"]["success"] == 5
    assert stats["models"]["demo:1"]["latency_ms"]["p50"] > 0
    assert set(stats["devices_busy"]) == {p["device"] for p in parts}
    ctl = [sys.executable, "-m", "cuvild.client.cli", "--target", d.target]
    svg = tmp_path / "plan.svg"
    done = subprocess.run([*ctl, "partition", "demo", "--svg", str(svg)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    root = ET.fromstring(svg.read_text())
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    groups = root.iter("{http://www.w3.org/2000/svg}g")
    bars = [g for g in groups if g.get("class") == "part"]
    assert sorted(g.get("data-part") for g in bars) == sorted(p["id"] for p in parts)
    measured = [g for g in root.iter("{http://www.w3.org/2000/svg}g")
                if g.get("class") == "measured"]
    assert len(measured) == len(parts)  # it served: the measured bars are drawn too
    shown = subprocess.run([*ctl, "stats", "--interval", "0.2"], capture_output=True,
                           text=True, timeout=60)
    assert shown.returncode == 0 and "demo:1" in shown.stdout and "BUSY" in shown.stdout


@pytest.mark.parametrize("section, key", [
    ({"listen": "nowhere"}, "metrics.listen"),
    ({"listen": 9464, "enabled": False}, "metrics.listen"),
])
def test_bad_metrics_config(section, key, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(config.ConfigError, match=key.replace(".", r"\.")):
        config.parse({"metrics": section})


def test_metrics_listen_defaults_to_loopback(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert config.parse({"metrics": {"listen": 9464}}).metrics_listen == "127.0.0.1:9464"
    assert config.parse({"metrics": {"listen": "0.0.0.0:9464"}}).metrics_listen == \
        "0.0.0.0:9464"
    with pytest.raises(config.ConfigError, match="tracing.path"):
        config.parse({"tracing": {"exporter": "file"}})
    with pytest.raises(config.ConfigError, match="tracing.sample_rate"):
        config.parse({"tracing": {"exporter": "otlp", "endpoint": "http://x", "sample_rate": 2}})
