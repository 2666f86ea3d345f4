"""Text from the wire made fit for a log line: what a command, a desired state or a local request
carries (cmd_id, verb, args, URLs, reasons built from them) goes through `safe` before it is logged,
so a payload can neither forge log lines nor plant text (a PEM key, an escape sequence) in a log file."""

from __future__ import annotations


def safe(text: object, limit: int = 120) -> str:
    """`text` (str() of anything else) with control and non-printable characters escaped as repr does
    (`\\n`, `\\x1b`, `\\u202e`; a backslash doubled), cut after `limit` characters of the escaped form
    with an ellipsis and the original length."""
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
