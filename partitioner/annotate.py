"""``@partition``: let the model's author pin a region of the model to a device or precision.

The partitioner places ops by cost, but the author sometimes knows better: a block the NPU
compiler mishandles, a head that must stay fp32. ``partition`` records that wish in the model's
own code, where it survives refactors, instead of in a side table keyed by node names that
change from one export to the next.

How: the annotated region runs under ``torch.fx.traceback.annotate``, so every graph node traced
inside it gets ``node.meta["custom"][ANNOTATION_KEY] = {"device", "precision", "strict"}`` (and
``"max_error"`` when a region sets one for ``precision="auto"``).
``meta["custom"]`` is where torch keeps user metadata: unlike a key of one's own in ``node.meta``,
it reaches the nodes ``ExportedProgram.run_decompositions()`` makes and goes through
``torch.export.save``/``load`` (for placeholders it does not). Non-strict export
(torch's default) records it only under ``torch.fx.traceback.preserve_node_meta()``: :func:`export`
sets that up, and so may a caller who runs ``torch.export.export`` itself. Strict (Dynamo) export
records it either way.

Nesting: a region inside another (an annotated submodule of an annotated model) wins for the
fields it sets and inherits the others from the enclosing region. Annotating the same target
again (a decorated class decorated again, an instance of a decorated class, a subclass that
inherits a decorated ``forward``) merges into one annotation, the latest application winning
for the fields it sets.

Node meta records where a node was traced: with non-strict export only ``call_function`` nodes
carry annotations, never placeholders (parameters, buffers, inputs) or the output node; strict
export also annotates the placeholders of parameters and buffers first used inside a region.

Outside tracing, an annotated callable is the original plus a check that no tracer is running;
it leaves torch's tracing context, a process-wide global, alone. Because that context is
global, do not run annotated code in other threads while an export is in progress.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from types import MethodType
from typing import Any, NotRequired, TypedDict, TypeVar

import torch
import torch.fx.traceback as fx_traceback
from torch import nn

from partitioner.profile import DTYPES, KINDS

__all__ = ["ANNOTATION_KEY", "PartitionAnnotation", "annotations", "export", "partition"]

ANNOTATION_KEY = "cuvil.partition"
"""Key of the annotation inside ``node.meta["custom"]``."""

_DEVICE_RE = re.compile(rf"(?:{'|'.join(KINDS)})\d*")
_FIELDS = ("device", "precision", "strict", "max_error")
# "auto": the engine picks the fastest precision whose outputs stay within the error budget
PRECISIONS = (*DTYPES, "auto")
_MARK = "__cuvil_partition__"  # on wrapper functions: the request they apply

_T = TypeVar("_T")
_Request = dict[str, Any]  # the fields as given: None means "inherit"


class PartitionAnnotation(TypedDict):
    """What a node carries under ``meta["custom"][ANNOTATION_KEY]``.

    ``device``: a kind ("cpu", "gpu", "npu") or a device id ("npu0"); None lets the planner
    choose. ``precision``: one of ``partitioner.profile.DTYPES``, or "auto" (the fastest
    precision whose outputs stay within the error budget: ``max_error``, else the model's);
    None follows the model's precision policy. ``strict``: True if the placement is a
    requirement, False if only a hint the planner may override when another placement is
    cheaper.
    """

    device: str | None
    precision: str | None
    strict: bool
    max_error: NotRequired[float]


def partition(
    device: str | None = None,
    precision: str | None = None,
    strict: bool | None = None,
    max_error: float | None = None,
) -> Callable[[_T], _T]:
    """Annotate a module class, a module instance or a function with a placement request.

    ``@partition(device="npu")`` on an ``nn.Module`` subclass annotates every instance's
    ``forward``; ``partition(device="npu")(module)`` annotates that instance in place and returns
    it (parameter names are unchanged); on a function it returns an annotated wrapper.

    Arguments left as None are inherited from an enclosing annotated region; ``strict`` is True
    when no region sets it. Raises ValueError at decoration time on a bad argument.
    """
    request = _validated(device, precision, strict, max_error)

    def apply(target: _T) -> _T:
        if isinstance(target, type) and issubclass(target, nn.Module):
            return _annotate_class(target, request)
        if isinstance(target, nn.Module):
            return _annotate_instance(target, request)
        if callable(target):
            return _annotate_function(target, request)
        raise TypeError(f"partition: cannot annotate {type(target).__name__} objects")

    return apply


def export(
    model: nn.Module,
    example_inputs: tuple[Any, ...],
    dynamic_shapes: Any = None,
    strict: bool = False,
    kwargs: dict[str, Any] | None = None,
) -> torch.export.ExportedProgram:
    """``torch.export.export`` that keeps ``partition`` annotations in the graph.

    ``strict`` is torch.export's tracing mode (Dynamo when True), unrelated to
    ``partition(strict=...)``; ``kwargs`` are keyword example inputs.
    """
    with fx_traceback.preserve_node_meta():
        return torch.export.export(
            model, example_inputs, kwargs, dynamic_shapes=dynamic_shapes, strict=strict
        )


def annotations(ep: torch.export.ExportedProgram) -> dict[str, PartitionAnnotation]:
    """The annotated nodes of ``ep``'s graph: node name -> a copy of its annotation."""
    found = {}
    for node in ep.graph.nodes:
        value = (node.meta.get("custom") or {}).get(ANNOTATION_KEY)
        if value is not None:
            found[node.name] = PartitionAnnotation(**value)
    return found


def _validated(device: str | None, precision: str | None, strict: bool | None,
               max_error: float | None = None) -> _Request:
    if device is not None and not (isinstance(device, str) and _DEVICE_RE.fullmatch(device)):
        raise ValueError(
            f"partition: device must be None, a kind in {KINDS} or a device id like 'npu0', "
            f"got {device!r}"
        )
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"partition: precision must be None or one of {PRECISIONS}, "
                         f"got {precision!r}")
    if strict is not None and not isinstance(strict, bool):
        raise ValueError(f"partition: strict must be None, True or False, got {strict!r}")
    if max_error is not None and (isinstance(max_error, bool) or not isinstance(
            max_error, (int, float)) or not 0 < max_error < 1):
        raise ValueError(f"partition: max_error must be a relative error in (0, 1), got "
                         f"{max_error!r}")
    if max_error is not None and precision not in (None, "auto"):
        raise ValueError(f"partition: max_error bounds precision='auto', not {precision!r}")
    return {"device": device, "precision": precision, "strict": strict,
            "max_error": None if max_error is None else float(max_error)}


