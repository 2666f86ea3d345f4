"""JSON from the broker parsed with limits (edgeserve/fleet/jsonlimits.py): nothing nested deeper than the
limit reaches Python's json (which recurses), however the depth is hidden, and it costs linear time."""

from __future__ import annotations

import json

import pytest

from edgeserve.fleet.jsonlimits import TOO_DEEP, JsonRefused, check_shape, depth, loads, loads_pruned

LIMIT = 1 << 20


@pytest.mark.parametrize(
    "text",
    [
        "[" * 2000 + "]" * 2000,
        '{"a":' * 2000 + "1" + "}" * 2000,
        "[" * 100_000,  # never closed
        '["]", ' + "[" * 50 + "]" * 50 + "]",  # brackets in a string do not count, real ones do
    ],
)
def test_too_deep_is_refused_before_parsing(text: str) -> None:
    with pytest.raises(JsonRefused, match="nested"):
        loads(text, max_bytes=LIMIT, max_depth=16)


def test_strings_and_escapes_do_not_hide_or_fake_depth() -> None:
    text = json.dumps({"a": ["[[[[[[[[[[[[[[[[[[[[", '\\"[[[[', "]]]]]]"], "b": {"c": [1, {"d": "}}}"}]}})
    assert depth(text) == 4 and loads(text, max_bytes=LIMIT, max_depth=4)["a"][2] == "]]]]]]"
    with pytest.raises(JsonRefused, match="nested 4 levels deep, over the limit of 3"):
        loads(text, max_bytes=LIMIT, max_depth=3)


def test_key_count_size_and_encoding_limits() -> None:
    many = json.dumps({str(n): n for n in range(2000)})
    with pytest.raises(JsonRefused, match="more than 1024 object keys"):
        loads(many, max_bytes=LIMIT)
    with pytest.raises(JsonRefused, match="over the limit of 10"):
        loads(b"[1,2,3,4,5,6]", max_bytes=10)
    with pytest.raises(JsonRefused, match="not UTF-8"):
        loads(b"\xff[]", max_bytes=LIMIT)
    with pytest.raises(JsonRefused, match="not JSON"):
        loads("[1,", max_bytes=LIMIT)


def test_pruning_keeps_the_envelope_and_marks_the_deep_part() -> None:
    deep = "[" * 3000 + "]" * 3000
    message = '{"execution": {"jobId": "j-1", "jobDocument": {"edgeserve": ' + deep + '}}, "n": "[[["}'
    body = loads_pruned(message, max_bytes=LIMIT, max_depth=8)
    assert body["execution"]["jobId"] == "j-1" and body["n"] == "[[["
    with pytest.raises(JsonRefused, match="nested more than 6 levels deep"):
        check_shape(body["execution"]["jobDocument"], max_depth=6)
    assert body["execution"]["jobDocument"]["edgeserve"][0][0][0][0] == [TOO_DEEP]  # 8 levels kept


def test_unterminated_strings_are_refused_in_one_pass() -> None:
    """A quote that never closes, repeated: trying each one to the end would be quadratic, some 10^10
    steps for 240 KB (hours, past the test timeout); one pass is a fraction of a second."""
    for text in ['"\\' * 120_000, '"' + "a" * 240_000, '["' + "\\\\" * 100_000]:
        with pytest.raises(JsonRefused, match="not JSON"):
            loads(text, max_bytes=LIMIT)
        with pytest.raises(JsonRefused, match="not JSON"):
            loads_pruned(text, max_bytes=LIMIT, max_depth=4)
