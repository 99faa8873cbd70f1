"""The load record: a restart serves a model again without deriving anything.

A load derives a plan, a split, each part's runtime and precision (by compiling and timing
candidates), an arena layout and torch eager's outputs on the check inputs. The record keeps
all of it, in the compile cache (`loads/<key>/`), so a restart reads one JSON file, has each
worker load its parts' cached executables (a `Restore` order: no archive, no split, nothing
compiled or timed), and checks the model once end to end against the recorded eager outputs
on the recorded check inputs. None of it imports torch: in the daemon, nor in a worker whose
parts run on OpenVINO or ONNX Runtime (cuvild/core/views.py).

The key holds everything the derivation depended on: the archive's digest, its input specs,
the objective, the precision policy, the devices (kind, name, features, cores, runtimes) and
the software (cuvild, torch). Another of any of them is another key, so a stale record is
never read; a runtime's version is held by the part's cache entry (a new version finds none).
A record that does not read, an executable that does not load, or a check that no longer
holds (outputs off from the record) sends the load down the cold path, which writes a fresh
record. Parts that run on torch itself (nothing cached to load) are not recorded: their
models take the cold path.

A dynamic-shape model has a record of its own (its plan, wiring, dynamic dimensions and
whether its rows can be batched: what it serves with before any bucket), and each bucket,
once built, a record under it (`buckets/<shapes>/`, as a static model's, checked the same
way on its first use after a restart; cuvild/load/buckets.py). So a restart serves a
dynamic model, and every bucket it had built, with nothing planned, split or compiled; only
a bucket of new shapes reads the archive (torch) and builds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cuvild.core.dtypes import NUMPY
from cuvild.core.errors import InferError
from cuvild.core.layout import Slot, input_table
from cuvild.core.loaded import Family, LoadedModel, Route, State, cut_bytes
from cuvild.core.precision import Accuracy
from cuvild.load.builder import Builder
from cuvild.run import batching
from cuvild.workers.handle import WorkerDied
from protos.orders import Built, RawTensor, Reply, Restore, Unload, Variant
from runtimes.base import fsync_dir, remove_leftovers, set_error, write_atomic

if TYPE_CHECKING:
    from collections.abc import Iterable

    from cuvild.core.precision import PrecisionPolicy
    from cuvild.workers.handle import WorkerHandle
    from partitioner.profile import DeviceProfile

log = logging.getLogger(__name__)
FORMAT = 1
RECORD, EXPECTED = "record.json", "check.npz"  # the check inputs and eager's outputs
BUCKETS = "buckets"  # a dynamic-shape model's record holds its buckets' records


class Stale(RuntimeError):
    """The record cannot serve this load; the cold path runs instead."""


def key(archive: str, input_specs: list[dict[str, Any]], objective: str,
        policy: PrecisionPolicy, devices: Iterable[DeviceProfile],
        runtimes: dict[str, list[str]]) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        own = version("cuvild")
    except PackageNotFoundError:  # run from a checkout that is not installed (tests/gpu)
        own = "checkout"
    what = {"format": FORMAT, "archive": Path(archive).name, "inputs": input_specs,
            "objective": objective, "policy": asdict(policy) | {"calibration": ""},
            "devices": sorted((d.id, d.kind, d.name, sorted(d.features), len(d.cores),
                               d.emulated, sorted(d.runtimes)) for d in devices),
            "runtimes": runtimes,  # the builder's runtimes: what a part could be built with
            "software": [own, version("torch")]}  # (torch not imported)
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]


def directory(cache_dir: Path, record_key: str) -> Path:
    return cache_dir / "loads" / record_key


def clean(cache_dir: Path) -> int:
    """Remove what a crash mid-write left of load records (`.tmp-*`, older than an hour:
    a daemon sharing the cache may be writing a young one)."""
    removed = remove_leftovers(cache_dir / "loads", ".tmp-*", "*/.tmp-*",
                               f"*/{BUCKETS}/.tmp-*")
    if removed:
        log.info("removed %d temporary file(s) a crash left among the load records", removed)
    return removed


def read(where: Path) -> dict[str, Any] | None:
    """The record at `where`, or None (none, or unreadable: then it is rebuilt)."""
    try:
        record = json.loads((where / RECORD).read_text())
        if record.get("format") != FORMAT:
            return None
        return record
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("load record %s does not read (%s); building the model again", where, e)
        return None


def devices_of(record: dict[str, Any]) -> set[str]:
    return {r["device"] for r in record.get("routes", [])}


def recordable(model: LoadedModel) -> bool:
    """Static shapes, inputs and outputs numpy can hold (the check runs without torch), and
    every part on a runtime that caches its builds."""
    return (not model.dynamic and model.accuracy is not None
            and all(model.slots[n].dtype in NUMPY for n in model.inputs + model.outputs)
            and all(r.variants.get(r.precision) and r.variants[r.precision].part_key
                    and r.runtime != "torch" for r in model.routes))


def write(where: Path, model: LoadedModel, inputs: list[list[Any]],
          expected: list[list[Any]]) -> None:
    """Record what the load derived: its files written and synced in a temporary directory,
    which then replaces the record (a crash leaves the old record, none, or the new one; a
    temporary left behind is removed by `clean`)."""
    import io

    import numpy as np

    if not recordable(model):
        return
    routes = []
    for r in model.routes:
        v = r.variants[r.precision]
        routes.append({"id": r.id, "device": r.device, "precision": r.precision,
                       "inputs": r.inputs, "outputs": r.outputs, "runtime": r.runtime,
                       "variant": asdict(v),
                       "candidates": r.built.candidates if r.built else []})
    record = {"format": FORMAT, "written_at": time.time(), "plan": model.plan.to_dict(),
              "inputs": model.inputs, "outputs": model.outputs,
              "slots": {n: [s.dtype, list(s.shape), s.offset] for n, s in model.slots.items()},
              "footprint": model.footprint, "total_bytes": model.total_bytes,
              "routes": routes, "accuracy": model.accuracy.to_dict(),
              "state": asdict(model.state) if model.state else None}
    tmp = where.with_name(f".tmp-{where.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        arrays = {f"i{i}_{j}": t.numpy() for i, xs in enumerate(inputs)
                  for j, t in enumerate(xs)}
        arrays |= {f"o{i}_{j}": t.numpy() for i, ys in enumerate(expected)
                   for j, t in enumerate(ys)}
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        write_atomic(tmp / EXPECTED, buf.getvalue())
        write_atomic(tmp / RECORD, json.dumps(record, indent=1).encode())
        shutil.rmtree(where, ignore_errors=True)
        tmp.rename(where)
        fsync_dir(where.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_dynamic(where: Path, model: LoadedModel) -> None:
    """A dynamic-shape model's record (its buckets' go under it as they are built)."""
    record = {"format": FORMAT, "written_at": time.time(), "plan": model.plan.to_dict(),
              "dynamic": [list(d) for d in model.dynamic],
              "replans": bool(model.family and model.family.replans),
              "inputs": model.inputs, "outputs": model.outputs,
              "routes": [{"id": r.id, "device": r.device, "precision": r.precision,
                          "inputs": r.inputs, "outputs": r.outputs} for r in model.routes],
              # whether its rows can be batched: "" yes, else why not; None: never asked
              "rows": model.unbatched if model.batcher or model.unbatched else None,
              "state": asdict(model.state) if model.state else None}
    try:
        write_atomic(where / RECORD, json.dumps(record, indent=1).encode())
    except OSError as e:
        log.warning("model %s: load record not written (%s)", model.key, e)


def restore(builder: Builder, where: Path, record: dict[str, Any], key_: str, name: str,
            version: str, archive: str, input_specs: list[dict[str, Any]],
            policy: PrecisionPolicy, objective: str = "latency",
            settings: batching.Batching | None = None) -> LoadedModel:
    """The model as the record has it, its parts loaded from the cache and checked end to
    end; Stale when any of that fails. A dynamic-shape model is served at once (its
    buckets are restored or built on first use, buckets.py)."""
    from partitioner.plan import Plan

    try:
        plan = Plan.from_dict(record["plan"])
        if "dynamic" in record:
            dynamic = [(int(i), int(d), int(lo), int(hi)) for i, d, lo, hi in record["dynamic"]]
            model = LoadedModel(key_, name, version, plan, [
                Route(r["id"], r["device"], r["precision"], list(r["inputs"]),
                      list(r["outputs"])) for r in record["routes"]],
                list(record["inputs"]), list(record["outputs"]),
                input_table(input_specs, dynamic), {}, 0, 0, archive, input_specs,
                objective=objective, family=Family(dynamic, replans=bool(record["replans"])))
            rows = record["rows"]
            model.state = State(**record["state"]) if record.get("state") else None
        else:
            slots = {n: Slot(d, tuple(s), o) for n, (d, s, o) in record["slots"].items()}
            model = LoadedModel(key_, name, version, plan, [_route(r) for r in record["routes"]],
                                list(record["inputs"]), list(record["outputs"]),
                                input_table(input_specs, []), slots, int(record["footprint"]),
                                int(record["total_bytes"]), archive, input_specs)
            model.accuracy = Accuracy.from_dict(record["accuracy"])
            model.state = State(**record["state"]) if record.get("state") else None
    except (KeyError, TypeError, ValueError) as e:
        raise Stale(f"the load record does not match this version ({e!r})") from None
    for route in model.routes:
        if route.device not in builder.devices:
            raise Stale(f"part {route.id} ran on {route.device}, which is gone")
        model.parts_by_device.setdefault(route.device, []).append(route.id)
    model.cut_bytes, model.policy, model.warm = cut_bytes(model), policy, True
    if model.family:
        if settings is not None and settings.max_batch > 1:
            if rows is None:
                raise Stale("whether its rows can be batched was never checked")
            batching.settle(model, rows, settings, builder.runner)
        model.family.record_at = where  # (its buckets' records are under it)
        builder.publish(model)
        return model
    try:
        load_parts(builder, model)
        _check(builder, model, where)
    except BaseException:
        builder.drop(model)
        raise
    builder.publish(model)  # (served only once the manager marks it READY)
    return model


def _route(r: dict[str, Any]) -> Route:
    """A part as a static model's record has it: built (its executable is in the cache)."""
    variant = Variant(**r["variant"])
    return Route(r["id"], r["device"], r["precision"], list(r["inputs"]), list(r["outputs"]),
                 runtime=r["runtime"], precisions=[r["precision"]],
                 variants={r["precision"]: variant},
                 built=Built(r["runtime"], True, r.get("candidates", []), [variant]))


