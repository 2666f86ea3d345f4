"""JSON from the broker or a job document, parsed with limits: size, nesting depth, key count.

Python's json module recurses once per nesting level: a 4 KB document nested 2000 levels deep raises
RecursionError (and deeper, on a thread's small stack, could do worse). So the depth is measured before
parsing by a scanner that does not recurse (strings skipped whole by one regular expression), and what is
handed to json.loads is never deeper than the limit.

`loads` refuses anything over a limit (JsonRefused, a ValueError: "malformed" to its callers).
`loads_pruned` is for a message whose envelope must still be read when a part of it is too deep (an AWS
IoT Jobs execution whose document is): every value nested deeper than the limit is replaced by
`TOO_DEEP`, a string no sender can guess, which `check_shape` then refuses with the reason."""

from __future__ import annotations

import itertools
import json
import re
import uuid
from array import array
from typing import Any

MAX_DEPTH = 16  # objects/arrays within each other; an edgeserve command or job document needs 4
MAX_KEYS = 1024  # object keys in all, nested ones included

TOO_DEEP = f"\x00edgeserve-too-deep-{uuid.uuid4().hex}"  # what loads_pruned puts where a value was
# A whole string (escapes included), or one bracket. A quote that opens no terminated string takes the
# rest of the text with it: json.loads stops there, and every later quote would fail the same way (it is
# escaped in the first one's reading), so trying each would be quadratic.
_STRING = r'"[^"\\]*(?:\\.[^"\\]*)*"|"[\s\S]*'
_TOKEN = re.compile(rf"{_STRING}|[\[\]{{}}]")
_STRINGS = re.compile(_STRING)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # as signed bytes: +1 opens, -1 closes


class JsonRefused(ValueError):
    """Not JSON, or JSON over a limit; the message says which."""


def _text(data: bytes | str, max_bytes: int) -> str:
    if len(data) > max_bytes:
        raise JsonRefused(f"{len(data)} bytes, over the limit of {max_bytes}")
    if isinstance(data, str):
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise JsonRefused("not UTF-8") from None


def depth(text: str) -> int:
    """The deepest nesting of `text`, counted in C (regular expressions, then a running sum): an upper
    bound of json's recursion on it, as for `deep_spans`."""
    brackets = _NOT_BRACKET.sub("", _STRINGS.sub("", text)).encode("ascii")
    return max(itertools.accumulate(array("b", brackets.translate(_STEP))), default=0)


def deep_spans(text: str, max_depth: int) -> tuple[int, list[tuple[int, int]]]:
    """(the deepest nesting seen, the spans of the values that open below `max_depth`), without recursion.

    The depth at any point is an upper bound of json's recursion there (an input the parser refuses
    stops it no deeper), so a text with no such span parses within `max_depth` levels."""
    depth = deepest = 0
    start = -1
    spans: list[tuple[int, int]] = []
    for match in _TOKEN.finditer(text):
        char = match.group()[0]
        if char == '"':  # a whole string: nothing in it nests
            continue
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if depth == max_depth + 1:
                start = match.start()
        else:
            if depth == max_depth + 1:
                spans.append((start, match.end()))
                start = -1
            depth -= 1
            if depth < 0:  # more closed than opened: json.loads refuses it
                break
    if start >= 0:  # opened and never closed: cut to the end (json.loads then refuses the rest)
        spans.append((start, len(text)))
    return deepest, spans


def loads(data: bytes | str, *, max_bytes: int, max_depth: int = MAX_DEPTH, max_keys: int = MAX_KEYS) -> Any:
    """The JSON value of `data`; JsonRefused when it is not JSON or is over a limit."""
    text = _text(data, max_bytes)
    deepest = depth(text)
    if deepest > max_depth:
        raise JsonRefused(f"nested {deepest} levels deep, over the limit of {max_depth}")
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise JsonRefused(f"not JSON: {exc}") from None
    check_shape(value, max_depth=max_depth, max_keys=max_keys)
    return value


def loads_pruned(data: bytes | str, *, max_bytes: int, max_depth: int) -> Any:
    """The JSON value of `data` with every value nested deeper than `max_depth` replaced by TOO_DEEP;
    JsonRefused when it is not JSON or is too large."""
    text = _text(data, max_bytes)
    spans = deep_spans(text, max_depth)[1] if depth(text) > max_depth else []
    if spans:
        marker = json.dumps(TOO_DEEP)
        pieces, last = [], 0
        for begin, end in spans:
            pieces += [text[last:begin], marker]
            last = end
        text = "".join([*pieces, text[last:]])
    try:
        return json.loads(text)
    except ValueError as exc:
        raise JsonRefused(f"not JSON: {exc}") from None


def check_shape(value: Any, *, max_depth: int = MAX_DEPTH, max_keys: int = MAX_KEYS) -> None:
    """JsonRefused when a parsed value is nested deeper than `max_depth` (TOO_DEEP counts as deeper) or
    holds more than `max_keys` object keys in all. Walks with a list, not recursion."""
    keys = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if item == TOO_DEEP:
                raise JsonRefused(f"nested more than {max_depth} levels deep")
            continue
        if not isinstance(item, (dict, list)):
            continue
        if depth > max_depth:
            raise JsonRefused(f"nested more than {max_depth} levels deep")
        children = list(item.values()) if isinstance(item, dict) else item
        keys += len(item) if isinstance(item, dict) else 0
        if keys > max_keys:
            raise JsonRefused(f"more than {max_keys} object keys, over the limit")
        stack.extend((child, depth + 1) for child in children)
