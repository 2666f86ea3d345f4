"""Python models behind a real `edgeserve serve`: Triton's add_sub over HTTP and gRPC (tritonclient),
BYTES, requests batched by the dynamic batcher, user-code errors, a worker that aborts or hangs while
the server stays up, initialize failing the load, and no worker process left after unload or stop."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
from es_server import RunningServer, start_server, wait_until
from pymodels import ADD_SUB_CONFIG, write_model, write_repo
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.timeout(180)

# A batching window no arrival misses (a minute): the batch runs once its 8 rows (max_batch_size) are
# there, however slowly a busy box sends them, so 8 concurrent requests always make one execute().
BATCHED_CONFIG = ADD_SUB_CONFIG.replace('name: "add_sub"', 'name: "add_sub_batched"').replace(
    "max_queue_delay_microseconds: 20000", "max_queue_delay_microseconds: 60000000"
)


def _workers(server: RunningServer, model: str | None = None) -> list[int]:
    """Live workers of this server (by the --parent and --label in their command line)."""
    import os

    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            args = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"edgeserve.backends.python.worker" not in args or state == "Z":
            continue
        if args[args.index(b"--parent") + 1] != str(server.process.pid).encode():
            continue
        label = args[args.index(b"--label") + 1].decode() if b"--label" in args else ""
        if model is None or label.startswith(f"model '{model}' "):
            found.append(int(entry))
    return found


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("pyserver")
    repo = write_repo(tmp / "repo", ["add_sub", "strings", "faulty", "broken_init", "batch_probe"])
    write_model(repo, "add_sub_batched", None, BATCHED_CONFIG)
    (repo / "add_sub_batched" / "1" / "model.py").write_text(
        (repo / "add_sub" / "1" / "model.py").read_text()
    )
    running = start_server(repo, tmp, wait_ready=False)  # never all ready: broken_init fails
    models = ("add_sub", "add_sub_batched", "strings", "faulty", "batch_probe")
    assert wait_until(lambda: all(running.model_ready(m) for m in models), 120), running.log()
    yield running
    pid = running.process.pid
    assert running.stop() == 0
    assert "Cleaning up..." in running.log()  # finalize() ran on the way out
    assert wait_until(lambda: not _workers(running), 10), f"workers of server {pid} outlived it"


def _add_sub_inputs(module: Any, a: np.ndarray, b: np.ndarray) -> list[Any]:
    inputs = [
        module.InferInput("INPUT0", list(a.shape), "FP32"),
        module.InferInput("INPUT1", list(b.shape), "FP32"),
    ]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs


def test_add_sub_over_http_and_grpc(server: RunningServer) -> None:
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.full((2, 4), 3.0, dtype=np.float32)
    http = httpclient.InferenceServerClient(server.http_url)
    result = http.infer("add_sub", _add_sub_inputs(httpclient, a, b))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    metadata = http.get_model_metadata("add_sub")
    assert metadata["platform"] == "python" or metadata.get("backend", "python") == "python"
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    result = grpc.infer("add_sub", _add_sub_inputs(grpcclient, a, b))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    http.close()
    grpc.close()


def test_bytes_over_http_and_grpc(server: RunningServer) -> None:
    text = np.array([b"edge", b"serve", b""], dtype=np.object_)
    for module, url in ((httpclient, server.http_url), (grpcclient, server.grpc_url)):
        client = module.InferenceServerClient(url)
        tensor = module.InferInput("TEXT", [3], "BYTES")
        tensor.set_data_from_numpy(text)
        result = client.infer("strings", [tensor])
        assert result.as_numpy("UPPER").tolist() == [b"EDGE", b"SERVE", b""]
        assert result.as_numpy("LENGTH").tolist() == [4, 5, 0]
        client.close()


def test_concurrent_requests_are_batched(server: RunningServer) -> None:
    rows = [np.full((1, 4), float(i), dtype=np.float32) for i in range(8)]

    async def run() -> list[np.ndarray]:
        client = grpcaio.InferenceServerClient(server.grpc_url)
        try:
            ones = np.ones((1, 4), dtype=np.float32)
            calls = [client.infer("add_sub_batched", _add_sub_inputs(grpcaio, row, ones)) for row in rows]
            results = await asyncio.gather(*calls)
            return [r.as_numpy("OUTPUT0") for r in results]
        finally:
            await client.close()

    outputs = asyncio.run(run())
    for row, out in zip(rows, outputs, strict=True):
        np.testing.assert_array_equal(out, row + 1)  # each request got its own rows back
    with urllib.request.urlopen(f"{server.base}/v2/models/add_sub_batched/stats") as response:
        stats = json.loads(response.read())["model_stats"][0]
    assert stats["inference_count"] == 8
    assert stats["execution_count"] == 1  # all eight went to execute() together


def test_batched_requests_reach_execute_one_by_one(server: RunningServer) -> None:
    """Triton's semantics: the batcher's batch arrives as several requests, each with its own rows
    and its own response; one request's error leaves the others alone."""
    values = [1.0, 2.0, -1.0, 4.0, 5.0, 6.0]

    async def run() -> list[Any]:
        client = grpcaio.InferenceServerClient(server.grpc_url)
        try:

            async def one(value: float) -> Any:
                tensor = grpcaio.InferInput("X", [1, 1], "FP32")
                tensor.set_data_from_numpy(np.array([[value]], dtype=np.float32))
                try:
                    return await client.infer("batch_probe", [tensor])
                except InferenceServerException as exc:
                    return exc

            return list(await asyncio.gather(*(one(v) for v in values)))
        finally:
            await client.close()

    results = asyncio.run(run())
    seen = []
    for value, result in zip(values, results, strict=True):
        if value < 0:
            assert isinstance(result, InferenceServerException)
            assert "negative X" in str(result) and result.status() == "StatusCode.INVALID_ARGUMENT"
            continue
        assert not isinstance(result, InferenceServerException), result
        assert result.as_numpy("Y").tolist() == [[value * 10]]
        assert result.as_numpy("ROWS").tolist() == [[1]]  # its own rows, not the batch's
        seen.append(int(result.as_numpy("N")[0, 0]))
    assert max(seen) > 1  # several client requests in one execute() call


