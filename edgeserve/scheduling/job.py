"""The unit a scheduler queues: one validated request's inputs and where its result goes."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import numpy.typing as npt

Arrays = dict[str, npt.NDArray[Any]]
# Called exactly once: on a worker thread, on the submitting thread for immediate rejections,
# or on the closing thread for jobs still queued at close();
# with this job's outputs (already split out of the batch) or the error that ended it.
JobCallback = Callable[["Arrays | BaseException"], None]
# A decoupled model's job (scheduling/decoupled.py): each response in order, (outputs, an error, or
# None for a final flag without a response; final). The last call has final True.
StreamCallback = Callable[["Arrays | BaseException | None", bool], None]


@dataclass(slots=True)
class Job:
    inputs: Arrays  # validated views; leading axis is the batch axis when the model batches
    batch_size: int  # rows this job contributes to a batch (1 for non-batching models)
    done: JobCallback
    priority: int = 0  # request value: 0 = model default level, 1 = highest
    timeout_us: int = 0  # request value: 0 = queue policy default
    arrival_ns: int = field(default_factory=time.monotonic_ns)
    request_id: str = ""
    client: str = ""  # who sent it (peer address, ZMQ identity): fair shares of a full queue
    parameters: Mapping[str, Any] = field(default_factory=dict)  # the request's (sequence flags, ...)
    outputs: tuple[str, ...] = ()  # the outputs the requester reads (() = all); an ensemble runs only
    # the steps they need
    # Set by the requester (an ensemble whose other step failed) when it no longer wants the answer:
    # a scheduler that finds it still queued answers it CANCELLED instead of running it.
    cancelled: bool = False
    on_response: StreamCallback | None = None  # set for a decoupled model's job (0..N responses)
    # Filled by the scheduler:
    shape_key: tuple[Any, ...] = ()
    deadline_ns: int = 0  # 0 = none
    enqueue_ns: int = 0
    finished: bool = False  # answered (set under the scheduler lock: a hung batch is answered once)


# The client a frontend is submitting for, set around `DataPlane.submit` (a context variable: the
# HTTP middleware and gRPC handlers set it per task, the ZeroMQ thread per message). The scheduler
# stamps it on jobs that carry none, so a full queue is shared fairly between clients.
CURRENT_CLIENT: ContextVar[str] = ContextVar("edgeserve_client", default="")


@contextmanager
def client_scope(client: str) -> Iterator[None]:
    token = CURRENT_CLIENT.set(client)
    try:
        yield
    finally:
        CURRENT_CLIENT.reset(token)


_log = logging.getLogger("edgeserve.scheduler")


def answer(job: Job, result: Arrays | BaseException, model: str, version: int) -> None:
    """`job.done(result)`; a callback that raises is logged, never taken into the caller's thread."""
    try:
        job.done(result)
    except Exception:
        _log.exception("%s version %d: the result callback of request '%s' failed",
                       model, version, job.request_id)  # fmt: skip
