"""The one map from the `kind` an error carries to a gRPC status.

Errors raised below the servicers (RegistryError, RegionError) say what kind of failure they
are; the servicers answer with exactly one status per kind, through `abort`.
"""

from __future__ import annotations

from typing import NoReturn

import grpc

CODES = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "exists": grpc.StatusCode.ALREADY_EXISTS,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "denied": grpc.StatusCode.PERMISSION_DENIED,
    "exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "deadline": grpc.StatusCode.DEADLINE_EXCEEDED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "internal": grpc.StatusCode.INTERNAL,
}


def abort(context: grpc.ServicerContext, error: Exception) -> NoReturn:
    """End the call with the status of `error.kind` and the error's message."""
    context.abort(CODES[getattr(error, "kind", "invalid")], str(error))
    raise AssertionError("unreachable: context.abort raises")
