"""Mixed precision inside a part: its compute groups at bf16 (or fp16), the fewest at fp32.

A part's precision "bf16+fp32" asks for it at bf16 except the fewest layer groups that must
stay fp32 for its outputs to stay within `target` of fp32 (0.8 of the error budget, on the
inputs the model is checked on end to end: cuvild/workers/build.py). How:

1. Groups: the part's compute ops (matmul, conv, attention: what a lower precision speeds up)
   by the module that made them (`nn_module_stack`: "encoder.layer.3.intermediate.dense"),
   coarsened to parent modules while there are more than MAX_GROUPS, so the search below
   stays a few dozen runs of the part.
2. The graph carries the precision: each lowered op gets its floating inputs cast to bf16
   and its output cast back (weights fold into bf16 constants at compile), so every runtime
   that runs a graph's own dtypes runs it as asked, with no per-runtime switch: OpenVINO
   compiles it with an f32 inference hint and runs those ops in bf16 (its runtime model says
   so, checked in runtimes/openvino.py), inductor likewise.
3. Which groups: on the part's first sample input in torch eager, the error of the whole
   part with only one group lowered ranks the groups (NNCF's accuracy-aware back-off ranks
   layers the same way, by what each costs the metric), and the smallest k such that
   lowering all but the k worst holds `target` is estimated by bisection on the first four.
   A runtime's bf16 is not exactly torch's, so k is then settled on real builds (`measure`,
   on every sample): more groups kept, doubling, until a build holds, then the gap halved,
   five builds at most. Where everything lowered holds, k is 0 (still a
   mix: the ops between the lowered ones stay fp32, unlike a whole-part bf16 build); where
   nothing short of all fp32 does, the mix is refused.

The chosen build is measured again by runtimes/select.py against the precision's tolerance,
and the model end to end by the engine's precision search, as every lower precision is.

A part that keeps state (a language model's step, its KV cache updated in place) is mixed
too, and run by the torch runtime (the one that keeps state: it folds each weight's cast at
its build, runtimes/torch_eager.py): its cache writes stay out of the lowered groups (the
cache keeps its dtype), a group never reads a frozen copy of the cache, each run of the
search starts from the part's initial state, and each is held on the state it leaves as on
its outputs (`After`: its last position run again in fp32 on that state, as the next step
reads it). Only a prompt chunk, unless engine.sequences.mixed_prompt is off
(cuvild/load/precision.py). The 200M Llama's 128-token prompt chunk under a 1e-2 budget
(2-core AMD EPYC, avx512_bf16): bf16 alone measures 1.8e-2; with the 6 most sensitive of
its 37 groups kept fp32, 7.9e-3 on its logits and on the next step's, ~152 ms a run
against ~190 at fp32 (docs/PRECISION.md). A search's choice is recorded (`again`): torch
caches no build, so a restart lowers the part again without searching.
"""

from __future__ import annotations

import copy
import logging
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import fx
from torch.fx.passes.shape_prop import ShapeProp

from partitioner.flops import category
from partitioner.fxgraph import updated
from runtimes.base import MIXED, CompileError, reset, set_error

log = logging.getLogger(__name__)

SUFFIX = MIXED  # "bf16+fp32": bf16 with the fewest groups kept at fp32
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
RUNTIMES = ("openvino", "triton")  # those that run a graph's own dtypes as they are
# (and torch, for a part that keeps state: runtimes/select.py)
COMPUTE = ("matmul", "conv", "attention")
MAX_GROUPS = 48


def is_mixed(precision: str) -> bool:
    return precision.endswith(SUFFIX) and precision.removesuffix(SUFFIX) in LOW


def low_of(precision: str) -> str | None:
    """"bf16" of "bf16+fp32"; None for a precision that is not mixed."""
    return precision.removesuffix(SUFFIX) if is_mixed(precision) else None


def name(low: str) -> str:
    return f"{low}{SUFFIX}"


@dataclass
class Mix:
    """What the search chose: the groups kept at fp32, in the order they cost error alone."""

    low: str
    kept: list[str]
    groups: int  # how many groups the part has
    alone: dict[str, float]  # per group: the part's error with only that group lowered
    error: float  # the part's error as built
    measured: bool = False  # on the runtime (else torch eager's estimate)
    state: bool = False  # the state it leaves checked too (`After`)

    def describe(self) -> str:
        worst = ", ".join(f"{g} ({self.alone[g]:.1e} alone)" for g in self.kept[:6])
        more = f" and {len(self.kept) - 6} more" if len(self.kept) > 6 else ""
        how = "measured" if self.measured else "torch's estimate"
        how += ", the next step on the state it leaves too" if self.state else ""
        if not self.kept:
            return (f"{self.low} in all {self.groups} groups, fp32 between them; error "
                    f"{self.error:.1e} ({how})")
        return (f"{self.low} except {len(self.kept)} of {self.groups} groups kept fp32: "
                f"{worst}{more}; error {self.error:.1e} ({how})")


