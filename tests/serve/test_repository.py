"""The model repository read at start (cuvild/intake/repository.py): Triton's layout, as KServe's
storage initializer leaves it under /mnt/models."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
import tritonclient.grpc as grpcclient
from daemons import ROOT, free_port, worker_processes
from generation_helpers import encoder_entry

import cuvild
from cuvild.client import Client, cli, samples
from cuvild.intake import repository

SEED = 7


def mlp() -> torch.nn.Module:
    torch.manual_seed(SEED)
    return samples.MLP(width=16, depth=1).eval()


def save(model: torch.nn.Module, path: Path, width: int = 16) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(cuvild.export(model, (torch.randn(2, width),)), path)
    return path


def embeddings(http: str) -> list[float]:
    """The repository's encoder's embedding of one text (its [1, 8] bucket)."""
    body = json.dumps({"model": "embed", "input": "hello", "encoding_format": "float"})
    request = urllib.request.Request(f"http://{http}/v1/embeddings", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())["data"][0]["embedding"]


def layout(root: Path, files: dict[str, str | bytes]) -> Path:
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    return root


def test_scan_reads_triton_layout_and_names_each_bad_entry(tmp_path):
    root = layout(tmp_path, {
        "resnet/config.yaml": "precision: auto\nmax_error: 0.005\nmax_batch: 4\n",
        "resnet/1/model.pt2": b"x", "resnet/10/model.pt2": b"x", "resnet/2/model.pt2": b"x",
        "bert/1/model.pt2": b"x", "bert/2/README": "no archive here",
        "typo/config.yaml": "precison: auto\n",
        "typo/1/model.pt2": b"x",
        "wrongtype/config.yaml": "max_batch: '4'\n", "wrongtype/1/model.pt2": b"x",
        "calib/config.yaml": "calibration: ../elsewhere.npz\n", "calib/1/model.pt2": b"x",
        "bad name/1/model.pt2": b"x",
        "empty/.keep": "",
        "embed/1/model.pt2": b"x", "embed/1_Pooling/config.json": "{}",  # (not versions)
        "embed/onnx/model.onnx": b"x", "embed/named/model.pt2": b"x",
        ".hidden/1/model.pt2": b"x",
        "stray-file.txt": "ignored",
    })
    found = {e.key: e for e in repository.scan(root)}
    assert list(found) == ["bad name", "bert:1", "bert:2", "calib", "embed:1", "embed:named",
                           "empty", "resnet:1", "resnet:2", "resnet:10", "typo", "wrongtype"]
    assert not found["embed:1"].error and not found["embed:named"].error
    assert [e.version for e in repository.scan(root) if e.name == "resnet"] == ["1", "2", "10"]
    assert found["resnet:1"].options == {"precision": "auto", "max_error": 0.005,
                                         "max_batch": 4}
    assert not found["resnet:10"].error and not found["bert:1"].error
    assert found["bert:2"].error == "no model.pt2 in bert/2/"
    assert "unknown option(s) precison" in found["typo"].error
    assert "max_batch: expected int, got str '4'" in found["wrongtype"].error
    assert "calibration: expected an .npz file in calib/" in found["calib"].error
    assert "directory name" in found["bad name"].error
    assert "no version directory" in found["empty"].error


def test_a_bad_model_repository_flag_is_a_config_error(tmp_path):
    missing = tmp_path / "nowhere"
    done = subprocess.run([sys.executable, "-m", "cuvild", "--model-repository", str(missing)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"model_repository: '{missing}' is not a readable directory" in done.stderr


def http_status(address: str, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=10) as reply:
            return reply.status
    except urllib.error.HTTPError as e:
        return e.code


def wait_server_ready(triton: grpcclient.InferenceServerClient, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not triton.is_server_ready():
        assert time.monotonic() < deadline, "not ready in time"
        time.sleep(0.1)


def served_again_warm(make_daemon: Any, state_dir: Path, root: Path, model: torch.nn.Module,
                      x: torch.Tensor, embedded: Any) -> None:
    """A restart on the same state: the repository's models from their load records (the
    encoder's /v1/embeddings answering as before: `embedded`), and the entry refused still
    refused, uninspected."""
    http = f"127.0.0.1:{free_port()}"
    again = make_daemon(state_dir=state_dir, model_repository=str(root),
                        listen={"http": http, "insecure_loopback": True})
    with grpcclient.InferenceServerClient(url=again.target) as triton:
        wait_server_ready(triton)
        assert triton.is_model_ready("mlp")
    log = again.log()
    assert "model repository: mlp:1 registered already" in log  # not inspected again
    assert "model mlp:1 ready" in log and "(from its load record)" in log
    with Client(again.target) as client:
        torch.testing.assert_close(client.infer("mlp", x)["output0"], model(x),
                                   rtol=1e-4, atol=1e-5)
    assert embeddings(http) == embedded  # (its bucket from its record, run as bytes)
    # restored without torch in the daemon, and the bad entry not inspected again (its
    # refusal kept in the compile cache): no inspector started
    assert "libtorch" not in Path(f"/proc/{again.proc.pid}/maps").read_text()
    assert "refused before" in log and worker_processes(again.proc.pid, "forkserver") == []
    with Client(again.target) as client:  # still refused, with its reason
        refused = {e["name"]: e["reason"] for e in client.status()["repository_refused"]}
    assert "refused" in refused["broken"], refused


@pytest.mark.daemon
def test_models_load_from_the_repository_at_start_and_again_warm(make_daemon, tmp_path, capsys):
    """A static model and a dynamic one with batching: both served; /v2/health/ready answers
    200 only once both are READY (a bad entry, refused, does not hold it back)."""
    model, rows = mlp(), mlp()
    root = tmp_path / "repo"
    save(model, root / "mlp" / "1" / "model.pt2")
    batch = torch.export.Dim("batch", min=1, max=8)
    (root / "rows" / "1").mkdir(parents=True)
    torch.export.save(cuvild.export(rows, (torch.randn(2, 16),), dynamic_shapes=({0: batch},)),
                      root / "rows" / "1" / "model.pt2")
    layout(root, {"mlp/config.yaml": "precision: fp32\n",
                  "rows/config.yaml": "precision: fp32\nmax_batch: 4\nmax_delay_us: 2000\n",
                  "broken/1/model.pt2": b"not a zip archive",
                  "typo/config.yaml": "precison: fp32\n", "typo/1/model.pt2": b"x"})
    encoder_entry(root / "embed")  # (a tiny BERT: /v1/embeddings, after the restart too)
    http = f"127.0.0.1:{free_port()}"
    daemon = make_daemon(model_repository=str(root),
                         listen={"http": http, "insecure_loopback": True})
    x = torch.randn(2, 16)
    with grpcclient.InferenceServerClient(url=daemon.target) as triton:
        deadline, not_ready = time.monotonic() + 300, 0
        while http_status(http, "/v2/health/ready") != 200:  # once every entry is settled
            assert time.monotonic() < deadline, "not ready in time"
            not_ready += 1
            time.sleep(0.05)
        # READY is kept once reached: a model not READY now was not READY at the 200 above
        index = {(m["name"], m.get("version", "")): m
                 for m in triton.get_model_repository_index(as_json=True)["models"]}
        assert index[("mlp", "1")]["state"] == "READY"
        assert index[("rows", "1")]["state"] == "READY"
        assert index[("broken", "1")]["state"] == "UNAVAILABLE"
        assert "refused" in index[("broken", "1")]["reason"]
        assert "unknown option(s) precison" in index[("typo", "")]["reason"]
        assert triton.is_model_ready("mlp") and triton.is_model_ready("rows")
        print(f"/v2/health/ready answered 503 {not_ready} time(s) before 200")
    with Client(daemon.target) as client:
        torch.testing.assert_close(client.infer("mlp", x)["output0"], model(x),
                                   rtol=1e-4, atol=1e-5)
        for n in (1, 3, 8):  # any batch size, merged up to max_batch
            xs = torch.randn(n, 16)
            torch.testing.assert_close(client.infer("rows", xs)["output0"], rows(xs),
                                       rtol=1e-4, atol=1e-5)
        (served,) = [m for m in client.models() if m["name"] == "rows"]
        assert served["batching"]["state"] == "on" and served["batching"]["max_batch"] == 4
        status = client.status()  # what `cuvilctl status` shows
    embedded = embeddings(http)
    refused = {(e["name"], e["version"]): e["reason"] for e in status["repository_refused"]}
    assert set(refused) == {("broken", "1"), ("typo", "")}
    assert "unknown option(s) precison" in refused[("typo", "")]
    cli.print_status(status)
    assert "model repository: 2 entries not served" in capsys.readouterr().out
    assert daemon.stop() == 0
    assert "model repository: mlp:1 registered\n" in daemon.log()

    served_again_warm(make_daemon, daemon.state_dir, root, model, x, embedded)


def test_one_bad_entry_fails_alone_with_a_bounded_reason(tmp_path, monkeypatch):
    """What one model's directory holds fails that model alone (issue 49): an alias bomb in
    config.yaml (its message repr()ed the value: a 321-byte file made 58 MB), YAML nested 3000
    deep, a version named "²", a folder that cannot be listed, links out of the repository,
    an archive over limits.max_model_bytes (refused before a byte is read)."""
    outside = tmp_path / "elsewhere.pt2"
    outside.write_bytes(b"x" * 64)
    bomb = "max_batch: [&a [x, x, x, x, x, x, x, x, x], " + ", ".join(
        f"&{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]"
        for p, c in zip("abcdefgh", "bcdefghi", strict=True)) + "]\n"  # 9^9 x's
    root = layout(tmp_path / "repo", {
        "bomb/config.yaml": bomb, "bomb/1/model.pt2": b"x",
        "deep/config.yaml": "[" * 3000, "deep/1/model.pt2": b"x",
        "super/\u00b2/model.pt2": b"x", "super/1/model.pt2": b"x",
        "locked/1/model.pt2": b"x",
        "big/1/model.pt2": b"x" * 4096,
        "fine/1/model.pt2": b"x",
    })
    (root / "linked" / "1").mkdir(parents=True)
    (root / "linked" / "1" / "model.pt2").symlink_to(outside)
    (root / "away").symlink_to(tmp_path, target_is_directory=True)
    real_iterdir = Path.iterdir

    def iterdir(self: Path):
        if self.name == "locked":
            raise PermissionError(13, "Permission denied", str(self))
        return real_iterdir(self)

    monkeypatch.setattr(Path, "iterdir", iterdir)
    found = {e.key: e for e in repository.scan(root, max_bytes=1024)}
    assert not found["fine:1"].error and not found["super:1"].error
    assert "max_batch: expected int, got list" in found["bomb"].error
    assert all(len(e.error) <= 500 for e in found.values())
    assert found["deep"].error.startswith("config.yaml")
    assert "directory name" in found["super:\u00b2"].error
    assert "cannot read locked/: PermissionError" in found["locked"].error
    assert "links out of the repository" in found["linked:1"].error
    assert "links out of the repository" in found["away"].error
    assert "over limits.max_model_bytes (1024)" in found["big:1"].error


@pytest.mark.daemon
def test_a_reload_unloads_what_left_the_repository(make_daemon, tmp_path):
    """As Triton's poll mode: an entry removed from the repository is unloaded at the next
    reload (SIGHUP, `cuvilctl reload`), a model a client uploaded is never touched; readiness
    holds until every scan asked for has run (two reloads close together raced on it)."""
    root = tmp_path / "repo"
    save(mlp(), root / "a" / "1" / "model.pt2")
    save(mlp(), root / "b" / "1" / "model.pt2")
    daemon = make_daemon(model_repository=str(root))
    with grpcclient.InferenceServerClient(url=daemon.target) as triton, \
            Client(daemon.target) as client:
        wait_server_ready(triton)
        client.load("uploaded", mlp(), (torch.randn(2, 16),))
        assert {m["name"] for m in client.models()} == {"a", "b", "uploaded"}
        for path in sorted((root / "b").rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        (root / "b").rmdir()
        client.reload()
        client.reload()  # two close together: ready only once both scans ran
        wait_server_ready(triton)
        assert {m["name"] for m in client.models()} == {"a", "uploaded"}
        assert not triton.is_model_ready("b")
    assert "model repository: b:1 is gone from" in daemon.log()


def test_a_files_digest_is_read_again_only_once_it_changed(tmp_path, monkeypatch):
    """A restart does not hash an unchanged archive again (repository.Digests: the file's
    stat as last read); a file written in place, even with its size and modification time
    put back, is read again (its change time moved), as is one replaced."""
    archive = tmp_path / "m" / "1" / "model.pt2"
    archive.parent.mkdir(parents=True)
    archive.write_bytes(b"a" * 4096)
    read: list[Path] = []
    real = repository.digest
    monkeypatch.setattr(repository, "digest", lambda p: read.append(p) or real(p))
    where = tmp_path / "state" / "repository-digests.json"
    where.parent.mkdir()

    def start() -> tuple[str, int]:  # a daemon's scan: read what is kept, keep what it read
        digests = repository.Digests(where)
        got = digests.of(archive)
        digests.save()
        return got

    first = start()
    assert first == (real(archive)[0], 4096) and len(read) == 1
    assert start() == first and len(read) == 1  # unchanged: not read
    before = archive.stat()
    time.sleep(0.05)  # (a change time in another tick of the kernel's clock)
    with open(archive, "r+b") as f:  # the same size, other bytes, the old mtime put back
        f.write(b"b")
    os.utime(archive, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert start() == (real(archive)[0], 4096) != first and len(read) == 2
    archive.unlink()
    archive.write_bytes(b"a" * 4096)  # replaced: a new file (its times; often its inode)
    assert start() == first and len(read) == 3
    where.write_text("[1, 2")  # a record that does not read: every file read again
    assert start() == first and len(read) == 4
