"""Triton's metrics port ([metrics] port, --metrics-port): a real server, scraped with aiohttp as a
Prometheus scraper or Triton's custom_metrics client would (a LAN peer's view:
tests/security/test_metrics_port.py)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import psutil
import pytest
from es_server import RunningServer, free_port, start_server, wait_until
from onnx_models import write_model
from prometheus_client.parser import text_string_to_metric_families

CONFIG = 'backend: "onnxruntime"\nmax_batch_size: 4\n'


def listening(server: RunningServer, port: int) -> list[str]:
    """The addresses the server process listens on at `port`."""
    return [c.laddr.ip for c in psutil.Process(server.process.pid).net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port]  # fmt: skip


def families(text: str) -> set[str]:
    return {family.name for family in text_string_to_metric_families(text)}


async def fetch(url: str, method: str = "GET", **kwargs: object) -> tuple[int, str, str]:
    async with aiohttp.ClientSession() as session, session.request(method, url, **kwargs) as response:
        return response.status, response.headers.get("Content-Type", ""), await response.text()


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("metrics-repo")
    write_model(root, "mlp", config=CONFIG)
    return root


@pytest.fixture(scope="module")
def server(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, int]]:
    port = free_port()
    running = start_server(
        repo, tmp_path_factory.mktemp("metrics-server"), args=["--metrics-port", str(port)]
    )
    yield running, port
    running.stop()


async def test_the_metrics_port_serves_the_same_page_as_the_http_port(
    server: tuple[RunningServer, int],
) -> None:
    running, port = server
    status, content_type, text = await fetch(f"http://127.0.0.1:{port}/metrics")
    assert status == 200, text
    assert content_type.startswith("text/plain")
    http_status, _, http_text = await fetch(f"{running.base}/metrics")
    assert http_status == 200
    assert families(text) == families(http_text)  # parses, and the same families on both ports
    assert 'nv_inference_count{model="mlp",version="1"}' in text
    assert listening(running, port) == ["127.0.0.1"]  # loopback unless [metrics] address says otherwise


async def test_the_metrics_port_answers_get_metrics_and_nothing_else(
    server: tuple[RunningServer, int],
) -> None:
    running, port = server
    base = f"http://127.0.0.1:{port}"
    assert (await fetch(f"{base}/metrics", "POST", data=b"x" * 1000))[0] == 405
    assert (await fetch(f"{base}/metrics", "HEAD"))[0] == 405
    assert (await fetch(f"{base}/v2/health/ready"))[0] == 404
    assert (await fetch(f"{base}/v2/models/mlp/infer", "POST", data=b"{}"))[0] == 404
    # a request line or header over the listener's few KB is refused, and the listener serves on
    assert (await fetch(f"{base}/metrics?{'a' * 8000}"))[0] in (400, 414)
    assert (await fetch(f"{base}/metrics", headers={"X-Big": "b" * 8000}))[0] in (400, 431)
    assert (await fetch(f"{base}/metrics"))[0] == 200
    assert running.alive()


def test_the_listener_stops_with_the_server(repo: Path, tmp_path: Path) -> None:
    port = free_port()
    running = start_server(repo, tmp_path, args=["--metrics-port", str(port)])
    assert listening(running, port) == ["127.0.0.1"]
    assert running.stop() == 0
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=5):
        pass
    assert "metrics listener stopped" in running.log()


def test_port_zero_is_off_and_a_port_in_use_does_not_keep_the_server_down(repo: Path, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        running = start_server(repo, tmp_path, args=["--metrics-port", str(port)])
        try:
            assert wait_until(lambda: "metrics listener cannot listen on" in running.log(), 30)
            assert running.model_ready("mlp")
            assert listening(running, port) == []
        finally:
            running.stop()
    off = start_server(repo, tmp_path, args=["--metrics-port", "0"])
    try:
        assert "metrics listener on" not in off.log()
        ports = {c.laddr.port for c in psutil.Process(off.process.pid).net_connections("inet")
                 if c.status == psutil.CONN_LISTEN}  # fmt: skip
        assert ports == {off.http_port, off.grpc_port}
    finally:
        off.stop()
