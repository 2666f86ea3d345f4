"""Text that came over the wire, made fit for a log line: escaped and capped.

Anything read from a payload, a topic or an MQTT property (cmd_id, verb, args, URLs, reasons built from
them) is attacker-chosen until it is verified, and often after: a newline forges a second log line, an
escape sequence rewrites the operator's terminal, a PEM block planted in a log file could pass for a
key, a megabyte fills the journal. `safe()` is the one way such text goes into a log.
"""

from __future__ import annotations


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
