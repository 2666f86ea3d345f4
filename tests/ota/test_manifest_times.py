"""Manifest times (created_at, expires_at) are read the same on every Python edgeserve runs on: 3.10's
datetime.fromisoformat takes only 0, 3 or 6 fraction digits and 3.11's takes ISO 8601 forms that RFC 3339
does not, so a bundle signed elsewhere must not be accepted on one device and refused on another."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from edgeserve.ota.errors import BundleRefused
from edgeserve.ota.manifest import parse_time, rfc3339

UTC = timezone.utc


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2025-01-02T03:04:05Z", datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)),
        ("2025-01-02t03:04:05z", datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)),  # RFC 3339 allows lower case
        ("2025-01-02T03:04:05.5Z", datetime(2025, 1, 2, 3, 4, 5, 500_000, tzinfo=UTC)),  # Go RFC3339Nano
        ("2025-01-02T03:04:05.12345Z", datetime(2025, 1, 2, 3, 4, 5, 123_450, tzinfo=UTC)),
        ("2025-01-02T03:04:05.123456789Z", datetime(2025, 1, 2, 3, 4, 5, 123_456, tzinfo=UTC)),
        ("2025-01-02T05:04:05+02:00", datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)),
        ("2025-01-01T23:04:05.25-04:00", datetime(2025, 1, 2, 3, 4, 5, 250_000, tzinfo=UTC)),
    ],
)
def test_rfc3339_times_are_read(text: str, expected: datetime) -> None:
    moment = parse_time(text, "expires_at")
    assert moment == expected and moment.utcoffset() == timedelta(0)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("20250102T030405Z", "not an RFC 3339 time"),  # ISO 8601 basic form: 3.11+ fromisoformat takes it
        ("2025-01-02T03:04Z", "not an RFC 3339 time"),  # no seconds
        ("2025-01-02", "not an RFC 3339 time"),
        ("2025-02-30T03:04:05Z", "not an RFC 3339 time"),
        ("2025-01-02T03:04:05.Z", "not an RFC 3339 time"),
        ("2025-01-02 03:04:05Z", "not an RFC 3339 time"),
        ("2025-01-02T03:04:05Z\n", "not an RFC 3339 time"),
        ("\uff12025-01-02T03:04:05Z", "not an RFC 3339 time"),  # a full-width digit is not a digit here
        ("2025-01-02T03:04:05", "no time zone"),
        ("2025-01-02T03:04:05.5", "no time zone"),
    ],
)
def test_other_times_are_refused_the_same_everywhere(text: str, words: str) -> None:
    with pytest.raises(BundleRefused) as caught:
        parse_time(text, "expires_at")
    assert caught.value.reason == "manifest" and words in caught.value.message


def test_the_builders_times_read_back() -> None:
    moment = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert parse_time(rfc3339(moment), "created_at") == moment
