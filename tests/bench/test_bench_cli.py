"""`edgeserve bench` against a real server on loopback: every protocol, both load modes, the output
files, image inputs for a dynamic-shape model, and the clean errors (exit 2)."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from es_server import ROOT, RunningServer, free_port, start_server
from onnx_models import write_model

from edgeserve.bench.stats import Point
from edgeserve.cli import main

FAST = ["--warmup-s", "0.2", "--window-s", "0.3", "--max-windows", "3", "--max-seconds", "20"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("bench")
    repo = tmp / "repo"  # the sample MLP (its builder and config) and a dynamic-shape conv
    write_model(repo, "mlp", "mlp", config=(ROOT / "models" / "mlp" / "config.pbtxt").read_text())
    write_model(repo, "conv", "conv")
    write_model(repo, "strings", "identity", datatype="BYTES")
    write_model(repo, "add_sub", "add_sub")
    running = start_server(repo, tmp, args=["--load-model", "*", "--log-level", "WARNING"])
    yield running
    running.stop()


def _url(server: RunningServer, protocol: str) -> list[str]:
    if protocol.startswith("http"):
        return ["-u", server.http_url]
    if protocol.startswith("grpc"):
        return ["-u", server.grpc_url]
    return ["-u", server.zmq_endpoint, "--stats-url", server.http_url]


def _bench(
    args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> tuple[int, dict[str, Any], str]:
    out = tmp_path / "points.json"
    code = main(["bench", *args, "--json", str(out)])
    captured = capsys.readouterr()
    document = json.loads(out.read_text()) if out.exists() else {}
    return code, document, captured.out + captured.err


def _sane(point: dict[str, Any], server_split: bool = True) -> None:
    assert point["requests"] > 0 and point["errors"] == 0, point
    assert point["throughput"] > 0
    assert point["p50_ms"] <= point["p90_ms"] <= point["p99_ms"] <= point["max_ms"]
    assert point["client_cpu_pct"] > 0
    if server_split:
        for key in (
            "server_queue_us",
            "server_compute_input_us",
            "server_compute_infer_us",
            "server_compute_output_us",
        ):
            assert point[key] is not None and point[key] >= 0, (key, point)
        assert point["server_batch"] >= 1


@pytest.mark.parametrize("protocol", ["http", "http-json", "grpc", "grpc-stream", "zmq", "zmq-shm"])
def test_every_protocol(
    server: RunningServer, protocol: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    levels = "1,2" if protocol == "grpc" else "2"
    code, document, text = _bench(
        ["mlp", "-i", protocol, *_url(server, protocol), "--concurrency", levels, *FAST], tmp_path, capsys
    )
    assert code == 0, text
    points = document["points"]
    assert [p["concurrency"] for p in points] == [int(c) for c in levels.split(",")]
    for point in points:
        assert point["protocol"] == protocol and point["model"] == "mlp"
        _sane(point)
    assert "window 1/3" in text and "infer/s" in text  # progress, then the table
    assert document["model"]["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 16]}]


def test_csv_json_png(server: RunningServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = {kind: tmp_path / f"out.{kind}" for kind in ("csv", "png")}
    code, document, text = _bench(
        [
            "mlp",
            "-i",
            "grpc,zmq",
            "--grpc-url",
            server.grpc_url,
            "--zmq-url",
            server.zmq_endpoint,
            "--stats-url",
            server.http_url,
            "--concurrency",
            "1:2",
            "--batch-size",
            "4",
            *FAST,
            "--csv",
            str(paths["csv"]),
            "--plot",
            str(paths["png"]),
        ],
        tmp_path,
        capsys,
    )
    assert code == 0, text
    with open(paths["csv"]) as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == Point.columns() == document["columns"]
    assert [(r["protocol"], int(r["concurrency"])) for r in rows] == [
        ("grpc", 1),
        ("grpc", 2),
        ("zmq", 1),
        ("zmq", 2),
    ]
    assert all(int(r["batch_size"]) == 4 and float(r["throughput"]) > 0 for r in rows)
    assert all(float(r["server_batch"]) >= 1 for r in rows)
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths["png"].stat().st_size > 5000
    # the table on stdout: a header and one line per point, the protocol named when there are several
    assert "p99 ms" in text and "client cpu%" in text and "zmq c=2" in text
    assert document["run"]["protocols"] == ["grpc", "zmq"]


@pytest.mark.parametrize("protocol", ["http", "grpc-stream", "zmq-shm"])
def test_poisson_rate(
    server: RunningServer, protocol: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Open loop: several requests in flight on one stream / socket / ring (every protocol multiplexes)."""
    code, document, text = _bench(
        [
            "mlp",
            "-i",
            protocol,
            *_url(server, protocol),
            "--request-rate",
            "100",  # well under a busy 2-core box's capacity: an open loop past it is refused (503)
            "--warmup-s",
            "0.2",
            "--window-s",
            "0.6",
            "--max-windows",
            "2",
        ],
        tmp_path,
        capsys,
    )
    assert code == 0, text
    (point,) = document["points"]
    assert point["concurrency"] == 0 and point["request_rate"] == 100
    _sane(point)
    # loose: Poisson arrivals over ~1 s at 100/s, on a shared machine
    assert 30 < point["sent_per_s"] < 250, point
    assert isinstance(point["late"], int)
    assert "rate=100/s" in text


