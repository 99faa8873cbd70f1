"""The reference runtime: the part's GraphModule run by torch eager on the host.

It is what every other runtime is checked against, and the null backend that lets the
engine and its tests run anywhere.

It is also the runtime of stateful parts: a part whose graph updates some of its buffers in
place (`state_of`: a language model's KV cache, as transformers' static-cache export writes
it with index_copy_) runs on a copy of those buffers per sequence (`use(slot, scope)`;
cuvild/run/sequences.py), swapped in before a run: the state stays where the part runs and
is never copied per step. The copies are this process's, by (scope, slot): the scope is the
model's key, so the buckets of a dynamic-shape model (a prefill chunk of 64 tokens, a
decode step of 1) share a sequence's cache. Slot 0 is a request outside any sequence: a
fresh copy each run. `drop_sequence` / `drop_scope` let them go.

At bf16 or fp16 a part runs on a copy that holds its weights (float tensors of two or more
dimensions) in that dtype, cast once at build (`lowered`), the ops that read them computing
at it: a decode step reads every weight once a token, so halving their bytes nearly halves
its time, where autocast would cast each weight again every run (and the whole cache for
attention). The state keeps the program's dtype (a prefill bucket at bf16 and a decode
bucket at fp16 share one cache), what is written into it cast to it. fp16
is offered on CPUs with F16C, which every x86-64 CPU since 2013 has: torch's fp16 matrix-vector
product converts with it and is the fastest there, its matrix products are not (a 64-token
prefill at fp16: 539 ms vs 196 ms fp32), so the search keeps it only where it measures faster.
At fp32 and bf16 its linears run on oneDNN's packed weights (`prepared`), faster than torch's
own at every row count measured.
"""

from __future__ import annotations

import copy
import logging
import platform
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from partitioner.fxgraph import updated
from partitioner.profile import DeviceProfile
from runtimes import compiled_step, mixed, packed_linear, torch_cuda
from runtimes.attention import attended
from runtimes.base import INITIAL, CompileError, CompileSpec, Executable, Runtime, reset
from runtimes.derived import derived
from runtimes.state import copy_sequence, drop_scope, drop_sequence, holds, layout_of, pool, runs
from runtimes.together import Together

# (the worker's, with the state: runtimes/state.py; a part's state reset: runtimes/base.py)
__all__ = ["copy_sequence", "drop_scope", "drop_sequence", "reset"]

log = logging.getLogger(__name__)


def state_of(module: fx.GraphModule) -> list[str]:
    """The module's attributes (buffers) its graph updates in place, in graph order."""
    found: list[str] = []
    for node in module.graph.nodes:
        value = updated(node)
        if value is not None and value.op == "get_attr" and value.target not in found:
            found.append(str(value.target))
    return found


def _attr(module: torch.nn.Module, name: str) -> torch.Tensor:
    for part in name.split("."):
        module = getattr(module, part)
    return module  # type: ignore[return-value]


