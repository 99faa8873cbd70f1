"""Cut an ExportedProgram into self-contained part modules along a Plan.

Each part becomes an fx.GraphModule that owns the parameters, buffers and constants it uses
(inlined back as attributes), takes the values that enter it as positional inputs and
returns the values other parts or the model's outputs need. Values are named as in the
submitted graph, so the engine wires parts by name and users can read the wiring.
"""

from __future__ import annotations

import contextlib
import copy
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx


@dataclass
class PartGraph:
    id: str
    module: fx.GraphModule
    inputs: list[str]  # value names, in the order the module takes them
    outputs: list[str]  # value names, in the order the module returns them


@dataclass
class SplitProgram:
    parts: list[PartGraph]  # in an order where every part comes after its producers
    inputs: list[str]  # the model's user inputs, in call order
    outputs: list[str]  # the values the model returns, in order

    def run(self, *args: Any) -> list[Any]:
        """Run every part with torch eager: the reference the compiled parts are checked by."""
        values = dict(zip(self.inputs, args, strict=True))
        for part in self.parts:
            results = part.module(*(values[name] for name in part.inputs))
            values.update(zip(part.outputs, results, strict=True))
        return [values[name] for name in self.outputs]

    def trace(self, *args: Any) -> dict[str, Any]:
        """Every value that crosses a part boundary, from one eager run (sample data per part)."""
        values = dict(zip(self.inputs, args, strict=True))
        for part in self.parts:
            results = part.module(*(values[name] for name in part.inputs))
            values.update(zip(part.outputs, results, strict=True))
        return values


def _state(ep: torch.export.ExportedProgram) -> dict[str, torch.Tensor]:
    """Placeholder name -> tensor for parameters, buffers and lifted constants."""
    sig = ep.graph_signature
    state: dict[str, Any] = {}
    for placeholder, key in sig.inputs_to_parameters.items():
        state[placeholder] = ep.state_dict[key]
    for placeholder, key in sig.inputs_to_buffers.items():
        state[placeholder] = ep.state_dict[key] if key in ep.state_dict else ep.constants[key]
    for placeholder, key in sig.inputs_to_lifted_tensor_constants.items():
        state[placeholder] = ep.constants[key]
    return state