def _faulty(client: httpclient.InferenceServerClient, mode: int, timeout_us: int | None = None) -> np.ndarray:
    x = httpclient.InferInput("X", [2], "FP32")
    x.set_data_from_numpy(np.array([1.0, 2.0], dtype=np.float32))
    flag = httpclient.InferInput("MODE", [1], "INT32")
    flag.set_data_from_numpy(np.array([mode], dtype=np.int32))
    result = client.infer("faulty", [x, flag], timeout=timeout_us)
    out: np.ndarray = result.as_numpy("Y")
    return out


def test_user_errors_abort_and_hang_leave_the_server_up(server: RunningServer) -> None:
    client = httpclient.InferenceServerClient(server.http_url, network_timeout=60)
    with pytest.raises(InferenceServerException) as raised:
        _faulty(client, 1)
    assert "ValueError: mode 1 asks for an exception" in str(raised.value)
    assert raised.value.status() == "500"
    assert _faulty(client, 0).tolist() == [2.0, 4.0]

    first = _workers(server, "faulty")
    assert len(first) == 1
    with pytest.raises(InferenceServerException) as raised:
        _faulty(client, 3)  # os.abort()
    message = str(raised.value)
    assert "model 'faulty' version 1 instance 0" in message and "SIGABRT" in message, message
    assert raised.value.status() == "500"
    # restarted (retried: a box this busy may take longer than the hang timeout to start the new worker)
    assert wait_until(lambda: _try(lambda: _faulty(client, 0).tolist() == [2.0, 4.0]), 60)
    assert _workers(server, "faulty") and first[0] not in _workers(server, "faulty")

    second = _workers(server, "faulty")
    with pytest.raises(InferenceServerException) as raised:
        _faulty(client, 4)  # sleeps 1000 s; hang_timeout_s is 5
    assert raised.value.status() == "503"
    assert "did not answer in 5 s; it is being replaced" in str(raised.value)
    assert wait_until(lambda: second[0] not in _workers(server, "faulty"), 60)  # the hung worker was killed
    assert wait_until(lambda: _try(lambda: _faulty(client, 0).tolist() == [2.0, 4.0]), 60)

    third = _workers(server, "faulty")
    with pytest.raises(InferenceServerException) as raised:
        _faulty(client, 4, timeout_us=200_000)  # the request's own timeout answers before the hang detector
    assert raised.value.status() == "503" and "Request timeout expired" in str(raised.value)
    assert wait_until(lambda: third[0] not in _workers(server, "faulty"), 60)  # still replaced as hung
    assert wait_until(lambda: _try(lambda: _faulty(client, 0).tolist() == [2.0, 4.0]), 60)
    assert server.alive()
    client.close()


