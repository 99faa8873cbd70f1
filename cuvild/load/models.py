"""Served models: each registered model is prepared (planned, split, compiled) in the
background (cuvild/load/prepare.py) and then served. State is READY, LOADING or UNAVAILABLE
(with the reason), with the phase of a load. Everything here can be rebuilt from disk: the
registry and the compile cache.

A model with a load record (cuvild/load/warm.py) is restored on a pool of its own, several
at once, beside the builds; one without, or whose record fails, is built on the build pool,
one at a time (compilers saturate the cores on their own). At start the workers of the
devices the records name are started before anything else, so their start overlaps the
reading of the registry.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cuvild.core.errors import InferError
from cuvild.core.loaded import Batching, LoadedModel
from cuvild.core.precision import PrecisionPolicy
from cuvild.intake import repository
from cuvild.intake.registry import ModelRecord, Registry, RegistryError
from cuvild.load import fallback, guard, prepare, warm, warmup
from cuvild.load.builder import Builder

log = logging.getLogger(__name__)
UNLOAD_WAIT_S = 10.0  # an unload waits this long for the workers to let the model go


@dataclass
class ServedModel:
    record: ModelRecord
    state: str = "LOADING"  # LOADING | READY | UNAVAILABLE
    reason: str = ""
    loaded: LoadedModel | None = None
    prepare_s: float = 0.0
    built: list[dict[str, Any]] = field(default_factory=list)
    # What the load is doing now, for people and `Client.load(wait=True)`: "queued",
    # "planning", "building part 1 of 2 on cpu0", "checking", "ready", "failed" ...
    phase: str = "queued"
    warm: bool = False  # READY from the load record: nothing planned or compiled

    @property
    def key(self) -> str:
        return f"{self.record.name}:{self.record.version}"


def untimed(loaded: LoadedModel, why: str) -> None:
    """A language model whose plan was to be timed at its warm-up (warmup.guarded), served
    untimed: its plan says so, and why. Nor is a generation of it checked (no program kept
    for it: `Family.reference`)."""
    if loaded.family is not None:
        loaded.family.reference = None
    if loaded.family is not None and loaded.family.alternative is not None:
        loaded.plan.notes.append(f"{guard.LABEL}: not timed against the plan "
                                 f"{loaded.family.alternative[2]} ({why})")
        loaded.family.alternative = None


class ModelManager:
    def __init__(self, registry: Registry, builder: Builder, objective: str = "latency",
                 precision: str = "fp32", max_error: float = 1e-2,
                 batching: Batching | None = None, warm_up: bool = True) -> None:
        """`warm_up`: a language model is warmed up before it is READY
        (engine.sequences.warm_up; cuvild/load/warmup.py)."""
        self.registry = registry
        self.builder = builder
        self.objective = objective
        self.default_policy = PrecisionPolicy(precision, max_error)  # engine.precision/max_error
        self.default_batching = batching or Batching(1)  # engine.batching (1: off)
        self.warm_up = warm_up
        self._models: dict[str, ServedModel] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prepare")
        self._warm_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="restore")
        # The model repository (cuvild/intake/repository.py): its entries that are not served,
        # key -> why, and whether a scan is under way (the server is not ready until it ends).
        self.refused: dict[str, str] = {}
        self._scans = 0  # scans asked for and not done: the server is not ready meanwhile
        self._scans_lock = threading.Lock()
        self._scan_lock = threading.Lock()
        self.scan_failed = ""  # a scan that failed as a whole: ServerReady says false

    def start_workers(self) -> list[str]:
        """Start the workers the registered models' load records name, first thing at start:
        a worker's start (a Python process, then its runtime's import) then overlaps the
        daemon's own. Returns their device ids."""
        devices: set[str] = set()
        for record in self.registry.list():
            where = warm.directory(self.builder.cache_dir, warm.key(
                str(self.registry.archive_path(record.sha256)), record.inputs,
                self.objective, self.policy(record), self.builder.devices.values(),
                self.builder.runtimes))
            devices |= warm.devices_of(warm.read(where) or {})
        started = sorted(devices & set(self.builder.devices))
        for device in started:
            self.builder.workers.of(device)
        return started

    def restore(self) -> None:
        """Serve every registered model again: from its load record where there is one."""
        for record in self.registry.list():
            self.submit(record)

    @property
    def scanning(self) -> bool:
        """Whether a scan of the model repository is asked for or under way."""
        return self._scans > 0

    def scan_asked(self) -> None:
        """A scan will run (ServerReady is false from now until every one asked is done)."""
        with self._scans_lock:
            self._scans += 1

    def load_repository(self, root: Path, inspect: Callable[[Path], dict[str, Any]]) -> None:
        """Register every entry of the model repository at `root` and serve it; one at a
        time, each inspected as an upload is (`inspect`), an entry registered already as it
        is without it. A bad entry is logged and kept in `refused`, and the others go on.
        An entry this repository served before that is gone from it now is unloaded, as
        Triton's poll mode does (the repository's names: state_dir/repository.json). Call
        `scan_asked` first; scans run one at a time."""
        try:
            with self._scan_lock:
                try:
                    self.refused = self._scan(root, inspect)
                    self.scan_failed = ""
                except Exception as e:  # a bug: said; the server is not ready, not silent
                    log.exception("model repository %s: the scan failed", root)
                    self.scan_failed = f"the model repository's scan failed: {e}"
                    self.refused = {str(root): self.scan_failed}
        finally:
            with self._scans_lock:
                self._scans -= 1

    def _forget_removed(self, root: Path, present: set[str]) -> None:
        """Unload (and unregister) what this repository served before and no longer holds;
        remember what it holds now. Models uploaded by clients are never touched."""
        from runtimes.base import write_atomic

        path = self.registry.models_dir.parent / "repository.json"
        try:
            before = json.loads(path.read_text())
            held = set(before["entries"]) if before.get("root") == str(root) else set()
        except (OSError, ValueError, KeyError, TypeError):
            held = set()
        for key in sorted(held - present):
            name, _, version = key.partition(":")
            log.info("model repository: %s is gone from %s: unloaded", key, root)
            try:
                self.registry.remove(name, version)
            except RegistryError:
                pass  # unloaded by a client meanwhile
            self.remove(name, version)
        write_atomic(path, json.dumps({"root": str(root), "entries": sorted(present)}).encode())

    def refusals(self) -> list[tuple[str, str, str]]:
        """(name, version, why) of the repository's entries not served (not registered since
        by another way)."""
        out = []
        for key, why in sorted(self.refused.items()):
            name, _, version = key.partition(":")
            if self.get(name, version) is None:
                out.append((name, version, why))
        return out

    def _scan(self, root: Path, inspect: Callable[[Path], dict[str, Any]]) -> dict[str, str]:
        t0, refused, served = time.perf_counter(), {}, 0
        try:
            entries = repository.scan(root, self.registry.max_model_bytes)
        except OSError as e:
            log.error("model repository %s: cannot list it: %s", root, e)
            return {str(root): f"cannot list the model repository: {e}"}
        self._forget_removed(root, {e.key for e in entries})
        digests = repository.Digests(self.registry.models_dir.parent / "repository-digests.json")
        for entry in entries:
            why = entry.error
            if not why:
                try:
                    record, present = repository.register(entry, self.registry, inspect,
                                                          digests)
                except ValueError as e:  # the safe loader's refusal, as an upload's
                    why = f"model archive refused: {e}"
                except (RegistryError, OSError) as e:
                    why = f"{type(e).__name__}: {e}"
            if why:
                refused[entry.key] = why
                log.error("model repository: %s not loaded: %s", entry.key, why)
                continue
            self.submit(record)
            served += 1
            log.info("model repository: %s %s", entry.key,
                     "registered already" if present else "registered")
        digests.save()
        log.info("model repository %s: %d model version(s) served, %d refused (%.2f s)",
                 root, served, len(refused), time.perf_counter() - t0)
        return refused

    def submit(self, record: ModelRecord) -> ServedModel:
        served = ServedModel(record)
        with self._lock:
            old = self._models.get(served.key)
            if old is not None and old.record == record and old.state != "UNAVAILABLE":
                return old
            self._models[served.key] = served
        if old is not None:
            self.builder.unload(old.key)
        self._warm_pool.submit(self._prepare, served, time.perf_counter(), False)
        return served

    def _prepare(self, served: ServedModel, t0: float, cold: bool) -> None:
        """Restore (cold=False) or build the model; a restore that cannot goes on to the
        build pool, which builds it without trying its load record again (a failed restore
        was tried twice: ~2 s more for a tampered part's)."""
        record = served.record
        if self._models.get(served.key) is not served:
            return  # unloaded or replaced while it waited
        try:
            loaded = prepare.prepare(
                self.builder, served.key, record.name, record.version,
                self.registry.archive_path(record.sha256), record.inputs,
                objective=self.objective, policy=self.policy(record),
                progress=lambda phase: self._phase(served, phase, t0), cold=cold,
                batching=self.batching(record), restore=not cold)
            if loaded is not None and loaded.state is not None and self.warm_up:
                loaded = self._warm(served, loaded, t0)
        except Exception as e:  # noqa: BLE001 - a model that cannot be served says why
            served.state, served.reason = "UNAVAILABLE", f"{type(e).__name__}: {e}"
            served.phase = "failed"
            log.error("model %s unavailable: %s", served.key, served.reason)
            return
        if loaded is None:
            served.phase = "queued to build"
            self._pool.submit(self._prepare, served, t0, True)
            return
        untimed(loaded, "engine.sequences.warm_up is off: its buckets are built at first use")
        served.loaded, served.prepare_s = loaded, time.perf_counter() - t0
        served.warm = loaded.warm
        with self._lock:
            if self._models.get(served.key) is not served:  # unloaded or replaced meanwhile
                self.builder.unload(served.key)
                return
            served.state, served.phase = "READY", "ready"
        log.info("model %s ready in %.2f s%s: %s", served.key, served.prepare_s,
                 " (from its load record)" if loaded.warm else "",
                 ", ".join(f"{r.id}@{r.device}/{r.runtime or 'runtime per input shape'}"
                           for r in loaded.routes))

    def _warm(self, served: ServedModel, loaded: LoadedModel, t0: float,
              banned: fallback.Banned | None = None) -> LoadedModel:
        """A language model's warm-up before it is READY (cuvild/load/warmup.py), then its
        plan timed against the one its load found to time it against (warmup.guarded): the
        faster served. Its parts are built here, so a part its device cannot build is
        planned again off that device, as a static model's is at its load
        (cuvild/load/fallback.py); a warm-up that fails otherwise fails the load with the
        reason (Triton's failed warmup fails the model's load): the model is not served."""
        if self.builder.runner.miss is None:
            return loaded
        progress = lambda phase: self._phase(served, phase, t0)  # noqa: E731
        record, archive = served.record, self.registry.archive_path(served.record.sha256)

        def load(key: str, plan: Any, keep_record: bool, banned: Any = None) -> LoadedModel:
            model = prepare.prepare(self.builder, key, record.name, record.version, archive,
                                    record.inputs, objective=self.objective, plan=plan,
                                    policy=self.policy(record), progress=progress,
                                    batching=self.batching(record), keep_record=keep_record,
                                    banned=banned, restore=False)
            assert model is not None  # (built, never restored)
            return model

        try:
            done = warmup.warm_up(self.builder, loaded, progress)
            if done:
                log.info("model %s: warmed up at load (%.2f s into it): %s", served.key,
                         time.perf_counter() - t0, "; ".join(done))
            served_now, compiled = warmup.guarded(self.builder, loaded, load, progress)
            if compiled:
                log.info("model %s: %s", served.key, "; ".join(compiled))
        except fallback.BuildFailed as e:  # its nodes off that device, planned again
            built = self.builder.runner.served.models.get(served.key, loaded)  # (the guard's?)
            self.builder.unload(served.key)
            banned = fallback.ban(e, built.plan, banned, len(self.builder.devices))
            progress(f"planning again: {e}")
            again = fallback.again(e, lambda: load(served.key, None, True, banned))
            return self._warm(served, again, t0, banned)
        except Exception as e:
            self.builder.unload(served.key)
            raise InferError(f"its warm-up failed: {type(e).__name__}: {e}") from e
        for said in served_now.plan.notes:
            if said.startswith(guard.LABEL):
                log.info("model %s: %s", served.key, said)
        return served_now

    @staticmethod
    def _phase(served: ServedModel, phase: str, t0: float) -> None:
        served.phase = phase
        log.debug("model %s: %s (%.2f s into its load)", served.key, phase,
                  time.perf_counter() - t0)

    def policy(self, record: ModelRecord) -> PrecisionPolicy:
        """The record's precision policy, the daemon's defaults where it left them open."""
        calibration = (str(self.registry.calibration_path(record.calibration))
                       if record.calibration else "")
        return PrecisionPolicy(record.precision or self.default_policy.mode,
                               record.max_error or self.default_policy.max_error,
                               calibration, record.calibration[:16])

    def batching(self, record: ModelRecord) -> Batching:
        """The record's batching, the daemon's engine.batching where it left it open (0)."""
        return Batching(record.max_batch or self.default_batching.max_batch,
                        record.max_delay_us or self.default_batching.max_delay_us)

    def remove(self, name: str, version: str = "") -> None:
        with self._lock:
            keys = [k for k, m in self._models.items() if m.record.name == name
                    and (not version or m.record.version == version)]
            for key in keys:
                del self._models[key]
        for key in keys:  # (once this returns, no worker serves it: its sessions end)
            self.builder.unload(key, wait_s=UNLOAD_WAIT_S)

    def get(self, name: str, version: str = "") -> ServedModel | None:
        """The named version, or the newest registered one."""
        with self._lock:
            matches = [m for m in self._models.values() if m.record.name == name
                       and (not version or m.record.version == version)]
        return max(matches, key=lambda m: m.record.created_at) if matches else None

    def current(self, served: ServedModel) -> bool:
        """Whether `served` is still the one served under its key, and READY (a session's
        per-request check: no lock, no scan)."""
        return self._models.get(served.key) is served and served.state == "READY"

    def all(self) -> list[ServedModel]:
        with self._lock:
            return sorted(self._models.values(), key=lambda m: m.key)

    def wait_ready(self, name: str, timeout: float = 600.0) -> ServedModel:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            served = self.get(name)
            if served is not None and served.state != "LOADING":
                return served
            time.sleep(0.05)
        raise TimeoutError(f"model {name!r} not ready within {timeout:.0f} s")

    def close(self) -> None:
        self._warm_pool.shutdown(wait=False, cancel_futures=True)
        self._pool.shutdown(wait=False, cancel_futures=True)
