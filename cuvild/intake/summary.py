"""Model intake: turn an uploaded archive into a registry summary, never running its code.

The archive is opened by cuvild/intake/safe_load.py (allow-listed entries, no pickle, built-in op
namespaces only); anything it refuses becomes INVALID_ARGUMENT naming the entry.

`inspect_archive` opens it in a child process under memory and CPU limits, so that what a
crafted archive costs to parse is paid there, not in the daemon's interpreter (its GIL, its
deserializer lock, its heap). Children fork from the daemon's forkserver (cuvild/intake/forks.py),
which has imported torch and the loader once: +40-60 ms an upload over loading in-process. Its
start costs ~3 s of CPU (2-core host, torch 2.13): it starts (`start_inspector`) as the
first bytes of an upload of unknown bytes arrive, while the rest do, where they begin as a
zip does (`zip_head`; bytes that do not are refused without it: one upload of junk to a
daemon that served from its records made it a resident forkserver and torch in the daemon,
~9 s of CPU). Bytes inspected before are not inspected again (cuvild/intake/verdicts.py).
"""

from __future__ import annotations

import signal
import zipfile
from pathlib import Path
from typing import Any

from cuvild.intake import forks

# Limits of one inspection. Memory (RLIMIT_DATA): the child's data segment when it starts,
# plus the archive's uncompressed size (payloads are read into memory), plus this much.
INSPECT_MEMORY_BYTES = 1 << 30
INSPECT_CPU_SECONDS = 120
_WALL_SECONDS_PER_CPU_SECOND = 2.5  # a child that sleeps or blocks is stopped too


def _spec(name: str, value: Any) -> dict[str, Any]:
    shape = [d if isinstance(d, int) else -1 for d in getattr(value, "shape", [])]
    dtype = str(getattr(value, "dtype", "")).removeprefix("torch.")
    return {"name": name, "dtype": dtype, "shape": shape}


# Ops an index passes through unchanged in value on its way to an embedding.
_SAME_VALUES = {"view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "expand", "flatten",
                "clone", "contiguous", "alias", "_to_copy", "to", "slice", "select", "permute",
                "transpose", "t"}


def index_bound(node: Any) -> int | None:
    """The rows of the smallest embedding table that integer input `node` indexes (through
    ops that keep its values), or None when it indexes none: token ids below this bound are
    valid inputs, so the checks of a text model can draw them at random instead of all ones
    (an attention mask, which indexes nothing, stays ones)."""
    bounds, seen, todo = [], set(), [node]
    while todo:
        current = todo.pop()
        for user in current.users:
            if user in seen:
                continue
            seen.add(user)
            name = getattr(getattr(user.target, "_schema", None), "name", "")
            op = name.removeprefix("aten::")
            if op == "embedding" and len(user.args) > 1 and user.args[1] is current:
                weight = getattr(user.args[0], "meta", {}).get("val")
                if weight is not None and isinstance(weight.shape[0], int):
                    bounds.append(weight.shape[0])
            elif op in _SAME_VALUES and user.args and user.args[0] is current:
                todo.append(user)
    return min(bounds) if bounds else None


def summarize(ep: Any, out_spec: str = "") -> dict[str, Any]:
    """Node counts and the user-visible inputs/outputs (-1 for dynamic dims) of a program.
    Inputs are named as the program's placeholders (the forward's argument names), outputs
    by their field paths in the program's output spec (trees.leaf_names: `logits`,
    `hidden_states.0`; `output0`... for a tuple or a lone tensor). `out_spec`, the spec as
    uploaded, is kept as data for clients (ModelRecord.out_spec)."""
    import torch.utils._pytree as pytree

    from cuvild.intake.trees import leaf_names
    from partitioner.annotate import annotations

    nodes = {n.name: n for n in ep.graph.nodes}
    sig = ep.graph_signature
    inputs = [_spec(name, nodes[name].meta.get("val")) for name in sig.user_inputs]
    for spec in inputs:
        high = index_bound(nodes[spec["name"]]) if "int" in spec["dtype"] else None
        if high:
            spec["high"] = high  # exclusive; the engine's check inputs draw ids below it
    output_node = next(n for n in ep.graph.nodes if n.op == "output")
    values = output_node.args[0][: len(sig.user_outputs)]
    spec = ep.call_spec.out_spec
    names = leaf_names(pytree.treespec_dumps(spec)) if spec is not None else []
    if len(names) != len(values):
        names = [f"output{i}" for i in range(len(values))]
    outputs = [_spec(name, arg.meta.get("val") if hasattr(arg, "meta") else None)
               for name, arg in zip(names, values, strict=True)]
    return {
        "num_nodes": sum(1 for n in ep.graph.nodes if n.op == "call_function"),
        "annotated_nodes": len(annotations(ep)),
        "inputs": inputs,
        "outputs": outputs,
        "out_spec": out_spec,
    }


