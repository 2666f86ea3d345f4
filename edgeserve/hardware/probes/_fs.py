"""Safe reads below an injectable root. Every helper degrades to "absent" (None / empty) instead of raising:
a missing, unreadable, binary or oddly typed file must never take detection down."""

from __future__ import annotations

import os
import re
from pathlib import Path

_MAX_READ = 1 << 20  # /proc and /sys files are small; a fixture that is not must not eat memory


class FsRoot:
    """A filesystem root to probe (`/` on a device, a fixture tree in tests)."""

    def __init__(self, root: Path | str = "/") -> None:
        self.root = Path(root)

    @property
    def is_live(self) -> bool:
        """True when probing the machine this process runs on."""
        try:
            return self.root.resolve() == Path("/")
        except OSError:
            return False

    def path(self, rel: str) -> Path:
        return self.root / rel.lstrip("/")

    def read_text(self, rel: str) -> str | None:
        try:
            with open(self.path(rel), "rb") as fh:
                data = fh.read(_MAX_READ)
        except (OSError, ValueError):
            return None
        return data.decode("utf-8", errors="replace")

    def read_line(self, rel: str) -> str | None:
        """First line, stripped of whitespace and device-tree NULs; None when absent or empty."""
        text = self.read_text(rel)
        if text is None:
            return None
        line = text.replace("\x00", "\n").strip().split("\n", 1)[0].strip()
        return line or None

    def read_int(self, rel: str, base: int = 10) -> int | None:
        line = self.read_line(rel)
        if line is None:
            return None
        try:
            return int(line, base)
        except ValueError:
            return None

    def read_nul_list(self, rel: str) -> tuple[str, ...]:
        """A device-tree string list (NUL separated)."""
        text = self.read_text(rel)
        if not text:
            return ()
        return tuple(item.strip() for item in text.split("\x00") if item.strip() and item.isprintable())

    def exists(self, rel: str) -> bool:
        try:
            return os.path.lexists(self.path(rel))
        except (OSError, ValueError):
            return False

    def is_dir(self, rel: str) -> bool:
        try:
            return self.path(rel).is_dir()
        except (OSError, ValueError):
            return False

    def listdir(self, rel: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(rel)))
        except (OSError, ValueError):
            return []

    def readlink_name(self, rel: str) -> str | None:
        """Last path component a symlink points to (sysfs `driver` links); None when not a link."""
        try:
            target = os.readlink(self.path(rel))
        except (OSError, ValueError):
            return None
        return os.path.basename(target.rstrip("/")) or None


def parse_cpu_list(text: str | None) -> tuple[int, ...] | None:
    """'0-3,8,10-11' -> (0, 1, 2, 3, 8, 10, 11); None for empty or malformed lists."""
    if not text:
        return None
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if match is None:
            return None
        low = int(match.group(1))
        high = int(match.group(2)) if match.group(2) is not None else low
        if high < low or high - low > 65536:
            return None
        cpus.update(range(low, high + 1))
    return tuple(sorted(cpus)) or None


def key_values(text: str | None, sep: str = ":") -> dict[str, str]:
    """'Key: value' lines -> dict (first occurrence wins)."""
    values: dict[str, str] = {}
    if not text:
        return values
    for line in text.splitlines():
        key, found, value = line.partition(sep)
        if found and key.strip() and key.strip() not in values:
            values[key.strip()] = value.strip()
    return values
