"""Python models (`backend: "python"`): Triton's TritonPythonModel, each instance in its own process.

Files: backend.py (BACKEND: inspect / auto-complete / load), instance.py (the server-side instance:
calls, crashes, restarts, hangs, close), process.py (spawning and talking to one worker), wire.py
(the control messages and the shared-memory tensor transport), worker.py (the worker's main),
pb_utils.py (`triton_python_backend_utils` inside the worker).

Batching: the scheduler hands an instance the already-concatenated batch, so `execute(requests)` gets
one request holding the whole batch (the first axis is the batch axis when max_batch_size > 0). A
Triton model that loops over its requests and computes row-wise, as Triton's examples do, runs
unchanged.

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
