"""Triton's restricted APIs (`--http-restricted-api`, `--grpc-restricted-protocol`): categories, syntax.

A group `<category>[,<category>...]:<key>=<value>` makes every request of those categories carry the
header `<key>: <value>` (HTTP) or the metadata `triton-grpc-protocol-<key>: <value>` (gRPC), whoever
sends it, loopback peers included. Parsed as Triton's `command_line_parser.cc` does (the first ':' ends
the categories, the first '=' after it ends the key; a category may sit in one group only), with the
same messages. Light on imports: config.py uses it at load, the frontends to check each request.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Triton's RestrictedCategory names (restricted_features.h), in its order.
CATEGORIES = (
    "health",
    "metadata",
    "inference",
    "shared-memory",
    "model-config",
    "model-repository",
    "statistics",
    "trace",
    "logging",
)
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"  # gRPC metadata keys are lowercase (HTTP/2)
HTTP_OPTION, HTTP_FEATURE = "http-restricted-api", "api"
GRPC_OPTION, GRPC_FEATURE = "grpc-restricted-protocol", "protocol"

_HTTP_TOKEN = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")  # RFC 9110 field name
_GRPC_KEY = re.compile(r"[A-Za-z0-9_.-]+")  # gRPC ASCII metadata key (lowercased before use)
# Visible ASCII with inner spaces: HTTP strips a value's outer whitespace, so it could never match.
_VALUE = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?")


class RestrictedGroups(list[str]):
    """A settings field of groups in Triton's syntax. TOML: a list of strings; environment: the groups
    separated by ';' (each group has commas of its own)."""

    @classmethod
    def from_setting(cls, value: Any, where: str) -> RestrictedGroups:
        if isinstance(value, str):
            value = [part.strip() for part in value.split(";") if part.strip()]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(
                f"{where}: expected a list of '<category>[,<category>...]:<key>=<value>' strings, "
                f"got {value!r}"
            )
        return cls(value)


@dataclass(frozen=True)
class Restriction:
    header: str  # the header (HTTP) or metadata key (gRPC) a request of the category must carry
    value: str


def parse_group(arg: str, option: str, feature: str) -> tuple[list[str], str, str]:
    """One `<category>[,<category>...]:<key>=<value>` -> (categories, key, value); ValueError with
    Triton's wording otherwise."""
    names, colon, rest = arg.partition(":")
    key, equals, value = rest.partition("=")
    if not (colon and equals and names and key and value):
        raise ValueError(
            f"--{option} option format is '<{feature}>[,<{feature}>...]:<key>=<value>'. Got {arg}"
        )
    categories = [name.strip() for name in names.split(",")]
    for category in categories:
        if category not in CATEGORIES:
            raise ValueError(f"unknown restricted {feature} '{category}'; use one of {', '.join(CATEGORIES)}")
    grpc = feature == GRPC_FEATURE
    if not (_GRPC_KEY if grpc else _HTTP_TOKEN).fullmatch(key) or (grpc and key.lower().endswith("-bin")):
        allowed = "letters, digits, '-', '_', '.' (not ending in -bin)" if grpc else "an HTTP header name"
        raise ValueError(f"--{option}: key '{key}' must be {allowed}")
    if not grpc and key.lower() == "authorization":
        raise ValueError(f"--{option}: key 'authorization' is the bearer token's header ([http] token)")
    if not _VALUE.fullmatch(value):
        raise ValueError(
            f"--{option}: the value for '{key}' must be printable ASCII without leading or trailing spaces"
        )
    return categories, key, value


def restriction_table(groups: Sequence[str], option: str, feature: str) -> dict[str, Restriction]:
    """category -> what its requests must carry; ValueError as Triton for a category in two groups."""
    prefix = GRPC_HEADER_PREFIX if feature == GRPC_FEATURE else ""
    table: dict[str, Restriction] = {}
    for group in groups:
        categories, key, value = parse_group(group, option, feature)
        for category in categories:
            if category in table:
                raise ValueError(
                    f"restricted {feature} '{category}' can not be specified in multiple config groups"
                )
            table[category] = Restriction(prefix + key.lower() if prefix else key, value)
    return table


def http_restrictions(groups: Sequence[str]) -> dict[str, Restriction]:
    return restriction_table(groups, HTTP_OPTION, HTTP_FEATURE)


def grpc_restrictions(groups: Sequence[str]) -> dict[str, Restriction]:
    return restriction_table(groups, GRPC_OPTION, GRPC_FEATURE)
