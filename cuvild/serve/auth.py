"""Bearer-token check for the TCP listener (the unix socket relies on its file mode)."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

import grpc


def _deny(request: Any, context: grpc.ServicerContext) -> None:
    context.abort(grpc.StatusCode.UNAUTHENTICATED,
                  "missing or wrong bearer token (metadata 'authorization: Bearer <token>')")


class TokenAuth(grpc.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        metadata = dict(details.invocation_metadata or ())
        given = str(metadata.get("authorization", "")).encode()
        if handler is None or hmac.compare_digest(given, self._expected):
            return handler
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(_deny)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(_deny)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(_deny)
        return grpc.unary_unary_rpc_method_handler(_deny)