def scalar(node: fx.Node) -> bool:
    """A node computing a number, not a tensor: a dynamic dimension's size (`sym_size`) or
    arithmetic on sizes. Such a value never crosses parts: each part that uses one computes
    it again from the tensors it sizes (its inputs then; a model input, most often)."""
    return node.op == "call_function" and isinstance(
        node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


def _crossing(compute: list[fx.Node], assignment: Mapping[str, str]) -> set[str]:
    """The values a part makes that another part reads: the tensors (a number is computed
    again where it is read, from the tensors it sizes: those are sent)."""
    out: set[str] = set()
    for node in compute:
        for user in node.users:
            if user.op == "output" or assignment[user.name] == assignment[node.name]:
                continue
            out |= _sized(node, assignment, assignment[user.name]) if scalar(node) else {
                node.name}
    return out


def _sized(node: fx.Node, assignment: Mapping[str, str], part: str) -> set[str]:
    """The tensors made by other parts than `part` that a number (`scalar`) is computed
    from, through the numbers it is computed from: what `part` must be sent to compute it."""
    out: set[str] = set()
    for arg in node.all_input_nodes:
        if scalar(arg):
            out |= _sized(arg, assignment, part)
        elif arg.op == "call_function" and assignment[arg.name] != part:
            out.add(arg.name)
    return out


def _aliased(node: fx.Node) -> fx.Node | None:
    """The value `node`'s result shares memory with (its first argument) where its op says
    so: a view, a `to` that converts nothing, an update in place (copy_, add_, index_copy_)."""
    target, args = node.target, node.args
    if (node.op != "call_function" or not isinstance(target, torch._ops.OpOverload)  # noqa: SLF001 - aten's op type
            or not args or not isinstance(args[0], fx.Node)):
        return None
    returns = target._schema.returns  # noqa: SLF001 - its schema
    return args[0] if returns and returns[0].alias_info is not None else None


def _memory(node: fx.Node) -> fx.Node:
    """The value whose memory `node`'s result is (following `_aliased`)."""
    while (of := _aliased(node)) is not None:
        node = of
    return node


def _updates_follow(compute: list[fx.Node], assignment: dict[str, str]) -> None:
    """An update in place whose result nothing reads goes to the part that made the value
    it updates (`x += n`: an update of the copy another part was sent would be lost), with
    the views between them (`x.to(dtype)` of a `copy_`, then `+= n`: transformers' cache
    position, one token a step), where nothing else they read is made by a third part."""
    from partitioner.fxgraph import updated

    for node in compute:
        target = updated(node)
        if target is None or node.users or target.name not in assignment:
            continue
        views = []
        while updated(target) is None and (base := _aliased(target)) is not None \
                and base.name in assignment:
            views.append(target)
            target = base
        home = assignment[target.name]
        if all(assignment.get(arg.name, home) == home or scalar(arg) for view in views
               for arg in view.all_input_nodes if arg is not _aliased(view)):
            assignment.update((view.name, home) for view in views)
        else:
            home = assignment[node.args[0].name]
        assignment[node.name] = home


def _copies(compute: list[fx.Node], assignment: Mapping[str, str], needed: set[str],
            user_outputs: set[str]) -> dict[str, fx.Node]:
    """A value that crosses parts is copied out when its part ends, after any later update
    in place of its memory there (a language model's state): where its readers in other
    parts read it before such an update (the cache's start position, read before
    `cumulative_length += n`), it is sent as a copy taken then. Per such value, the node
    after which its copy is taken (the value itself, or the last update its readers
    follow); ValueError where no one copy serves them all."""
    from partitioner.fxgraph import updated

    order = {n: i for i, n in enumerate(compute)}
    updates: dict[fx.Node, list[fx.Node]] = {}
    for node in compute:
        if updated(node) is not None:
            updates.setdefault(_memory(node), []).append(node)
    taken: dict[str, fx.Node] = {}
    for node in compute:
        later = [m for m in updates.get(_memory(node), []) if order[m] > order[node]]
        if node.name not in needed or not later:
            continue
        if any(assignment[m.name] != assignment[node.name] for m in later):
            raise ValueError(f"{node.name} is updated in place by another part: the program "
                             "cannot be split there")
        readers = [u for u in node.users
                   if u.op != "output" and assignment[u.name] != assignment[node.name]]
        seen = {sum(order[m] < order[u] for m in later) for u in readers}
        seen |= {len(later)} if node.name in user_outputs else set()
        if len(seen) > 1:
            raise ValueError(f"{node.name} is read by other parts between its updates in "
                             "place: the program cannot be split there")
        k = seen.pop() if seen else len(later)
        if k < len(later):
            taken[node.name] = later[k - 1] if k else node
    return taken


def _build_part(part_id: str, nodes: list[fx.Node], owner: Mapping[str, str],
                state: Mapping[str, torch.Tensor], needed: set[str],
                taken: Mapping[str, fx.Node] | None = None) -> PartGraph:
    graph = fx.Graph()
    root = torch.nn.Module()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[str] = []
    members = {n.name for n in nodes}

    def bring(value: fx.Node) -> fx.Node:
        if value in env:
            return env[value]
        if scalar(value) and value.name not in members:  # computed here again (`scalar`)
            env[value] = graph.node_copy(value, bring)
            return env[value]
        if value.name in state:  # a weight: inline it into this part
            attr = value.name
            root.register_buffer(attr, state[attr], persistent=False)
            env[value] = graph.get_attr(attr)
        else:  # a model input or a value made by another part
            env[value] = graph.placeholder(value.name)
            inputs.append(value.name)
        env[value].meta = dict(value.meta)
        return env[value]

    for node in nodes:
        for arg in node.all_input_nodes:
            if arg.name not in members:
                bring(arg)
        env[node] = graph.node_copy(node, lambda n: env[n])
    sent = {n.name: env[n] for n in nodes if n.name in needed}
    for name, after in (taken or {}).items():  # a copy taken before a later update here
        if name in sent:
            with graph.inserting_after(env[after]):
                copied = graph.call_function(torch.ops.aten.clone.default, (sent[name],))
            copied.meta = dict(sent[name].meta)
            sent[name] = copied
    outputs = list(sent)
    graph.output(tuple(sent.values()))
    module = fx.GraphModule(root, graph, class_name=f"Part_{part_id}")
    return PartGraph(part_id, module, inputs, outputs)


def split_program(ep: torch.export.ExportedProgram,
                  assignment: Mapping[str, str] | Sequence[tuple[str, Sequence[str]]],
                  ) -> SplitProgram:
    """Split `ep` into parts.

    `assignment` is either node name -> part id, or a list of (part id, node names) such as
    a Plan's parts. Every call_function node must belong to exactly one part; the parts must
    form an acyclic graph (a Plan guarantees it) and are returned in dependency order.
    """
    if not isinstance(assignment, Mapping):
        assignment = {name: pid for pid, names in assignment for name in names}
    assignment = dict(assignment)
    for node in ep.graph.nodes:  # a tuple never crosses parts: its getitems follow the op
        if node.op == "call_function" and node.target is operator.getitem:
            producer = node.args[0]
            if isinstance(producer, fx.Node) and producer.name in assignment:
                assignment[node.name] = assignment[producer.name]
    state = _state(ep)
    graph_nodes = list(ep.graph.nodes)
    compute = [n for n in graph_nodes if n.op == "call_function"]
    missing = [n.name for n in compute if n.name not in assignment]
    if missing:
        raise ValueError(f"nodes without a part: {missing[:5]}{'...' if len(missing) > 5 else ''}")
    output_node = graph_nodes[-1]
    n_user = len(ep.graph_signature.user_outputs)
    user_outputs = list(output_node.args[0][:n_user])
    needed = {a.name for a in user_outputs if isinstance(a, fx.Node)}
    _updates_follow(compute, assignment)
    returned = set(needed)
    needed |= _crossing(compute, assignment)
    taken = _copies(compute, assignment, needed, returned)
    by_part: dict[str, list[fx.Node]] = {}
    for node in compute:
        by_part.setdefault(assignment[node.name], []).append(node)
    parts = [_build_part(pid, nodes, assignment, state, needed, taken)
             for pid, nodes in by_part.items()]
    return SplitProgram(_dependency_order(parts), list(ep.graph_signature.user_inputs),
                        [a.name for a in user_outputs])


def _dependency_order(parts: list[PartGraph]) -> list[PartGraph]:
    producer = {name: p.id for p in parts for name in p.outputs}
    order: list[PartGraph] = []
    done: set[str] = set()
    pending = list(parts)
    while pending:
        ready = [p for p in pending
                 if all(producer.get(i) in done or i not in producer for i in p.inputs)]
        if not ready:
            raise ValueError("parts form a cycle: "
                             + ", ".join(p.id for p in pending))
        for p in ready:
            order.append(p)
            done.add(p.id)
            pending.remove(p)
    return order


_LINEAR = torch.ops.aten.linear.default
_END = 2**63 - 1  # a slice to the end, as aten writes it


def last_rows(split: SplitProgram) -> SplitProgram | None:
    """The split with its first output computed for the last position only: where that
    output is a linear over [batch, n, features] (a language model's logits: its head, the
    largest matrix of all, applied to every position of a prompt), the linear's input is cut
    to [batch, 1, features] first, as optimum-intel's and vLLM's generation do: generation
    reads the last position's logits alone. The part that makes it is a new module over the
    same weights (nothing copied); the others are the split's own. None where the first
    output is not such a linear."""
    name = split.outputs[0]
    owner = next((p for p in split.parts if name in p.outputs), None)
    if owner is None:
        return None
    graph = copy.deepcopy(owner.module.graph)
    out = next(n for n in graph.nodes if n.op == "output")
    node = out.args[0][owner.outputs.index(name)]
    rows = node.args[0] if node.target is _LINEAR else None
    val = rows.meta.get("val") if isinstance(rows, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() != 3:
        return None
    with graph.inserting_before(node):
        last = graph.call_function(torch.ops.aten.slice.Tensor, (rows, 1, -1, _END))
    node.args = (last, *node.args[1:])
    fake = getattr(val, "fake_mode", None)  # (the runtimes read each value's meta)
    with fake if fake is not None else contextlib.nullcontext():
        last.meta["val"] = torch.ops.aten.slice.Tensor(val, 1, -1, _END)
        node.meta["val"] = _LINEAR(last.meta["val"], *(
            a.meta["val"] if isinstance(a, fx.Node) else a for a in node.args[1:]))
    module = fx.GraphModule(owner.module, graph, class_name=type(owner.module).__name__)
    module.meta.update(owner.module.meta)  # (a stateful part's initial state: the same)
    part = PartGraph(owner.id, module, owner.inputs, owner.outputs)
    return SplitProgram([part if p is owner else p for p in split.parts], split.inputs,
                        split.outputs)
