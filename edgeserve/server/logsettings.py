"""Triton's `logging` extension (HTTP /v2/logging, gRPC LogSettings) over the process's real logging.

One instance lives on the data plane, so every frontend reads and changes the same state.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from edgeserve.protocol.errors import invalid_arg, unsupported


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
        logging.getLogger("edgeserve.server").info(
            "log settings changed: level=%s format=%s", logging.getLevelName(level), new["log_format"]
        )
