"""Python models (`backend: "python"`): Triton's TritonPythonModel, each instance in its own process.

Files: backend.py (BACKEND: inspect / auto-complete / load), instance.py (the server-side instance:
calls, crashes, restarts, hangs, close), process.py (spawning and talking to one worker), wire.py
(the control messages and the shared-memory tensor transport), worker.py (the worker's main),
pb_utils.py (`triton_python_backend_utils` inside the worker).

Batching: Triton's semantics. When the dynamic batcher groups several client requests, the
scheduler calls `PythonInstance.infer_requests` with one input dict per request instead of
concatenating them, so `execute(requests)` gets one pb_utils request per client request (each with
its own rows) and answers each with its own response or error, as in Triton. A batch of one request
goes through `infer`.

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
