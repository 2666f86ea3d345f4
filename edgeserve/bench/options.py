"""An options dataclass built from a command line's parsed arguments (`edgeserve tune`, `edgeserve
watch`, the fuzz runner): each field named like an option is taken from it; the caller passes the
fields whose option is named otherwise or needs converting."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")


def from_args(cls: type[T], args: argparse.Namespace, **values: Any) -> T:
    """`cls(**values)`, with every other field of the dataclass `cls` that `args` has taken from `args`."""
    assert dataclasses.is_dataclass(cls)
    for f in dataclasses.fields(cls):
        if f.name not in values and hasattr(args, f.name):
            values[f.name] = getattr(args, f.name)
    return cls(**values)
