"""Non-inference JSON for the HTTP frontend: model config as Triton's protobuf-JSON, log settings."""

from __future__ import annotations

import logging
import time
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from edgeserve.protocol.errors import invalid_arg, unsupported

_INT64_TYPES = (
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
)


# -- model config ----------------------------------------------------------------------------------
def _numbers(value: Any, descriptor: Descriptor) -> None:
    """protobuf-JSON prints 64-bit integers as strings; Triton prints them as numbers."""
    if not isinstance(value, dict):
        return
    for field in descriptor.fields:
        if field.name not in value:
            continue
        item = value[field.name]
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            if value_field.message_type is not None:
                for sub in item.values():
                    _numbers(sub, value_field.message_type)
            elif value_field.type in _INT64_TYPES:
                value[field.name] = {k: int(v) for k, v in item.items()}
        elif field.message_type is not None:
            for sub in item if isinstance(item, list) else [item]:
                _numbers(sub, field.message_type)
        elif field.type in _INT64_TYPES:
            value[field.name] = [int(v) for v in item] if isinstance(item, list) else int(item)


def config_to_json(config: Message) -> dict[str, Any]:
    """Model config as Triton's HTTP endpoint prints it: snake_case, defaults printed, enums as
    strings, 64-bit integers as JSON numbers."""
    result: dict[str, Any] = json_format.MessageToDict(
        config, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    _numbers(result, config.DESCRIPTOR)
    return result


# -- logging -----------------------------------------------------------------------------------------
class _IsoFormatter(logging.Formatter):
    """Triton's ISO8601 log format, one line per record."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        return f"{stamp}.{int(record.msecs):03d}Z"

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).replace("\n", " | ")


class LogSettings:
    """Triton's `/v2/logging` settings, applied to the process's real logging levels."""

    FORMATS = ("default", "ISO8601")

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self._default_formatters: list[tuple[logging.Handler, logging.Formatter | None]] = []
        self.refresh()

    def refresh(self) -> None:
        """Read the current state from the root logger (startup or someone else changed it)."""
        level = logging.getLogger().getEffectiveLevel()
        self.values = {
            "log_file": "",
            "log_info": level <= logging.INFO,
            "log_warning": level <= logging.WARNING,
            "log_error": level <= logging.ERROR,
            "log_verbose_level": 1 if level <= logging.DEBUG else 0,
            "log_format": self.values.get("log_format", "default"),
        }

    def get(self) -> dict[str, Any]:
        self.refresh()
        return dict(self.values)

    def update(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise invalid_arg("log settings must be a JSON object")
        self.refresh()
        new = dict(self.values)
        for key, value in body.items():
            if key in ("log_info", "log_warning", "log_error"):
                if not isinstance(value, bool):
                    raise invalid_arg(f"log setting '{key}' must be true or false, got {value!r}")
                new[key] = value
            elif key == "log_verbose_level":
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise invalid_arg(
                        f"log setting 'log_verbose_level' must be an integer >= 0, got {value!r}"
                    )
                new[key] = value
            elif key == "log_format":
                if value not in self.FORMATS:
                    raise invalid_arg(f"log setting 'log_format' must be one of {', '.join(self.FORMATS)}")
                new[key] = value
            elif key == "log_file":
                if value not in ("", None):
                    raise unsupported(
                        "log_file cannot be changed at run time; edgeserve logs to stderr (journald)"
                    )
            else:
                raise invalid_arg(
                    f"unknown log setting '{key}'; known: log_file, log_info, log_warning, log_error, "
                    "log_verbose_level, log_format"
                )
        self._apply(new)
        self.values = new
        return dict(new)

    def _apply(self, new: dict[str, Any]) -> None:
        if new["log_verbose_level"] > 0:
            level = logging.DEBUG
        elif new["log_info"]:
            level = logging.INFO
        elif new["log_warning"]:
            level = logging.WARNING
        elif new["log_error"]:
            level = logging.ERROR
        else:
            level = logging.CRITICAL + 1
        root = logging.getLogger()
        root.setLevel(level)
        if new["log_format"] != self.values.get("log_format"):
            if not self._default_formatters:
                self._default_formatters = [(h, h.formatter) for h in root.handlers]
            for handler, formatter in self._default_formatters:
                if new["log_format"] == "ISO8601":
                    handler.setFormatter(_IsoFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
                else:
                    handler.setFormatter(formatter)
        logging.getLogger("edgeserve.http").info(
            "log settings changed: level=%s format=%s", logging.getLevelName(level), new["log_format"]
        )
