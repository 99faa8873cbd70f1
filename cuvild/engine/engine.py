"""The engine: a plan becomes a served model.

Control path (`prepare`, once per model): load the archive safely, plan it on the measured
devices, split it, lay out every crossing tensor in one arena block per request (tensors whose
lifetimes do not overlap share bytes), and have each device's worker build its parts.

Data path (`infer`): take a block, put the inputs in it, dispatch each part to its worker as
soon as its inputs are ready (independent parts run at once; requests in flight pipeline
across devices), read the outputs, give the block back. No planning, compiling or file I/O.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cuvild.engine.arena import Arena, Block, plan_offsets
from cuvild.engine.worker import RawTensor, TensorRef, WorkerDied, WorkerHandle, nbytes
from partitioner.profile import DeviceProfile

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class InferError(RuntimeError):
    """A request failed; the message names the part, the device and the cause."""


class BadInput(ValueError):
    """A request's inputs do not match the model (name, count, dtype or shape)."""


@dataclass
class Slot:
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0

    @property
    def nbytes(self) -> int:
        return nbytes(self.dtype, self.shape)


@dataclass
class Route:
    id: str
    device: str
    precision: str
    inputs: list[str]
    outputs: list[str]
    runtime: str = ""
    build: dict[str, Any] = field(default_factory=dict)
    measured_ms: list[float] = field(default_factory=list)


@dataclass
class LoadedModel:
    key: str
    name: str
    version: str
    plan: Any  # partitioner.plan.Plan
    routes: list[Route]
    inputs: list[str]
    outputs: list[str]
    slots: dict[str, Slot]
    footprint: int  # bytes per request: the peak of live tensors
    total_bytes: int  # what the same tensors would take without sharing
    archive: str = ""
    input_specs: list[dict[str, Any]] = field(default_factory=list)
    parts_by_device: dict[str, list[str]] = field(default_factory=dict)
    # Dynamic shapes: (input index, dim, low, high) per symbolic input dim; the split is kept
    # to lay out and build one variant per concrete shape (bucket) on first use.
    dynamic: list[tuple[int, int, int, int]] = field(default_factory=list)
    split: Any = None
    variants: dict[tuple, LoadedModel] = field(default_factory=dict)
    base_key: str = ""
    part_input_shapes: dict[str, list[list[int]]] = field(default_factory=dict)


def _slot(val: Any) -> Slot:
    import torch

    if not isinstance(val, torch.Tensor):
        raise ValueError(f"a value crossing parts is not a tensor ({type(val).__name__})")
    if any(not isinstance(d, int) for d in val.shape):
        raise ValueError("dynamic shapes are not served yet; export with static shapes")
    return Slot(str(val.dtype).removeprefix("torch."), tuple(int(d) for d in val.shape))


def dynamic_dims(ep: Any) -> list[tuple[int, int, int, int]]:
    """(input index, dim, low, high) for every symbolic dimension of the user inputs."""
    nodes = {n.name: n for n in ep.graph.nodes}
    ranges = {str(sym): r for sym, r in ep.range_constraints.items()}
    out = []
    for i, name in enumerate(ep.graph_signature.user_inputs):
        val = nodes[name].meta.get("val")
        for d, size in enumerate(getattr(val, "shape", ())):
            if isinstance(size, int):
                continue
            r = ranges.get(str(size.node.expr))
            low = int(r.lower) if r is not None and r.lower.is_finite else 0
            high = int(r.upper) if r is not None and r.upper.is_finite else 2**62
            out.append((i, d, low, high))
    return out


