"""Python models (`backend: "python"`): Triton's TritonPythonModel, each instance in its own process.

Files: backend.py (BACKEND: inspect / auto-complete / load), instance.py (the server-side instance:
calls, crashes, restarts, hangs, close), process.py (spawning and talking to one worker), wire.py
(the control messages and the shared-memory tensor transport), worker.py (the worker's main),
pb_utils.py (`triton_python_backend_utils` inside the worker).

Batching: Triton's semantics. When the dynamic batcher groups several client requests, the
scheduler calls `PythonInstance.infer_requests` with one input dict per request instead of
concatenating them, so `execute(requests)` gets one pb_utils request per client request (each with
its own rows) and answers each with its own response or error, as in Triton. The sequence batcher
does the same with its batch: one request per sequence slot (its own row, control inputs and state;
`correlation_id()` and `flags()` set), empty Direct slots as Triton's null requests (READY=0,
correlation ID 0) whose responses are dropped. Responses are matched to requests by position within
one execute call, and each call's reply to its call by a number the worker echoes: a reply that does
not carry it is never handed to a request (the worker is replaced).

This module stays import-light: the worker process imports the package too, and must not pull in the
server side (BACKEND is loaded on first access).
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "BACKEND":
        from edgeserve.backends.python.backend import BACKEND

        return BACKEND
    raise AttributeError(name)
