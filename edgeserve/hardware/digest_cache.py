"""JSON entries kept per model file hash under <cache_dir>/<kind>/<digest>.json: the accuracy guard's
figures (accuracy.py) and the race results (race_result.py). A cache never decides anything: a file that
cannot be read or written is logged and costs one measurement again, nothing more. Entries are sealed
(backends/cache.py): a file edgeserve did not write, or one changed since, is discarded, not believed."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from edgeserve.backends.cache import discard, read_sealed, write_sealed


class DigestCache:
    def __init__(self, cache_dir: Path | None, kind: str, what: str, log: logging.Logger) -> None:
        """`what` names the entries in the log lines, e.g. "the race result"."""
        self.cache_dir = cache_dir
        self.kind = kind
        self.what = what
        self.log = log

    def file(self, digest: str) -> Path | None:
        return None if self.cache_dir is None else self.cache_dir / self.kind / f"{digest[:32]}.json"

    def load(self, digest: str) -> dict[str, Any]:
        file = self.file(digest)
        if file is None:
            return {}
        raw = read_sealed(file, f"the {self.kind} cache")
        if raw is None:
            return {}
        try:
            data = json.loads(raw)
        except ValueError as exc:
            discard(file, f"the {self.kind} cache", f"it is not JSON ({exc})")
            return {}
        return data if isinstance(data, dict) else {}

    def store(self, digest: str, entries: dict[str, Any]) -> None:
        file = self.file(digest)
        if file is None:
            return
        try:  # a full disk leaves no half-written temporary file behind (write_sealed)
            write_sealed(file, (json.dumps(entries, indent=2, default=str) + "\n").encode())
        except OSError as exc:
            self.log.warning("cannot cache %s in %s: %s", self.what, file.parent, exc)
