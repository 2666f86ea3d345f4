"""BLS calls (Triton's business logic scripting): a Python model's `pb_utils.InferenceRequest(...).exec()`
reaches the served models as one more client of the data plane (backends/streams.py's ModelCaller).

The request goes through `DataPlane.submit_stream` like a client's: admission, validation, the
model's scheduler (dynamic batching), statistics and metrics all count it. A model that is not
decoupled answers once (final True); a decoupled one answers 0..N times, the last final. Results are
handed over on the thread that produced them, in order (the caller's channel copes with them); the
caller reads as fast as results come, so the stream's buffer bound never waits here.

A call to the calling model itself when that model has a single instance would wait for the instance
that is making the call: refused at once instead of deadlocking.

A call into a model that is not decoupled, with an idle instance and a recent compute time under
INLINE_MAX_NS, runs on the calling thread (the worker's event reader) and answers before `call`
returns: no hop to a scheduler thread (issue 35's "one BLS hop" cost). The reader is blocked that
long, so the bound stays small.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from edgeserve.protocol.errors import InferenceError, Status

if TYPE_CHECKING:
    from edgeserve.backends.streams import CallResult
    from edgeserve.protocol.inference import InferRequest
    from edgeserve.server.dataplane import DataPlane
    from edgeserve.server.streaming import ResponseStream

log = logging.getLogger("edgeserve.bls")

INLINE_MAX_NS = 2_000_000  # a model this quick runs on the caller's thread (its other events wait)
SELF_CALL_MESSAGE = (
    "BLS call from model '{model}' to itself: its only instance is the one making the call, so the "
    "call would wait forever; give the model more instances (instance_group count) or call another model"
)
NOT_READY_MESSAGE = "Failed for execute the inference request. Model '{model}' is not ready."


def _nothing() -> None:
    """The cancel function of a call that was answered at once."""


class DataPlaneCaller:
    """The ModelCaller the server installs (`streams.install_caller`) while its data plane runs."""

    def __init__(self, dataplane: DataPlane) -> None:
        self.dataplane = dataplane

    def call(self, request: InferRequest, on_result: CallResult, *, caller: str = "") -> Callable[[], None]:
        if caller and caller == request.model_name and self._single_instance(request):
            on_result(InferenceError(Status.INVALID_ARG, SELF_CALL_MESSAGE.format(model=caller)), True)
            return _nothing

        try:
            self.dataplane.repository.get(request.model_name, request.model_version)
        except InferenceError as exc:  # in the words of Triton's BLS (its bls example prints them)
            text = NOT_READY_MESSAGE.format(model=request.model_name)
            on_result(InferenceError(exc.status, text), True)
            return _nothing

        def notify(stream: ResponseStream) -> None:
            for result, final in stream.take():
                try:
                    on_result(result, final)
                except Exception:  # the caller's bug must not reach the model's worker thread
                    log.exception("BLS result callback for %s failed", request.model_name)

        return self.dataplane.submit_stream(request, notify, inline_max_ns=INLINE_MAX_NS).cancel

    def _single_instance(self, request: InferRequest) -> bool:
        try:
            scheduler = self.dataplane.repository.get(request.model_name, request.model_version).scheduler
        except InferenceError:
            return False  # the call itself answers why
        return int(getattr(scheduler, "instance_count", 1) or 1) <= 1