def load_parts(builder: Builder, model: LoadedModel, only_device: str | None = None) -> bool:
    """Have the workers load the model's parts from the cache (Stale if one cannot)."""
    futures: list[tuple[Route, Future[Reply]]] = []
    for route in model.routes:
        if only_device and route.device != only_device:
            continue
        variant = route.variants[route.precision]
        shapes = [(model.slots[n].dtype, model.slots[n].shape) for n in route.inputs]
        worker = builder.workers.of(route.device)
        route.generation = worker.generation  # (the start that holds it: Builder.rebuild_lost)
        futures.append((route, worker.call(Restore(
            model.key, route.id, route.runtime, variant.part_key, route.precision, shapes))))
    deadline = time.monotonic() + builder.build_timeout_s
    for route, future in futures:
        try:
            reply = future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            raise Stale(f"part {route.id}: no reply from {route.device}'s worker") from None
        except WorkerDied as e:  # (a cached build whose load killed it: not loaded again,
            # runtimes/crashes.py) revived for the cold path, which builds on it
            builder.workers.revive_later(route.device)
            builder.workers.wait_usable(route.device, max(0.0, deadline - time.monotonic()))
            raise Stale(f"part {route.id}: {e}") from None
        except Exception as e:  # noqa: BLE001 - the cold path tries again
            raise Stale(f"part {route.id}: {e}") from None
        if not reply.ok:
            raise Stale(f"part {route.id} on {route.device}: {reply.error}")
        builder.counters["restored"] += 1
    return True