# A torch.export archive is a zip written from its first entry on: it begins with that entry's
# local header. (zipfile would also open a zip behind other bytes, as a self-extractor is.)
ZIP_HEAD = b"PK\x03\x04"


def zip_head(head: bytes) -> bool:
    """Whether bytes beginning with `head` can be an archive (read here, not by a child)."""
    return head[:len(ZIP_HEAD)] == ZIP_HEAD


def inspect_archive(path: Path, max_bytes: int) -> dict[str, Any]:
    """Load the archive safely and summarise it, in a child process under memory and CPU
    limits. Raises ValueError (UnsafeArchive) if refused or over a limit."""
    from cuvild.intake.errors import UnsafeArchive

    with open(path, "rb") as f:
        if not zip_head(f.read(len(ZIP_HEAD))):
            raise UnsafeArchive("<archive>", "not a readable zip archive (its first bytes are "
                                "not a zip entry's header)")
    return _inspect_in_child(Path(path), max_bytes, INSPECT_MEMORY_BYTES, INSPECT_CPU_SECONDS)


def start_inspector() -> None:
    """Start the forkserver now (as an upload's first bytes arrive), so that its inspection
    does not wait for it. Optional: inspect_archive starts it when needed."""
    forks.start()


def _inspect_in_child(path: Path, max_bytes: int, memory: int, cpu: int) -> dict[str, Any]:  # noqa: C901 - the child's steps and its failures in order
    from cuvild.intake.errors import UnsafeArchive  # (no torch in the daemon for this)

    ctx = forks.context()
    reader, writer = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(writer, str(path), max_bytes, memory, cpu),
                        name="cuvild-inspect", daemon=True)
    wall = cpu * _WALL_SECONDS_PER_CPU_SECOND
    message: Any = None
    try:
        child.start()
        writer.close()
        if not reader.poll(wall):
            message = ("wall",)
        else:
            try:
                message = reader.recv()
            except EOFError:  # it died before answering
                message = None
    finally:
        reader.close()
        writer.close()
        if child.is_alive():
            child.kill()
        if child.pid is not None:
            child.join()
    limits = f"{memory >> 20} MiB beyond the archive's size / {cpu} s of CPU"
    if message is None:
        if child.exitcode in (-signal.SIGXCPU, -signal.SIGKILL):
            raise ValueError(f"archive inspection exceeded {cpu} s of CPU")
        raise ValueError(f"archive inspection died (exit code {child.exitcode}) under its "
                         f"limits of {limits}")
    kind, *rest = message
    if kind == "ok":
        return rest[0]
    if kind == "unsafe":
        raise UnsafeArchive(*rest)
    if kind == "memory":
        raise ValueError(f"archive inspection exceeded {memory >> 20} MiB of memory beyond the "
                         "archive's size")
    if kind == "wall":
        raise ValueError(f"archive inspection exceeded {wall:.0f} s")
    if kind == "value":
        raise ValueError(rest[0])
    raise ValueError(f"archive inspection failed: {rest[0]}")


def _data_size() -> int | None:
    """This process's data segment (heap and private writable mappings), the amount that
    RLIMIT_DATA bounds. Not RLIMIT_AS: CUDA and glibc reserve large address ranges they
    never touch (PROT_NONE), which RLIMIT_AS counts and RLIMIT_DATA does not."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _limit(which: int, soft: int) -> None:
    import resource

    _, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(which, (soft, hard))


def _child(conn: Any, path: str, max_bytes: int, memory: int, cpu: int) -> None:
    """Runs in the forked child: limit yourself, inspect, send one tuple back."""
    import resource

    import torch

    from cuvild.intake.safe_load import UnsafeArchive, load_archive

    try:
        _limit(resource.RLIMIT_CPU, cpu)  # SIGXCPU past it
        try:
            with zipfile.ZipFile(path) as z:
                size = sum(i.file_size for i in z.infolist())
        except (OSError, ValueError, EOFError, zipfile.BadZipFile):
            size = 0  # the loader refuses it with a precise reason
        base = _data_size()
        if base is not None:
            _limit(resource.RLIMIT_DATA, base + memory + min(size, max_bytes))
        torch.set_num_threads(1)  # nothing to compute; no thread pools or their arenas
        ep, info = load_archive(path, max_bytes=max_bytes)
        result: tuple[Any, ...] = ("ok", summarize(ep, info.trees.get("out_spec", "")))
    except UnsafeArchive as e:
        result = ("unsafe", e.entry, e.reason)
    except MemoryError:
        result = ("memory",)
    except RuntimeError as e:  # torch's allocator: "can't allocate memory", std::bad_alloc
        result = ("memory",) if "alloc" in str(e) else ("error", f"RuntimeError: {e}")
    except ValueError as e:
        result = ("value", str(e))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises
        result = ("error", f"{type(e).__name__}: {e}")
    try:
        conn.send(result)
    except MemoryError:
        conn.send(("memory",))
    finally:
        conn.close()
