"""Errors in OpenAI's JSON shape, and the gRPC status -> HTTP status mapping.

Every error a client sees is ``{"error": {"message", "type", "param", "code"}}``
with an HTTP status that says what went wrong (400 bad input, 404 unknown model,
429 queue full, 503 stack not ready, ...). Messages are one line; tracebacks stay
in the gateway's log.
"""

from __future__ import annotations

import grpc

from modalmesh.errors import one_line

# HTTP status -> OpenAI error "type".
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    499: "request_cancelled",
    500: "server_error",
    501: "invalid_request_error",
    503: "service_unavailable",
    504: "timeout",
}

# gRPC status of a backend call -> HTTP status.
GRPC_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.FAILED_PRECONDITION: 503,  # stack not ready / misconfigured behind the gateway
    grpc.StatusCode.ABORTED: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.DATA_LOSS: 500,
}


class APIError(Exception):
    """An error answered to the HTTP client in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | int | None = None,
                 type: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.headers = headers  # e.g. Retry-After
        self.status = status
        self.message = one_line(message)
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_grpc(exc: grpc.RpcError, backend: str) -> APIError:
    """A backend's gRPC error as the HTTP error the client gets (message kept, code mapped)."""
    code = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
    details = (exc.details() if callable(getattr(exc, "details", None)) else "") or code.name
    status = GRPC_TO_HTTP.get(code, 500)
    if code == grpc.StatusCode.UNAVAILABLE:
        details = f"the {backend} service is unavailable ({details})"
    elif code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS):
        details = f"the {backend} service failed: {details}"
    return APIError(status, details, code=code.name.lower())
