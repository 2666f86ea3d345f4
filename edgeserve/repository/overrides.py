"""Model files sent with a load request (Triton's `file:<path>` parameters).

As in Triton, a load with files serves the model from a fresh folder holding only those files (and
the override config): `<state_dir>/overrides/<model>/<unique>/`, or a temporary folder when the
state folder is not writable. Each load gets its own folder, so a version still serving (and
draining) keeps its files until it is retired; `prune` removes the folders no longer in use. That
these files came with a request is carried by the load itself (origin.py), not by the folder.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path

from edgeserve.protocol.errors import RepositoryError
from edgeserve.repository.layout import override_path

log = logging.getLogger("edgeserve.repository")


def write_files(state_dir: Path, model: str, files: Mapping[str, bytes]) -> Path:
    """Write `files` ("1/model.onnx" or "file:1/model.onnx" -> content) into a fresh folder."""
    entries = []
    for key, data in files.items():
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise RepositoryError(
                f"load file '{key}'", "content", f"must be bytes, got {type(data).__name__}"
            )
        entries.append((override_path(key), bytes(data)))
    unique = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
    base = state_dir / "overrides" / model
    try:
        target = base / unique
        target.mkdir(parents=True)
    except OSError as exc:
        target = Path(tempfile.mkdtemp(prefix=f"edgeserve-{model}-"))
        log.warning("model %s: %s is not writable (%s); load files go to %s", model, base, exc, target)
    try:
        for relative, data in entries:
            path = target.joinpath(*relative.parts)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
    except OSError as exc:
        remove(target)
        raise RepositoryError(str(target), "", f"cannot write the load request's files: {exc}") from None
    return target


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def prune(created: Iterable[Path], in_use: Iterable[Path]) -> list[Path]:
    """Remove the created folders not in use; returns the ones kept."""
    keep = {p.resolve() for p in in_use}
    kept: list[Path] = []
    for path in created:
        if path.resolve() in keep:
            kept.append(path)
        else:
            remove(path)
    return kept
