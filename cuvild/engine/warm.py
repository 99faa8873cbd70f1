"""The load record: a restart serves a model again without deriving anything.

A load derives a plan, a split, each part's runtime and precision (by compiling and timing
candidates), an arena layout and torch eager's outputs on the check inputs. The record keeps
all of it, in the compile cache (`loads/<key>/`), so a restart reads one JSON file, has each
worker load its parts' cached executables (a `Restore` order: no archive, no split, nothing
compiled or timed), and checks the model once end to end against the recorded eager outputs.

The key holds everything the derivation depended on: the archive's digest, its input specs,
the objective, the precision policy, the devices (kind, name, features, cores, runtimes) and
the software (cuvild, torch). Another of any of them is another key, so a stale record is
never read; a runtime's version is held by the part's cache entry (a new version finds none).
A record that does not read, an executable that does not load, or a check that no longer
holds (outputs off from the record) sends the load down the cold path, which writes a fresh
record. Dynamic-shape models (built per bucket on first use) and parts that run on torch
itself (nothing cached to load) are not recorded: they take the cold path.
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

from cuvild.engine import precision
from cuvild.engine.errors import InferError
from cuvild.engine.layout import Slot, input_table
from cuvild.engine.loaded import LoadedModel, Route, cut_bytes
from cuvild.engine.orders import Built, Reply, Restore, Variant

if TYPE_CHECKING:
    from collections.abc import Iterable

    from cuvild.engine.precision import PrecisionPolicy
    from partitioner.profile import DeviceProfile

log = logging.getLogger(__name__)
FORMAT = 1
RECORD, EXPECTED = "record.json", "expected.npz"


class Stale(RuntimeError):
    """The record cannot serve this load; the cold path runs instead."""


def key(archive: str, input_specs: list[dict[str, Any]], objective: str,
        policy: PrecisionPolicy, devices: Iterable[DeviceProfile],
        runtimes: dict[str, list[str]]) -> str:
    from importlib.metadata import version

    what = {"format": FORMAT, "archive": Path(archive).name, "inputs": input_specs,
            "objective": objective, "policy": asdict(policy) | {"calibration": ""},
            "devices": sorted((d.id, d.kind, d.name, sorted(d.features), len(d.cores),
                               d.emulated, sorted(d.runtimes)) for d in devices),
            "runtimes": runtimes,  # engine.runtimes: what a part could be built with
            "software": [version("cuvild"), version("torch")]}  # (torch not imported)
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]


def directory(cache_dir: Path, record_key: str) -> Path:
    return cache_dir / "loads" / record_key


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
    return (not model.dynamic and model.accuracy is not None
            and all(r.variants.get(r.precision) and r.variants[r.precision].part_key
                    and r.runtime != "torch" for r in model.routes))


def write(where: Path, model: LoadedModel, expected: list[list[Any]]) -> None:
    """Record what the load derived (written to a temporary directory, then renamed)."""
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
              "routes": routes, "accuracy": model.accuracy.to_dict()}
    tmp = where.with_name(f".tmp-{where.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        np.savez(tmp / EXPECTED, **{f"o{i}_{j}": t.numpy() for i, outs in enumerate(expected)
                                    for j, t in enumerate(outs)})
        (tmp / RECORD).write_text(json.dumps(record, indent=1))
        shutil.rmtree(where, ignore_errors=True)
        tmp.rename(where)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def drop(where: Path) -> None:
    shutil.rmtree(where, ignore_errors=True)


def restore(engine: Any, where: Path, record: dict[str, Any], key_: str, name: str,
            version: str, archive: str, input_specs: list[dict[str, Any]],
            policy: PrecisionPolicy) -> LoadedModel:
    """The model as the record has it, its parts loaded from the cache and checked end to
    end; Stale when any of that fails."""
    from partitioner.plan import Plan

    try:
        plan = Plan.from_dict(record["plan"])
        slots = {n: Slot(d, tuple(s), o) for n, (d, s, o) in record["slots"].items()}
        routes = [Route(r["id"], r["device"], r["precision"], list(r["inputs"]),
                        list(r["outputs"]), runtime=r["runtime"],
                        precisions=[r["precision"]],
                        variants={r["precision"]: Variant(**r["variant"])})
                  for r in record["routes"]]
        candidates = {r["id"]: r.get("candidates", []) for r in record["routes"]}
        accuracy = precision.Accuracy.from_dict(record["accuracy"])
        model = LoadedModel(key_, name, version, plan, routes, list(record["inputs"]),
                            list(record["outputs"]), input_table(input_specs, []), slots,
                            int(record["footprint"]), int(record["total_bytes"]), archive,
                            input_specs)
    except (KeyError, TypeError, ValueError) as e:
        raise Stale(f"the load record does not match this version ({e!r})") from None
    for route in routes:
        if route.device not in engine.devices:
            raise Stale(f"part {route.id} ran on {route.device}, which is gone")
        model.parts_by_device.setdefault(route.device, []).append(route.id)
        route.built = Built(route.runtime, True, candidates[route.id],
                            list(route.variants.values()))
    model.cut_bytes, model.policy, model.accuracy = cut_bytes(model), policy, accuracy
    model.warm = True
    engine.models[key_] = model  # (served only once the manager marks it READY)
    try:
        load_parts(engine, model)
        _check(engine, model, where, policy)
    except BaseException:
        engine.unload(key_)
        raise
    return model


def load_parts(engine: Any, model: LoadedModel, only_device: str | None = None) -> None:
    """Have the workers load the model's parts from the cache (Stale if one cannot)."""
    futures: list[tuple[Route, Future[Reply]]] = []
    for route in model.routes:
        if only_device and route.device != only_device:
            continue
        variant = route.variants[route.precision]
        shapes = [(model.slots[n].dtype, model.slots[n].shape) for n in route.inputs]
        futures.append((route, engine.worker(route.device).call(Restore(
            model.key, route.id, route.runtime, variant.part_key, route.precision, shapes))))
    deadline = time.monotonic() + engine.build_timeout_s
    for route, future in futures:
        try:
            reply = future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            raise Stale(f"part {route.id}: no reply from {route.device}'s worker") from None
        except Exception as e:  # noqa: BLE001 - the worker died: the cold path tries again
            raise Stale(f"part {route.id}: {e}") from None
        if not reply.ok:
            raise Stale(f"part {route.id} on {route.device}: {reply.error}")
        engine.counters["restored"] += 1


