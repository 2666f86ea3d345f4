"""Helpers for the HTTP end-to-end tests: model configs, direct runtime calls, request builders."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx_models
import requests
import tritonclient.http as httpclient
from es_server import RunningServer

MLP_CONFIG = onnx_models.MLP_CONFIG + "dynamic_batching { max_queue_delay_microseconds: 20000 }\n"


def ort_run(model: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return list(session.run(None, feeds))


def client(server: RunningServer, **kwargs: Any) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.http_url, **kwargs)


def mlp_infer(
    cli: httpclient.InferenceServerClient, x: np.ndarray, model: str = "mlp", **kwargs: Any
) -> np.ndarray:
    inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = cli.infer(model, [inp], **kwargs)
    out = result.as_numpy("OUTPUT0")
    assert out is not None
    return out


def post_infer(
    server: RunningServer, model: str, body: Any, headers: dict[str, str] | None = None, path: str = ""
) -> requests.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return requests.post(
        f"{server.base}/v2/models/{model}{path}/infer", data=data, headers=headers or {}, timeout=60
    )


def mlp_repo(root: Path) -> Path:
    """`root`/repo holding the mlp model (MLP_CONFIG: dynamic batching); tests add their own."""
    repo = root / "repo"
    onnx_models.write_model(repo, "mlp", "mlp", config=MLP_CONFIG)
    return repo


def json_mlp_request(x: np.ndarray) -> dict[str, Any]:
    return {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": list(x.shape), "data": x.tolist()}]}


def assert_good_request_works(server: RunningServer, model: str = "mlp") -> None:
    x = np.ones((1, 16), dtype=np.float32)
    response = post_infer(server, model, json_mlp_request(x))
    assert response.status_code == 200, response.text
    assert server.alive()
