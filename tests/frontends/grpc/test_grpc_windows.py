"""The gRPC server's HTTP/2 stream windows: fixed (no BDP probe), sized to hold a whole request up to
4 MiB; requests below, at and past the window all arrive whole."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from grpc_fakes import InProcessServer, make_plane
from tritonclient.utils import InferenceServerException

from edgeserve.config import Settings
from edgeserve.frontends.grpc.server import (
    STREAM_WINDOW_MAX,
    STREAM_WINDOW_MIN,
    server_options,
    stream_window,
)


def test_the_window_holds_a_whole_request_up_to_4_mib() -> None:
    assert stream_window(100_000) == 100_005  # the message and its 5-byte gRPC prefix
    assert stream_window(1000) == STREAM_WINDOW_MIN
    assert stream_window(256 << 20) == STREAM_WINDOW_MAX == 4 << 20
    options = dict(server_options(1 << 20))
    assert options["grpc.http2.bdp_probe"] == 0
    assert options["grpc.http2.lookahead_bytes"] == (1 << 20) + 5


@pytest.mark.parametrize("limit", [0, 300_000])  # 0: sized for the device (window 4 MiB)
def test_requests_around_the_window_arrive_whole(tmp_path: Path, limit: int) -> None:
    plane, repo = make_plane(tmp_path)
    repo.add(
        "sum",
        'max_batch_size: 0 input { name: "X" data_type: TYPE_UINT8 dims: [-1] }'
        ' output { name: "S" data_type: TYPE_UINT64 dims: [1] }',
        lambda x: {"S": x["X"].sum(dtype=np.uint64, keepdims=True)},
    )
    settings = Settings()
    settings.grpc.max_message_bytes = limit
    server = InProcessServer(plane, settings)
    client = grpcclient.InferenceServerClient(server.url)
    try:
        window = stream_window(server.frontend.max_message_bytes)
        sizes = [60_000, 110_592, limit - 1000, window + 1] if limit else [110_592, window + 1]
        rng = np.random.default_rng(3)
        for size in sizes:
            data = rng.integers(0, 255, size, dtype=np.uint8)
            tensor = grpcclient.InferInput("X", [size], "UINT8")
            tensor.set_data_from_numpy(data)
            if size > server.frontend.max_message_bytes:  # past the message limit: refused
                with pytest.raises(InferenceServerException, match=r"RESOURCE_EXHAUSTED|larger than max"):
                    client.infer("sum", [tensor])
                continue
            for _ in range(3):  # a fresh stream each call: each starts with the fixed window
                result = client.infer("sum", [tensor])
                assert int(result.as_numpy("S")[0]) == int(data.sum(dtype=np.uint64)), size
    finally:
        client.close()
        server.close()
        repo.pool.shutdown(wait=False)
