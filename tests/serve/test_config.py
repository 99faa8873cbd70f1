"""Bad configs exit 2 naming the key; good ones fill defaults."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cuvild import config

ROOT = Path(__file__).resolve().parents[2]


def run_cuvild(tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return subprocess.run([sys.executable, "-m", "cuvild", "--config", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("text, key", [
    ("listen: {unix: /tmp/x.sock, port: 5}\n", "listen.port"),
    ("bogus: 1\n", "bogus"),
    ("log_level: 3\n", "log_level"),
    ("log_level: loud\n", "log_level"),
    ("devices: {cpu: {enabled: 'yes'}}\n", "devices.cpu.enabled"),
    ("devices: {cpu: {cores: [9999]}}\n", "devices.cpu.cores"),
    ("limits: {max_model_bytes: true}\n", "limits.max_model_bytes"),
    ("devices: {emulated: [{id: npu0, kind: tpu, cores: [0]}]}\n", "devices.emulated[0].kind"),
    ("devices: {overrides: {cpu0: {mem_bw: 3}}}\n", "devices.overrides.cpu0.mem_bw"),
    ("listen: {tcp: 'nohostport'}\n", "listen.tcp"),
    ("listen: {tcp: '0.0.0.0:9000'}\n", "listen.token"),
    ("listen: {tcp: '0.0.0.0:9000', insecure_loopback: true}\n", "listen.token"),
    ("listen: {tls: {cert: /etc/hostname}}\n", "listen.tls"),
    ("engine: {workers: fork}\n", "engine.workers"),
    ("engine: {runtimes: {cpu: [openvino, tvm]}}\n", "engine.runtimes.cpu"),
    ("engine: {runtimes: {npu0: []}}\n", "engine.runtimes.npu0"),
    ("engine: {runtimes: [openvino]}\n", "engine.runtimes"),
])
def test_bad_config_exits_2_naming_key(tmp_path, text, key):
    result = run_cuvild(tmp_path, text)
    assert result.returncode == 2, result.stderr
    assert key in result.stderr
    assert "Traceback" not in result.stderr


def test_unwritable_state_dir_exits_2(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = run_cuvild(tmp_path, yaml.safe_dump({"state_dir": str(blocker / "state")}))
    assert result.returncode == 2
    assert "state_dir" in result.stderr and "cannot create" in result.stderr


def test_not_yaml_exits_2(tmp_path):
    result = run_cuvild(tmp_path, "listen: [unclosed\n")
    assert result.returncode == 2 and "not valid YAML" in result.stderr


def test_defaults_follow_systemd_directories(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(tmp_path / "run"))
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "state"))
    monkeypatch.setenv("CACHE_DIRECTORY", str(tmp_path / "cache"))
    cfg = config.parse({})
    assert cfg.unix_socket == str(tmp_path / "run" / "cuvild.sock")
    assert cfg.state_dir == tmp_path / "state" and cfg.cache_dir == tmp_path / "cache"
    assert cfg.tcp is None and cfg.emulated == []


def test_engine_runtimes_parse_by_device_id_or_kind(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert config.parse({}).runtimes == {}
    cfg = config.parse({"engine": {"runtimes": {"cpu": ["openvino", "onnxruntime"],
                                                "npu0": ["openvino"]}}})
    assert cfg.runtimes == {"cpu": ["openvino", "onnxruntime"], "npu0": ["openvino"]}
    with pytest.raises(config.ConfigError, match="engine.runtimes.cpu: unknown runtime 'tvm'"):
        config.parse({"engine": {"runtimes": {"cpu": ["tvm"]}}})


def test_shipped_configs_are_valid(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    shipped = config.load(ROOT / "configs" / "cuvild.yaml")
    defaults = config.parse({})
    assert shipped.unix_socket == str(tmp_path / "cuvild" / "cuvild.sock") and shipped.tcp is None
    assert shipped.emulated == [] and shipped.cpu_enabled and shipped.cpu_cores is None
    # the shipped config spells out the defaults; nothing in it differs from them
    assert {k: v for k, v in vars(shipped).items() if k != "path"} == \
        {k: v for k, v in vars(defaults).items() if k != "path"}
    demo = config.load(ROOT / "configs" / "demo.yaml")
    assert demo.cpu_cores == [0]
    assert [(d.id, d.kind, d.runtime, d.cores) for d in demo.emulated] == \
        [("npu0", "npu", "openvino", [1])]


def test_a_reload_applies_or_names_every_setting():
    """Each field is either applied by a reload or named as taking effect on restart: a new
    one is never silently left as it started."""
    fields = {f.name for f in dataclasses.fields(config.Config)}
    assert config.RELOADED.isdisjoint(config.ON_RESTART)
    assert fields == config.RELOADED | set(config.ON_RESTART)


def test_every_key_is_declared_once_and_the_docs_table_is_the_codes():
    """The schema, the reload rule and docs/OPERATIONS.md's table come from one declaration
    per key (config.setting)."""
    keys = [f.metadata["key"] for f in config.KEYS]
    assert len(keys) == len(set(keys))
    assert config.RELOADED | set(config.ON_RESTART) == {
        f.name for f in dataclasses.fields(config.Config)}
    assert config.table() in (ROOT / "docs" / "OPERATIONS.md").read_text()
    cfg = config.parse({"engine": {"max_buckets": 3, "batching": {"max_batch": 2}},
                        "limits": {"upload_idle_s": 5}})
    assert (cfg.max_buckets, cfg.max_batch, cfg.upload_idle_s) == (3, 2, 5.0)
    assert isinstance(cfg.upload_idle_s, float)
    with pytest.raises(config.ConfigError, match="engine.max_dim: expected a positive number"):
        config.parse({"engine": {"max_dim": 0}})