def _op_name(node: fx.Node) -> str:
    target = node.target
    return getattr(target, "__name__", str(target)).split(".")[0]


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return node.name
    path = list(stack.values())[-1][0]
    return path.removeprefix("L['self'].").removeprefix("L__self__.") or node.name


def compute_groups(gm: fx.GraphModule) -> dict[str, list[str]]:
    """Group name -> the names of its compute nodes (single-tensor floating outputs)."""
    groups: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and category(_op_name(node)) in COMPUTE and _float(node):
            groups.setdefault(_module_path(node), []).append(node.name)
    while len(groups) > MAX_GROUPS and any("." in path for path in groups):
        coarser: dict[str, list[str]] = {}  # (a level may merge nothing: a wrapper module)
        for path, nodes in groups.items():
            coarser.setdefault(path.rsplit(".", 1)[0], []).extend(nodes)
        groups = coarser
    return groups


def _float(node: fx.Node) -> bool:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.dtype == torch.float32
    meta = node.meta.get("tensor_meta")  # ShapeProp's, where the graph carries no val
    return getattr(meta, "dtype", None) == torch.float32


# Kept fp32 inside a lowered group, as compilers' own mixed precision does (normalisations,
# softmax and reductions accumulate; exp and log amplify): in bf16, one ViT layer's
# LayerNorms alone cost 1e-1 of the model's output.
SENSITIVE_KINDS = ("norm", "softmax", "reduction")
SENSITIVE = ("exp", "log", "pow", "rsqrt", "sqrt", "reciprocal", "div", "softplus",
             "log_sigmoid_forward", "logsumexp")


def regions(gm: fx.GraphModule, groups: dict[str, list[str]]) -> dict[str, set[str]]:
    """Per group, every floating op its module made but the sensitive ones (its activations,
    adds, views too), so that a lowered group runs at the low precision from its first op to
    its last, with casts only where it meets fp32 (a cast around every matmul alone costs
    more than bf16 saves: ResNet-50 ran slower than fp32 that way)."""
    out: dict[str, set[str]] = {g: set(nodes) for g, nodes in groups.items()}
    # (an update in place, a cache write, stays as exported: the state keeps its dtype)
    for node in gm.graph.nodes:  # in order: an op's inputs are placed before it
        if (node.op != "call_function" or not _float(node) or _op_name(node) in SENSITIVE
                or category(_op_name(node)) in SENSITIVE_KINDS or updated(node) is not None
                or any(node.name in nodes for nodes in out.values())):
            continue
        path = _module_path(node)
        within = [g for g in out if path == g or path.startswith(g + ".")]
        if not within:
            continue
        group = max(within, key=len)  # the innermost ("layers.6.mlp", not "layers.6")
        inputs = [a for a in node.all_input_nodes if _float(a) and a.op != "get_attr"]
        if all(a.name in out[group] for a in inputs):  # not a residual add: its stream
            out[group].add(node.name)  # (from outside the group) stays fp32
    return out


BATCH_NORMS = ("batch_norm", "_native_batch_norm_legit_no_training")
CONVS = ("conv1d", "conv2d", "conv3d", "convolution")


