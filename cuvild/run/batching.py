"""Dynamic batching: concurrent requests to one model merged into one run, and split back.

A model is batched when its first input dimension is dynamic in every input and output (one
symbol: the batch) and a batch of rows gives each row what that row gives alone (checked once
at load on torch eager: `check`); its settings (`Batching`) come from its load or the daemon's
`engine.batching` key. Each request is queued with the bucket its own shapes resolved to; only
requests whose rows have the same shape and dtype merge.

Who runs a batch: no thread of its own. A queued request's thread becomes the leader when no
other leads and fewer batches of the model run than it has devices (one batch per pipeline
stage). The leader waits until the oldest queued request has waited `max_delay_us`, or the
rows queued reach `max_batch`, then takes the oldest requests that fit (first come, first
served), hands leadership on and runs them: inputs gathered into one buffer per input (client
regions read without mapping them: clientmem.py DaemonRegions), the model's bucket for the
merged shapes padded to the next power of two rows (`padded_rows`; built once, on first use:
cuvild/load/buckets.py), one run, and each request's rows scattered back (into its client
region where it named one). A request alone in a model
that is otherwise idle (no other request was in flight with it since the last batch began,
or none arrived and no batch ended within the delay before it) is not held back: it runs at
once as it would unbatched, with no copy (a lone client pays no delay).

Bounds: a request waits at most the batches ahead of it plus `max_delay_us` (when a batch
ends, the next one waits up to the delay for the callers just answered to send again, unless
it is full already; while fewer requests came since than it answered, up to the delay and
one run more: a closed loop of clients comes back within its round trip, which may be longer
than the delay); a request past its deadline leaves the queue with RunTimeout and takes
nobody with it. A request whose client region cannot be read or written fails alone. A batch
whose run fails is run again one request at a time, so that each request gets its own
answer, unless it timed out or its worker could not be brought back: then every request of
it gets the same error.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from cuvild.core.errors import BadRegion, InferError, RunTimeout, WorkerUnavailable
from cuvild.core.loaded import Batching, Out
from cuvild.core.views import as_bytes
from cuvild.workers.clientmem import RegionGone
from protos.orders import RawTensor, TensorRef

if TYPE_CHECKING:
    from cuvild.core.loaded import LoadedModel
    from cuvild.core.served import Timeline
    from cuvild.run.runner import Runner

log = logging.getLogger(__name__)




def padded_rows(rows: int, max_batch: int) -> int:
    """The rows of the bucket a merged batch of `rows` runs in: the next power of two, at
    most max_batch (and never fewer than `rows`), so a model builds log2(max_batch) + 1
    buckets, not one per size that happens to merge (a build is seconds on a CPU and tens
    of seconds for a GPU part). The padding rows repeat the last real row and their outputs
    are dropped: rows are independent (`check`)."""
    bucket = 1 << max(0, rows - 1).bit_length()
    return max(rows, min(bucket, max_batch))


def batcher_for(model: LoadedModel, ep: Any, settings: Batching, runner: Runner) -> None:
    """Give a dynamic-shape model its batcher, or say why it gets none (`model.unbatched`)."""
    low = min((lo for _, d, lo, _ in model.dynamic if d == 0), default=1)
    high = min((hi for _, d, _, hi in model.dynamic if d == 0), default=1)
    settle(model, batch_symbol(ep) or (
        f"its batch dimension's exported range ends at {high}" if high < 2 else
        check(ep, model.input_specs, low)), settings, runner)


def settle(model: LoadedModel, unbatched: str, settings: Batching, runner: Runner) -> None:
    """The batcher of a model whose rows can be batched (`unbatched` "": what the load
    checked, or its load record says), else the reason it is not."""
    model.unbatched = unbatched
    if unbatched:
        log.warning("model %s is not batched: %s", model.key, unbatched)
    else:  # no batch past the exported range; one batch in flight per pipeline stage
        high = min((hi for _, d, _, hi in model.dynamic if d == 0), default=1)
        settings = Batching(min(settings.max_batch, high), settings.max_delay_us)
        model.batcher = Batcher(model.key, settings, runner, len(model.parts_by_device))


def batch_symbol(ep: Any) -> str:
    """Why the exported program cannot be batched ("" when it can): the first dimension of
    every user input and output must be the same symbol."""
    nodes = {n.name: n for n in ep.graph.nodes}
    sig = ep.graph_signature
    output = next(n for n in ep.graph.nodes if n.op == "output")
    names = [(f"input {n}", nodes[n].meta.get("val")) for n in sig.user_inputs]
    names += [(f"output {i}", getattr(v, "meta", {}).get("val"))
              for i, v in enumerate(output.args[0][:len(sig.user_outputs)])]
    symbols = set()
    for what, val in names:
        shape = getattr(val, "shape", None)
        if not shape or isinstance(shape[0], int):
            return (f"{what} has no dynamic first dimension (export it with "
                    "dynamic_shapes={...: {0: torch.export.Dim('batch')}})")
        symbols.add(str(shape[0]))
    if len(symbols) > 1:
        return f"the inputs' and outputs' first dimensions differ ({', '.join(sorted(symbols))})"
    return ""


def check(ep: Any, specs: list[dict[str, Any]], low: int) -> str:
    """Why batching would change this model's results ("" when it would not): two rows run
    together on torch eager must each give what they give alone (a model that mixes rows,
    say normalisation across the batch, cannot be batched)."""
    import torch

    from cuvild.workers.build import eager

    module = eager(ep)
    torch.manual_seed(0)
    rows = max(2, low)

    def sample(spec: dict[str, Any], n: int) -> torch.Tensor:
        shape = [n] + [d if d >= 0 else 2 for d in spec["shape"][1:]]
        dtype = getattr(torch, spec["dtype"])
        if dtype.is_floating_point:
            return torch.randn(shape).to(dtype)
        return torch.randint(0, 2, shape, dtype=dtype)

    try:
        with torch.no_grad():
            batch = [sample(s, rows * 2) for s in specs]
            together = module(*batch)
            alone = [module(*[t[i * rows:(i + 1) * rows] for t in batch])
                     for i in range(2)]
    except Exception as e:  # noqa: BLE001 - a model that cannot run apart is not batched
        return f"running its rows apart failed ({type(e).__name__}: {e})"
    for k, out in enumerate(together):
        expect = torch.cat([a[k] for a in alone])
        if out.shape != expect.shape or not torch.allclose(out.float(), expect.float(),
                                                           rtol=1e-4, atol=1e-5):
            return f"output {k}: rows run together differ from the same rows run apart"
    return ""


class Pending:
    """One queued request."""

    __slots__ = ("arrived", "deadline", "done", "error", "gap", "given", "inputs", "model",
                 "out", "result", "rows", "sig", "taken", "timeline")

    def __init__(self, model: LoadedModel, inputs: Sequence[Any], out: Out,
                 given: float | None, default_s: float,
                 timeline: Timeline | None = None) -> None:
        self.model, self.inputs, self.out = model, inputs, out
        self.timeline = timeline  # a traced request's: the parts of its batch's run
        self.given = given  # the caller's deadline
        shapes = model.bucket.shapes  # (a batched request's model is a bucket)
        self.rows = shapes[0][0]
        self.sig = tuple((spec.dtype, shape[1:]) for spec, shape
                         in zip(model.table, shapes, strict=True))
        self.arrived = time.monotonic()
        self.deadline = self.arrived + default_s if given is None else given
        self.gap = 0.0  # since the request queued, or the batch ended, before it
        self.done = self.taken = False
        self.result: list[Any] | None = None  # (None: not answered yet)
        self.error: BaseException | None = None


class Batcher:
    """The queue of one batched model (shared by its buckets)."""

    def __init__(self, base_key: str, settings: Batching, runner: Runner,
                 instances: int = 1) -> None:
        """`runner`: what runs a batch (`Runner.execute`) and resolves its bucket."""
        self.base_key, self.settings, self.runner = base_key, settings, runner
        self.delay = settings.max_delay_us / 1e6
        self.instances = max(1, instances)
        self._queue: deque[Pending] = deque()
        self._cond = threading.Condition()
        self._leading = False
        self._running = 0
        self._last = 0.0  # when the last request queued, or the last batch ended
        self._ended = 0.0  # when the last batch ended
        self._in_flight = 0  # requests queued or in a running batch
        self._peak = 0  # the most in flight at once since the last batch was taken
        self._answered = 0  # requests the last batch answered, and arrivals since it ended:
        self._back = 0  # fewer arrivals than answers, and some callers may send again
        self._run_s = 0.0  # how long the last batch took
        self.sizes: Counter[int] = Counter()  # rows per run -> runs
        self.requests = 0
        self.waits: deque[float] = deque(maxlen=1000)  # the last queue waits, seconds

    # -- the request's side ----------------------------------------------------------------
    def run(self, model: LoadedModel, inputs: Sequence[Any], out: Out,
            deadline: float | None, timeline: Timeline | None = None) -> list[Any]:
        """Run one request of `model` (its bucket) in a batch; what Runner.execute returns."""
        runner = self.runner
        me = Pending(model, inputs, out, deadline, runner.run_timeout_s, timeline)
        if me.rows >= self.settings.max_batch:
            return runner.execute(model, inputs, out, timeline, deadline)
        with self._cond:
            me.gap, self._last = me.arrived - self._last, me.arrived
            self._back += 1
            self._queue.append(me)
            self._in_flight += 1
            self._peak = max(self._peak, self._in_flight)
            self._cond.notify_all()
        while True:
            with self._cond:
                while not me.done and (me.taken or self._leading
                                       or self._running >= self.instances):
                    left = me.deadline - time.monotonic()
                    if left <= 0 and me in self._queue:
                        self._queue.remove(me)
                        self._in_flight -= 1
                        raise RunTimeout(f"model {self.base_key}: waited "
                                         f"{time.monotonic() - me.arrived:.1f} s in the batch "
                                         "queue (the request's deadline)")
                    self._cond.wait(max(left, 0.01))
                if me.done:
                    if me.error is not None:
                        raise me.error
                    return me.result  # type: ignore[return-value]
                self._leading = True
                try:
                    batch = self._take()
                finally:
                    self._leading = False
                self._running += bool(batch)
                self._cond.notify_all()
            if batch:
                batch_began = time.monotonic()
                try:
                    self._run(runner, batch)
                finally:
                    with self._cond:
                        self._running -= 1
                        self._last = self._ended = time.monotonic()  # (callers send again)
                        self._run_s = self._ended - batch_began
                        self._answered, self._back = len(batch), 0
                        self._in_flight -= len(batch)
                        for p in batch:
                            p.done = True
                            if p.error is None and p.result is None:  # (the leader failed)
                                p.error = InferError(f"model {self.base_key}: its batch "
                                                     "ended without an answer for it")
                        self._cond.notify_all()

    def _take(self) -> list[Pending]:
        """Wait until a batch is due (under the lock) and take it off the queue: the oldest
        request and those after it with rows of its shape, up to max_batch rows."""
        while self._queue:
            now = time.monotonic()
            head = self._queue[0]
            if head.deadline <= now:  # its own thread raises the RunTimeout
                self._queue.popleft()
                self._in_flight -= 1
                head.done, head.error = True, RunTimeout(
                    f"model {self.base_key}: waited {now - head.arrived:.1f} s in the batch "
                    "queue (the request's deadline)")
                continue
            queued = sum(p.rows for p in self._queue if p.sig == head.sig)
            # Callers the last batch answered that have not sent again yet: a closed loop of
            # clients (each sends its next request once answered) comes back within a round
            # trip, which may be longer than the delay (resnet18's 600 KB over gRPC: 1-3 ms).
            # Waiting for them keeps its batches whole, where running without them split a
            # loop of 4 clients into a batch of 3 and one alone, over and over. They are
            # waited for until the delay plus one run (the last batch's) after it ended, and
            # no request waits for them past the delay plus one run from its own arrival.
            back_by = self._ended + self.delay + self._run_s
            coming = self._back < self._answered and now < back_by
            # alone, and no company to wait for: none was in flight with it since the last
            # batch began, or none arrived (and no batch ended) within the delay before it
            idle = self._running == 0 and len(self._queue) == 1 and not coming and (
                self._peak <= 1 or head.gap > self.delay)
            # (a request that waited for a batch ahead waits for company from the batch end)
            due = max(head.arrived, self._ended) + self.delay
            if coming:
                due = max(due, min(back_by, head.arrived + self.delay + self._run_s))
            if queued >= self.settings.max_batch or now >= due or idle:
                break
            self._cond.wait(min(due, head.deadline) - now)
        batch, rows = [], 0
        for p in self._queue:
            if p.sig == self._queue[0].sig and rows + p.rows <= self.settings.max_batch:
                batch.append(p)
                rows += p.rows
        for p in batch:
            self._queue.remove(p)
            p.taken = True  # its thread waits for it, and leads no other batch meanwhile
        self._peak = self._in_flight  # (counted again until the next batch)
        return batch

    # -- the leader's side: one batch -------------------------------------------------------
    def _run(self, runner: Runner, batch: list[Pending]) -> None:  # noqa: C901 - a batch's run: merge, run, split, answer each
        """Run the batch and give each request its answer (result or error)."""
        start = time.monotonic()
        rows = sum(p.rows for p in batch)
        waits = [start - p.arrived for p in batch]
        with self._cond:
            self.sizes[rows] += 1
            self.requests += len(batch)
            self.waits.extend(waits)
        if runner.monitor:
            runner.monitor.batched(batch[0].model, rows, waits)
        if len(batch) == 1:  # alone: as unbatched, no copy
            self._alone(runner, batch[0])
            return
        try:
            self._merged(runner, batch, rows)
        except (RunTimeout, WorkerUnavailable) as e:
            for p in batch:
                if p.error is None:
                    p.error = e
        except InferError as e:  # which request's inputs? each runs alone to tell
            log.warning("model %s: a batch of %d requests failed (%s); running them one by "
                        "one", self.base_key, len(batch), e)
            for p in batch:
                if p.error is None:
                    self._alone(runner, p)
        except Exception as e:  # a bug: every request not yet answered gets it, not nothing
            log.exception("model %s: a batch of %d requests failed", self.base_key, len(batch))
            for p in batch:
                if p.error is None and p.result is None:
                    p.error = e

    @staticmethod
    def _alone(runner: Runner, p: Pending) -> None:
        try:
            p.result = runner.execute(p.model, p.inputs, p.out, p.timeline, p.given)
        except Exception as e:  # noqa: BLE001 - the request's own answer
            p.error = e

    def _merged(self, runner: Runner, batch: list[Pending], rows: int) -> None:
        base = runner.served.models.get(self.base_key)
        if base is None:
            raise InferError(f"model {self.base_key} is not loaded any more")
        first = batch[0].model
        rows = padded_rows(rows, self.settings.max_batch)  # padding after the requests' rows
        shapes = tuple((rows, *shape[1:]) for shape in first.bucket.shapes)
        given = [p.given for p in batch]  # None: the engine's own (a silent worker is hung)
        deadline = None if None in given else max(given)  # type: ignore[type-var]
        model = runner.resolve(base, [(spec.dtype, shape) for spec, shape in  # its bucket
                                      zip(base.table, shapes, strict=True)], deadline)
        inputs = self._gather(runner, batch, model, rows)
        outs = [memoryview(bytearray(model.slots[n].nbytes)) for n in model.outputs]
        traced = [p.timeline for p in batch if p.timeline is not None]
        timeline: Timeline | None = [] if traced else None
        runner.execute(model, inputs, Out(into=outs), timeline, deadline)
        for each in traced:
            each.extend(timeline or ())
        at_row = 0
        for p in batch:
            if p.error is None:
                try:
                    p.result = self._scatter(runner, model, outs, p, at_row, rows)
                except RegionGone as e:
                    p.error = BadRegion(str(e))
            at_row += p.rows

    def _gather(self, runner: Runner, batch: list[Pending], model: Any,
                rows: int) -> list[RawTensor]:
        """The batch's inputs, each request's rows in turn, padded to `rows`."""
        inputs = []
        for i, name in enumerate(model.inputs):
            slot = model.slots[name]
            buf = memoryview(bytearray(slot.nbytes))
            at = 0
            for p in batch:
                n = slot.nbytes * p.rows // rows
                if p.error is None:
                    try:
                        self._read(runner, p.inputs[i], buf[at:at + n], slot.dtype)
                    except RegionGone as e:
                        p.error = BadRegion(str(e))
                at += n
            row = slot.nbytes // rows
            for pad in range(at, slot.nbytes, row):  # padding: the last row again, so its
                buf[pad:pad + row] = buf[at - row:at]  # values are ones the model takes
            inputs.append(RawTensor(buf, slot.dtype, slot.shape))  # type: ignore[arg-type]
        return inputs

    def _read(self, runner: Runner, value: Any, out: memoryview, dtype: str) -> None:
        if isinstance(value, RawTensor):
            out[:] = memoryview(value.data).cast("B")
        elif isinstance(value, TensorRef):
            if value.inode:  # a client's region: read, never mapped
                runner.regions.read(value.segment, value.inode, value.offset, out)
            else:
                out[:] = runner.arena.segments[value.segment].view(value.offset, len(out))
        else:
            out[:] = as_bytes(value, dtype)

    @staticmethod
    def _scatter(runner: Runner, model: Any, outs: list[memoryview], p: Pending, at_row: int,
                 rows: int) -> list[Any]:
        """Request p's rows of each output: into its region or `into`, or as its result."""
        result = []
        for k, name in enumerate(model.outputs):
            per_row = len(outs[k]) // rows
            mine = outs[k][at_row * per_row:(at_row + p.rows) * per_row]
            ref = p.out.refs.get(name)
            if ref is not None:
                runner.regions.write(ref.segment, ref.inode, ref.offset, mine)
                result.append(None)
            elif p.out.into is not None:
                p.out.into[k][:] = mine
            elif p.out.raw:
                result.append(bytes(mine))
            else:
                import torch

                slot = p.model.slots[name]
                result.append(torch.frombuffer(bytearray(mine), dtype=getattr(
                    torch, slot.dtype)).view(slot.shape))
        return [] if p.out.into is not None else result

    # -- what it did -------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        with self._cond:
            waits = sorted(self.waits)
            sizes = dict(sorted(self.sizes.items()))
            queued = len(self._queue)

        def at(q: float) -> float:
            return round(waits[min(len(waits) - 1, int(q * len(waits)))] * 1e3, 3) if waits else 0.0

        return {"max_batch": self.settings.max_batch,
                "max_delay_us": self.settings.max_delay_us, "sizes": sizes,
                "requests": self.requests, "queued": queued,
                "queue_ms": {"p50": at(0.5), "p99": at(0.99), "max": at(1.0)}}
