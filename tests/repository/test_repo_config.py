"""config.pbtxt / JSON parsing and validation: every error names the file, the field and the problem."""

from __future__ import annotations

from pathlib import Path

import pytest
from tritonclient.grpc import model_config_pb2 as mc

from edgeserve.protocol.errors import InferenceError, RepositoryError, Status
from edgeserve.repository.config import parse_json, parse_override, parse_pbtxt, parse_text, validate

BASE = """
name: "foo"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""


def _check(tmp_path: Path, text: str, name: str = "foo") -> None:
    model_dir = tmp_path / "models" / name
    model_dir.mkdir(parents=True, exist_ok=True)
    path = model_dir / "config.pbtxt"
    path.write_text(text)
    validate(parse_pbtxt(path), str(path), name, model_dir)


def _error(tmp_path: Path, text: str, name: str = "foo") -> RepositoryError:
    with pytest.raises(RepositoryError) as err:
        _check(tmp_path, text, name)
    return err.value


def test_valid_config_passes(tmp_path: Path) -> None:
    _check(
        tmp_path,
        BASE + "dynamic_batching { preferred_batch_size: [ 4, 8 ] max_queue_delay_microseconds: 100 }",
    )


def test_preferred_batch_size_over_max(tmp_path: Path) -> None:
    err = _error(tmp_path, BASE + "dynamic_batching { preferred_batch_size: [ 16 ] }")
    path = tmp_path / "models" / "foo" / "config.pbtxt"
    assert err.message == f"{path}: dynamic_batching.preferred_batch_size: 16 exceeds max_batch_size 8"
    assert err.status is Status.INVALID_ARG and isinstance(err, InferenceError)


@pytest.mark.parametrize(
    ("extra", "field", "words"),
    [
        ('name: "bar"', "name", "must match the model folder name 'foo'"),
        ("", "input 'INPUT0'.dims", "each dim must be >= 1"),
        ("", "output 'OUTPUT0'.data_type", "missing"),
        ("instance_group [ { count: -1 } ]", "instance_group[0].count", ">= 1"),
        ("instance_group [ { kind: KIND_CPU gpus: [ 0 ] } ]", "instance_group[0].gpus", "KIND_GPU"),
        ("version_policy { latest { num_versions: 0 } }", "version_policy.latest.num_versions", ">= 1"),
        ("version_policy { specific { } }", "version_policy.specific.versions", "at least one"),
        ("dynamic_batching { priority_levels: 2 default_priority_level: 3 }",
         "dynamic_batching.default_priority_level", "between 1 and priority_levels 2"),
        ('sequence_batching { control_input [ { name: "INPUT0" control [ { kind: CONTROL_SEQUENCE_START '
         "fp32_false_true: [ 0, 1 ] } ] } ] }", "sequence_batching.control_input", "fed by the server"),
        ('sequence_batching { control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_READY } ] } ] }',
         "sequence_batching.control_input 'S'", "needs int32_false_true"),
        ('output [ { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 1 ] label_filename: "labels.txt" } ]',
         "output 'OUTPUT1'.label_filename", "'labels.txt' not found"),
        ('model_warmup [ { name: "w" batch_size: 1 inputs { key: "NOPE" value: { data_type: TYPE_FP32 '
         "dims: [ 16 ] zero_data: true } } } ]", "model_warmup[0].inputs['NOPE']", "not a model input"),
        ('model_warmup [ { name: "w" batch_size: 16 inputs { key: "INPUT0" value: { data_type: TYPE_FP32 '
         "dims: [ 16 ] zero_data: true } } } ]", "model_warmup[0].batch_size", "exceeds max_batch_size 8"),
        ('model_warmup [ { name: "w" batch_size: 1 inputs { key: "INPUT0" value: { data_type: TYPE_INT32 '
         "dims: [ 16 ] zero_data: true } } } ]", "model_warmup[0].inputs['INPUT0'].data_type", "TYPE_INT32"),
        ('model_warmup [ { name: "w" batch_size: 1 inputs { key: "INPUT0" value: { data_type: TYPE_FP32 '
         'dims: [ 16 ] input_data_file: "raw" } } } ]', "model_warmup[0].inputs['INPUT0'].input_data_file",
         "not found"),
    ],
)  # fmt: skip
def test_errors_name_file_and_field(tmp_path: Path, extra: str, field: str, words: str) -> None:
    text = BASE + extra
    if field == "input 'INPUT0'.dims":
        text = text.replace("dims: [ 16 ]", "dims: [ -2 ]", 1)
    if field == "output 'OUTPUT0'.data_type":
        text = text.replace('name: "OUTPUT0" data_type: TYPE_FP32', 'name: "OUTPUT0"')
    if field == "name":
        text = text.replace('name: "foo"', "", 1)
    err = _error(tmp_path, text)
    assert err.where.endswith("models/foo/config.pbtxt")
    assert err.field == field, err.message
    assert words in err.message
    assert err.message.startswith(f"{err.where}: {field}: ")


def test_syntax_error_names_the_file_and_field(tmp_path: Path) -> None:
    path = tmp_path / "config.pbtxt"
    path.write_text('name: "foo"\nmax_batch: 8\n')
    with pytest.raises(RepositoryError) as err:
        parse_pbtxt(path)
    assert str(path) in err.value.message and "max_batch" in err.value.message and "2:" in err.value.message


def test_json_errors_name_the_field() -> None:
    with pytest.raises(RepositoryError) as err:
        parse_json('{"name": "foo", "max_batch_sise": 4}', "load request config for 'foo'")
    assert "max_batch_sise" in err.value.message and "load request config for 'foo'" in err.value.message
    assert err.value.status is Status.INVALID_ARG
    tensor = '{"name": "x", "data_type": "TYPE_FP32", "dims": [3]}'
    text = '{"name": "foo", "max_batch_size": 4, "input": [' + tensor + "]}"
    config = parse_json(text, "where")
    assert config.max_batch_size == 4 and config.input[0].data_type == mc.TYPE_FP32


def test_override_accepts_json_or_pbtxt() -> None:
    assert parse_override('{"max_batch_size": 2}', "w").max_batch_size == 2
    assert parse_override("max_batch_size: 3", "w").max_batch_size == 3
    assert parse_text("", "w") == mc.ModelConfig()


def test_reshape_element_count(tmp_path: Path) -> None:
    text = BASE.replace("dims: [ 16 ] }", "dims: [ 16 ] reshape: { shape: [ 4, 5 ] } }", 1)
    err = _error(tmp_path, text)
    assert err.field == "input 'INPUT0'.reshape.shape" and "holds 20 elements" in err.message
    _check(tmp_path, BASE.replace("dims: [ 16 ] }", "dims: [ 16 ] reshape: { shape: [ 4, 4 ] } }", 1))


def test_duplicate_and_missing_tensors(tmp_path: Path) -> None:
    dup = BASE + 'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]'
    assert "appears twice" in _error(tmp_path, dup).message
    no_outputs = 'name: "foo"\ninput [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]'
    assert _error(tmp_path, no_outputs).field == "output"


def test_warmup_needs_every_input(tmp_path: Path) -> None:
    text = BASE + 'model_warmup [ { name: "w" batch_size: 1 } ]'
    err = _error(tmp_path, text)
    assert err.field == "model_warmup[0].inputs" and "INPUT0" in err.message