def _check(builder: Builder, model: LoadedModel, where: Path) -> None:
    """Run the model on the first recorded check input (bytes in, bytes out: no torch): its
    outputs must still match torch eager's, as recorded, read against the range of all the
    recorded outputs, within what the load measured on all of them (twice that, at least
    1e-5, at most the budget). One input tells a part that loads wrong (the load measured the
    rest), and a restart of a large model pays one run."""
    import numpy as np

    n_in, n_out = len(model.inputs), len(model.outputs)
    try:
        with np.load(where / EXPECTED, allow_pickle=False) as data:
            rows = len(data.files) // max(n_in + n_out, 1)
            inputs = [[data[f"i{i}_{j}"] for j in range(n_in)] for i in range(min(1, rows))]
            expected = [[data[f"o{i}_{j}"] for j in range(n_out)] for i in range(rows)]
    except (OSError, ValueError, KeyError) as e:
        raise Stale(f"the recorded check does not read ({e})") from None
    outputs, times = [], []
    try:
        for xs, want in zip(inputs, expected, strict=False):
            t0 = time.perf_counter()
            got = builder.runner.run_raw(
                model, [RawTensor(x.tobytes(), str(x.dtype), x.shape) for x in xs])
            times.append((time.perf_counter() - t0) * 1e3)
            outputs.append([np.frombuffer(g, w.dtype).reshape(w.shape)
                            for g, w in zip(got, want, strict=True)])
    except InferError as e:
        raise Stale(f"the restored parts do not run: {e}") from None
    # read against the range of all the recorded outputs, as the load's check was
    # (runtimes/base.py set_error): the rows not run count as exact
    now = set_error(outputs + expected[len(outputs):], expected) if outputs else 0.0
    recorded = model.accuracy.chosen.error if model.accuracy.chosen else 0.0
    bound = max(2 * recorded, 1e-5)
    if model.accuracy.max_error is not None:
        bound = min(bound, model.accuracy.max_error)
    if not now <= bound:
        raise Stale(f"outputs measure {now:.1e} from torch eager now, {recorded:.1e} when "
                    "recorded")
    log.debug("model %s: restored parts check out (error %.1e, %.2f ms)", model.key, now,
              times[0] if times else 0.0)



def revive(builder: Builder, device: str, worker: WorkerHandle) -> None:
    """Put a restarted worker's parts back (cuvild/workers/workers.py calls it): each served
    model's parts on `device` loaded from the cache as a load record would be, else built
    again. (A dynamic-shape model's own parts are never built: its buckets are.)"""
    for model in list(builder.runner.served.models.values()):
        if device not in model.parts_by_device or model.evicted or model.dynamic:
            continue
        try:
            cached = recordable(model) and load_parts(builder, model, only_device=device)
        except Stale as e:
            log.warning("model %s: %s; building its parts again", model.key, e)
            cached = False
        if not cached:
            builder.build(model, only_device=device)
        if model.evicted:  # evicted meanwhile: not kept there either
            worker.call(Unload(model.key))
