"""configs/kserve/: the ServingRuntime, its config Secret, an InferenceService and the image recipe
agree with each other, with KServe's SDK model classes and with what cuvild serves. Checked by
reading them, by the kserve SDK (in a process of its own: tests/serve/kserve_sdk.py), and by
cuvild's own config parser and HTTP routes (the image is not built here: no registry for base
images)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from daemons import ROOT

from cuvild import config
from cuvild.serve.rest import RestServer

KSERVE = ROOT / "configs" / "kserve"


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((KSERVE / name).read_text())


@pytest.fixture(scope="module")
def runtime() -> dict[str, Any]:
    return load("cluster-serving-runtime.yaml")


def container(runtime: dict[str, Any]) -> dict[str, Any]:
    (only,) = runtime["spec"]["containers"]
    return only


def pod_config(tmp_path: Path) -> config.Config:
    """The Secret's cuvild.yaml through cuvild's parser, its directories moved under tmp_path
    (the parser creates them)."""
    text = load("cuvild-config.yaml")["stringData"]["cuvild.yaml"]
    data = yaml.safe_load(text)
    data["state_dir"], data["cache_dir"] = str(tmp_path / "state"), str(tmp_path / "cache")
    data["listen"]["unix"] = str(tmp_path / "run" / "cuvild.sock")
    with pytest.raises(config.ConfigError, match="placeholder"):  # as shipped: refused
        config.parse(data, "cuvild-config.yaml")
    data["listen"]["token"] = "0" * 64  # as an operator puts it
    return config.parse(data, "cuvild-config.yaml")


def test_the_manifests_are_what_the_kserve_sdk_models_accept():
    """Each manifest through the SDK's own classes (kserve.models' ClusterServingRuntime and
    InferenceService, kubernetes' Secret): a field they do not have, a wrong type or a missing
    required field fails, and what they read back holds every field written."""
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "kserve_sdk.py"),
                           "manifests", str(KSERVE)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result.pop("misspelt field refused") is True  # the check itself is strict
    for name, checked in result.items():
        assert "error" not in checked, f"{name}: {checked.get('error')}"
        assert checked["round_trip"], f"{name}: the SDK's {checked['kind']} lost a field"


def test_the_runtime_declares_what_kserve_matches_on(runtime):
    assert runtime["apiVersion"] == "serving.kserve.io/v1alpha1"
    assert runtime["kind"] == "ClusterServingRuntime"
    spec = runtime["spec"]
    assert spec["protocolVersions"] == ["v2", "grpc-v2"]
    assert {"name": "torch-export", "version": "2", "autoSelect": True,
            "priority": 1} in spec["supportedModelFormats"]
    c = container(runtime)
    assert c["name"] == "kserve-container"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http1": 8080, "h2c": 9000}  # KServe's names for HTTP and gRPC


def test_the_config_secret_parses_and_matches_the_ports(runtime, tmp_path):
    cfg = pod_config(tmp_path)
    c = container(runtime)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert cfg.http == f"0.0.0.0:{ports['http1']}" and cfg.tcp == f"0.0.0.0:{ports['h2c']}"
    assert cfg.token  # a listener off loopback needs one: the parser refuses it otherwise
    metrics_port = runtime["spec"]["annotations"]["prometheus.kserve.io/port"]
    assert cfg.metrics_listen == f"0.0.0.0:{metrics_port}"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    written = yaml.safe_load(load("cuvild-config.yaml")["stringData"]["cuvild.yaml"])
    assert mounts["cuvild-cache"] == written["cache_dir"]
    assert mounts["cuvild-state"] == written["state_dir"]
    assert mounts["dshm"] == "/dev/shm"
    secret = next(v for v in runtime["spec"]["volumes"] if v["name"] == "cuvild-config")
    assert secret["secret"]["secretName"] == load("cuvild-config.yaml")["metadata"]["name"]
    assert c["args"][:2] == ["--config", f"{mounts['cuvild-config']}/cuvild.yaml"]
    assert c["args"][2:] == ["--model-repository", "/mnt/models"]  # the storage initializer's


def test_the_probes_are_routes_the_http_listener_serves(runtime):
    server = RestServer(service=None, address="127.0.0.1:0", threads=1)
    routes = {(r.method, r.resource.canonical) for r in server.app().router.routes()}
    server.listener.loop.close()
    server.pool.shutdown()
    c = container(runtime)
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        get = c[probe]["httpGet"]
        assert ("GET", get["path"]) in routes and get["port"] == 8080, probe


def test_the_inference_service_names_the_runtime_and_its_format(runtime):
    isvc = load("inference-service.yaml")
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1"
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert {k: model["modelFormat"][k] for k in ("name", "version")} in [
        {k: f[k] for k in ("name", "version")} for f in runtime["spec"]["supportedModelFormats"]]
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
    assert "://" in model["storageUri"]


def test_the_image_runs_cuvild_as_the_runtimes_non_root_user(runtime):
    text = (KSERVE / "Dockerfile").read_text()
    user = re.findall(r"^USER (\S+)$", text, re.M)
    assert user == [str(container(runtime)["securityContext"]["runAsUser"])]
    assert user[0] != "0" and "--uid " + user[0] in text
    assert re.findall(r"^ENTRYPOINT (.+)$", text, re.M) == ['["cuvild"]']
    cmd = yaml.safe_load(re.findall(r"^CMD (.+)$", text, re.M)[0])
    assert cmd == container(runtime)["args"]  # the runtime's args are the image's default
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["cuvild"]  # the entry point the image calls
    torch_pin = next(d for d in project["dependencies"] if d.startswith("torch=="))
    assert torch_pin in text  # the same pin as the project's
    for copied in re.findall(r"^COPY (\S+) \1$", text, re.M):
        assert (ROOT / copied).exists(), copied
    assert "make setup EXTRAS=" in text and "EXTRAS ?= [dev]" in (ROOT / "Makefile").read_text()


def test_the_pod_meets_the_restricted_pod_security_standard(runtime):
    """capabilities dropped, the runtime's seccomp profile, a read-only root with a volume for
    every path written, probes given more than the 1 s default (issue 49)."""
    c = container(runtime)
    sc = c["securityContext"]
    assert sc["capabilities"]["drop"] == ["ALL"] and sc["allowPrivilegeEscalation"] is False
    assert sc["seccompProfile"]["type"] == "RuntimeDefault" and sc["runAsNonRoot"] is True
    assert sc["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    written = yaml.safe_load(load("cuvild-config.yaml")["stringData"]["cuvild.yaml"])
    for path in (written["state_dir"], written["cache_dir"], "/dev/shm", "/tmp"):
        assert path in mounts, path
    assert str(Path(written["listen"]["unix"]).parent).startswith("/tmp")
    assert all(c[p]["timeoutSeconds"] >= 5 for p in ("livenessProbe", "readinessProbe",
                                                     "startupProbe"))
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"  # devices.gpu is on

