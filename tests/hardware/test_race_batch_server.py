"""Issue 34 item 2 through the real server: a model whose config leaves `max_batch_size` open is served
with the batch size its load-time race measured (in `/v2/models/{m}/config`, with the evidence), and a
restart serves the cached choice at once. What was measured is never asserted: only that what serves
is what the race decided, and that a request of that many rows runs."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from race_models import build_wide_mlp

pytest.importorskip("onnxruntime", reason="onnxruntime is not installed")

BUDGET_S = 120.0  # generous: a busy box must not push the batch size to the background race


def _get(base: str, path: str) -> Any:
    with urllib.request.urlopen(f"{base}{path}", timeout=60) as response:
        return json.loads(response.read())


def _infer(base: str, rows: int) -> list[float]:
    body = {"inputs": [{"name": "x", "shape": [rows, 256], "datatype": "FP32", "data": [0.5] * 256 * rows}]}
    request = urllib.request.Request(
        f"{base}/v2/models/wide/infer", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        data: list[float] = json.loads(response.read())["outputs"][0]["data"]
    return data


def test_the_server_serves_the_raced_batch_size_and_again_after_a_restart(tmp_path: Path) -> None:
    from es_server import start_server

    model = tmp_path / "repo" / "wide"
    build_wide_mlp(model / "1" / "model.onnx")
    (model / "config.pbtxt").write_text('backend: "onnxruntime"\n')  # the batch size is left open
    # es_server turns the batch-size race off for other tests: on here, with the default cap
    env = {"EDGESERVE_RUNTIME_RACE_BUDGET_S": str(BUDGET_S), "EDGESERVE_RUNTIME_RACE_MAX_BATCH_SIZE": "16"}

    def served() -> tuple[dict[str, Any], list[float]]:
        # generous: starting a runtime and racing on a 2-core box under other tests' load is slow
        server = start_server(model.parent, tmp_path, env=env, timeout=600.0)
        try:
            config = _get(server.base, "/v2/models/wide/config")
            answer = _infer(server.base, int(config["max_batch_size"]))
        finally:
            server.stop()
        return config, answer

    config, first = served()
    parameters = config["parameters"]
    if "batch_size_choice" not in parameters:
        assert "runtime_choice" not in parameters  # one CPU: one layout of one runtime, nothing raced
        pytest.skip("one CPU: nothing to race")
    choice = parameters["batch_size_choice"]["string_value"]
    found = re.match(r"max_batch_size (\d+), preferred_batch_size (\d+): ", choice)
    assert found is not None and choice.endswith("; final)"), choice
    most, size = int(found[1]), int(found[2])
    assert size in (1, 2, 4, 8, 16) and most == max(size, 4)  # auto-complete's default is the floor
    assert config["max_batch_size"] == most
    assert config["dynamic_batching"]["preferred_batch_size"] == [size]
    assert choice in parameters["runtime_choice"]["string_value"]
    assert len(first) == 10 * most  # a request of max_batch_size rows runs

    again, second = served()  # the restart reads the cached race: the same batch size, the same answers
    assert "cached" in again["parameters"]["runtime_choice"]["string_value"]
    assert again["parameters"]["batch_size_choice"]["string_value"] == choice
    assert again["max_batch_size"] == most
    assert second == first