def layout(meta: dict[str, Any], split: Any) -> tuple[dict[str, Slot], int, int]:
    """Offsets for every tensor crossing a part boundary, from their lifetimes. `meta` maps
    value names to tensors (or fake tensors) with concrete shapes."""
    slots: dict[str, Slot] = {}
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for name in split.inputs:
        slots[name], first[name], last[name] = _slot(meta[name]), 0, 0
    for step, part in enumerate(split.parts, start=1):
        for name in part.inputs:
            last[name] = max(last.get(name, step), step)
        for name in part.outputs:
            slots[name], first[name], last[name] = _slot(meta[name]), step, step
    for name in split.outputs:
        last[name] = len(split.parts) + 1  # read back after the last part
    sizes = {n: s.nbytes for n, s in slots.items()}
    offsets, footprint = plan_offsets(sizes, {n: (first[n], last[n]) for n in slots})
    for name, off in offsets.items():
        slots[name].offset = off
    return slots, footprint, sum(sizes.values())


class Engine:
    def __init__(self, devices: Sequence[DeviceProfile], cache_dir: Path, arena: Arena,
                 in_process: bool = False, max_in_flight: int = 4,
                 build_timeout_s: float = 600.0, compile_timeout_s: float = 300.0) -> None:
        self.devices = {d.id: d for d in devices}
        self.cache_dir = cache_dir
        self.arena = arena
        self.in_process = in_process
        self.workers: dict[str, WorkerHandle] = {}
        self.models: dict[str, LoadedModel] = {}
        self._in_flight = threading.BoundedSemaphore(max_in_flight)
        self._active = 0  # requests inside infer(): alone, a part's reply is read directly
        self._active_lock = threading.Lock()
        self._restart_lock = threading.Lock()
        self._usable: dict[str, threading.Event] = {}  # cleared while a worker is revived
        self.build_timeout_s = build_timeout_s
        self.compile_timeout_s = compile_timeout_s

    def support(self) -> dict[str, Any]:
        """Per device, whether one of its runtimes can run a node: ops no runtime of a device
        supports cost infinity there, so the planner places them elsewhere and says why."""
        from runtimes import registry
        from runtimes.base import RuntimeUnavailable
        from runtimes.select import candidates_for

        out: dict[str, Any] = {}
        for dev in self.devices.values():
            usable = []
            for name in candidates_for(dev, "fp32", "auto"):
                try:
                    usable.append(registry.get(name))
                except RuntimeUnavailable:
                    continue

            def supported(cnode: Any, runtimes: list[Any] = usable) -> bool:
                node = getattr(cnode, "fx_node", None)
                return node is None or any(rt.supports(node) for rt in runtimes)

            out[dev.id] = supported
        return out

    def worker(self, device_id: str) -> WorkerHandle:
        if device_id not in self.workers:
            self._usable[device_id] = threading.Event()
            self._usable[device_id].set()
            self.workers[device_id] = WorkerHandle(self.devices[device_id], self.cache_dir,
                                                   in_process=self.in_process)
        return self.workers[device_id]

    # -- control path ----------------------------------------------------------------------
    def prepare(self, key: str, name: str, version: str, archive: Path,
                input_specs: list[dict[str, Any]], objective: str = "latency",
                plan: Any = None) -> LoadedModel:
        """Plan, split, lay out and build a registered model; returns it ready to serve."""
        from cuvild.intake.safe_load import load_exported_program
        from partitioner.plan import plan_model
        from partitioner.split import split_program

        ep = load_exported_program(archive)
        if plan is None:
            plan = plan_model(ep, list(self.devices.values()), objective=objective,
                              support=self.support())
        assignment = [(p.id, p.nodes) for p in plan.parts]
        split = split_program(ep, assignment)
        dynamic = dynamic_dims(ep)
        if dynamic:  # laid out and built per concrete shape, on first use
            slots, footprint, total = {}, 0, 0
        else:
            slots, footprint, total = layout({n.name: n.meta.get("val") for n in ep.graph.nodes},
                                             split)
        model = LoadedModel(key, name, version, plan, self._routes(plan, split),
                            list(split.inputs), list(split.outputs), slots, footprint, total,
                            str(archive), input_specs, dynamic=dynamic,
                            split=split if dynamic else None)
        for route in model.routes:
            model.parts_by_device.setdefault(route.device, []).append(route.id)
        del ep, split  # workers hold the parts; the daemon keeps only the wiring
        if dynamic:
            self.models[key] = model
            return model
        self._build(model)
        routes = model.routes
        for part in plan.parts:  # the plan records what each part really runs on
            route = next((r for r in routes if r.id == part.id), None)
            if route is not None:
                part.runtime = route.runtime
        self.models[key] = model
        return model

    @staticmethod
    def _routes(plan: Any, split: Any) -> list[Route]:
        by_id = {p.id: p for p in plan.parts}
        return [Route(p.id, by_id[p.id].device, by_id[p.id].precision, p.inputs, p.outputs)
                for p in split.parts]

    def _variant(self, model: LoadedModel, shapes: tuple) -> LoadedModel:
        """The model laid out and built for one concrete input shape (a bucket)."""
        import torch

        with self._restart_lock:
            variant = model.variants.get(shapes)
            if variant is not None:
                return variant
            dtypes = [getattr(torch, s["dtype"]) for s in model.input_specs]
            with torch.no_grad():
                values = model.split.trace(*[torch.zeros(shape, dtype=dt)
                                             for shape, dt in zip(shapes, dtypes, strict=True)])
            slots, footprint, total = layout(values, model.split)
            tag = "x".join("-".join(map(str, shape)) for shape in shapes)
            specs = [{**s, "shape": list(shape)}
                     for s, shape in zip(model.input_specs, shapes, strict=True)]
            variant = LoadedModel(f"{model.key}@{tag}", model.name, model.version, model.plan,
                                  self._routes(model.plan, model.split), model.inputs,
                                  model.outputs, slots, footprint, total, model.archive, specs,
                                  parts_by_device=model.parts_by_device, base_key=model.key)
            variant.part_input_shapes = {
                p.id: [list(values[n].shape) for n in p.inputs] for p in model.split.parts}
            log.info("building %s for input shapes %s", model.key, [list(s) for s in shapes])
            self._build(variant)
            model.variants[shapes] = variant
            self.models[variant.key] = variant
            return variant

    def resolve(self, key: str, inputs: Sequence[Any]) -> LoadedModel:
        """The model, or for a dynamic-shape model its variant for these inputs' shapes."""
        model = self.models[key]
        if model.dynamic:
            model = self._variant(model, self.check_ranges(model, inputs))
        return model

    def check_ranges(self, model: LoadedModel, inputs: Sequence[Any]) -> tuple:
        """Concrete input shapes, after checking every dynamic dim against its range."""
        if len(inputs) != len(model.inputs):
            raise BadInput(f"model {model.name} takes {len(model.inputs)} inputs "
                           f"({', '.join(model.inputs)}), got {len(inputs)}")
        shapes = tuple(tuple(int(d) for d in t.shape) for t in inputs)
        for i, spec in enumerate(model.input_specs):
            if len(shapes[i]) != len(spec["shape"]):
                raise BadInput(f"input {model.inputs[i]}: expected {len(spec['shape'])} dims, "
                               f"got {len(shapes[i])}")
            for d, want in enumerate(spec["shape"]):
                if want >= 0 and shapes[i][d] != want:
                    raise BadInput(f"input {model.inputs[i]}: dim {d} must be {want}, got "
                                   f"{shapes[i][d]}")
        for i, d, low, high in model.dynamic:
            if not low <= shapes[i][d] <= high:
                raise BadInput(f"input {model.inputs[i]}: dim {d} is {shapes[i][d]}, outside "
                               f"the exported range [{low}, {high}]")
        return shapes

    def _build(self, model: LoadedModel, only_device: str | None = None) -> None:
        assignment = [(p.id, p.nodes) for p in model.plan.parts]
        futures: list[tuple[Route, Future[dict[str, Any]]]] = []
        for device, part_ids in model.parts_by_device.items():
            if only_device and device != only_device:
                continue
            for i, pid in enumerate(part_ids):
                route = next(r for r in model.routes if r.id == pid)
                futures.append((route, self.worker(device).call(
                    "build", model=model.key, archive=model.archive, parts=assignment,
                    part=pid, precision=route.precision, input_specs=model.input_specs,
                    timeout_s=self.compile_timeout_s, split_key=model.base_key or model.key,
                    input_shapes=model.part_input_shapes.get(pid),
                    last=not model.base_key and i == len(part_ids) - 1)))
        for route, future in futures:
            reply = future.result(timeout=self.build_timeout_s)
            if not reply["ok"]:
                raise InferError(f"building part {route.id} for {route.device} failed: "
                                 f"{reply['error']}")
            route.runtime, route.build = reply["runtime"], reply

    def unload(self, key: str) -> None:
        model = self.models.pop(key, None)
        if model is None:
            return
        for variant in model.variants.values():
            self.unload(variant.key)
        for device in model.parts_by_device:
            if device in self.workers:
                self.workers[device].call("unload", model=key)

    def forget_segments(self, segments: list[tuple[str, int]]) -> None:
        """Have every worker unmap these client objects (name, inode); no reply awaited."""
        if segments:
            for worker in list(self.workers.values()):
                worker.call("forget", segments=segments)

    def close(self) -> None:
        for worker in self.workers.values():
            worker.stop()
        self.workers.clear()

    # -- data path -------------------------------------------------------------------------
    def _ref(self, block: Block, slot: Slot) -> TensorRef:
        return TensorRef(block.segment, block.offset + slot.offset, slot.dtype, slot.shape)

    def _view(self, block: Block, slot: Slot) -> torch.Tensor:
        import torch

        seg = self.arena.segments[block.segment]
        if slot.nbytes == 0:
            return torch.empty(slot.shape, dtype=getattr(torch, slot.dtype))
        raw = seg.view(block.offset + slot.offset, slot.nbytes)
        return torch.frombuffer(raw, dtype=getattr(torch, slot.dtype)).view(slot.shape)

    def check_inputs(self, model: LoadedModel, inputs: Sequence[Any]) -> None:
        if len(inputs) != len(model.inputs):
            raise BadInput(f"model {model.name} takes {len(model.inputs)} inputs "
                           f"({', '.join(model.inputs)}), got {len(inputs)}")
        for name, t in zip(model.inputs, inputs, strict=True):
            slot = model.slots[name]
            dtype = (t.dtype if isinstance(t, (TensorRef, RawTensor))
                     else str(t.dtype).removeprefix("torch."))
            if dtype != slot.dtype:
                raise BadInput(f"input {name}: expected dtype {slot.dtype}, got {dtype}")
            if tuple(t.shape) != slot.shape:
                raise BadInput(f"input {name}: expected shape {list(slot.shape)}, got "
                               f"{list(t.shape)}")
            if isinstance(t, RawTensor) and len(t.data) != slot.nbytes:
                raise BadInput(f"input {name}: {len(t.data)} bytes, expected {slot.nbytes}")

    def infer(self, key: str, inputs: Sequence[torch.Tensor | TensorRef | RawTensor],
              output_refs: dict[str, TensorRef] | None = None,
              raw: bool = False) -> list[torch.Tensor | bytes | None]:
        """Run one request. Inputs are tensors or raw bytes (copied into the arena) or
        references into shared memory (read in place by the first part); outputs named in
        output_refs are written in place there (None is returned for them), the rest come
        back as fresh host tensors, or with raw=True as bytes (the block is reused at once)."""
        model = self.resolve(key, inputs)
        self.check_inputs(model, inputs)
        output_refs = output_refs or {}
        with self._in_flight, self._counted():
            block = self.arena.alloc(model.footprint)
            try:
                refs = dict(output_refs)
                for name, value in zip(model.inputs, inputs, strict=True):
                    if isinstance(value, TensorRef):
                        refs[name] = value
                    elif isinstance(value, RawTensor):
                        self._bytes(block, model.slots[name])[:] = value.data
                    else:
                        self._view(block, model.slots[name]).copy_(value)
                self._run_parts(model, block, refs)
                if raw:
                    return [None if n in output_refs else bytes(self._bytes(block, model.slots[n]))
                            for n in model.outputs]
                return [None if n in output_refs else self._view(block, model.slots[n]).clone()
                        for n in model.outputs]
            finally:
                self.arena.free(block)

    @contextlib.contextmanager
    def _counted(self) -> Iterator[None]:
        with self._active_lock:
            self._active += 1
        try:
            yield
        finally:
            with self._active_lock:
                self._active -= 1

    def _bytes(self, block: Block, slot: Slot) -> memoryview:
        return self.arena.segments[block.segment].view(block.offset + slot.offset, slot.nbytes)

    def _run_parts(self, model: LoadedModel, block: Block, refs: dict[str, TensorRef]) -> None:
        def ref(name: str) -> TensorRef:
            return refs.get(name) or self._ref(block, model.slots[name])

        ready = set(model.inputs)
        waiting = list(model.routes)
        running: dict[Future[dict[str, Any]], Route] = {}
        failure: str | None = None
        dead: set[str] = set()

        def finish(route: Route, reply: dict[str, Any] | WorkerDied) -> str | None:
            if isinstance(reply, WorkerDied):
                dead.add(route.device)
                return f"part {route.id} on {route.device} ({route.runtime}) failed: {reply}"
            if not reply["ok"]:
                return (f"part {route.id} on {route.device} ({route.runtime}) failed: "
                        f"{reply['error']}")
            route.measured_ms.append(reply["run_ms"])
            del route.measured_ms[:-100]
            ready.update(route.outputs)
            return None

        def start(route: Route) -> tuple[WorkerHandle, dict[str, Any]]:
            waiting.remove(route)
            self._usable[route.device].wait(self.build_timeout_s)
            return self.worker(route.device), dict(
                model=model.key, part=route.id, inputs=[ref(n) for n in route.inputs],
                outputs=[ref(n) for n in route.outputs])

        while waiting or running:
            startable = ([r for r in waiting if all(i in ready for i in r.inputs)]
                         if failure is None else [])
            if len(startable) == 1 and not running and self._active == 1:
                # Nothing to overlap with: call and read the reply in this thread. (With
                # other requests in flight, queueing in the worker's pipe keeps it busy.)
                worker, fields = start(startable[0])
                try:
                    reply: dict[str, Any] | WorkerDied = worker.run(**fields)
                except WorkerDied as e:
                    reply = e
                failure = finish(startable[0], reply)
                continue
            for route in startable:
                worker, fields = start(route)
                running[worker.call("run", **fields)] = route
            if not running:
                break
            done, _ = wait(list(running), return_when=FIRST_COMPLETED)
            for future in done:
                route = running.pop(future)
                try:
                    reply = future.result()
                except WorkerDied as e:
                    reply = e
                failure = failure or finish(route, reply)
        for device in dead:
            threading.Thread(target=self._revive, args=(device,), daemon=True).start()
        if failure:
            raise InferError(failure)

    def _revive(self, device: str) -> None:
        """Restart a dead worker and rebuild its parts from the compile cache."""
        with self._restart_lock:
            worker = self.workers[device]
            if worker.alive():
                return
            log.error("worker for %s died; restarting it", device)
            self._usable[device].clear()
            t0 = time.perf_counter()
            try:
                worker.restart()
                for model in list(self.models.values()):
                    if device in model.parts_by_device:
                        self._build(model, only_device=device)
                log.info("worker for %s back in %.2f s", device, time.perf_counter() - t0)
            finally:
                self._usable[device].set()

    def stats(self, key: str) -> dict[str, Any]:
        """Predicted vs measured time per part (the profile feedback)."""
        model = self.models[key]
        predicted = {p.id: p.predicted_ms for p in model.plan.parts}
        out = {}
        for r in model.routes:
            ms = sorted(r.measured_ms)
            out[r.id] = {"device": r.device, "runtime": r.runtime,
                         "predicted_ms": predicted.get(r.id, 0.0),
                         "measured_ms": ms[len(ms) // 2] if ms else None,
                         "candidates": r.build.get("candidates", [])}
        return out
