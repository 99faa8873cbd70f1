"""What the daemon and a device worker say to each other: typed orders and replies.

An order travels to the worker in an `Envelope` over a pipe (pickled) and comes back as a
`Reply` with the same id. Orders build, restore, choose and drop parts, unmap clients'
objects, and attach sessions and bells (whose rings then run the parts: requests never travel
here, cuvild/run/bells.py). `TensorRef` says where a tensor lives in shared memory. The
classes are slotted dataclasses: typed, and measured as cheap to pickle as the dicts they
replace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple


class TensorRef(NamedTuple):
    """Where a tensor lives: a named shared-memory segment and a place in it."""

    segment: str
    offset: int
    dtype: str  # torch dtype name, e.g. "float32"
    shape: tuple[int, ...]
    inode: int = 0  # a client's region: the object registered (0: the daemon's arena)


class RawTensor(NamedTuple):
    """An input as a request's bytes (C order, native byte order), copied once, into the
    arena."""

    data: bytes
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Build:
    """Build (compile, or load from the compile cache) one part of a model, at one or more
    precisions: the first is the part's own and must build; the others are candidates of a
    precision search, each kept when a runtime runs it within `tolerance`."""

    model: str  # the key the part is served under (a dynamic model's bucket has its own)
    part: str
    archive: str  # the registered .pt2, opened with the safe loader
    assignment: list[tuple[str, list[str]]]  # the plan: part id -> node names
    precisions: list[str]
    input_specs: list[dict[str, Any]]  # the model's inputs: name, dtype, shape (-1: dynamic)
    timeout_s: float  # per runtime candidate
    split_key: str  # the split is shared by a model's buckets: kept under the base model's key
    input_shapes: list[list[int]] | None = None  # this part's input shapes, for a bucket
    last: bool = False  # the model's last part on this device: the split may go after it
    tolerance: float | None = None  # the error budget of a search's lower precisions
    budget: float | None = None  # the model's end-to-end budget: a mixed part aims at half
    calibration: str = ""  # an .npz of the model's inputs, one row per sample ("": none)
    calibration_tag: str = ""  # its digest: int8 builds depend on it
    allowed: list[str] | None = None  # the runtimes `auto` may try (config engine.runtimes)
    floor_ms: dict[str, float] | None = None  # per precision, the part's roofline time
    defer_mix: bool = True  # a mix whose low precision alone builds waits for the end-to-end
    # check to refuse that (cuvild/workers/build.py `_needless_mix`); False: built now


@dataclass(frozen=True, slots=True)
class Restore:
    """Load one part's executable from the compile cache, as a load record names it: no
    archive, no split, nothing compiled or timed (cuvild/load/warm.py)."""

    model: str
    part: str
    runtime: str
    part_key: str  # with the runtime and its installed version: the cache entry
    precision: str
    shapes: list[tuple[str, tuple[int, ...]]]  # the part's inputs: dtype name, shape


@dataclass(frozen=True, slots=True)
class Choose:
    """Run a part at one of the precisions it was built at; `final` drops the others."""

    model: str
    part: str
    precision: str
    final: bool = False


@dataclass(frozen=True, slots=True)
class Unload:
    """Drop every part of a model."""

    model: str


@dataclass(frozen=True, slots=True)
class Preload:
    """Read a model's archive now, for the Builds that follow (cuvild/workers/build.py
    `preload`): a worker reads it while the daemon reads it too, not after."""

    archive: str


@dataclass(frozen=True, slots=True)
class Forget:
    """Unmap client shared-memory objects (name, inode) whose regions were unregistered."""

    segments: list[tuple[str, int]]


@dataclass(frozen=True, slots=True)
class EndSequence:
    """A sequence of a stateful model ended (cuvild/run/sequences.py): its parts here drop the
    state they kept for its slot."""

    model: str
    slot: int


@dataclass(frozen=True, slots=True)
class CopySequence:
    """A sequence starts from another's state (n choices of one prompt: the prompt ran once,
    cuvild/serve/generation.py; a kept prefix, cuvild/run/prefixes.py): the parts here copy
    the state they keep for slot `source` into slot `slot`'s; with `length`, cut back to its
    first `length` positions (its written counts set to it: runtimes/state.py)."""

    model: str
    source: int
    slot: int
    length: int = 0  # 0: all of it


@dataclass(frozen=True, slots=True)
class Describe:
    """How a built part runs now, in a line (`cuvilctl partition`): a language model's decode
    step compiled by inductor or eager, and why; answered between runs."""

    model: str
    part: str


@dataclass(frozen=True, slots=True)
class LogLevel:
    """The worker's log level: the daemon's `log_level`, as a config reload changed it."""

    level: str


@dataclass(frozen=True, slots=True)
class Described:
    text: str  # "" where there is nothing more to say than the plan does


@dataclass(frozen=True, slots=True)
class Attach:
    """Serve a fast-path session of a one-part model here, or with layout "kind" "bell" an
    engine's bell for one part (cuvild/workers/sessions.py): the client's socket, the
    session's memfd and its counts' memfd follow this order on the pipe (SCM_RIGHTS)."""

    model: str
    part: str
    layout: dict[str, Any]  # as the session's open reply gave it to the client


Order = (Build | Preload | Unload | Forget | Choose | Restore | Attach | EndSequence
         | CopySequence | Describe | LogLevel)


@dataclass(frozen=True, slots=True)
class Envelope:
    id: int
    order: Order


@dataclass(frozen=True, slots=True)
class Variant:
    """A part built at one precision: the runtime that won, its time and its error."""

    precision: str
    runtime: str
    median_ms: float
    rel_error: float
    part_key: str = ""  # where its executable is cached (runtimes/cache.py part_key)


@dataclass(frozen=True, slots=True)
class Built:
    runtime: str  # the winner at the part's own precision (the first asked for)
    from_cache: bool
    candidates: list[dict[str, Any]] = field(default_factory=list)  # every runtime tried
    variants: list[Variant] = field(default_factory=list)  # one per precision that built
    # the signed compile-cache entry it runs from (runtimes/cache.py artifact): hash, runtime,
    # runtime_version, verified; {} for a part with none (torch eager)
    artifact: dict[str, Any] = field(default_factory=dict)
    # how a GPU part's kernels are launched: "cuda graph ...", "kernel by kernel: why"
    # (runtimes/graphs.py); "" where that does not apply
    graph: str = ""


@dataclass(frozen=True, slots=True)
class Progress:
    """Sent while a Build runs, before its reply: what it is doing (e.g. "trying openvino")."""

    text: str


@dataclass(frozen=True, slots=True)
class Reply:
    id: int
    result: Built | Progress | Described | None = None
    error: str = ""  # "ExceptionType: message" when the order failed

    @property
    def ok(self) -> bool:
        return not self.error
