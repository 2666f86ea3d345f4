"""One error type for every refusal: a short machine-readable reason and one line for a person."""

from __future__ import annotations


class BundleRefused(Exception):
    """The bundle (or its download) is refused; nothing outside the staging folder was written."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # e.g. "signature", "hash", "downgrade", "path", "bomb", "disk"
        self.message = message

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"


class StoreError(Exception):
    """The store cannot do what was asked (no such kept version, another install running...)."""