def _set_attr(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    *path, last = name.split(".")
    for part in path:
        module = getattr(module, part)
    setattr(module, last, value)


RECENT_S = 0.25  # a sequence that stepped on a part this recently is waited for by a batch


def remember_initial(module: fx.GraphModule) -> list[str]:
    """Keep the module's state as it is now (before any run) in its meta; its state's names."""
    state = state_of(module)
    if state and INITIAL not in module.meta:
        module.meta[INITIAL] = {n: _attr(module, n).detach().clone() for n in state}
    return state


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
aten = torch.ops.aten
_ASSERT = aten._assert_tensor_metadata.default  # noqa: SLF001 - export's dtype checks
_CAST = aten._to_copy.default  # noqa: SLF001 - aten's cast (prims' costs ~40 us a call)
# ops that view or re-lay out their first argument: a lowered weight stays lowered through them
_VIEWS = {aten.t.default, aten.permute.default, aten.transpose.int, aten.view.default,
          aten.reshape.default, aten._unsafe_view.default, aten.expand.default,  # noqa: SLF001
          aten.unsqueeze.default, aten.squeeze.dim, aten.slice.Tensor, aten.alias.default}


_LINEAR = aten.linear.default
_PACKED_LINEAR = packed_linear.PACKED  # oneDNN's linear
_REORDER = torch.ops.mkldnn._reorder_linear_weight  # noqa: SLF001 - oneDNN's weight packing
PACK_ROWS = 128  # the rows oneDNN lays a packed weight out for (any count runs on it)
def _size(value: torch.Tensor, dim: int) -> int:
    return value.shape[dim]  # (under vmap: the size one sequence's step sees)


def batchable(module: fx.GraphModule, repack: bool = True) -> fx.GraphModule:
    """The module as vmap runs it: its packed linears as `cuvild::packed_linear` (with `repack`, a
    weight packed for one row packed again for several: `_packed`), a dynamic-shape bucket's
    size reads as plain Python (aten's `sym_size` has no batching rule). Also what inductor
    compiles (runtimes/compiled_step.py): the custom op is opaque to it, oneDNN's op is not."""
    graph = copy.deepcopy(module.graph)
    attrs = {str(n.target): _attr(module, str(n.target)) for n in graph.nodes
             if n.op == "get_attr"}
    for node in list(graph.nodes):
        if node.target is _PACKED_LINEAR:
            node.target, node.args = packed_linear.op(), node.args[:3]
            weight = node.args[1]
            source = module.meta.get(ONE_ROW, {}).get(str(weight.target)) if repack else None
            if source is not None:  # the weight again, packed for PACK_ROWS
                name = f"{weight.target}_rows"
                attrs[name] = derived(source, f"packed{PACK_ROWS}",
                                       lambda w: _REORDER(w, PACK_ROWS))
                with graph.inserting_before(node):
                    node.args = (node.args[0], graph.get_attr(name), node.args[2])
        elif node.target is aten.sym_size.int:
            node.target = _size
    graph.eliminate_dead_code()
    used = {str(n.target) for n in graph.nodes if n.op == "get_attr"}
    out = fx.GraphModule({k: v for k, v in attrs.items() if k in used}, graph)
    out.meta.update(module.meta)
    return out


def packs(dtype: torch.dtype | None) -> bool:
    """Whether linears at `dtype` (None: as exported) run on oneDNN's packed weights here:
    fp32 and bf16 where oneDNN has them (its fp16 is slower than torch's fp16 matrix-vector
    product on CPUs without fp16 units)."""
    if (not torch.backends.mkldnn.is_available() or dtype == torch.float16
            or platform.machine() not in ("x86_64", "AMD64")):  # (measured on x86 only)
        return False
    return dtype is None or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())  # noqa: SLF001


