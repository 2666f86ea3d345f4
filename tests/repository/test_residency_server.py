"""A real server with more models than its memory budget holds: requests round-robin over five
load-on-first-use models (two fit) are all answered correctly, the server's RSS stays under its
baseline plus the budget, and the index, the metrics and `edgeserve models` say why.

The baseline is the server ready with its runtimes imported and only a tiny pinned model loaded (so
the runtime's own memory is not counted against the models); the models may then hold the budget less
that tiny model's accounted cost."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import tritonclient.grpc as grpcclient
from es_server import ROOT, scrape, start_server
from onnx_models import write_model
from residency_helpers import BUDGET_MB, make_models, param, reference

from edgeserve.repository.residency import EVICTED_REASON, FIRST_USE_REASON, MIB

NAMES = "abcde"


def post(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def metrics(base: str) -> dict[str, float]:
    return scrape(base, "edgeserve_")


def test_round_robin_over_more_models_than_fit_stays_under_the_budget(tmp_path: Path) -> None:
    ort = 'backend: "onnxruntime"\n'  # one runtime for all: its import is in the baseline
    repo = make_models(tmp_path, NAMES, dict.fromkeys(NAMES, ort + param("load_on_first_use")))
    write_model(repo, "base", "identity", config=ort + param("pinned"))
    budget_mb = BUDGET_MB + 8  # the tiny pinned model is accounted at about 8 MiB
    server = start_server(repo, tmp_path, env={"EDGESERVE_REPOSITORY_MEMORY_BUDGET_MB": str(budget_mb),
                                               "EDGESERVE_RUNTIME_CPU_THREADS": "1",
                                               "EDGESERVE_RUNTIME_RACE_BUDGET_S": "0"})  # fmt: skip
    try:
        process = psutil.Process(server.process.pid)
        index = {e["name"]: e for e in post(server.base + "/v2/repository/index", {})}
        assert all(index[n]["state"] == "UNAVAILABLE" and index[n]["reason"] == FIRST_USE_REASON
                   for n in NAMES), index  # fmt: skip
        assert index["base"]["state"] == "READY"
        figures = metrics(server.base)
        assert figures["edgeserve_memory_budget_bytes"] == budget_mb * MIB
        base_cost = figures['edgeserve_model_memory_bytes{model="base"}']
        baseline = process.memory_info().rss  # runtimes imported, only the tiny model loaded
        allowed = budget_mb * MIB - base_cost

        x = np.random.default_rng(3).standard_normal((1, 16)).astype(np.float32)
        tensor = {"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": x.ravel().tolist()}
        body = {"inputs": [tensor]}
        peak = 0
        for round_ in range(3):
            for name in NAMES:
                answer = post(f"{server.base}/v2/models/{name}/infer", body)
                got = np.asarray(answer["outputs"][0]["data"], dtype=np.float32).reshape(1, 4)
                np.testing.assert_allclose(got, reference(repo, name, x), rtol=1e-4, atol=1e-5,
                                           err_msg=f"model {name}, round {round_}")  # fmt: skip
                peak = max(peak, process.memory_info().rss)
        print(f"baseline {baseline / MIB:.1f} MiB, models' budget {allowed / MIB:.1f} MiB, peak RSS "
              f"{peak / MIB:.1f} MiB")  # fmt: skip
        assert peak <= baseline + allowed, (peak / MIB, baseline / MIB, allowed / MIB)

        index = {e["name"]: e for e in post(server.base + "/v2/repository/index", {})}
        ready = [n for n in NAMES if index[n]["state"] == "READY"]
        evicted = [n for n in NAMES if index[n]["reason"] == EVICTED_REASON]
        assert ready == ["d", "e"] and index["base"]["state"] == "READY", index  # the two most recent
        assert evicted == ["a", "b", "c"], index
        assert all(index[n]["state"] == "UNAVAILABLE" for n in evicted)
        client = grpcclient.InferenceServerClient(server.grpc_url)  # an evicted model, over gRPC
        tensor_in = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
        tensor_in.set_data_from_numpy(x)
        got = client.infer("a", [tensor_in]).as_numpy("OUTPUT0")
        np.testing.assert_allclose(got, reference(repo, "a", x), rtol=1e-4, atol=1e-5)
        client.close()
        index = {e["name"]: e for e in post(server.base + "/v2/repository/index", {})}
        assert index["a"]["state"] == "READY" and index["d"]["reason"] == EVICTED_REASON, index
        figures = metrics(server.base)
        assert figures['edgeserve_model_resident{model="e"}'] == 1.0
        assert figures['edgeserve_model_resident{model="d"}'] == 0.0
        assert figures['edgeserve_evictions_total{model="a"}'] >= 2
        assert figures['edgeserve_model_instances{model="e"}'] == 1.0

        command = [sys.executable, "-m", "edgeserve", "models", "list", "--url", server.base]
        listing = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=60, check=True)
        models_table = listing.stdout.split("\n\n")[0]  # the memory tables follow after a blank line
        lines = {line.split()[0]: line for line in models_table.splitlines()[1:]}
        assert EVICTED_REASON in lines["d"] and "READY" in lines["e"], listing.stdout
        assert "MiB" in lines["e"], listing.stdout
    finally:
        assert server.stop() == 0, server.log()


def test_raw_binary_request_loads_a_first_use_model(tmp_path: Path) -> None:
    # a raw body (Inference-Header-Content-Length: 0) is decoded with the model's config: the model
    # must be loaded before decoding, not only before queueing
    ort = 'backend: "onnxruntime"\n'
    repo = make_models(tmp_path, "a", {"a": ort + param("load_on_first_use")})
    server = start_server(repo, tmp_path, env={"EDGESERVE_RUNTIME_CPU_THREADS": "1",
                                               "EDGESERVE_RUNTIME_RACE_BUDGET_S": "0"})  # fmt: skip
    try:
        x = np.random.default_rng(5).standard_normal((1, 16)).astype(np.float32)
        request = urllib.request.Request(
            f"{server.base}/v2/models/a/infer", x.tobytes(), {"Inference-Header-Content-Length": "0"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            header_length = int(response.headers["Inference-Header-Content-Length"])
            raw = response.read()
        header = json.loads(raw[:header_length])
        assert header["outputs"][0]["shape"] == [1, 4]
        got = np.frombuffer(raw[header_length:], dtype=np.float32).reshape(1, 4)
        np.testing.assert_allclose(got, reference(repo, "a", x), rtol=1e-4, atol=1e-5)
        index = {e["name"]: e for e in post(server.base + "/v2/repository/index", {})}
        assert index["a"]["state"] == "READY"
    finally:
        server.stop()
