"""The MLServer peer of bench_peers.py: `mlserver start` on a folder written here (settings.json with
loopback addresses and free ports, one model-settings.json per model naming mlserver_ort.OrtModel),
from a throwaway venv (mlserver + uvloop < 0.22, which MLServer's workers need here, + the ONNX
Runtime version edgeserve runs). Adaptive batching is configured like edgeserve's dynamic batcher:
`max_batch_size` and `max_batch_time` = max_queue_delay_microseconds from the model's config.pbtxt.
`parallel_workers` = the instance count (MLServer's inference worker processes, each with one session).

MLServer speaks KServe V2 over HTTP and gRPC; it has no Triton binary-data extension (HTTP tensors go
as JSON), and its ModelStreamInfer feeds a whole stream to one `predict_stream` call (token streaming),
not one request per message, so it gets the gRPC unary and HTTP JSON callers.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from common import free_port
from peers import VENV_DIR, PeerProcess, ensure_venv, runtime_pin

VERSION = "1.7.1"
HERE = Path(__file__).resolve().parent
TRANSPORTS = ("gRPC unary", "HTTP JSON")


def prepare(venv_dir: Path = VENV_DIR, install: bool = True) -> tuple[str | None, str]:
    packages = [f"mlserver=={VERSION}", "uvloop<0.22", runtime_pin("onnxruntime")]
    return ensure_venv(venv_dir / "mlserver-venv", packages, "import mlserver, onnxruntime", install)


def start(python: str, specs: list[dict[str, Any]]) -> tuple[PeerProcess, dict[str, str]]:
    """Start MLServer (not waiting): (process, {transport: address}); wait with `wait_ready`."""
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    folder = Path(tempfile.mkdtemp(prefix="mlserver-bench-"))
    settings = {
        "debug": False,
        "host": "127.0.0.1",
        "http_port": http_port,
        "grpc_port": grpc_port,
        "metrics_port": metrics_port,
        "metrics_endpoint": None,  # no metrics server
        "parallel_workers": max(spec["instances"] for spec in specs),
        "load_models_at_startup": True,
    }
    (folder / "settings.json").write_text(json.dumps(settings, indent=1))
    for spec in specs:
        model_dir = folder / spec["model"]
        model_dir.mkdir()
        (model_dir / "spec.json").write_text(json.dumps(spec, indent=1))
        batching = spec["max_batch_size"] > 1 and spec["max_queue_delay_us"] > 0
        model = {
            "name": spec["model"],
            "implementation": "mlserver_ort.OrtModel",
            "max_batch_size": spec["max_batch_size"] if batching else 0,
            "max_batch_time": spec["max_queue_delay_us"] / 1e6 if batching else 0,
            "parameters": {"extra": {"spec": str(model_dir / "spec.json")}},
        }
        (model_dir / "model-settings.json").write_text(json.dumps(model, indent=1))
    mlserver = str(Path(python).parent / "mlserver")
    env = {"PYTHONPATH": str(HERE), "MLSERVER_LOGGING_LEVEL": "WARNING"}
    process = PeerProcess("mlserver", [mlserver, "start", str(folder)], env=env)
    process.ready_urls = [
        f"http://127.0.0.1:{http_port}/v2/health/ready",
        *(f"http://127.0.0.1:{http_port}/v2/models/{s['model']}/ready" for s in specs),
    ]
    grpc, http = f"127.0.0.1:{grpc_port}", f"127.0.0.1:{http_port}"
    return process, {"gRPC unary": grpc, "HTTP JSON": http}
