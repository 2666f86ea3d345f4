"""Auto-complete from real model files (inspected by the real ONNX Runtime and OpenVINO backends)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from google.protobuf import text_format
from onnx_models import build_add_sub, build_conv_dynamic_hw, build_identity, build_mlp
from tritonclient.grpc import model_config_pb2 as mc

from edgeserve.backends import onnxruntime as ortb
from edgeserve.backends import openvino as ovb
from edgeserve.protocol.errors import RepositoryError
from edgeserve.repository.autocomplete import complete, instance_count
from edgeserve.repository.config import validate


def _complete(
    path: Path, text: str = "", default_max_batch_size: int = 4, backend: Any = ortb.BACKEND
) -> Any:
    config = text_format.Parse(text, mc.ModelConfig())
    out = complete(
        config,
        backend.inspect(path),
        model_name="m",
        backend_name=backend.name,
        platform=backend.platforms[0],
        model_file=path.name,
        default_max_batch_size=default_max_batch_size,
        where="models/m/config.pbtxt",
    )
    validate(out, "models/m/config.pbtxt", "m")
    return out


def test_dynamic_batch_model_gets_max_batch_4_and_dims_without_batch(tmp_path: Path) -> None:
    config = _complete(build_mlp(tmp_path / "model.onnx"))
    assert config.name == "m" and config.backend == "onnxruntime" and config.platform == "onnxruntime_onnx"
    assert config.max_batch_size == 4
    assert [(t.name, t.data_type, list(t.dims)) for t in config.input] == [("INPUT0", mc.TYPE_FP32, [16])]
    assert [(t.name, t.data_type, list(t.dims)) for t in config.output] == [("OUTPUT0", mc.TYPE_FP32, [4])]
    assert config.HasField("dynamic_batching")
    assert [(g.count, g.kind) for g in config.instance_group] == [(1, mc.ModelInstanceGroup.KIND_CPU)]
    assert config.version_policy.latest.num_versions == 1
    assert config.default_model_filename == "model.onnx"
    assert instance_count(config) == 1


@pytest.mark.parametrize("backend", [ortb.BACKEND, ovb.BACKEND], ids=["onnxruntime", "openvino"])
def test_conv_dynamic_hw_dims(tmp_path: Path, backend: Any) -> None:
    config = _complete(build_conv_dynamic_hw(tmp_path / "model.onnx"), backend=backend)
    assert config.max_batch_size == 4
    assert list(config.input[0].dims) == [3, -1, -1]
    assert list(config.output[0].dims) == [4, -1, -1]
    assert config.backend == backend.name


def test_fixed_first_axis_means_no_batching(tmp_path: Path) -> None:
    config = _complete(build_identity(tmp_path / "model.onnx", "INT32", shape=[2, "D"]))
    assert config.max_batch_size == 0
    assert list(config.input[0].dims) == [2, -1]
    assert not config.HasField("dynamic_batching")


def test_default_max_batch_size_setting(tmp_path: Path) -> None:
    path = build_mlp(tmp_path / "model.onnx")
    assert _complete(path, default_max_batch_size=16).max_batch_size == 16
    config = _complete(path, default_max_batch_size=0)
    assert config.max_batch_size == 0 and list(config.input[0].dims) == [-1, 16]
    single = _complete(path, default_max_batch_size=1)
    assert single.max_batch_size == 1 and not single.HasField("dynamic_batching")


def test_partial_config_is_completed(tmp_path: Path) -> None:
    text = """
    max_batch_size: 8
    input [ { name: "INPUT1" } ]
    output [ { name: "OUTPUT0" dims: [ 16 ] } ]
    dynamic_batching { max_queue_delay_microseconds: 500 }
    instance_group [ { count: 2 kind: KIND_CPU } ]
    """
    config = _complete(build_add_sub(tmp_path / "model.onnx"), text)
    assert config.max_batch_size == 8
    assert [t.name for t in config.input] == ["INPUT1", "INPUT0"]  # the missing input is added
    assert all(list(t.dims) == [16] and t.data_type == mc.TYPE_FP32 for t in config.input)
    assert [t.name for t in config.output] == ["OUTPUT0"]  # a declared subset of outputs is kept
    assert config.dynamic_batching.max_queue_delay_microseconds == 500
    assert instance_count(config) == 2


def test_explicit_non_batching_config_is_respected(tmp_path: Path) -> None:
    text = 'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1, 16 ] } ]'
    config = _complete(build_mlp(tmp_path / "model.onnx"), text)
    assert config.max_batch_size == 0 and list(config.input[0].dims) == [-1, 16]
    assert list(config.output[0].dims) == [-1, 4]


def test_more_specific_dims_are_allowed(tmp_path: Path) -> None:
    text = 'max_batch_size: 2 input [ { name: "images" dims: [ 3, 32, 32 ] } ]'
    config = _complete(build_conv_dynamic_hw(tmp_path / "model.onnx"), text)
    assert list(config.input[0].dims) == [3, 32, 32]


@pytest.mark.parametrize(
    ("text", "field", "words"),
    [
        ('input [ { name: "INPUT0" data_type: TYPE_INT32 } ]', "input 'INPUT0'.data_type",
         "TYPE_INT32 does not match model.onnx, which has TYPE_FP32"),
        ('max_batch_size: 4 input [ { name: "INPUT0" dims: [ 15 ] } ]', "input 'INPUT0'.dims",
         "[15] does not match model.onnx, which has [16]"),
        ('input [ { name: "INPUT0" dims: [ 16 ] } ]', "input 'INPUT0'.dims", "[16] does not match"),
        ('output [ { name: "PROBS" } ]', "output 'PROBS'", "no output of that name; its outputs: OUTPUT0"),
        ('input [ { name: "IMAGE" } ]', "input 'IMAGE'", "its inputs: INPUT0"),
    ],
)  # fmt: skip
def test_partial_config_disagreeing_with_the_model(tmp_path: Path, text: str, field: str, words: str) -> None:
    with pytest.raises(RepositoryError) as err:
        _complete(build_mlp(tmp_path / "model.onnx"), text)
    assert err.value.where == "models/m/config.pbtxt" and err.value.field == field
    assert words in err.value.message


def test_batching_needs_a_dynamic_first_axis(tmp_path: Path) -> None:
    with pytest.raises(RepositoryError) as err:
        _complete(build_identity(tmp_path / "model.onnx", "FP32", shape=[2, 3]), "max_batch_size: 8")
    assert err.value.field == "max_batch_size" and "'INPUT0' with shape [2,3]" in err.value.message


def test_existing_scheduler_and_names_kept(tmp_path: Path) -> None:
    text = 'name: "m" platform: "onnxruntime_onnx" sequence_batching { }'
    config = complete(
        text_format.Parse(text, mc.ModelConfig()), ortb.BACKEND.inspect(build_mlp(tmp_path / "model.onnx")),
        model_name="m", backend_name="onnxruntime", platform="onnxruntime_onnx", model_file="model.onnx",
        default_max_batch_size=4,
    )  # fmt: skip
    assert config.WhichOneof("scheduling_choice") == "sequence_batching"


def test_gpu_instances(tmp_path: Path) -> None:
    config = complete(
        mc.ModelConfig(),
        ortb.BACKEND.inspect(build_mlp(tmp_path / "model.onnx")),
        model_name="m",
        backend_name="onnxruntime",
        platform="onnxruntime_onnx",
        model_file="model.onnx",
        default_max_batch_size=4,
        gpu=True,
    )
    assert config.instance_group[0].kind == mc.ModelInstanceGroup.KIND_GPU
