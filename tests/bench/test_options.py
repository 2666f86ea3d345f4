"""from_args: an options dataclass from parsed command-line arguments."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from edgeserve.bench.options import from_args


@dataclass
class Options:
    seconds: float = 1.0
    name: str = "default"
    kept: int = 7  # no option of that name: keeps its default


def test_fields_named_like_options_come_from_args_and_the_caller_gives_the_rest() -> None:
    args = argparse.Namespace(seconds=3.0, name="raw", other="ignored")
    assert from_args(Options, args) == Options(seconds=3.0, name="raw", kept=7)
    assert from_args(Options, args, name="converted") == Options(seconds=3.0, name="converted", kept=7)
    assert from_args(Options, argparse.Namespace()) == Options()
