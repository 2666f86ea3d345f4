"""Python models that say which process serves them (for the python_worker_group and memory tests).

`PID` answers [pid of the worker process, how many of HEAVY that process has imported]; an input
whose first value is negative makes the model end its process (a crash of one group member).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.http as httpclient
from python_models import as_pbtxt, python_config

# What a Python model's worker must not import unless the model does: the runtimes and the server's
# frontends (each costs the worker megabytes of RSS).
HEAVY = ("onnxruntime", "openvino", "tensorrt", "grpc", "zmq", "aiohttp", "tritonclient", "edgeserve.server")

SOURCE = """
import os
import sys

import numpy as np
import triton_python_backend_utils as pb_utils

HEAVY = {heavy!r}
{marker}

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            if pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0] < 0:
                os._exit(3)
            loaded = sum(1 for name in HEAVY if name in sys.modules)
            answer = np.array([os.getpid(), loaded], np.int64)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("PID", answer)]))
        return out
"""

CONFIG = python_config(("IN", "TYPE_FP32", [1]), ("PID", "TYPE_INT64", [2]))


def source(marker: Path | None = None) -> str:
    """The model's code; with `marker`, importing it writes that file (to tell whether the code ran)."""
    line = f"open({str(marker)!r}, 'w').write('ran')" if marker is not None else ""
    return SOURCE.format(heavy=HEAVY, marker=line)


def _config(group: str | None) -> dict[str, Any]:
    """CONFIG, in the worker group `group` when given."""
    if group is None:
        return CONFIG
    return {**CONFIG, "parameters": {"python_worker_group": {"string_value": group}}}


def json_config(group: str | None = None) -> str:
    """The config as load-API JSON (a config sent with a load request)."""
    return json.dumps(_config(group))


def write(repo: Path, name: str, group: str | None = None, marker: Path | None = None) -> None:
    (repo / name / "1").mkdir(parents=True, exist_ok=True)
    (repo / name / "config.pbtxt").write_text(as_pbtxt(_config(group)))
    (repo / name / "1" / "model.py").write_text(source(marker))


def ask(http_url: str, name: str, value: float = 1.0) -> tuple[int, int]:
    """(worker pid, heavy modules imported there) from one HTTP call to the model."""
    client = httpclient.InferenceServerClient(http_url, network_timeout=60)
    try:
        tensor = httpclient.InferInput("IN", [1], "FP32")
        tensor.set_data_from_numpy(np.array([value], np.float32))
        pid, heavy = (int(v) for v in client.infer(name, [tensor]).as_numpy("PID"))
        return pid, heavy
    finally:
        client.close()


def mapped_libraries(pid: int) -> set[str]:
    """Base names of the shared libraries a process maps (/proc/<pid>/maps)."""
    names: set[str] = set()
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            path = line.split(maxsplit=5)[5].strip() if len(line.split(maxsplit=5)) == 6 else ""
            if ".so" in path:
                names.add(os.path.basename(path))
    return names


def worker_pids(server_pid: int) -> list[int]:
    """The server's live Python model worker processes."""
    import psutil

    found = []
    for child in psutil.Process(server_pid).children():
        try:
            if (
                "edgeserve.backends.python.worker" in child.cmdline()
                and child.status() != psutil.STATUS_ZOMBIE
            ):
                found.append(child.pid)
        except psutil.NoSuchProcess:
            continue
    return sorted(found)
