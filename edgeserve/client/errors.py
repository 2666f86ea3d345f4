"""The one error type the edgeserve Python clients raise."""

from __future__ import annotations


class ClientError(Exception):
    """A failed call. `status` is the server's status name (INVALID_ARG, NOT_FOUND, UNAVAILABLE,
    RESOURCE_EXHAUSTED, INTERNAL, UNSUPPORTED, PERMISSION_DENIED, ...) or, for failures on this
    side, DEADLINE_EXCEEDED (no reply in time), UNAVAILABLE (server unreachable, client closed)
    and RESOURCE_EXHAUSTED (no free ring slot)."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message

    def __repr__(self) -> str:
        return f"ClientError({self.status!r}, {self.message!r})"


class RingFull(ClientError):
    """Every slot of a frame ring is in use: the producer may drop this frame or wait for a result."""

    def __init__(self, message: str) -> None:
        super().__init__("RESOURCE_EXHAUSTED", message)
