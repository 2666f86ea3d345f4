"""OpenVINO compiled models cached by edgeserve (export_model / import_model), keyed and sealed.

OpenVINO's own CACHE_DIR would have the runtime read whatever blob sits in the cache folder, so it is
never passed: edgeserve exports the compiled model after compiling it, writes it sealed (backends/
cache.py) under a key of everything that makes a blob unusable elsewhere (the model files, the
openvino version, the device and its name, the compile properties), and on the next load imports it
from the verified bytes (not from a mapping in place: openvino 2026 keeps pointers into an imported
tensor without holding it, so the mapping would have to outlive every infer request). A blob that fails
its check, or that openvino refuses, is discarded and the model compiled again. Loading takes about as
long and as much memory as with CACHE_DIR (measured on the sample models). Meta devices (AUTO, MULTI,
HETERO, BATCH) compile every time: their compiled models are not portable blobs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from edgeserve.backends.cache import discard, read_sealed, write_sealed

log = logging.getLogger("edgeserve.backends.openvino")

META_DEVICES = ("AUTO", "MULTI", "HETERO", "BATCH")
BLOB_SUFFIX = ".ovblob"
WHAT = "the compiled openvino model"
_KEY_FORMAT = "openvino blob v1"
_CHUNK = 1 << 20

_locks: dict[Path, threading.Lock] = {}
_locks_lock = threading.Lock()


def _lock(path: Path) -> threading.Lock:
    """One compile per blob at a time: a model's second instance imports what the first one wrote."""
    with _locks_lock:
        return _locks.setdefault(path, threading.Lock())


def sources_digest(model_path: Path) -> str:
    """sha256 of the model file (and an IR's .bin), plus the name, size and mtime of every other file
    beside it (ONNX external data): a replaced model never finds the old model's blob."""
    digest = hashlib.sha256()
    hashed = [model_path]
    if model_path.suffix == ".xml":
        hashed.append(model_path.with_suffix(".bin"))
    for file in hashed:
        digest.update(file.name.encode() + b"\0")
        if file.is_file():
            with open(file, "rb") as fh:
                while chunk := fh.read(_CHUNK):
                    digest.update(chunk)
    for other in sorted(model_path.parent.iterdir()):
        if other in hashed or not other.is_file():
            continue
        st = other.stat()
        digest.update(f"\0{other.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return digest.hexdigest()


def blob_key(sources: str, version: str, device: str, device_name: str, props: Mapping[str, Any]) -> str:
    canonical = json.dumps(
        {"format": _KEY_FORMAT, "model": sources, "openvino": version, "device": device,
         "device_name": device_name, "properties": {k: str(v) for k, v in props.items()}},
        sort_keys=True,
    )  # fmt: skip
    return hashlib.sha256(canonical.encode()).hexdigest()[:40]


def _device_name(core: Any, device: str) -> str:
    try:
        return str(core.get_property(device, "FULL_DEVICE_NAME"))
    except Exception:  # a plugin without the property: the version and device still key the blob
        return "?"


def _message(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines()]
    return " ".join(line for line in lines if line and not line.startswith("Exception from src/"))[:300]


class CompiledCache:
    """The compiled models of one cache folder (`<cache_dir>/openvino`)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def blob_path(
        self, core: Any, version: str, model_path: Path, device: str, props: Mapping[str, Any]
    ) -> Path:
        key = blob_key(sources_digest(model_path), version, device, _device_name(core, device), props)
        return self.folder / f"{model_path.parent.parent.name or 'model'}-{key}{BLOB_SUFFIX}"

    def compile(self, ov: Any, core: Any, model: Any, model_path: Path, device: str,
                props: Mapping[str, Any]) -> Any:  # fmt: skip
        """The compiled model, imported from a verified blob or compiled (and cached); raises as
        compile_model does."""
        if device.split(".")[0] in META_DEVICES:
            return core.compile_model(model, device, dict(props))
        path = self.blob_path(core, str(ov.get_version()), model_path, device, props)
        with _lock(path):
            blob = read_sealed(path, WHAT)
            if blob is not None:
                try:
                    compiled = core.import_model(blob, device, dict(props))
                    log.debug("%s: compiled model imported from %s", model_path, path)
                    return compiled
                except Exception as exc:
                    discard(path, WHAT, f"openvino cannot import it ({_message(exc)})")
            compiled = core.compile_model(model, device, dict(props))
            try:
                exported = compiled.export_model()
                write_sealed(path, exported.getvalue() if hasattr(exported, "getvalue") else exported)
            except Exception as exc:  # a cache is an optimisation: serve the compiled model anyway
                log.warning("%s: cannot cache the compiled model in %s: %s", model_path, self.folder, exc)
            return compiled
