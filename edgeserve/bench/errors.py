"""The two errors of the bench tools: one that ends the run (exit 2), one that fails one request."""

from __future__ import annotations


class BenchError(Exception):
    """The run cannot go on: unreachable server, unknown model, bad arguments. The CLI prints the
    message on one line and exits with 2."""


class RequestError(Exception):
    """One request failed (counted as an error of its window, never ends the run)."""