def test_images_into_a_dynamic_nchw_input(
    server: RunningServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from PIL import Image

    images = tmp_path / "images"
    images.mkdir()
    for i, size in enumerate([(50, 40), (20, 64)]):
        Image.fromarray(np.full((size[1], size[0], 3), 40 * i, np.uint8)).save(images / f"{i}.png")
    code, document, text = _bench(
        ["conv", "-u", server.grpc_url, "--input-data", str(images), "--shape", "images:3,32,32", *FAST],
        tmp_path,
        capsys,
    )
    assert code == 0, text
    _sane(document["points"][0])
    assert "images [1, 3, 32, 32]" in text
    # without --shape the dynamic dimensions are named in the error
    code, _, text = _bench(["conv", "-u", server.grpc_url, *FAST], tmp_path, capsys)
    assert code == 2 and "--shape images:" in text


@pytest.mark.parametrize("protocol", ["http", "grpc", "zmq"])
def test_unreachable_server_and_unknown_model(
    server: RunningServer, protocol: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dead = {
        "http": f"127.0.0.1:{free_port()}",
        "grpc": f"127.0.0.1:{free_port()}",
        "zmq": f"ipc://{tmp_path}/nobody.zmq",
    }[protocol]
    code, _, text = _bench(["mlp", "-i", protocol, "-u", dead, *FAST], tmp_path, capsys)
    assert code == 2 and "edgeserve bench: cannot reach" in text and "Traceback" not in text
    code, _, text = _bench(["nomodel", "-i", protocol, *_url(server, protocol), *FAST], tmp_path, capsys)
    assert code == 2 and "nomodel" in text and "Traceback" not in text


def test_exit_code_of_the_command(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "edgeserve", "bench", "mlp", "-i", "http", "-u", f"127.0.0.1:{free_port()}"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert result.stderr.strip().startswith("edgeserve bench: cannot reach http://127.0.0.1:")


def test_plot_without_matplotlib(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code = main(["bench", "mlp", "-u", f"127.0.0.1:{free_port()}", "--plot", str(tmp_path / "x.png")])
    assert code == 2
    assert "pip install 'edgeserve[plot]'" in capsys.readouterr().err


def test_nan_is_null_in_json(
    server: RunningServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A server without statistics (here: ZeroMQ with --stats-url none) leaves the split empty, not NaN."""
    code, document, text = _bench(
        ["mlp", "-i", "zmq", "-u", server.zmq_endpoint, "--stats-url", "none", "--concurrency", "1", *FAST],
        tmp_path,
        capsys,
    )
    assert code == 0, text
    point = document["points"][0]
    _sane(point, server_split=False)
    assert point["server_queue_us"] is None and not math.isnan(point["p50_ms"])


def test_max_seconds_bounds_the_run(
    server: RunningServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "mlp",
        "-u",
        server.grpc_url,
        "--concurrency",
        "1,2,4,8",
        "--warmup-s",
        "0.2",
        "--window-s",
        "0.4",
    ]
    code, document, text = _bench([*args, "--max-seconds", "1.5"], tmp_path, capsys)
    assert code == 0, text
    assert 1 <= len(document["points"]) < 4
    assert "time limit" in text
    assert sum(p["seconds"] for p in document["points"]) < 3.0


@pytest.mark.parametrize("protocol", ["http", "http-json", "grpc", "zmq-shm"])
def test_bytes_inputs(
    server: RunningServer, protocol: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "strings",
        "-i",
        protocol,
        *_url(server, protocol),
        "--shape",
        "INPUT0:3",
        "--concurrency",
        "1",
        *FAST,
    ]
    code, document, text = _bench(args, tmp_path, capsys)
    assert code == 0, text
    _sane(document["points"][0])


def test_two_inputs_from_named_files(
    server: RunningServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    (data / "INPUT1").mkdir(parents=True)
    np.save(data / "INPUT0.npy", np.ones(16, np.float32))  # one item: the batch dimension is added
    for i in range(3):
        np.save(data / "INPUT1" / f"{i}.npy", np.full((1, 16), i, np.float32))
    args = ["add_sub", "-u", server.grpc_url, "--input-data", str(data), "--concurrency", "2", *FAST]
    code, document, text = _bench(args, tmp_path, capsys)
    assert code == 0, text
    _sane(document["points"][0])
