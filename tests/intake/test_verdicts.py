"""The inspection's verdicts kept in the compile cache (cuvild/intake/verdicts.py): the same
bytes are inspected once per cache (accepted, or refused by the safe loader), and only a
verdict this daemon's key signed, by this software, for these bytes, spares an archive its
inspection."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

from cuvild.intake import verdicts
from cuvild.intake.errors import UnsafeArchive
from cuvild.intake.registry import Registry
from cuvild.intake.verdicts import Verdicts
from runtimes.cache import KEY_ENV

LIMIT = 1 << 20  # the size limit the registries here inspect under
SUMMARY = {"num_nodes": 3, "annotated_nodes": 0, "out_spec": "",
           "inputs": [{"name": "x", "dtype": "float32", "shape": [2, 16]}],
           "outputs": [{"name": "output0", "dtype": "float32", "shape": [2, 4]}]}


@pytest.fixture
def key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cache.key"
    monkeypatch.setenv(KEY_ENV, str(path))
    return path


def upload(registry: Registry, data: bytes, name: str,
           inspect: Any) -> tuple[Any, bool]:
    sha = hashlib.sha256(data).hexdigest()
    up = registry.begin_upload({"name": name, "version": "1", "sha256": sha,
                                "size_bytes": len(data), "replace": False})
    up.write(data)
    return up.finish(inspect)


def test_the_same_bytes_are_inspected_once_per_cache(tmp_path: Path, key: Path) -> None:
    inspected: list[Path] = []

    def inspect(path: Path) -> dict[str, Any]:
        inspected.append(path)
        return json.loads(json.dumps(SUMMARY))

    cache = Verdicts(tmp_path / "cache")
    data = b"an archive's bytes"
    sha = hashlib.sha256(data).hexdigest()
    assert not Registry(tmp_path / "a", 1 << 20, cache).known(sha)
    record, _ = upload(Registry(tmp_path / "a", 1 << 20, cache), data, "m", inspect)
    # a second daemon's registry (another state directory), the same cache
    again = Registry(tmp_path / "b", 1 << 20, Verdicts(tmp_path / "cache"))
    assert again.known(sha) and again.known(sha.upper())
    other, _ = upload(again, data, "n", inspect)
    assert len(inspected) == 1 and other.inputs == record.inputs == SUMMARY["inputs"]
    upload(again, b"other bytes", "o", inspect)  # unknown bytes: inspected
    assert len(inspected) == 2
    # without verdicts (a library's registry), every upload is inspected
    upload(Registry(tmp_path / "c", 1 << 20), data, "m", inspect)
    assert len(inspected) == 3


def test_only_a_verdict_this_key_signed_for_these_bytes_and_software_counts(
        tmp_path: Path, key: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = Verdicts(tmp_path / "cache")
    sha, other = "a" * 64, "b" * 64
    cache.keep(sha, SUMMARY)
    assert cache.verdict(sha, LIMIT) == SUMMARY and cache.verdict(other, LIMIT) is None
    assert cache.verdict("../" + sha[3:], LIMIT) is None  # (an upload header's, not checked yet)
    where = tmp_path / "cache" / "inspected" / f"{sha}.json"
    kept = json.loads(where.read_text())

    def forged(**change: Any) -> dict[str, Any] | None:
        where.write_text(json.dumps({**kept, **change}))
        said = cache.verdict(sha, LIMIT)
        return said if isinstance(said, dict) else None

    # what it says of the archive changed (its inputs), or moved to other bytes: not signed
    assert forged(summary={**SUMMARY, "inputs": []}) is None
    (tmp_path / "cache" / "inspected" / f"{other}.json").write_text(
        json.dumps({**kept, "sha256": other}))
    assert cache.verdict(other, LIMIT) is None
    assert forged(mac="0" * 64) is None and forged() == SUMMARY
    # another key (a cache shared with a daemon that does not hold this one)
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "another.key"))
    assert cache.verdict(sha, LIMIT) is None
    monkeypatch.setenv(KEY_ENV, str(key))
    # another version of the intake code or of torch: inspected again
    monkeypatch.setattr(verdicts, "_software", ["changed", "2.13.0"])
    assert cache.verdict(sha, LIMIT) is None
    where.write_text("{not json")
    assert cache.verdict(sha, LIMIT) is None


def test_the_oldest_verdicts_go_past_keep(tmp_path: Path, key: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verdicts, "KEEP", 2)
    cache = Verdicts(tmp_path / "cache")
    for i, sha in enumerate(("a" * 64, "b" * 64, "c" * 64)):
        cache.keep(sha, SUMMARY)
        stamp = 1_000_000 + i
        os.utime(cache.directory / f"{sha}.json", (stamp, stamp))
    assert sorted(p.stem[0] for p in cache.directory.glob("*.json")) == ["b", "c"]


def test_the_safe_loaders_refusal_is_kept_and_said_again_uninspected(
        tmp_path: Path, key: Path) -> None:
    calls: list[Path] = []

    def refuse(path: Path) -> dict[str, Any]:
        calls.append(path)
        raise UnsafeArchive("data/pkl", "a pickle")

    def limit(path: Path) -> dict[str, Any]:  # the inspection process's limit, not the bytes'
        calls.append(path)
        raise ValueError("archive inspection exceeded 120 s of CPU")

    cache = tmp_path / "cache"
    for registry in (Registry(tmp_path / "a", 1 << 20, Verdicts(cache)),
                     Registry(tmp_path / "b", 1 << 20, Verdicts(cache))):
        with pytest.raises(UnsafeArchive, match="data/pkl: a pickle"):
            upload(registry, b"a crafted archive", "m", refuse)
    assert len(calls) == 1 and registry.known(hashlib.sha256(b"a crafted archive").hexdigest())
    # under another size limit (what the loader refuses may depend on it): inspected again
    with pytest.raises(UnsafeArchive):
        upload(Registry(tmp_path / "c", 1 << 21, Verdicts(cache)), b"a crafted archive", "m",
               refuse)
    assert len(calls) == 2
    for _ in range(2):  # a limit's refusal is not kept
        with pytest.raises(ValueError, match="120 s of CPU"):
            upload(Registry(tmp_path / "d", 1 << 20, Verdicts(cache)), b"slow bytes", "m", limit)
    assert len(calls) == 4
