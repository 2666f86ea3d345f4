"""A LAN peer and Triton's metrics port ([metrics] port, 8002): nothing answers it on the network unless
[metrics] address says so, and then the [http] token guards the page as it does on the HTTP port."""

from __future__ import annotations

import socket
from pathlib import Path

import aiohttp
import psutil
import pytest
from es_server import RunningServer, free_port, start_server
from http_access_helpers import FAST, TOKEN, model_repository, network_address


def listening(server: RunningServer, port: int) -> list[str]:
    return [c.laddr.ip for c in psutil.Process(server.process.pid).net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port]  # fmt: skip


async def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as response:
        return response.status, await response.text()


def test_the_metrics_port_is_not_on_the_network_by_default(tmp_path: Path) -> None:
    lan = network_address()
    port = free_port()
    running = start_server(model_repository(tmp_path), tmp_path, args=["--metrics-port", str(port)], env=FAST)
    try:
        assert listening(running, port) == ["127.0.0.1"]
        with pytest.raises(OSError), socket.create_connection((lan, port), timeout=5):
            pass  # refused: nothing listens there
    finally:
        running.stop()


async def test_a_lan_metrics_port_asks_a_network_peer_for_the_http_token(tmp_path: Path) -> None:
    lan = network_address()
    port = free_port()
    env = {**FAST, "EDGESERVE_METRICS_ADDRESS": "0.0.0.0", "EDGESERVE_HTTP_TOKEN": TOKEN}
    running = start_server(model_repository(tmp_path), tmp_path, args=["--metrics-port", str(port)], env=env)
    try:
        assert listening(running, port) == ["0.0.0.0"]
        assert "plain HTTP beyond loopback" in running.log()
        # dialled on the LAN address, the connection comes from a network peer
        for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
            status, text = await get(f"http://{lan}:{port}/metrics", headers)
            assert status == 401, text
            assert "nv_" not in text and "process_" not in text  # not a byte of the page
        status, text = await get(f"http://{lan}:{port}/metrics", {"Authorization": f"Bearer {TOKEN}"})
        assert status == 200 and "nv_inference_count" in text
        assert (await get(f"http://127.0.0.1:{port}/metrics"))[0] == 200  # loopback needs no token
    finally:
        running.stop()