def _is_float(arg: object) -> bool:
    val = arg.meta.get("val") if isinstance(arg, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def prepared(module: fx.GraphModule, dtype: torch.dtype | None,
             inputs: Sequence[torch.Tensor] = (), attend: bool = True,
             host: bool = True, keys: bool = False) -> fx.GraphModule:
    """The part as the runtime runs it at `dtype` (None: as exported) on inputs shaped as
    `inputs` (none: any): its weights lowered (`lowered`), then its linears on oneDNN's
    packed weights where `packs` (one packing per weight and row count, shared by the
    part's buckets): a 2816x1024 fp32 linear on the 2-core EPYC, 686 -> 494 us for 1 row,
    1375 -> 644 for 16, 4650 -> 3490 for 128 (bf16: 414 -> 243 for 1 row), the results
    within 1e-6 of torch's. At fp32 a linear of one row (a decode step's) gets a weight
    packed for one row: 24 such weights read from memory, 515 -> 386 us each, the 200M
    Llama's decode step 39.1 -> 31.4 ms (packed for 128 rows it is faster from 4 rows up,
    and bf16 gains nothing). Its attentions first work on the keys they attend
    (runtimes/attention.py: a static cache's unwritten tail left out; not with `attend`
    False; with `keys`, their count an input's length: what inductor compiles). Nothing
    packed for a part that runs on a GPU (`host` False)."""
    module = attended(module, keys) if attend else module
    module = module if dtype is None else lowered(module, dtype)
    module = mixed.folded(module) if module.meta.get(mixed.META) else module
    if not host or not packs(dtype) or not any(n.target is _LINEAR for n in module.graph.nodes):
        return module
    try:
        return _packed(module, _rows(module, inputs) if dtype is None else {})
    except RuntimeError as e:  # oneDNN refused a weight: the linears as torch runs them
        log.info("linears left unpacked: %s", e)
        return module


def decode_step(part: fx.GraphModule, inputs: Sequence[torch.Tensor]) -> bool:
    """Whether `part` on `inputs` is a language model's decode step (runtimes/compiled_step.py:
    it keeps state and every linear computes one row)."""
    return compiled_step.decode_step(state_of(part), _rows(part, inputs))


def _rows(module: fx.GraphModule, inputs: Sequence[torch.Tensor]) -> dict[str, int]:
    """The rows each linear of `module` computes on `inputs` (its input's size but the
    last), by node name, where `inputs` tell them (a dynamic-shape part's sizes bound from
    its placeholders' symbols)."""
    bound: dict[Any, int] = {}
    places = [n for n in module.graph.nodes if n.op == "placeholder"]
    for node, value in zip(places, inputs, strict=False):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() == value.dim():
            bound.update((d.node.expr, int(v)) for d, v in zip(val.shape, value.shape,
                                                                strict=True)
                         if isinstance(d, torch.SymInt) and d.node.expr.is_Symbol)
    rows: dict[str, int] = {}
    for node in module.graph.nodes:
        val = node.args[0].meta.get("val") if node.target is _LINEAR else None
        if not isinstance(val, torch.Tensor) or not inputs:
            continue
        count = 1
        for d in val.shape[:-1]:
            size = d.node.expr.subs(bound) if isinstance(d, torch.SymInt) else d
            if not getattr(size, "is_number", True):
                break
            count *= int(size)
        else:
            rows[node.name] = count
    return rows


ONE_ROW = "cuvild_one_row"  # a packed module's meta: weights packed for 1 row -> their source


def _packed(module: fx.GraphModule, rows: dict[str, int]) -> fx.GraphModule:
    graph = copy.deepcopy(module.graph)
    attrs = {str(n.target): _attr(module, str(n.target)) for n in graph.nodes
             if n.op == "get_attr"}
    one_row: dict[str, torch.Tensor] = {}
    for node in list(graph.nodes):
        weight = node.args[1] if node.target is _LINEAR and len(node.args) > 1 else None
        value = attrs.get(str(weight.target)) if isinstance(weight, fx.Node) \
            and weight.op == "get_attr" else None
        if value is None or value.dim() != 2 or not value.is_floating_point():
            continue
        at = 1 if rows.get(node.name) == 1 else PACK_ROWS
        name = f"{weight.target}_packed{at}".replace(".", "_")
        attrs[name] = derived(value, f"packed{at}", lambda w, at=at: _REORDER(w, at))
        if at == 1:
            one_row[name] = value
        with graph.inserting_before(node):
            packed = graph.get_attr(name)
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            linear = graph.call_function(_PACKED_LINEAR, (node.args[0], packed, bias, "none",
                                                          [], ""))
        linear.meta = dict(node.meta)
        node.replace_all_uses_with(linear)
        graph.erase_node(node)
    for node in list(graph.nodes):  # the weights only the packed linears read now
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    used = {str(n.target) for n in graph.nodes if n.op == "get_attr"}
    packed_module = fx.GraphModule({k: v for k, v in attrs.items() if k in used}, graph)
    packed_module.meta.update(module.meta)
    if one_row:
        packed_module.meta[ONE_ROW] = one_row
    return packed_module


def _is_weight(value: object) -> bool:
    """A tensor `lowered` holds in another dtype (where it is not the part's state)."""
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() >= 2


def _weight_bytes(module: fx.GraphModule, itemsize: int) -> int:
    """What `module`'s weights (as `lowered` takes them) hold at `itemsize` bytes a value."""
    state = set(state_of(module))
    values = [_attr(module, str(n.target)) for n in module.graph.nodes
              if n.op == "get_attr" and n.target not in state]
    return sum(itemsize * v.numel() for v in values if _is_weight(v))


def lowered(module: fx.GraphModule, dtype: torch.dtype) -> fx.GraphModule:
    """A copy of the part that holds its weights (float tensors of two or more dimensions
    that are not its state) in `dtype`, cast once. An op that reads one (a linear, a matmul,
    an embedding) gets its other float inputs cast to `dtype` and its result cast back, so
    everything else (norms, softmax, attention over the cache, the state) runs as exported.
    Export's dtype assertions go; what is written into the state is cast to the state's
    dtype. The original module is left as it is (other buckets share it)."""
    graph = copy.deepcopy(module.graph)
    state = set(state_of(module))
    attrs: dict[str, torch.Tensor] = {}
    low: set[fx.Node] = set()
    for node in list(graph.nodes):
        if node.op == "get_attr":
            value = _attr(module, str(node.target))
            if _is_weight(value) and node.target not in state:
                value = derived(value, str(dtype), lambda w: w.to(dtype))
                low.add(node)
            attrs[str(node.target)] = value
        elif node.op == "call_function" and node.target is _ASSERT:
            graph.erase_node(node)
    for node in list(graph.nodes):
        if node.op == "call_function":
            _compute_at(graph, node, low, dtype)
            _write_as_kept(graph, node, attrs)
    lowered_module = fx.GraphModule(attrs, graph)
    lowered_module.meta.update(module.meta)  # (a stateful part's initial state, as exported)
    return lowered_module


def _cast(graph: fx.Graph, before: fx.Node, arg: fx.Node, to: torch.dtype) -> fx.Node:
    with graph.inserting_before(before):
        return graph.call_function(_CAST, (arg,), {"dtype": to})


def _compute_at(graph: fx.Graph, node: fx.Node, low: set[fx.Node], dtype: torch.dtype) -> None:
    """A view of a lowered weight is lowered too; an op computing on one computes at `dtype`
    (its other float inputs cast) and gives its result back in its exported dtype."""
    if not any(a in low for a in node.all_input_nodes):
        return
    if node.target in _VIEWS and node.args[0] in low:
        low.add(node)
        return
    node.args, node.kwargs = fx.map_arg(
        (node.args, node.kwargs),
        lambda a: _cast(graph, node, a, dtype) if a not in low and _is_float(a) else a)
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and val.is_floating_point():
        with graph.inserting_after(node):
            back = graph.call_function(_CAST, (node,), {"dtype": val.dtype})
        back.meta["val"] = val
        node.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)


