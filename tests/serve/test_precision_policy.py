"""A precision policy through the daemon: refused when malformed (nothing registered), and
reported when served (cuvilctl models / compare / partition)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from cuvild.client import Client, InvalidArgument
from cuvild.client.samples import MLP


def small() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return MLP(width=32, depth=2).eval(), torch.randn(2, 32)


def wait_ready(client: Client, name: str) -> dict:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        model = next(m for m in client.models() if m["name"] == name)
        if model["state"] != "loading":
            return model
        time.sleep(0.2)
    raise AssertionError(f"{name} still loading")


@pytest.mark.parametrize("kwargs, field", [
    ({"precision": "int4"}, "precision"),
    ({"precision": "auto", "max_error": -0.5}, "max_error"),
    ({"precision": "auto", "max_error": 3.0}, "max_error"),
    ({"precision": "auto", "calibration": [torch.randn(2, 31)]}, "calibration"),
    ({"precision": "auto", "calibration": [(torch.randn(2, 32), torch.randn(2, 32))]},
     "calibration"),
])
def test_bad_policy_values_are_refused_naming_the_field(daemon, state_root, kwargs, field):
    """Against the session's shared daemon (its state: state_root): a refusal leaves nothing
    registered, so the cases need no daemon each (five starts, an inspector each)."""
    model, x = small()
    with Client(daemon.target) as client:
        with pytest.raises((InvalidArgument, ValueError)) as err:
            client.load("bad", model, (x,), **kwargs)
        if isinstance(err.value, InvalidArgument):
            message = err.value.message
        else:  # the client refuses a sample that does not hold the model's inputs itself
            message = str(err.value)
        assert message.startswith(f"{field}:") or f"{field}:" in message, message
        assert client.models() == []
    assert [p.name for p in (state_root / "models").iterdir() if p.name != "index.json"] == []
    assert list((state_root / "uploads").iterdir()) == []


def test_auto_is_served_and_reported(make_daemon):
    d = make_daemon()
    model, x = small()
    calibration = [torch.randn(2, 32) for _ in range(8)]
    with Client(d.target, timeout=120) as client:
        client.load("mlp", model, (x,), precision="auto", max_error=0.25,
                    calibration=calibration)
        listed = wait_ready(client, "mlp")
        assert listed["state"] == "ready", d.log()[-3000:]
        assert listed["precision"] == "auto" and listed["max_error"] == 0.25
        assert listed["calibration_inputs"] == 8 and 0 <= listed["measured_error"] <= 0.25
        report = client.compare("mlp")
        assert report["policy"] == "auto" and report["calibrated"] and report["inputs"] == 8
        assert report["fp32"]["error"] < 1e-4 and report["chosen"]["error"] <= 0.25
        tried = {(c["precision"], c["status"]) for p in report["parts"] for c in p["candidates"]}
        assert ("fp32", "ok") in tried and any(p == "int8" for p, _ in tried), tried
        with torch.no_grad():
            want = model(x)
        got = client.infer("mlp", x)["output0"]
        assert float((got - want).abs().max() / want.abs().max()) <= 0.25
        plan = client.plan("mlp")
        assert "error" in plan["explain"].splitlines()[1]
        assert all(p["error"] is not None for p in plan["plan"]["parts"])
    ctl = [sys.executable, "-m", "cuvild.client.cli", "--target", d.target]
    shown = subprocess.run([*ctl, "compare", "mlp"], capture_output=True, text=True,
                           timeout=60)
    assert shown.returncode == 0, shown.stderr
    for needle in ("torch eager fp32", "fp32 plan", "chosen plan", "TOP-1", "int8"):
        assert needle in shown.stdout, shown.stdout
    as_json = json.loads(subprocess.run([*ctl, "compare", "mlp", "--json"], capture_output=True,
                                        text=True, timeout=60).stdout)
    assert as_json["chosen"]["error"] == report["chosen"]["error"]
    status = subprocess.run([*ctl, "models"], capture_output=True, text=True, timeout=60)
    assert "auto 0.25" in status.stdout, status.stdout
