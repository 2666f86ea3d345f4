"""One error type for the whole data plane; each frontend maps `Status` to its own wire code."""

from __future__ import annotations

import enum


class Status(enum.Enum):
    INVALID_ARG = "INVALID_ARG"
    NOT_FOUND = "NOT_FOUND"
    UNAVAILABLE = "UNAVAILABLE"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    INTERNAL = "INTERNAL"
    UNSUPPORTED = "UNSUPPORTED"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    CANCELLED = "CANCELLED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    UNKNOWN = "UNKNOWN"


# Triton's http_server.cc mapping; the extra statuses get the nearest HTTP meaning.
HTTP_STATUS: dict[Status, int] = {
    Status.INVALID_ARG: 400,
    Status.NOT_FOUND: 404,
    Status.UNAVAILABLE: 503,
    Status.RESOURCE_EXHAUSTED: 429,
    Status.INTERNAL: 500,
    Status.UNSUPPORTED: 501,
    Status.ALREADY_EXISTS: 400,
    Status.CANCELLED: 400,
    Status.DEADLINE_EXCEEDED: 504,
    Status.PERMISSION_DENIED: 403,
    Status.UNAUTHENTICATED: 401,
    Status.UNKNOWN: 400,
}

# Names of grpc.StatusCode members, so this module does not import grpc.
GRPC_STATUS_NAME: dict[Status, str] = {
    Status.INVALID_ARG: "INVALID_ARGUMENT",
    Status.NOT_FOUND: "NOT_FOUND",
    Status.UNAVAILABLE: "UNAVAILABLE",
    Status.RESOURCE_EXHAUSTED: "RESOURCE_EXHAUSTED",
    Status.INTERNAL: "INTERNAL",
    Status.UNSUPPORTED: "UNIMPLEMENTED",
    Status.ALREADY_EXISTS: "ALREADY_EXISTS",
    Status.CANCELLED: "CANCELLED",
    Status.DEADLINE_EXCEEDED: "DEADLINE_EXCEEDED",
    Status.PERMISSION_DENIED: "PERMISSION_DENIED",
    Status.UNAUTHENTICATED: "UNAUTHENTICATED",
    Status.UNKNOWN: "UNKNOWN",
}


class InferenceError(Exception):
    """An error with a status that every frontend knows how to put on the wire."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    @property
    def http_status(self) -> int:
        return HTTP_STATUS[self.status]

    @property
    def grpc_status_name(self) -> str:
        return GRPC_STATUS_NAME[self.status]

    def __repr__(self) -> str:
        return f"InferenceError({self.status.value}, {self.message!r})"


class RepositoryError(InferenceError):
    """A model folder or model config that cannot serve: `<file>: <field>: <what is wrong>`;
    INVALID_ARG unless a status is given. Raised wherever a config is read (backends, the sequence
    batcher, ensembles, the repository)."""

    def __init__(self, where: str, field: str, problem: str, status: Status = Status.INVALID_ARG) -> None:
        message = f"{where}: {field}: {problem}" if field else f"{where}: {problem}"
        super().__init__(status, message)
        self.where = where
        self.field = field
        self.problem = problem


def invalid_arg(message: str) -> InferenceError:
    return InferenceError(Status.INVALID_ARG, message)


def not_found(message: str) -> InferenceError:
    return InferenceError(Status.NOT_FOUND, message)


def unavailable(message: str) -> InferenceError:
    return InferenceError(Status.UNAVAILABLE, message)


def internal(message: str) -> InferenceError:
    return InferenceError(Status.INTERNAL, message)


def unsupported(message: str) -> InferenceError:
    return InferenceError(Status.UNSUPPORTED, message)