def _write_as_kept(graph: fx.Graph, node: fx.Node, attrs: dict[str, torch.Tensor]) -> None:
    """What an op writes into a float state buffer, cast to the buffer's dtype."""
    target = updated(node)
    kept = attrs.get(str(target.target)) if target is not None and target.op == "get_attr" \
        else None
    if kept is not None and kept.is_floating_point():
        node.args = (node.args[0], *(_cast(graph, node, a, kept.dtype) if _is_float(a) else a
                                     for a in node.args[1:]))


class TorchExecutable(Executable):
    runtime = "torch"

    def __init__(self, module: fx.GraphModule, dtype: torch.dtype | None,
                 device: torch.device | None = None,
                 twin: Callable[[], fx.GraphModule] | None = None) -> None:
        """`twin`: for a decode step below fp32, its fp32 twin, made where several sequences'
        steps run together (runtimes/together.py)."""
        self.module = module
        self.device = device  # a CUDA device it runs on (runtimes/torch_cuda.py); None: host
        self._plain = module  # (what a batch of sequences runs: `_vmapped`)
        self._call: Callable[..., Any] = module  # the module, or its compiled form
        # what compiled_step compiles at a sequence's first step here, in the background;
        # the thread, and what it offers when done (module, compiled), taken before a run
        self.tier_up: compiled_step.Sources | None = None
        self.compiling: threading.Thread | None = None
        self._offered: compiled_step.Offer | None = None
        self._aside = 0.0  # seconds of the last run spent timing an offer (`aside`)
        self.step = ""  # where its decode step stands (compiled_step), for cuvilctl partition
        self.dtype = dtype
        self.state = remember_initial(module)  # what a sequence keeps: runs change it in place
        self.initial: dict[str, torch.Tensor] = module.meta.get(INITIAL, {})
        self._layout = layout_of(self.initial)  # (its sequences' pool's, computed once)
        # the module's own buffers, put back after each run: a module is shared (a split's
        # part is cached per model, its buckets' executables run it) and reset by builds
        self.home = {n: _attr(module, n) for n in self.state}
        self._next = ("", 0)  # the sequence (scope, slot) of the next run (slot 0: none)
        self._batched: Callable[..., Any] | None = None
        # sequences share runs at fp32: on the part itself, or below fp32 on its fp32 twin
        # where that measures faster than their steps alone (runtimes/together.py)
        self.together = Together(dtype is None, twin if device is None else None,
                                 {v: k for k, v in DTYPES.items()}.get(dtype, "fp32"))
        self.batches = bool(self.state) and device is None and self.together.possible
        self._stepped: dict[int, float] = {}  # slot -> when it last stepped here
        self._scope = ""

    def describe(self) -> str:
        """Where its decode step stands (`step`), and how its sequences' steps have shared
        runs so far (`cuvilctl partition`)."""
        return "; ".join(t for t in (self.step, self.together.describe()) if t)

    def expected(self) -> int:
        """How many sequences stepped on this part in the last RECENT_S and hold their state
        still: the steps a batch of them waits for (cuvild/workers/sessions.py)."""
        now = time.monotonic()
        for slot, when in list(self._stepped.items()):
            if now - when > RECENT_S or not holds(self._scope, slot):
                del self._stepped[slot]
        count = len(self._stepped)  # (not a batch that does not pay: runtimes/together.py)
        return count if count < 2 or self.together.worth_waiting(count) else 1

    def _step(self, scope: str, slots: Sequence[int]) -> None:
        now = time.monotonic()
        self._scope = scope
        self._stepped.update((slot, now) for slot in slots)

    def use(self, slot: int, scope: str = "") -> None:
        """Run the next call on sequence `slot` of model `scope` (its state made from the
        initial values at its first step); without it, or with slot 0, on a fresh copy."""
        self._next = (scope, slot)

    def _install(self) -> None:
        (scope, slot), self._next = self._next, ("", 0)
        if slot:
            if self.batches:
                self._step(scope, [slot])
            held = pool(scope, self.initial, self._layout)
            kept = held.views(held.row(slot))
        else:
            kept = {name: value.clone() for name, value in self.initial.items()}
        for name, tensor in kept.items():
            _set_attr(self.module, name, tensor)

    def run_batch(self, slots: Sequence[int], inputs: Sequence[Sequence[torch.Tensor]],
                  scope: str) -> list[list[torch.Tensor]]:
        """One step of each sequence `slots[i]` of model `scope` on `inputs[i]`: those
        whose rows of the pool are consecutive in one run (runtimes/state.py), torch's vmap
        over the pool's slice, each sequence at its own position; the outputs per sequence."""
        held = pool(scope, self.initial, self._layout)
        rows = [held.row(slot) for slot in slots]
        self._step(scope, slots)
        at = {row: i for i, row in enumerate(rows)}
        out: list[list[torch.Tensor]] = [[] for _ in slots]
        for first, count in runs(rows):
            members = [at[row] for row in range(first, first + count)]
            if count == 1 or not self.together.pays(count):
                for i in members:
                    self.use(slots[i], scope)
                    out[i] = self.run(inputs[i])
                continue
            stacked = torch_cuda.inputs_on([torch.stack([inputs[i][k] for i in members])
                                            for k in range(len(inputs[members[0]]))],
                                           self.device)
            batched = self._vmapped()
            t0 = time.perf_counter()
            with torch.inference_mode():
                got = batched(held.views(first, count), *stacked)
            self.together.ran(count, time.perf_counter() - t0)
            for j, i in enumerate(members):
                out[i] = [self._back(o[j]) for o in got]
        return out

    def _vmapped(self) -> Callable[..., Any]:
        if self._batched is None:
            batch = batchable(self.together.module(self._plain))

            def one(state: dict[str, torch.Tensor], *inputs: torch.Tensor) -> Any:
                return tuple(torch.func.functional_call(batch, state, inputs))

            torch._C._functorch._set_vmap_fallback_warning_enabled(False)  # noqa: SLF001 - the
            # cache's writes and attention run per sequence (no batching rule): said once here
            self._batched = torch.func.vmap(one)
        return self._batched

    def _back(self, out: torch.Tensor) -> torch.Tensor:
        """An output as the part gives it: its exported dtype, on the host."""
        if self.dtype is not None and out.dtype in (torch.bfloat16, torch.float16):
            out = out.float()
        return out if self.device is None else out.to("cpu")

    def run_on(self, module: fx.GraphModule, call: Callable[..., Any],
               inputs: Sequence[torch.Tensor], state: dict[str, torch.Tensor],
               ) -> list[torch.Tensor]:
        """One run of `call` (`module`, or its compiled form) on a copy of `state`."""
        home = {n: _attr(module, n) for n in self.state}
        for name, value in state.items():
            _set_attr(module, name, value.clone())
        try:
            with torch.inference_mode():
                return [self._back(o) for o in call(*inputs)]
        finally:
            for name, value in home.items():
                _set_attr(module, name, value)

    def offer(self, offer: compiled_step.Offer) -> None:
        """A compiled step, timed before the next run and served from it on where faster
        (called from compiled_step's thread: the run's thread swaps it in)."""
        self._offered = offer

    def run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        inputs = torch_cuda.inputs_on(inputs, self.device)
        self._aside = 0.0
        if not self.state:
            return self._run(inputs)
        if self._offered is not None:
            offer, self._offered = self._offered, None
            t0 = time.perf_counter()
            if compiled_step.faster(self, offer):
                self._serve(offer.module, offer.compiled)
            self._aside = time.perf_counter() - t0
        if self.tier_up is not None and self._next[1]:  # a sequence's first step here
            sources, self.tier_up = self.tier_up, None
            scope, slot = self._next
            held = pool(scope, self.initial, self._layout)
            self.compiling = compiled_step.start(self, sources, inputs,
                                                 held.views(held.row(slot)))
        sequence = self._next
        self._install()
        try:
            if not sequence[1]:
                return self._run(inputs)
            t0 = time.perf_counter()
            outs = self._run(inputs)
            self.together.alone(time.perf_counter() - t0)  # (a sequence's step alone)
            return outs
        except Exception:
            if self._call is self._plain:
                raise
            # the compiled step failed (a case its check did not meet): eager from now on,
            # this step again (a step's writes go to its own position: run twice, the same)
            log.warning("a compiled decode step failed; the step runs eagerly from now on",
                        exc_info=True)
            self.step = "decode step eager: its compiled form failed while serving (log)"
            self._put_home()
            self._serve(self._plain, self._plain)
            self._next = sequence
            self._install()
            return self._run(inputs)
        finally:
            self._put_home()

    def aside(self) -> float:
        aside, self._aside = self._aside, 0.0
        return aside

    def _serve(self, module: fx.GraphModule, call: Callable[..., Any]) -> None:
        self.module, self._call = module, call
        self.home = {n: _attr(module, n) for n in self.state}

    def _put_home(self) -> None:
        for name, tensor in self.home.items():
            _set_attr(self.module, name, tensor)

    def _run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        with torch.inference_mode():
            outs = list(self._call(*inputs))
        return [self._back(o) for o in outs]


