"""The HTTP frontend's access rules in this process (real HttpFrontend, fake models): HTTPS without
client certificates, the supervisor's control socket, every route mapped to an access endpoint, and
settings that cannot start."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from fake_plane import FakeRepository, fake_plane
from http_access_helpers import make_pki

from edgeserve.config import Settings
from edgeserve.frontends.http import security
from edgeserve.frontends.http.server import HttpFrontend, build_app

SIMPLE = """
max_batch_size: 4
input { name: "INPUT0" data_type: TYPE_FP32 dims: [ 2 ] }
output { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 2 ] }
"""
BODY = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}]}


@contextlib.asynccontextmanager
async def frontend(
    tmp: Path, settings: Settings, unix_path: Path | None = None
) -> AsyncIterator[HttpFrontend]:
    repo = FakeRepository(tmp)
    repo.add("simple", SIMPLE, lambda x: {"OUTPUT0": x["INPUT0"] * 2})
    settings.http.port = 0
    running = HttpFrontend(fake_plane(repo), settings, unix_path=unix_path)
    await running.start()
    try:
        yield running
    finally:
        await running.stop(5)
        repo.close()


async def test_https_without_client_certificates(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki", [])
    settings = Settings()
    settings.http.tls_cert, settings.http.tls_key = pki.server_cert, pki.server_key
    async with frontend(tmp_path, settings) as running, aiohttp.ClientSession() as session:
        trusting = ssl.create_default_context(cafile=str(pki.ca))
        url = f"https://localhost:{running.port}/v2/models/simple/infer"
        async with session.post(url, json=BODY, ssl=trusting) as response:
            assert response.status == 200
            assert (await response.json())["outputs"][0]["data"] == [2.0, 4.0]
        with pytest.raises(aiohttp.ClientConnectorCertificateError):  # a client that checks: not its CA
            await session.get(f"https://localhost:{running.port}/v2", ssl=ssl.create_default_context())
        with pytest.raises(aiohttp.ClientError):  # plain HTTP on the TLS port
            await session.get(f"http://127.0.0.1:{running.port}/v2")


async def test_the_control_socket_needs_no_restricted_header(tmp_path: Path) -> None:
    """The supervisor's Unix socket (0600) checks health and loads models without Triton's headers;
    the same requests over TCP, even from loopback, need them."""
    settings = Settings()
    settings.http.restricted_api = ["health,model-repository:admin-key=admin-value"]  # type: ignore[assignment]
    sock = tmp_path / "control.sock"
    async with frontend(tmp_path, settings, unix_path=sock) as running:
        assert sock.stat().st_mode & 0o777 == 0o600
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sock))) as private:
            async with private.get("http://edgeserve/v2/health/ready") as response:
                assert response.status == 200
            async with private.post("http://edgeserve/v2/repository/index", json={}) as response:
                assert response.status == 200
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{running.port}/v2/health/ready") as response:
                assert response.status == 403
                assert (await response.json())[
                    "error"
                ] == "This API is restricted, expecting header 'admin-key'"
            ready = f"http://127.0.0.1:{running.port}/v2/health/ready"
            async with session.get(ready, headers={"admin-key": "admin-value"}) as response:
                assert response.status == 200


def test_every_route_has_an_access_endpoint(tmp_path: Path) -> None:
    repo = FakeRepository(tmp_path)
    app = build_app(fake_plane(repo), 1 << 20)  # check_routes passes at build time
    admin = {
        f"{route.method} {route.resource.canonical}"  # type: ignore[union-attr]
        for route in app.router.routes()
        if security.ENDPOINTS[route.handler.__func__].admin  # type: ignore[attr-defined]
    }
    assert admin == {
        "POST /v2/repository/models/{model}/load", "POST /v2/repository/models/{model}/unload",
        "POST /v2/repository/{repository}/models/{model}/load",
        "POST /v2/repository/{repository}/models/{model}/unload",
        "POST /v2/systemsharedmemory/region/{region}/register", "POST /v2/systemsharedmemory/unregister",
        "POST /v2/systemsharedmemory/region/{region}/unregister",
        "POST /v2/cudasharedmemory/region/{region}/register", "POST /v2/cudasharedmemory/unregister",
        "POST /v2/cudasharedmemory/region/{region}/unregister", "POST /v2/logging",
    }  # fmt: skip

    async def sneaky(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post("/v2/admin/backdoor", sneaky)
    with pytest.raises(RuntimeError, match="has no access endpoint"):
        security.check_routes(app)
    repo.close()


async def test_unreadable_tls_files_stop_the_start_with_the_setting_named(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki", [])
    settings = Settings()
    settings.http.tls_cert, settings.http.tls_key = pki.server_cert, tmp_path / "missing.key"
    with pytest.raises(RuntimeError, match=r"\[http\] tls_key .*missing\.key"):
        async with frontend(tmp_path, settings):
            pass
    settings.http.tls_key = pki.client_key  # not the certificate's key
    with pytest.raises(RuntimeError, match="not usable PEM files"):
        async with frontend(tmp_path, settings):
            pass