def _check(engine: Any, model: LoadedModel, where: Path, policy: PrecisionPolicy) -> None:
    """Run the model on the check inputs: its outputs must still match torch eager's, as
    recorded, within what the load measured (twice that, at least 1e-5, at most the budget)."""
    import numpy as np
    import torch

    try:
        with np.load(where / EXPECTED, allow_pickle=False) as data:
            expected = [[torch.from_numpy(data[f"o{i}_{j}"]) for j in range(len(model.outputs))]
                        for i in range(len(data.files) // max(len(model.outputs), 1))]
    except (OSError, ValueError, KeyError) as e:
        raise Stale(f"the recorded outputs do not read ({e})") from None
    inputs = precision.check_inputs(model, policy)
    if len(inputs) != len(expected):
        raise Stale("the record's check inputs changed")
    try:
        now = precision.check(engine, model, inputs, expected)
    except InferError as e:
        raise Stale(f"the restored parts do not run: {e}") from None
    recorded = model.accuracy.chosen.error if model.accuracy.chosen else 0.0
    bound = max(2 * recorded, 1e-5)
    if model.accuracy.max_error is not None:
        bound = min(bound, model.accuracy.max_error)
    if not now.error <= bound:
        raise Stale(f"outputs measure {now.error:.1e} from torch eager now, {recorded:.1e} "
                    "when recorded")
    model.accuracy.chosen = now
