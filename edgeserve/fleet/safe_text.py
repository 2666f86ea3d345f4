"""Text that came over the broker, made safe for a log line: escaped and capped.

Anything read from a payload, a topic or an MQTT property is attacker-chosen until it is verified (and
often after): a newline forges a second log line, an escape sequence rewrites the operator's terminal,
a megabyte fills the journal. `safe()` is the one way such text goes into a log.
"""

from __future__ import annotations


def safe(text: object, limit: int = 120) -> str:
    """`text` as a quoted, `repr`-escaped string of at most about `limit` characters, with the full
    length named when it was cut: never a raw control character, newline or invisible format character."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        value = bytes(text).decode("utf-8", "backslashreplace")
    elif isinstance(text, str):
        value = text
    else:
        value = str(text)
    shown = repr(value[:limit])  # escapes every non-printable character, \n and the Cf bidi controls
    cut = len(value) > limit
    if len(shown) > limit + 2:  # escapes can make it several times longer than the characters shown
        shown, cut = shown[: limit + 1] + shown[0], True
    return f"{shown}...({len(value)} chars)" if cut else shown