def _overlay(base: Mapping[str, Any] | None, top: Mapping[str, Any]) -> _Request:
    """``top``'s fields, with those it leaves None taken from ``base``."""
    base = base or {}
    return {f: top[f] if top.get(f) is not None else base.get(f) for f in _FIELDS}


def _region(request: _Request) -> AbstractContextManager[None]:
    """The ``annotate`` context for ``request`` nested in whatever region is active now.

    A no-op unless a tracer that records node meta is running: the tracing context is a
    process-wide global in torch, and eager calls have no reason to touch it.
    """
    if not (fx_traceback.has_preserved_node_meta() or torch.compiler.is_compiling()):
        return nullcontext()
    custom = fx_traceback.get_current_meta().get("custom") or {}
    value = _overlay(custom.get(ANNOTATION_KEY), request)
    if value["strict"] is None:
        value["strict"] = True
    if value["max_error"] is None:  # only regions that set one carry it
        del value["max_error"]
    return fx_traceback.annotate({ANNOTATION_KEY: value})


def _wrap(fn: Callable[..., Any], request: _Request) -> Callable[..., Any]:
    """``fn`` running in ``request``'s region; re-wrapping merges instead of nesting."""
    inner = getattr(fn, _MARK, None)
    if inner is not None:
        fn, request = fn.__wrapped__, _overlay(inner, request)

    @functools.wraps(fn)
    def annotated(*args: Any, **kwargs: Any) -> Any:
        with _region(request):
            return fn(*args, **kwargs)

    setattr(annotated, _MARK, request)
    return annotated


def _annotate_function(fn: _T, request: _Request) -> _T:
    return _wrap(fn, request)  # type: ignore[return-value]


def _annotate_class(cls: _T, request: _Request) -> _T:
    cls.forward = _wrap(cls.forward, request)  # type: ignore[attr-defined]
    return cls


def _annotate_instance(module: _T, request: _Request) -> _T:
    own = vars(module).get("forward")
    if own is not None and not isinstance(own, _InstanceForward):
        raise TypeError("partition: the module already has its own instance-level forward")
    if own is not None:
        request = _overlay(own.args[1], request)
    vars(module)["forward"] = _InstanceForward(_instance_forward, module, request)
    return module


def _class_forward(module: nn.Module, request: _Request) -> tuple[Callable[..., Any], _Request]:
    """The unannotated ``forward`` of ``module``'s class, and ``request`` over the class's."""
    forward = type(module).forward
    class_request = getattr(forward, _MARK, None)
    if class_request is None:
        return forward, request
    return forward.__wrapped__, _overlay(class_request, request)


def _instance_forward(module: nn.Module, request: _Request, *args: Any, **kwargs: Any) -> Any:
    forward, request = _class_forward(module, request)
    with _region(request):
        return forward(module, *args, **kwargs)


class _InstanceForward(functools.partial):
    """``forward`` of an annotated instance: ``partial(_instance_forward, module, request)``.

    A partial rather than a closure or bound method: ``copy.deepcopy`` and ``pickle`` carry it
    with the module (rebinding it to the copy), and torch.export knows partials (it reads
    ``forward.func.__code__``). ``__signature__`` is the class forward's, because torch.export
    matches ``dynamic_shapes`` to the argument names of ``inspect.signature(module.forward)``.
    """

    @property
    def __signature__(self) -> inspect.Signature:
        module, request = self.args
        return inspect.signature(MethodType(_class_forward(module, request)[0], module))
