"""The bench's pieces without a server: flags, shapes, input files, stability, the split, the
search order and config rewriting of `tune`, the frontier."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import pytest

from edgeserve.bench.api import grpc_metadata
from edgeserve.bench.candidates import Candidate, apply, cpu_precisions, layouts, search
from edgeserve.bench.cli import parse_headers, parse_levels, parse_protocols, parse_rates
from edgeserve.bench.errors import BenchError
from edgeserve.bench.inputs import (
    ModelInfo,
    TensorSpec,
    make_samples,
    model_info,
    parse_shape_flags,
    resolve_shapes,
)
from edgeserve.bench.stats import Counters, Window, stable
from edgeserve.bench.tune_check import compare
from edgeserve.bench.tune_report import Measured, best_within, frontier


def test_levels_and_rates() -> None:
    assert parse_levels("1,2,4,8") == [1, 2, 4, 8]
    assert parse_levels("1:8:2") == [1, 3, 5, 7]
    assert parse_levels("2:4,16") == [2, 3, 4, 16]
    assert parse_rates("100,250.5") == [100.0, 250.5]
    for bad in ("0", "a", "4:1:0", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_levels(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_rates("-1")


def _info(shape: tuple[int, ...], max_batch: int | None, datatype: str = "FP32") -> ModelInfo:
    return ModelInfo(
        "m",
        "1",
        "onnxruntime_onnx",
        (TensorSpec("x", datatype, shape),),
        (TensorSpec("y", "FP32", (-1,)),),
        max_batch,
    )


def test_shapes_batch_dynamic_and_warmup() -> None:
    assert resolve_shapes(_info((-1, 16), 8), 4, {}) == {"x": (4, 16)}
    assert resolve_shapes(_info((-1, 16), None), 2, {}) == {"x": (2, 16)}  # no config: leading -1 batches
    dynamic = _info((-1, 3, -1, -1), 0)
    with pytest.raises(BenchError, match=r"--shape x:1,3,1,1"):
        resolve_shapes(dynamic, 1, {})
    assert resolve_shapes(dynamic, 1, parse_shape_flags(["x:1,3,64,32"])) == {"x": (1, 3, 64, 32)}
    with pytest.raises(BenchError, match="does not batch"):
        resolve_shapes(dynamic, 2, {})
    with pytest.raises(BenchError, match="does not fit"):
        resolve_shapes(dynamic, 1, {"x": (1, 4, 8, 8)})
    meta = {
        "name": "m",
        "versions": ["1"],
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 3, 48, -1]}],
    }
    config = {
        "max_batch_size": 8,
        "model_warmup": [{"batch_size": 1, "inputs": {"x": {"dims": ["3", "48", "320"]}}}],
    }
    assert resolve_shapes(model_info(meta, config), 2, {}) == {"x": (2, 3, 48, 320)}
    with pytest.raises(BenchError):
        parse_shape_flags(["x:0,1"])


def test_samples_random_zeros_npy_raw(tmp_path: Path) -> None:
    info = _info((-1, 4), 8)
    shapes = {"x": (2, 4)}
    random = make_samples(info, shapes, ["random"])
    assert len(random) == 16 and random[0]["x"].shape == (2, 4) and random[0]["x"].dtype == np.float32
    assert not np.array_equal(random[0]["x"], random[1]["x"])
    assert make_samples(info, shapes, ["zeros"])[0]["x"].sum() == 0
    np.save(tmp_path / "a.npy", np.arange(4, dtype=np.float64))  # one item: batch added, dtype cast
    (tmp_path / "b.raw").write_bytes(np.ones(8, np.float32).tobytes())  # a whole batch, raw
    samples = make_samples(info, shapes, [str(tmp_path)])
    assert [s["x"].dtype for s in samples] == [np.float32, np.float32]
    assert samples[0]["x"].tolist() == [[0, 1, 2, 3]] * 2 and samples[1]["x"].sum() == 8
    (tmp_path / "c.raw").write_bytes(b"\0" * 12)
    with pytest.raises(BenchError, match="does not fit"):
        make_samples(info, shapes, [str(tmp_path / "c.raw")])
    with pytest.raises(BenchError):
        make_samples(info, shapes, ["random", str(tmp_path)])


def test_images_nchw_float_and_nhwc_uint8(tmp_path: Path) -> None:
    from PIL import Image

    path = tmp_path / "frame.png"
    Image.fromarray(np.full((30, 50, 3), 255, np.uint8)).save(path)
    nchw = make_samples(_info((-1, 3, 8, 12), 4), {"x": (1, 3, 8, 12)}, [str(path)])[0]["x"]
    assert nchw.shape == (1, 3, 8, 12) and nchw.dtype == np.float32 and np.allclose(nchw, 1.0)
    nhwc = make_samples(_info((-1, 8, 12, 3), 4, "UINT8"), {"x": (2, 8, 12, 3)}, [str(path)])[0]["x"]
    assert nhwc.shape == (2, 8, 12, 3) and nhwc.dtype == np.uint8 and int(nhwc.min()) == 255


def test_images_without_pillow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "PIL", None)
    (tmp_path / "a.jpg").write_bytes(b"not really")
    with pytest.raises(BenchError, match="needs Pillow"):
        make_samples(_info((-1, 3, 8, 8), 4), {"x": (1, 3, 8, 8)}, [str(tmp_path / "a.jpg")])


def _window(throughput: float, latency: float) -> Window:
    count = int(throughput)
    return Window(1.0, [latency] * count, 0, count, 0, 0.1, None)


def test_stability_rule() -> None:
    assert not stable([_window(100, 0.01)] * 2, 10)
    assert stable([_window(100, 0.01), _window(105, 0.0104), _window(96, 0.0098)], 10)
    assert not stable([_window(100, 0.01), _window(150, 0.01), _window(100, 0.01)], 10)
    assert not stable([_window(100, 0.01), _window(100, 0.02), _window(100, 0.01)], 10)


def test_server_split_from_statistics_deltas() -> None:
    def body(n: int, queue_ns: int, executions: int) -> dict[str, object]:
        stats = {
            k: {"count": str(n), "ns": str(queue_ns if k == "queue" else n * 1000)}
            for k in ("success", "queue", "compute_input", "compute_infer", "compute_output")
        }
        return {"model_stats": [{"execution_count": executions, "inference_stats": stats}]}

    before, after = Counters.from_json(body(10, 10_000, 10)), Counters.from_json(body(30, 70_000, 15))
    assert before is not None and after is not None
    delta = after - before
    assert delta.success == 20 and delta.executions == 5
    split = delta.per_request_us()
    assert split["queue"] == 3.0 and split["compute_infer"] == 1.0
    assert Counters.from_json({"model_stats": []}) is None
    assert math.isnan(Counters().per_request_us()["queue"])


def test_search_order_is_staged_and_deterministic() -> None:
    scores = {"onnxruntime": 100.0, "openvino": 50.0}

    def score(c: Candidate) -> float | None:
        return None if c.baseline else scores[c.backend] * (1.5 if c.instances == 2 else 1.0)

    walked = list(search(["onnxruntime", "openvino"], ["fp32", "bf16"], 8, score, cores=2))
    assert [c.label for c in walked[:4]] == [
        "onnxruntime fp32 1x2t mbs8",
        "openvino fp32 1x2t mbs8",
        "openvino bf16 1x2t mbs8",
        "as configured",
    ]
    assert {(c.instances, c.threads) for c in walked[4:7]} == {(1, 1), (2, 1)}
    batching = [c for c in walked if c.queue_delay_us >= 0 or not c.dynamic_batching]
    assert batching and all(c.backend == "onnxruntime" and c.instances == 2 for c in batching)
    assert len(walked) == len(set(walked))
    assert walked == list(search(["onnxruntime", "openvino"], ["fp32", "bf16"], 8, score, cores=2))
    assert layouts(4) == [(1, 4), (1, 1), (2, 2), (2, 1), (4, 1)]
    no_batch = list(search(["onnxruntime"], ["fp32"], 0, score, cores=2))
    assert all(c.max_batch_size == -1 for c in no_batch)


def test_apply_rewrites_only_what_is_tuned() -> None:
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    base = text_format.Parse(
        (Path(__file__).resolve().parents[2] / "models" / "mlp" / "config.pbtxt").read_text(),
        mc.ModelConfig(),
    )
    config = apply(base, Candidate("openvino", "bf16", 2, 1, 4, True, 500))
    assert config.backend == "openvino" and config.parameters["precision"].string_value == "bf16"
    assert config.parameters["INFERENCE_NUM_THREADS"].string_value == "1"
    assert [g.count for g in config.instance_group] == [2] and config.max_batch_size == 4
    assert list(config.dynamic_batching.preferred_batch_size) == [4]
    assert config.dynamic_batching.max_queue_delay_microseconds == 500
    assert [w.batch_size for w in config.model_warmup] == [1]  # the batch-8 warm-up no longer fits
    off = apply(base, Candidate("onnxruntime", "fp32", 1, 2, 8, False, -1))
    assert (
        not off.HasField("dynamic_batching") and off.parameters["intra_op_thread_count"].string_value == "2"
    )
    assert apply(base, Candidate()) == base


def test_frontier_and_best() -> None:
    points = [
        Measured("a", "a", 1, 100, 1.0, 0.5),
        Measured("a", "a", 4, 300, 5.0, 2.0),
        Measured("b", "b", 1, 90, 2.0, 1.0),
        Measured("b", "b", 4, 400, 9.0, 4.0),
    ]
    assert [(p.key, p.concurrency) for p in frontier(points)] == [("a", 1), ("a", 4), ("b", 4)]
    best = best_within(points, 6.0)
    assert best is not None and (best.key, best.concurrency) == ("a", 4)
    assert best_within(points, 0.5) is None


def test_accuracy_compare() -> None:
    ref = [{"y": np.array([0.0, 1.0, 2.0], np.float32)}]
    assert compare(ref, ref)["max_err_over_range"] == 0.0
    near = compare(ref, [{"y": np.array([0.0, 1.01, 2.0], np.float32)}])
    assert 0.004 < near["max_err_over_range"] < 0.006 and near["cosine_min"] > 0.999
    assert compare(ref, [{"y": np.zeros(2, np.float32)}])["max_err_over_range"] == math.inf
    # two near-equal classes: the range is ~0, the scale is not; top-1 flips are counted, not fatal
    soft = [{"p": np.array([[0.5001, 0.4999]], np.float32)}]
    flipped = compare(soft, [{"p": np.array([[0.4999, 0.5001]], np.float32)}])
    assert flipped["max_err_over_range"] < 1e-3 and flipped["top1_agreement"] == 0.0


def test_headers_and_protocol_lists() -> None:
    headers = parse_headers(["triton-access-token: abc", "X-Trace:1:2"])
    assert headers == {"triton-access-token": "abc", "X-Trace": "1:2"}
    assert grpc_metadata(headers) == (("triton-access-token", "abc"), ("x-trace", "1:2"))
    with pytest.raises(BenchError):
        parse_headers(["no-colon"])
    assert parse_protocols("grpc,zmq-shm,grpc") == ["grpc", "zmq-shm"]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_protocols("grpc,carrier-pigeon")


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ("avx2 fma", ["fp32"]),
        ("avx512f avx512_bf16 avx512_fp16 amx_bf16", ["fp32", "bf16"]),  # Sapphire Rapids: no f16 hint
        ("avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_fp16", ["fp32", "bf16", "fp16"]),  # Granite Rapids
    ],
)
def test_cpu_precisions_offer_only_what_openvino_runs(
    tmp_path: Path, flags: str, expected: list[str]
) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    assert cpu_precisions(cpuinfo) == expected
