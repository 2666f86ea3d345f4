"""Triton's generate extension end to end (frontends/http/generate.py): a real `edgeserve serve` on
loopback, aiohttp as the client: `/generate` (one JSON answer) and `/generate_stream` (server-sent
events, one `data:` event per response) over decoupled models and an ordinary one; a client that
leaves mid-stream cancels the model. The decoupled models are the in-process stand-in
(decoupled_stub.py) until the Python backend's land."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from decoupled_stub import start_stub_server, write_model
from es_server import RunningServer, wait_until
from stub_models import DECOUPLED_CONFIG, FLOOD, REPEAT

WAIT_S = 60.0  # generous: a loaded 2-core box; never reached when the code is right

ECHO_CONFIG = """max_batch_size: 0
input [{ name: "text_input", data_type: TYPE_STRING, dims: [1] }]
output [{ name: "text_output", data_type: TYPE_STRING, dims: [1] }]
"""
ECHO = '''
class Model:
    def __init__(self, config, model_dir):
        pass

    def infer(self, inputs, outputs=None):
        return {"text_output": inputs["text_input"]}

    def close(self):
        pass
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("decoupled-http")
    repo = tmp / "repo"
    write_model(repo, "repeat", DECOUPLED_CONFIG, REPEAT)
    write_model(repo, "flood", DECOUPLED_CONFIG, FLOOD)
    write_model(repo, "echo", ECHO_CONFIG, ECHO)
    running = start_stub_server(repo, tmp)
    yield running
    running.stop()


async def _post(server: RunningServer, path: str, body: Any) -> tuple[int, str, bytes]:
    timeout = aiohttp.ClientTimeout(total=WAIT_S)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(server.base + path, json=body) as response,
    ):
        return response.status, response.headers.get("Content-Type", ""), await response.read()


def _events(raw: bytes) -> list[Any]:
    chunks = [c for c in raw.decode().split("\n\n") if c.strip()]
    assert all(c.startswith("data: ") for c in chunks), raw
    return [json.loads(c[len("data: ") :]) for c in chunks]


def test_generate_answers_an_ordinary_model_in_tritons_json(server: RunningServer) -> None:
    status, kind, raw = asyncio.run(_post(server, "/v2/models/echo/generate", {"text_input": "hello"}))
    assert status == 200 and kind.startswith("application/json")
    assert json.loads(raw) == {"model_name": "echo", "model_version": "1", "text_output": "hello"}


def test_generate_stream_sends_each_response_as_an_event(server: RunningServer) -> None:
    status, kind, raw = asyncio.run(_post(server, "/v2/models/repeat/generate_stream", {"IN": [7, 8, 9]}))
    assert status == 200 and kind == "text/event-stream; charset=utf-8"
    events = _events(raw)
    assert [(e["OUT"], e["IDX"]) for e in events] == [(7, 0), (8, 1), (9, 2)]
    assert all(e["model_name"] == "repeat" for e in events)


def test_generate_of_a_decoupled_model_takes_exactly_one_response(server: RunningServer) -> None:
    status, _, raw = asyncio.run(_post(server, "/v2/models/repeat/generate", {"IN": 5}))
    assert status == 200 and json.loads(raw)["OUT"] == 5
    status, kind, raw = asyncio.run(_post(server, "/v2/models/repeat/generate", {"IN": [1, 2]}))
    assert status == 400 and kind.startswith("application/json")
    assert "use /generate_stream" in json.loads(raw)["error"]


def test_an_error_before_the_first_response_is_a_json_error(server: RunningServer) -> None:
    status, kind, raw = asyncio.run(_post(server, "/v2/models/nowhere/generate_stream", {"IN": 1}))
    assert status == 404 and kind.startswith("application/json") and "nowhere" in json.loads(raw)["error"]


def test_unary_infer_of_a_decoupled_model_is_refused(server: RunningServer) -> None:
    body = {"inputs": [{"name": "IN", "datatype": "INT32", "shape": [1], "data": [1]}]}
    status, _, raw = asyncio.run(_post(server, "/v2/models/repeat/infer", body))
    # UNSUPPORTED, in Triton's HTTP words
    assert status == 501
    words = "HTTP end point doesn't support models with decoupled transaction policy"
    assert json.loads(raw)["error"] == words


def test_a_client_leaving_mid_stream_cancels_the_model(server: RunningServer) -> None:
    async def read_a_little() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S)) as session:
            body = {"IN": [1_000_000, 1]}
            async with session.post(server.base + "/v2/models/flood/generate_stream", json=body) as response:
                assert response.status == 200
                await response.content.readuntil(b"\n\n")  # one event, then the client leaves

    asyncio.run(read_a_little())
    path = server.repository / "flood" / "done-"
    assert wait_until(path.exists, WAIT_S), server.log()[-3000:]
    report = path.read_text()
    assert report.startswith("cancelled=True") and int(report.rpartition("=")[2]) < 1_000_000
