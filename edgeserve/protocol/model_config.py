"""Triton's model configuration (model_config.proto, the class tritonclient ships): config.pbtxt and
the load API's JSON parsed into it, and the names of its data types; a syntax error names the file, the
line and the field. Below the repository so that the backends and the data plane's ensembles read
configs too; repository/config.py validates them and re-exports these names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2 as mc

from edgeserve.protocol.errors import RepositoryError

ModelConfig = mc.ModelConfig


def parse_pbtxt(path: Path) -> Any:
    """Parse a config.pbtxt; a syntax error or unknown field names the file, line and field."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RepositoryError(str(path), "", f"cannot read: {exc}") from None
    return parse_text(text, str(path))


def parse_text(text: str, where: str) -> Any:
    """Parse protobuf text format (the config.pbtxt syntax)."""
    return _parse(text_format, text, where)


def parse_json(text: str, where: str) -> Any:
    """Parse Triton model-config JSON (the load API's `config` parameter)."""
    return _parse(json_format, text, where)


def _parse(syntax: Any, text: str, where: str) -> Any:
    """`syntax`: protobuf's text_format or json_format module (both have Parse and ParseError)."""
    config = mc.ModelConfig()
    try:
        syntax.Parse(text, config)
    except syntax.ParseError as exc:
        raise RepositoryError(where, "", f"not a valid model config: {exc}") from None
    return config


def parse_override(text: str, where: str) -> Any:
    """The load API's `config`: Triton's JSON, or config.pbtxt text (what `edgeserve models load
    --config-file` sends)."""
    return parse_json(text, where) if text.lstrip().startswith("{") else parse_text(text, where)


def to_json(config: Any) -> str:
    text: str = json_format.MessageToJson(config, preserving_proto_field_name=True)
    return text


def type_name(data_type: int) -> str:
    try:
        name: str = mc.DataType.Name(data_type)
        return name
    except ValueError:
        return str(data_type)
