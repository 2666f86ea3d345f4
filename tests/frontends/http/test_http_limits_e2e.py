"""Issue 13, end to end against a real `edgeserve serve`: the HTTP connection guard (slowloris, total
connection bound), the request size limits on HTTP and gRPC, the gRPC stream idle timeout and
`max_concurrent_rpcs`. Real sockets and clients on loopback; statuses and counts, no timing bounds
beyond generous timeouts."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from es_server import RunningServer, ServerFactory
from http_e2e_helpers import MLP_CONFIG, assert_good_request_works, post_infer
from onnx_models import ORT, write_model
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.timeout(180)

LIMIT = 65536


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    write_model(repo, "mlp", "mlp", config=MLP_CONFIG)
    write_model(repo, "ident", "identity", config=ORT + "max_batch_size: 8\n")
    return repo


def _connect(server: RunningServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.http_port), timeout=30)


def _read_all(sock: socket.socket, timeout: float = 30.0) -> bytes:
    """Everything the server sends until it closes the connection (or `timeout` passes)."""
    sock.settimeout(timeout)
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def _ident_request(values: int) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="ident")
    tensor = request.inputs.add()
    tensor.name, tensor.datatype = "INPUT0", "FP32"
    tensor.shape.extend([1, values])
    request.raw_input_contents.append(np.arange(values, dtype=np.float32).tobytes())
    return request


# -- HTTP -------------------------------------------------------------------------------------------
def test_slowloris_headers_are_cut_off_and_others_are_served(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    server = server_factory(_repo(tmp_path), env={"EDGESERVE_HTTP_HEADER_TIMEOUT_S": "1"})
    header = b"GET /v2/health/live HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: slowloris-test\r\n\r\n"
    sock = _connect(server)
    sock.settimeout(0.05)
    sent, closed = 0, False
    deadline = time.monotonic() + 60  # one byte a second: the full header would take ~75 s
    try:
        while sent < len(header) - 1 and time.monotonic() < deadline:
            try:
                sock.sendall(header[sent : sent + 1])
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            sent += 1
            try:
                if sock.recv(4096) == b"":
                    closed = True
                    break
            except TimeoutError:
                pass
            except ConnectionResetError:
                closed = True
                break
            # while the slow client trickles, other clients are served
            assert requests.get(f"{server.base}/v2/health/ready", timeout=30).status_code == 200
            time.sleep(1.0)
    finally:
        sock.close()
    assert closed, f"server kept a connection sending one header byte a second open ({sent} bytes sent)"
    assert sent < len(header) - 1
    assert_good_request_works(server)
    assert "closing a stalled connection" in server.log()


def test_total_connection_bound_refuses_the_ninth_with_503(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    server = server_factory(_repo(tmp_path), env={"EDGESERVE_HTTP_MAX_CONNECTIONS": "8"})
    held: list[socket.socket] = []
    try:
        # 8 connections, each proven admitted by a keep-alive request answered 200
        for _ in range(8):
            sock = _connect(server)
            sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            sock.settimeout(30)
            answer = sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200"), answer
            held.append(sock)
        ninth = _connect(server)
        with contextlib.closing(ninth):
            with contextlib.suppress(OSError):
                ninth.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = _read_all(ninth)  # returns only once the server closed it
        assert answer.startswith(b"HTTP/1.1 503"), answer
        assert b"max_connections" in answer, answer
        # the held connections still work
        held[0].sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        assert held[0].recv(65536).startswith(b"HTTP/1.1 200")
    finally:
        for sock in held:
            sock.close()
    # once they are gone, new connections are admitted again
    deadline = time.monotonic() + 30
    while True:
        try:
            if requests.get(f"{server.base}/v2/health/ready", timeout=10).status_code == 200:
                break
        except requests.ConnectionError:
            pass
        assert time.monotonic() < deadline, "connections were not released after the clients closed"
        time.sleep(0.2)
    assert_good_request_works(server)


def test_body_over_max_input_bytes_is_413_naming_the_setting(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    server = server_factory(_repo(tmp_path), env={"EDGESERVE_HTTP_MAX_INPUT_BYTES": str(LIMIT)})
    values = 2 * LIMIT // 4
    body = (
        b'{"inputs":[{"name":"INPUT0","datatype":"FP32","shape":[1,%d],"parameters":'
        b'{"binary_data_size":%d}}]}' % (values, values * 4)
    )
    data = body + np.zeros(values, dtype=np.float32).tobytes()
    response = post_infer(server, "ident", data, headers={"Inference-Header-Content-Length": str(len(body))})
    assert response.status_code == 413, response.text
    assert "max_input_bytes" in response.json()["error"]
    # a JSON body over the limit on an admin route too
    big = b'{"parameters":{"x":"' + b"a" * (2 * LIMIT) + b'"}}'
    r = requests.post(f"{server.base}/v2/repository/models/mlp/load", data=big, timeout=60)
    assert r.status_code == 413, r.text
    assert "max_input_bytes" in r.json()["error"]
    assert_good_request_works(server)


# -- gRPC -------------------------------------------------------------------------------------------
def test_grpc_message_over_max_message_bytes_is_resource_exhausted(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    server = server_factory(_repo(tmp_path), env={"EDGESERVE_GRPC_MAX_MESSAGE_BYTES": str(LIMIT)})
    cli = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        big = np.zeros((1, 2 * LIMIT // 4), dtype=np.float32)
        inp = grpcclient.InferInput("INPUT0", list(big.shape), "FP32")
        inp.set_data_from_numpy(big)
        with pytest.raises(InferenceServerException) as info:
            cli.infer("ident", [inp])
        assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED", info.value
        small = np.ones((1, 16), dtype=np.float32)
        inp = grpcclient.InferInput("INPUT0", list(small.shape), "FP32")
        inp.set_data_from_numpy(small)
        out = cli.infer("ident", [inp]).as_numpy("OUTPUT0")
        assert out is not None and np.array_equal(out, small)
    finally:
        cli.close()
    assert server.alive()


def test_grpc_idle_stream_is_ended_with_deadline_exceeded(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    server = server_factory(_repo(tmp_path), env={"EDGESERVE_GRPC_STREAM_IDLE_TIMEOUT_S": "1"})

    async def scenario() -> tuple[int, grpc.StatusCode, str]:
        hold = asyncio.Event()

        async def requests_() -> AsyncIterator[service_pb2.ModelInferRequest]:
            yield _ident_request(16)
            await hold.wait()  # then nothing: the stream goes idle

        async with grpc.aio.insecure_channel(server.grpc_url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            call = stub.ModelStreamInfer(requests_(), timeout=60)
            answers = 0
            try:
                async for answer in call:
                    assert not answer.error_message, answer.error_message
                    answers += 1
            except grpc.aio.AioRpcError as exc:
                return answers, exc.code(), exc.details() or ""
            finally:
                hold.set()
            return answers, grpc.StatusCode.OK, ""

    answers, code, details = asyncio.run(scenario())
    assert answers == 1
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED, details
    assert "stream_idle_timeout_s" in details
    assert server.alive()


def test_grpc_max_concurrent_rpcs_refuses_beyond_with_resource_exhausted(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    """Open streams are RPCs: two held-open streams fill `max_concurrent_rpcs = 2`, so a unary call
    beyond them is refused; once they end, calls are accepted again."""
    server = server_factory(_repo(tmp_path), env={"EDGESERVE_GRPC_MAX_CONCURRENT_RPCS": "2"})

    async def scenario() -> tuple[grpc.StatusCode, grpc.StatusCode]:
        hold = asyncio.Event()

        async def requests_() -> AsyncIterator[service_pb2.ModelInferRequest]:
            yield _ident_request(16)
            await hold.wait()

        async with grpc.aio.insecure_channel(server.grpc_url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            streams = [stub.ModelStreamInfer(requests_(), timeout=120) for _ in range(2)]
            for stream in streams:  # both streams are running on the server
                answer = await stream.read()
                assert not answer.error_message, answer.error_message
            try:
                await stub.ModelInfer(_ident_request(16), timeout=30)
                refused = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                refused = exc.code()
            hold.set()
            for stream in streams:  # their request iterators end: the streams finish
                while await stream.read() is not grpc.aio.EOF:
                    pass
            after = grpc.StatusCode.UNKNOWN
            for _ in range(100):  # the server notices the ended streams
                try:
                    await stub.ModelInfer(_ident_request(16), timeout=30)
                    after = grpc.StatusCode.OK
                    break
                except grpc.aio.AioRpcError as exc:
                    after = exc.code()
                    await asyncio.sleep(0.1)
            return refused, after

    refused, after = asyncio.run(scenario())
    assert refused == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert after == grpc.StatusCode.OK
    assert server.alive()
