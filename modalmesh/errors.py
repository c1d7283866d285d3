"""Error types of the project, each carrying the gRPC status it maps to.

Raise these anywhere below a servicer; the server interceptor turns them into a
status code with a one-line message. Anything else becomes INTERNAL with no
traceback sent to the client (it is logged on the server).
"""

from __future__ import annotations

import grpc


class ModalmeshError(Exception):
    status: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(ModalmeshError, ValueError):
    status = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(ModalmeshError):
    status = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(ModalmeshError):
    status = grpc.StatusCode.RESOURCE_EXHAUSTED


class NotFound(ModalmeshError):
    status = grpc.StatusCode.NOT_FOUND


class Unavailable(ModalmeshError):
    status = grpc.StatusCode.UNAVAILABLE


class Unimplemented(ModalmeshError, NotImplementedError):
    status = grpc.StatusCode.UNIMPLEMENTED


class DeadlineExceeded(ModalmeshError):
    status = grpc.StatusCode.DEADLINE_EXCEEDED


class Unauthenticated(ModalmeshError):
    status = grpc.StatusCode.UNAUTHENTICATED


class ConfigError(ModalmeshError):
    """A start-up problem (bad flag, unreadable model directory): exits the process."""

    status = grpc.StatusCode.FAILED_PRECONDITION


def one_line(message: str, limit: int = 1000) -> str:
    """Collapse a message to one bounded line, as clients receive it."""
    text = " ".join(str(message).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
