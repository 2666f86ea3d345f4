"""The Triton repository layout: `<repo>/<model>/[config.pbtxt] [labels…] <version>/<model file>`.

Version folders are numeric; names that are not, or that start with "0", are ignored (as Triton
does). Hidden folders (`.cache`, `.git`) are not models. Models come from the model repository, then
from the active OTA bundle's `models/` folder.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from edgeserve.protocol.errors import RepositoryError

if TYPE_CHECKING:
    from edgeserve.config import Settings

CONFIG_FILE = "config.pbtxt"
WARMUP_DIR = "warmup"  # model_warmup input_data_file lives in <model>/warmup/ (Triton)

# Triton's default model file per platform / backend
DEFAULT_FILENAMES: dict[str, str] = {
    "onnxruntime_onnx": "model.onnx",
    "onnxruntime": "model.onnx",
    "tensorrt_plan": "model.plan",
    "tensorrt": "model.plan",
    "openvino": "model.xml",
    "pytorch_libtorch": "model.pt",
    "python": "model.py",
}

_VERSION = re.compile(r"[1-9][0-9]*")


def is_version_name(name: str) -> bool:
    return _VERSION.fullmatch(name) is not None


# Unicode categories no file or model name needs: control (NUL, newline, ESC), format (bidi overrides,
# zero-width), surrogates (no file-system encoding), private use, unassigned, line/paragraph separators.
# They forge log lines, hide a name's real spelling, or fail at the file system with an error of its own.
_HOSTILE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})
NAME_MAX_BYTES = 255  # one folder or file name (Linux NAME_MAX)
PATH_MAX_PARTS = 8  # <version>/<folders>/<file>: enough for external data in subfolders
PATH_MAX_BYTES = 1024


def shown(name: str, limit: int = 120) -> str:
    """A name as an error message or log line may show it: quoted, control and hidden characters
    escaped (repr), cut to `limit` characters."""
    text = repr(name)
    return text if len(text) <= limit else text[: limit - 4] + "...'"


def hostile_character(name: str) -> str | None:
    """The first character of `name` no file name needs (as an escape, e.g. '\\x00'), or None."""
    for char in name:
        if unicodedata.category(char) in _HOSTILE_CATEGORIES:
            return repr(char)[1:-1]  # repr escapes every character of these categories
    return None


def _encoded_size(name: str) -> int:
    return len(name.encode("utf-8", errors="surrogatepass"))


def check_model_name(name: str) -> None:
    """A model name must be one plain folder name (it becomes a path and a URL segment)."""
    if not name or name in (".", "..") or name.startswith(".") or "/" in name or "\\" in name:
        problem = "must be a plain folder name (no '/', not hidden)"
        raise RepositoryError(f"model name {shown(name)}", "", problem)
    char = hostile_character(name)
    if char is not None or _encoded_size(name) > NAME_MAX_BYTES:
        problem = f"holds the character {char}" if char else f"is longer than {NAME_MAX_BYTES} bytes"
        raise RepositoryError(f"model name {shown(name)}", "", f"{problem}; use a plain folder name")


def list_models(root: Path) -> list[str]:
    """Model folder names in the repository, sorted; [] when the repository folder is missing."""
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def active_models(state_dir: Path) -> Path | None:
    """The models folder of the active OTA bundle (resolved now: a later switch is seen by the next
    call). `<state_dir>/ota/current` is the bundle store's link (ota/store.py)."""
    link = state_dir / "ota" / "current"
    if not link.is_symlink():
        return None
    models = link.resolve() / "models"
    return models if models.is_dir() else None


def repository_problem(settings: Settings) -> str | None:
    """Why the model repository cannot be served, or None (checked before anything starts)."""
    repository = settings.server.model_repository
    if repository.is_dir() or active_models(settings.server.state_dir) is not None:
        return None
    return (
        f"model repository {repository} is not a folder; set --model-repository or "
        "[server] model_repository (run `edgeserve samples` for the sample models)"
    )


def version_dirs(model_dir: Path) -> dict[int, Path]:
    """Numeric version folders of a model: {version: path}."""
    if not model_dir.is_dir():
        return {}
    return {int(p.name): p for p in model_dir.iterdir() if p.is_dir() and is_version_name(p.name)}


def find_artifact(version_dir: Path, names: tuple[str, ...] | list[str]) -> Path | None:
    """The first of `names` present in `version_dir` (a file, or a folder such as model.onnx/)."""
    for name in names:
        candidate = version_dir / name
        if candidate.exists():
            return candidate
    return None


def override_path(key: str) -> PurePosixPath:
    """A load-API file key ("file:1/model.onnx" or "1/model.onnx") as a safe relative path.

    Rejects absolute paths, `..` and empty components, so a request cannot write outside the
    model's override folder, and names no file needs (control or hidden characters, too long), which
    the file system would refuse with an error of its own after folders were made.
    """
    name = key[len("file:") :] if key.startswith("file:") else key
    where = f"load file {shown(key)}"
    path = PurePosixPath(name)
    char = hostile_character(name)
    if char is not None:
        problem = f"holds the character {char}; send plain file names, e.g. 1/model.onnx"
        raise RepositoryError(where, "path", problem)
    if not name or path.is_absolute() or "\\" in name or name.startswith("~"):
        raise RepositoryError(where, "path", "must be relative to the model folder, e.g. 1/model.onnx")
    parts = name.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise RepositoryError(where, "path", "must not contain '..', '.' or empty components")
    longest = max(_encoded_size(part) for part in parts)
    if len(parts) > PATH_MAX_PARTS or longest > NAME_MAX_BYTES or _encoded_size(name) > PATH_MAX_BYTES:
        most = f"{PATH_MAX_PARTS} levels, {NAME_MAX_BYTES} bytes a name, {PATH_MAX_BYTES} in all"
        problem = f"is too long (at most {most})"
        raise RepositoryError(where, "path", problem)
    return path