class TorchRuntime(Runtime):
    name = "torch"
    kinds = ("cpu", "gpu")  # a GPU for stateful parts only (runtimes/registry.py)
    precisions = ("fp32", "bf16", "fp16")

    @classmethod
    def version(cls) -> str:
        return torch.__version__

    def can_target(self, device: DeviceProfile, precision: str) -> bool:
        if precision not in self.precisions:
            return False
        if device.kind == "gpu" and not device.emulated:  # a stateful part's GPU runtime
            return torch_cuda.unavailable(device) is None  # (runtimes/registry.py)
        # Emulated devices run on the host CPU, so the reference can stand in for them.
        if precision == "fp16" and "f16c" not in device.features:
            return False
        return device.kind == "cpu" or device.emulated

    def why_not(self, device: DeviceProfile, precision: str) -> str:
        why = torch_cuda.unavailable(device) if device.kind == "gpu" and not device.emulated \
            and precision in self.precisions else None
        return f"cannot run on {device.id}: {why}" if why else super().why_not(device, precision)

    def compile(self, part: fx.GraphModule, spec: CompileSpec) -> Executable:
        dtype = DTYPES.get(spec.precision)
        device = torch_cuda.target(spec.device)
        if device is not None and (why := torch_cuda.unavailable(spec.device)):
            raise CompileError(f"torch: {why}")
        remember_initial(part)  # (the state before any run, moved with the part's tensors)
        module = prepared(part, dtype, spec.example_inputs, host=device is None)
        inputs = list(spec.example_inputs)
        rows = _rows(part, inputs)
        twin = None  # a decode step below fp32: its fp32 twin for several sequences' steps
        if dtype is not None and device is None and compiled_step.decode_step(state_of(part),
                                                                              rows):
            twin = lambda: prepared(part, None)  # noqa: E731 - (weights packed for PACK_ROWS)
        exe = TorchExecutable(torch_cuda.on_device(module, device, INITIAL), dtype, device,
                              twin)
        if twin is not None:
            exe.together.twin_bytes = _weight_bytes(part, 4)
        if compiled_step.decode_step(exe.state, rows):  # (not yet compiled on a GPU)
            exe.step = (compiled_step.ON_GPU if device is not None else
                        compiled_step.WAITING if compiled_step.enabled() else compiled_step.OFF)
        if device is None and compiled_step.wanted(exe.state, rows):
            exe.tier_up = compiled_step.Sources(
                lambda: batchable(prepared(part, dtype, inputs, keys=True), repack=False),
                lambda: prepared(part, dtype, inputs),
                lambda: fx.GraphModule(part, copy.deepcopy(part.graph)))
        return exe
