"""Contracts for Triton's decoupled models and BLS calls (issue 35), shared by the Python backend
(which produces responses and makes calls) and the scheduler / data plane (which carry them).

Decoupled: a request gets 0..N responses, sent from any thread of the model, any time until the final
flag, also after `execute` returned. The scheduler hands the instance one `ResponseSink` per request
(`StreamingInstance.infer_decoupled`); the instance is free for the next batch once that returns.

BLS: a Python model's `pb_utils.InferenceRequest(...).exec()` reaches the served models through the
same data plane as a client request. The server installs a `ModelCaller` at start (`install_caller`);
backends find it with `current_caller()` and never import the server.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from edgeserve.protocol.errors import InferenceError, Status

if TYPE_CHECKING:
    from edgeserve.backends.base import Array, RequestInfo
    from edgeserve.protocol.inference import InferRequest, InferResponse


class ResponseSink(Protocol):
    """Where one decoupled request's responses go. Thread-safe; never blocks the model for long (a
    slow reader makes `send` wait on a bounded buffer, then drop the request as cancelled)."""

    def send(
        self, outputs: Mapping[str, Array] | None, *, final: bool = False, error: InferenceError | None = None
    ) -> None:
        """One response (`outputs`), or an error response (`error`), or with `outputs` None and
        `final` True the final flag alone (Triton's TRITONSERVER_RESPONSE_COMPLETE_FINAL without a
        response). After `final`, further sends raise InferenceError (the model's bug, logged)."""

    @property
    def cancelled(self) -> bool:
        """The requester went away, cancelled or timed out: the model should stop (request.is_cancelled())."""


@runtime_checkable
class StreamingInstance(Protocol):
    """An instance of a model whose config says `model_transaction_policy { decoupled: true }`."""

    def infer_decoupled(
        self,
        batch: Sequence[Mapping[str, Array]],
        infos: Sequence[RequestInfo],
        sinks: Sequence[ResponseSink],
    ) -> None:
        """Run one execute() over `batch` (one entry per request); returns when execute returned.
        Responses may keep arriving on the sinks afterwards, each request ending with one final."""


# (response or error, final) -> None. Called once with final=True for a non-decoupled model; for a
# decoupled one once per response, the last with final=True (its response may be None: flag only).
CallResult = Callable[["InferResponse | InferenceError | None", bool], None]


class ModelCaller(Protocol):
    """The data plane as a BLS call sees it."""

    def call(self, request: InferRequest, on_result: CallResult, *, caller: str = "") -> Callable[[], None]:
        """Submit `request` (inputs as numpy arrays, no shm) as a client would; `caller` names the
        calling model (for recursion checks and statistics). Returns a cancel function. A missing or
        unready model is an InferenceError result naming it, never a hang."""


_caller: list[ModelCaller] = []


def install_caller(caller: ModelCaller | None) -> None:
    """Set (or with None clear) the process's ModelCaller: the server does it when its data plane starts."""
    _caller[:] = [caller] if caller is not None else []


def current_caller() -> ModelCaller | None:
    return _caller[0] if _caller else None


DECOUPLED_UNARY = "ModelInfer RPC doesn't support models with decoupled transaction policy"
DECOUPLED_HTTP = "HTTP end point doesn't support models with decoupled transaction policy"


def decoupled_error() -> InferenceError:
    """Triton's answer to a unary request (gRPC ModelInfer, ZeroMQ) for a decoupled model; HTTP's
    /infer words it as Triton's HTTP server does (`http_wording`)."""
    return InferenceError(Status.UNSUPPORTED, DECOUPLED_UNARY)


def http_wording(error: InferenceError) -> InferenceError:
    """`error` as Triton's HTTP endpoint says it (the data plane does not know the frontend)."""
    if error.status is Status.UNSUPPORTED and error.message == DECOUPLED_UNARY:
        return InferenceError(Status.UNSUPPORTED, DECOUPLED_HTTP)
    return error