def _try(check: Any) -> bool:
    try:
        return bool(check())
    except InferenceServerException:
        return False


def test_initialize_failure_fails_the_load(server: RunningServer) -> None:
    request = urllib.request.Request(f"{server.base}/v2/repository/index", data=b"{}", method="POST")
    with urllib.request.urlopen(request) as response:
        index = {m["name"]: m for m in json.loads(response.read())}
    assert index["broken_init"]["state"] == "UNAVAILABLE"
    assert "RuntimeError: no weights in broken_init" in index["broken_init"]["reason"]
    assert not _workers(server, "broken_init")
    client = httpclient.InferenceServerClient(server.http_url)
    with pytest.raises(InferenceServerException) as raised:
        client.load_model("broken_init")
    assert "initialize() failed: RuntimeError: no weights in broken_init (model.py:7 in initialize)" in str(
        raised.value
    )
    assert not _workers(server, "broken_init")
    client.close()


def test_unload_and_reload_leave_no_workers(server: RunningServer) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    before = _workers(server, "strings")
    assert len(before) == 1
    client.unload_model("strings")
    assert wait_until(lambda: not _workers(server, "strings"), 20)
    client.load_model("strings")
    after = _workers(server, "strings")
    assert len(after) == 1 and after != before
    client.load_model("strings")  # a reload replaces the worker
    assert wait_until(
        lambda: len(_workers(server, "strings")) == 1 and _workers(server, "strings") != after, 20
    )
    client.close()


def test_python_code_in_a_load_request_is_refused(server: RunningServer) -> None:
    from pymodels import ADD_SUB, ADD_SUB_CONFIG

    client = httpclient.InferenceServerClient(server.http_url)
    config = ADD_SUB_CONFIG.replace('name: "add_sub"', 'name: "sneaky"')
    with pytest.raises(InferenceServerException) as raised:
        client.load_model("sneaky", config=config, files={"file:1/model.py": ADD_SUB.encode()})
    assert "only from the local model repository or a signed bundle" in str(raised.value)
    assert not _workers(server, "sneaky")
    client.close()


def test_workers_die_with_a_killed_server(tmp_path: Path) -> None:
    repo = write_repo(tmp_path / "repo", ["add_sub"])
    running = start_server(repo, tmp_path)
    try:
        workers = _workers(running, "add_sub")
        assert len(workers) == 1
        assert Path(f"/proc/{workers[0]}/oom_score_adj").read_text().strip() == "500"
        running.process.kill()  # SIGKILL: no close(), no finalize()
        running.process.wait(10)
        assert wait_until(lambda: not Path(f"/proc/{workers[0]}").exists() or _zombie(workers[0]), 10)
    finally:
        running.stop()


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
