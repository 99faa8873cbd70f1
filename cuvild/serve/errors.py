"""The one map from the `kind` an error carries to a gRPC status, and the one error the
serving layer refuses a request with.

Errors raised below the servicers (BadInput, InferError and its kinds, RegistryError,
RegionError) say what kind of failure they are; the listeners (gRPC, HTTP, the fast path)
answer with exactly one status per kind (`status`). An error that says no kind is a bug:
INTERNAL, on every listener.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

import grpc

if TYPE_CHECKING:
    from cuvild.load.models import ModelManager, ServedModel

CODES = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "exists": grpc.StatusCode.ALREADY_EXISTS,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "denied": grpc.StatusCode.PERMISSION_DENIED,
    "exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "deadline": grpc.StatusCode.DEADLINE_EXCEEDED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "precondition": grpc.StatusCode.FAILED_PRECONDITION,
    "internal": grpc.StatusCode.INTERNAL,
}
KINDS = {code: kind for kind, code in CODES.items()}
# the HTTP status of each (500 for the rest), as Triton's HTTP endpoint answers them
STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.NOT_FOUND: 404,
          grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.RESOURCE_EXHAUSTED: 503,
          grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.PERMISSION_DENIED: 403,
          grpc.StatusCode.DEADLINE_EXCEEDED: 504, grpc.StatusCode.FAILED_PRECONDITION: 400}


class Refused(Exception):
    """A request a listener refuses itself, on any protocol: `kind` as every error's (CODES);
    `http` where the HTTP status is not the one the kind maps to (413 for a body part over its
    limit); `said`, more for a fast-path client's reply."""

    def __init__(self, kind: str, message: str, http: int | None = None, **said: Any) -> None:
        super().__init__(message)
        self.kind, self.http, self.said = kind, http, said

    @classmethod
    def of(cls, code: grpc.StatusCode, message: str) -> Refused:
        """The refusal a servicer's `context.abort(code, message)` makes."""
        return cls(KINDS.get(code, code.name.lower()), message)

    @property
    def code(self) -> grpc.StatusCode:
        return status(self)


def status(error: BaseException) -> grpc.StatusCode:
    """The status an error answers: its kind's (INTERNAL for one that says none)."""
    kind = getattr(error, "kind", "internal")
    return CODES.get(kind) or getattr(grpc.StatusCode, kind.upper(), grpc.StatusCode.INTERNAL)


def abort(context: grpc.ServicerContext, error: Exception) -> NoReturn:
    """End the call with the status of `error.kind` and the error's message."""
    context.abort(status(error), str(error))
    raise AssertionError("unreachable: context.abort raises")


def find(models: ModelManager, name: str, version: str = "", ready: bool = True) -> ServedModel:
    """The served model a request names, or the one refusal every listener gives: not_found
    (unknown), or, when it must be `ready`, unavailable (loading or failed, and why)."""
    served = models.get(name, version)
    if served is None:
        what = f"{name!r}" + (f" version {version!r}" if version else "")
        raise Refused("not_found", f"unknown model {what}")
    if ready and (served.state != "READY" or served.loaded is None):
        detail = f": {served.reason}" if served.reason else " (still loading)"
        raise Refused("unavailable", f"model {served.key} is {served.state.lower()}{detail}")
    return served
