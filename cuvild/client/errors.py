"""The client's errors: one class per status a caller acts on, the same on every path.

A gRPC call's status, a fast-path answer and a check the client makes before sending all
become a `CuvildError` of the class for their status (`NotFound`, `AlreadyExists`,
`InvalidArgument`, ...), so a caller catches what it can handle by type, not by reading a
grpc exception's repr. `code` is the status name ("NOT_FOUND"), `message` the daemon's words.
"""

from __future__ import annotations

from typing import Any


class CuvildError(RuntimeError):
    """A call to cuvild was refused or failed. `CuvildError(code, message)` makes the
    subclass for `code` (NotFound for "NOT_FOUND"), so `except NotFound` works whichever
    path raised it."""

    code = "UNKNOWN"

    def __new__(cls, code: str, message: str) -> CuvildError:  # noqa: ARG004 - __init__ takes them
        if cls is CuvildError:
            cls = BY_CODE.get(code, CuvildError)
        return super().__new__(cls)

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message

    def __reduce__(self) -> tuple[Any, ...]:
        return CuvildError, (self.code, self.message)


class NotFound(CuvildError):
    """No such model (or version, or shared-memory region)."""


class AlreadyExists(CuvildError):
    """The name and version are registered with other content."""


class InvalidArgument(CuvildError):
    """A bad request: an input's name, dtype or shape, a bad option."""


class Unavailable(CuvildError):
    """The daemon cannot be reached, or the model is not ready (loading or failed)."""


class DeadlineExceeded(CuvildError):
    """No answer within the call's timeout."""


class PermissionDenied(CuvildError):
    """This caller may not do that (a region it does not own, shared memory over TCP)."""


class ResourceExhausted(CuvildError):
    """A limit was reached: connections, uploads, regions, bytes."""


class Unimplemented(CuvildError):
    """The daemon does not do that (a fast path for that model, a protocol call)."""


class Internal(CuvildError):
    """The daemon failed (its log says more)."""


BY_CODE: dict[str, type[CuvildError]] = {
    "NOT_FOUND": NotFound, "ALREADY_EXISTS": AlreadyExists,
    "INVALID_ARGUMENT": InvalidArgument, "FAILED_PRECONDITION": InvalidArgument,
    "OUT_OF_RANGE": InvalidArgument, "UNAVAILABLE": Unavailable,
    "DEADLINE_EXCEEDED": DeadlineExceeded, "PERMISSION_DENIED": PermissionDenied,
    "UNAUTHENTICATED": PermissionDenied, "RESOURCE_EXHAUSTED": ResourceExhausted,
    "UNIMPLEMENTED": Unimplemented, "INTERNAL": Internal,
}

def convert_hint(dtype: str) -> str:
    """How to give an input the dtype a model takes (a torch dtype name, "float32")."""
    return f"convert it first (numpy: x.astype(np.{dtype}); torch: x.to(torch.{dtype}))"


# grpc's own words when no daemon answered at all (no socket, nothing listening)
_UNREACHABLE = ("failed to connect", "connection refused", "no such file", "connect failed")


def from_rpc(err: Any, target: str) -> CuvildError:
    """The CuvildError for a grpc.RpcError: its status and details, and where nothing answered,
    the address tried and what to check."""
    code, details = err.code().name, err.details() or ""
    if code == "UNAVAILABLE" and any(w in details.lower() for w in _UNREACHABLE):
        details = (f"cannot reach cuvild at {target}: is it running (`make run`, `systemctl "
                   "start cuvild`)? Another address: Client(target=...), $CUVIL_TARGET or "
                   f"cuvilctl --target ({details})")
    return CuvildError(code, details)


class Translated:
    """A gRPC stub whose calls raise CuvildError instead of grpc.RpcError (unary and
    client-streaming calls: the error comes from the call itself)."""

    def __init__(self, stub: Any, target: str) -> None:
        self._stub, self._target = stub, target

    def __getattr__(self, name: str) -> Any:
        import grpc

        method = getattr(self._stub, name)
        target = self._target

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            except grpc.RpcError as e:
                raise from_rpc(e, target) from None

        return call