def fold_batch_norms(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` with each inference batch norm that alone follows a convolution folded
    into the convolution's weight and bias, in fp32, as compilers do before lowering: a
    norm left after a bf16 convolution would be folded in bf16 (or not at all). Where there
    is none, a copy of its graph on its own tensors (a stateful part's do not deepcopy)."""
    if not any(n.op == "call_function" and _op_name(n) in BATCH_NORMS for n in gm.graph.nodes):
        out = fx.GraphModule(gm, copy.deepcopy(gm.graph))
        out.meta.update(gm.meta)
        return out
    out = copy.deepcopy(gm)
    graph = out.graph
    for i, bn in enumerate(list(graph.nodes)):
        if bn.op != "call_function" or _op_name(bn) not in BATCH_NORMS:
            continue
        conv = bn.args[0]
        params = bn.args[1:5]
        if (not isinstance(conv, fx.Node) or conv.op != "call_function"
                or _op_name(conv) not in CONVS or len(conv.users) != 1
                or not all(isinstance(p, fx.Node) and p.op == "get_attr" for p in params)
                or not isinstance(conv.args[1], fx.Node) or conv.args[1].op != "get_attr"
                or (_op_name(bn) == "batch_norm" and bn.args[5])):  # training
            continue
        if _op_name(conv) == "convolution" and conv.args[6]:  # transposed: weights differ
            continue
        eps = bn.args[7] if _op_name(bn) == "batch_norm" else bn.args[6]
        gamma, beta, mean, var = (getattr(out, p.target) for p in params)
        weight = getattr(out, conv.args[1].target)
        bias_arg = conv.args[2] if len(conv.args) > 2 else None
        bias = (getattr(out, bias_arg.target) if isinstance(bias_arg, fx.Node)
                else torch.zeros_like(mean))
        scale = gamma / torch.sqrt(var + eps)
        names = (f"_cuvil_folded_{i}_weight", f"_cuvil_folded_{i}_bias")
        out.register_buffer(names[0], (weight * scale.reshape(-1, *[1] * (weight.dim() - 1)))
                            .detach().contiguous())
        out.register_buffer(names[1], ((bias - mean) * scale + beta).detach().contiguous())
        with graph.inserting_before(conv):
            w, b = graph.get_attr(names[0]), graph.get_attr(names[1])
        w.meta["val"], b.meta["val"] = conv.args[1].meta.get("val"), bn.args[2].meta.get("val")
        args = list(conv.args) + [None] * max(0, 3 - len(conv.args))
        args[1], args[2] = w, b
        conv.args = tuple(args)
        if _op_name(bn) == "batch_norm":
            bn.replace_all_uses_with(conv)
        else:  # a tuple: its [0] is the normalized output
            for user in list(bn.users):
                user.replace_all_uses_with(conv)
                graph.erase_node(user)
        graph.erase_node(bn)
    graph.eliminate_dead_code()
    graph.lint()
    out.recompile()
    return out


def lower(gm: fx.GraphModule, nodes: set[str], low: str) -> fx.GraphModule:
    """A copy of `gm` in which `nodes` run at `low`: a weight they read is rounded to `low` by
    torch and cast (OpenVINO folds a cast of a constant without rounding to nearest: a
    ResNet-50 lowered that way ran 3x further off than torch's bf16 of the same graph; the
    rounded weight stays fp32, so the cast it folds is exact, and its constants its own: built
    from bf16 tensors they were shared with torch, and read freed memory once the build's
    tensors were gone); an activation from outside them is cast down, and an output used
    outside them is cast back to fp32. The copy shares `gm`'s other weights, and its rounded
    ones with every other copy lowered from `gm` (`ROUNDED`: the search lowers a part dozens
    of times; copies of ViT-B's took 10 GiB, the 200M Llama's chunk's 5.1 GB of resident
    memory)."""
    out = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    gm.meta.setdefault(ROUNDED, {})
    out.meta.update(gm.meta)
    graph = out.graph
    downs: dict[fx.Node, fx.Node] = {}
    for node in list(graph.nodes):
        if node.name not in nodes or not _float(node):
            continue
        node.args = tuple(_down(out, a, node, nodes, low, downs) for a in node.args)
        node.kwargs = {k: _down(out, v, node, nodes, low, downs)
                       for k, v in node.kwargs.items()}
    for node in list(graph.nodes):
        if node.name not in nodes or not _float(node):
            continue
        outside = [u for u in node.users if u.name not in nodes or u.op == "output"]
        if outside:
            back = _after(node, CAST, (node,), {"dtype": torch.float32})
            for user in outside:
                user.replace_input_with(node, back)
        _retype(node, node, LOW[low])
    graph.eliminate_dead_code()  # the fp32 weights no lowered op reads any more
    graph.lint()
    out.recompile()
    out.meta[META] = low  # what runtimes/openvino.py checks ran low
    return out


CAST = torch.ops.aten._to_copy.default  # noqa: SLF001 - the cast export writes for .to()
META = "cuvil_mixed"  # a mixed part's meta (`lower`): its low precision
ROUNDED = "cuvil_rounded"  # a part's meta while it is lowered: its weights rounded (`_down`)


def folded(gm: fx.GraphModule) -> fx.GraphModule:
    """A mixed part with each weight's cast to its low dtype done once, for a runtime that
    runs the graph as it is (torch: runtimes/torch_eager.py): the graph casts each lowered
    weight (rounded, still fp32) at every run, which reads and writes all of them a run,
    slower than fp32 itself. Its state is no weight (`_state`)."""
    graph = copy.deepcopy(gm.graph)
    attrs = {str(n.target): operator.attrgetter(str(n.target))(gm) for n in graph.nodes
             if n.op == "get_attr"}
    state = _state(gm)
    for node in list(graph.nodes):
        source = node.args[0] if node.target is CAST and node.args else None
        if (not isinstance(source, fx.Node) or source.op != "get_attr"
                or str(source.target) in state or set(node.kwargs) != {"dtype"}):
            continue
        dtype = node.kwargs["dtype"]
        name = f"{source.target}_as_{str(dtype).removeprefix('torch.')}".replace(".", "_")
        attrs[name] = attrs[str(source.target)].to(dtype)
        with graph.inserting_before(node):
            weight = graph.get_attr(name)
        weight.meta = dict(node.meta)
        node.replace_all_uses_with(weight)
        graph.erase_node(node)
    for node in list(graph.nodes):  # the fp32 weights nothing reads any more
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    used = {str(n.target) for n in graph.nodes if n.op == "get_attr"}
    out = fx.GraphModule({k: v for k, v in attrs.items() if k in used}, graph)
    out.meta.update(gm.meta)
    return out


def _down(out: fx.GraphModule, arg: object, node: fx.Node, nodes: set[str], low: str,
          downs: dict[fx.Node, fx.Node]) -> object:
    """`node`'s input `arg` at `low` (once per input): a weight rounded by torch, then cast;
    an activation from outside `nodes` cast."""
    if not isinstance(arg, fx.Node) or arg.name in nodes or not _float(arg):
        return arg
    if arg not in downs:
        dtype = LOW[low]
        source = arg
        if arg.op == "get_attr" and str(arg.target) not in _state(out):
            # its values rounded by torch, still fp32: the cast is exact (not the state's:
            # it changes from run to run)
            name = f"_cuvil_{low}_{str(arg.target).replace('.', '_')}"
            rounded = out.meta[ROUNDED]  # (one per weight for all of a search's copies)
            if name not in rounded:
                weight = operator.attrgetter(str(arg.target))(out).detach()
                rounded[name] = weight.to(dtype).to(weight.dtype)
            if not hasattr(out, name):
                out.register_buffer(name, rounded[name])
            with out.graph.inserting_before(node):
                source = out.graph.get_attr(name)
            _retype(source, arg, torch.float32)
        downs[arg] = _after(source, CAST, (source,), {"dtype": dtype})
        _retype(downs[arg], arg, dtype)
    return downs[arg]


def _after(node: fx.Node, op: object, args: tuple[object, ...],
           kwargs: dict[str, object] | None = None) -> fx.Node:
    """A call of `op` placed right after `node`, typed as `node` at fp32."""
    with node.graph.inserting_after(node):
        new = node.graph.call_function(op, args, kwargs or {})  # type: ignore[arg-type]
    _retype(new, node, torch.float32)
    return new


def _retype(node: fx.Node, like: fx.Node, dtype: torch.dtype) -> None:
    """`node`'s meta says it holds `like`'s value at `dtype` (where `like` says anything)."""
    val = like.meta.get("val")
    if isinstance(val, torch.Tensor):
        node.meta["val"] = val.to(dtype)
    meta = like.meta.get("tensor_meta")
    if meta is not None:
        node.meta["tensor_meta"] = meta._replace(dtype=dtype)


@dataclass
class After:
    """How the state a stateful part's run leaves is checked: the part as exported (fp32)
    runs its last position again on that state (`rereads`, each input cut to its last row
    along its dynamic length), and what it gives is held against what it gives on the state
    fp32 left (`expected`). That run reads every cache row the chunk wrote but its own (it
    writes its own row again, in fp32), as the next step of the sequence would: a cache the
    mix wrote too coarsely shows there, while the chunk's own logits stay within the budget."""

    reference: fx.GraphModule
    rereads: list[list[torch.Tensor]]
    expected: list[list[torch.Tensor]]


def after_runs(gm: fx.GraphModule, inputs: Sequence[Sequence[torch.Tensor]]) -> After:
    """The check of the state `gm` leaves (`After`), fp32's side computed; CompileError where
    `gm` has no dynamic length to cut its inputs along (no last position to run alone)."""
    cut = [last_position(gm, x) for x in inputs]
    rereads = [r for r in cut if r is not None]
    if len(rereads) < len(cut):
        raise CompileError("the part keeps state and has no dynamic length: the state a mix "
                           "writes could not be checked")
    expected = []
    with torch.no_grad():
        for x, last in zip(inputs, rereads, strict=True):
            reset(gm)
            gm(*x)
            expected.append([t.clone() for t in gm(*last)])
    return After(gm, rereads, expected)


def last_position(gm: fx.GraphModule, inputs: Sequence[torch.Tensor],
                  ) -> list[torch.Tensor] | None:
    """`inputs` cut to their last row along each dynamic dimension of the part's inputs
    (a prompt chunk's tokens, positions, hidden states: its length); None where none has
    more than one row there."""
    out, cut = [], False
    places = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(places, inputs, strict=True):
        val = node.meta.get("val")
        for dim, size in enumerate(val.shape if isinstance(val, torch.Tensor) else ()):
            if isinstance(size, torch.SymInt) and value.dim() > dim and value.shape[dim] > 1:
                value = value.narrow(dim, value.shape[dim] - 1, 1)
                cut = True
        out.append(value)
    return out if cut else None


def error_on(gm: fx.GraphModule, inputs: Sequence[Sequence[torch.Tensor]],
             expected: Sequence[Sequence[torch.Tensor]], after: After | None = None,
             above: float | None = None) -> float:
    """`gm`'s error on `inputs`, each run from the part's initial state where it keeps one
    (as `expected` was: runtimes/torch_eager.py `remember_initial`, `reset`), and `after`
    each run, the error of the part's last position run again on the state it left.

    With `above` (a search asking whether `gm` holds it), the runs stop at the first input
    after which the error is known to be over `above`, and that lower bound is returned: the
    set's error (`set_error`) takes the largest difference on any input over the largest
    value expected on any, so the inputs still to run can only raise it."""
    wanted_all = [list(e) + (list(after.expected[i]) if after is not None else [])
                  for i, e in enumerate(expected)]
    outputs, wanted = [], []
    with torch.no_grad():
        for i, x in enumerate(inputs):
            reset(gm)
            got, want = list(gm(*x)), list(expected[i])
            if after is not None:
                for state in _state(gm):  # (a lowered copy shares its state tensors)
                    kept = operator.attrgetter(state)(after.reference)
                    left = operator.attrgetter(state)(gm)
                    if kept is not left:
                        kept.copy_(left)
                got += list(after.reference(*after.rereads[i]))
                want += list(after.expected[i])
            outputs.append(got)
            wanted.append(want)
            if above is not None and len(outputs) < len(inputs):
                rest = wanted_all[len(outputs):]  # (as if given exactly: no difference)
                bound = set_error(outputs + rest, wanted + rest)
                if bound > above:
                    return bound
    return set_error(outputs, wanted)


def _state(gm: fx.GraphModule) -> set[str]:
    """The buffers `gm` updates in place (its state: a language model's cache)."""
    return {str(updated(n).target) for n in gm.graph.nodes
            if updated(n) is not None and updated(n).op == "get_attr"}


def choose(gm: fx.GraphModule, low: str, target: float,
           inputs: Sequence[Sequence[torch.Tensor]],
           expected: Sequence[Sequence[torch.Tensor]],
           measure: Callable[[fx.GraphModule], float] | None = None,
           max_builds: int = 5) -> tuple[fx.GraphModule, Mix]:
    """The part lowered to `low` but for the fewest groups that hold it within `target`;
    CompileError when nothing short of fp32 does.

    torch eager ranks the groups and estimates how many must stay fp32; a runtime's bf16 is
    not torch's (OpenVINO's ran ViT-B 2-4x further off than torch's estimate), so where
    `measure` is given (a build's error on a real runtime) the count is settled on it: more
    groups kept (doubling) until a build holds, then halving the gap, `max_builds` builds
    at most. A part that keeps state (`_state`) is held on the state it leaves too (`After`),
    and settled on torch eager's runs of it: torch, its runtime, runs the graph as it is."""
    gm, groups, spans = spans_of(gm, low, inputs[0])
    after = after_runs(gm, inputs) if _state(gm) else None
    if after is not None:
        measure = lambda module: error_on(module, inputs, expected, after,  # noqa: E731
                                          above=target)
    everything = {n for nodes in spans.values() for n in nodes}
    order: list[str] = []
    alone: dict[str, float] = {}

    def ranked() -> list[str]:
        if not order:
            # on the first input: a run of the part per group (the count is then settled
            # on all of them)
            alone.update({g: error_on(lower(gm, spans[g], low), inputs[:1], expected[:1], after)
                          for g in groups})
            order.extend(sorted(groups, key=lambda g: -alone[g]))
        return order

    def keeping(k: int) -> fx.GraphModule:
        keep = {n for g in ranked()[:k] for n in spans[g]} if k else set()
        return lower(gm, everything - keep, low)

    k = _estimate(keeping, len(groups), target, inputs[:4], expected[:4], after)  # a guess
    if measure is None:
        if k >= len(groups):
            raise CompileError(f"{name(low)}: no group short of all {len(groups)} at fp32 "
                               f"holds {target:.0e} (torch's estimate)")
        module = chosen(keeping(k))
        return module, Mix(low, ranked()[:k], len(groups), alone,
                           error_on(module, inputs, expected, after), state=after is not None)
    k, error = _settle(keeping, min(k, len(groups) - 1), len(groups), target, measure,
                       max_builds)
    mix = Mix(low, ranked()[:k] if k else [], len(groups), alone, error, measured=True,
              state=after is not None)
    log.info("mixed precision: %s", mix.describe())
    return chosen(keeping(k)), mix


def chosen(module: fx.GraphModule) -> fx.GraphModule:
    """A lowered part as built and served: without the rounded weights its search shared
    (`ROUNDED`: those of the groups it kept fp32 too)."""
    module.meta.pop(ROUNDED, None)
    return module


def spans_of(gm: fx.GraphModule, low: str, inputs: Sequence[torch.Tensor],
           ) -> tuple[fx.GraphModule, dict[str, list[str]], dict[str, set[str]]]:
    """The part as lowered (its batch norms folded), its groups and each one's region."""
    gm = fold_batch_norms(gm)
    ShapeProp(gm).propagate(*inputs)  # dtypes where a part's inputs carry no meta val
    groups = compute_groups(gm)
    if not groups:
        raise CompileError(f"{name(low)}: the part has no matmul, conv or attention to lower")
    return gm, groups, regions(gm, groups)


def again(gm: fx.GraphModule, low: str, kept: Sequence[str],
          inputs: Sequence[torch.Tensor]) -> fx.GraphModule:
    """The mix a search chose (`Mix.kept`, recorded with the part's choice), made again
    without searching: a runtime that caches no build (torch, a language model's steps)
    lowers the part again at each build."""
    gm, _, spans = spans_of(gm, low, inputs)
    keep = {n for g in kept for n in spans.get(g, ())}
    return chosen(lower(gm, {n for nodes in spans.values() for n in nodes} - keep, low))


def _estimate(keeping: Callable[[int], fx.GraphModule], count: int, target: float,
              inputs: Sequence[Sequence[torch.Tensor]],
              expected: Sequence[Sequence[torch.Tensor]], after: After | None) -> int:
    """torch eager's count of groups to keep: 0 when all lowered holds, else the bisection's
    smallest k (`count` when only all of them hold)."""
    if error_on(keeping(0), inputs, expected, after, above=target) <= target:
        return 0
    lo, hi = 1, count
    while lo < hi:
        mid = (lo + hi) // 2
        if error_on(keeping(mid), inputs, expected, after, above=target) <= target:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _settle(keeping: Callable[[int], fx.GraphModule], k: int, count: int, target: float,
            measure: Callable[[fx.GraphModule], float], max_builds: int) -> tuple[int, float]:
    """The smallest k a real build holds `target` at, from torch's estimate `k` (the error
    of a build over it may be a bound: `error_on`'s `above`)."""
    errors: dict[int, float] = {}
    failing = -1
    while len(errors) < max_builds:
        errors[k] = measure(keeping(k))
        if errors[k] <= target:
            break
        failing = k
        if k >= count - 1:
            raise CompileError(f"no group short of all {count} at fp32 holds {target:.0e} "
                               f"(kept {k}: {errors[k]:.1e} or more)")
        k = min(count - 1, max(k + 1, 2 * k))
    else:
        raise CompileError(f"no build of {max_builds} held {target:.0e} (kept "
                           + ", ".join(f"{n}: {e:.1e} or more" for n, e in errors.items()) + ")")
    passing = k
    while len(errors) < max_builds and passing - failing > 1:
        mid = (passing + failing) // 2
        errors[mid] = measure(keeping(mid))
        if errors[mid] <= target:
            passing = mid
        else:
            failing = mid
    return passing, errors[passing]
