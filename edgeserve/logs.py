"""One line per event, bounded: journald under systemd (no timestamps, it adds its own), a rotated file
when `[logging] file` is set, stderr otherwise.

Text that came over the wire goes into a line only through `safe()`: anything read from a payload, a
topic or an MQTT property (cmd_id, verb, args, URLs, reasons built from them) is attacker-chosen until it
is verified, and often after: a newline forges a second log line, an escape sequence rewrites the
operator's terminal, a PEM block planted in a log file could pass for a key, a megabyte fills the journal.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import sys
from pathlib import Path

PASSTHROUGH = "edgeserve.passthrough"


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"level": record.levelname, "logger": record.name, "msg": record.getMessage()}
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info).replace("\n", " | ")
        return json.dumps(entry)


class _OneLineFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text.replace("\n", " | ")


class _PassthroughAware(logging.Formatter):
    """Lines already formatted by another process (the server child) are written as they are."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        if record.name == PASSTHROUGH:
            return record.getMessage()
        return self.inner.format(record)


def setup_logging(
    level: str = "INFO",
    fmt: str = "text",
    file: Path | None = None,
    max_bytes: int = 10 * 2**20,
    backups: int = 3,
) -> None:
    handler: logging.Handler
    if file is not None:
        file.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.handlers.RotatingFileHandler(
            file, maxBytes=max_bytes, backupCount=backups, encoding="utf-8"
        )
    else:
        handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        inner: logging.Formatter = _JsonFormatter()
    else:
        stamp = "" if os.environ.get("JOURNAL_STREAM") and file is None else "%(asctime)s "
        inner = _OneLineFormatter(f"{stamp}%(levelname)s %(name)s: %(message)s")
    handler.setFormatter(_PassthroughAware(inner))
    root = logging.getLogger()
    for old in root.handlers:
        old.close()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def set_level(level: str) -> None:
    logging.getLogger().setLevel(level.upper())


def forward_line(line: str) -> None:
    """Write a line another process formatted (its level was filtered there) through our handlers."""
    record = logging.LogRecord(PASSTHROUGH, logging.INFO, "", 0, line, None, None)
    logging.getLogger(PASSTHROUGH).handle(record)


def safe(text: object, limit: int = 120) -> str:
    """`text` (bytes decoded with backslash escapes, str() of anything else) with control, format and
    other non-printable characters escaped as repr does (`\\n`, `\\x1b`, `\\u202e`; a backslash doubled),
    cut after `limit` characters of the escaped form with an ellipsis and the original length."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        value = bytes(text).decode("utf-8", "backslashreplace")
    else:
        value = text if isinstance(text, str) else str(text)
    out: list[str] = []
    size = 0
    for char in value:
        piece = char if char.isprintable() and char != "\\" else repr(char)[1:-1]
        if size + len(piece) > limit:
            return "".join(out) + f"…({len(value)} chars)"
        out.append(piece)
        size += len(piece)
    return "".join(out)
