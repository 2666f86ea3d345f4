"""One step of a sequence (tritonclient, gRPC or HTTP) and the clients that run sequences side by side,
for the end-to-end sequence tests (tests/server/test_sequence_e2e.py, the Python backend's)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient


def send_step(client: Any, model: str, seq: int | str, value: float, start: bool = False,
              end: bool = False) -> Any:  # fmt: skip
    """Infer INPUT = [[value]] as a step of sequence `seq`; the tritonclient result."""
    module = grpcclient if isinstance(client, grpcclient.InferenceServerClient) else httpclient
    tensor = module.InferInput("INPUT", [1, 1], "FP32")
    tensor.set_data_from_numpy(np.full((1, 1), value, np.float32))
    return client.infer(model, [tensor], sequence_id=seq, sequence_start=start, sequence_end=end)


def run_clients(run: Callable[[int], None], count: int, timeout: float = 120.0) -> None:
    """`run(index)` on `count` threads at once; returns once they are done (or `timeout` s each)."""
    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
