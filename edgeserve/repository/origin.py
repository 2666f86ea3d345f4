"""Where a model's files and config came from, and what that lets them run.

DESIGN.md "Trust": code runs only from the local model repository or a signed bundle, and nothing
sent over an API changes paths or what code runs. The origin is decided by how the load was asked
for, never by what sits in a folder:

- LOCAL: a model folder of the repository or of the active (signed) bundle, with its own config;
- API_CONFIG: such a folder, with a config sent with the load request;
- REQUEST_FILES: files sent with the load request (served from an override folder, overrides.py).

The manager decides it per load (`admit`), `prepare_version` checks each version folder before any
backend or the runtime race touches it (`Provenance.check_version`) and the backend choice after
(`Provenance.check_choice`), which also marks the backend options (`from_load_request`) so the
backends that could run code refuse on their own too.

Links: a model folder of the operator's own model repository is followed wherever its links lead (the
operator put them there: models kept on a data partition, Kubernetes ConfigMap and projected volumes,
whose files are links by construction). Nothing else resolves outside its version folder: not files
sent with a load request (nor the external data they name), not a bundle's files.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from edgeserve.backends.base import PLATFORM_BACKEND
from edgeserve.backends.python.group import GROUP_PARAMETER
from edgeserve.protocol.errors import InferenceError, RepositoryError, Status
from edgeserve.repository.layout import DEFAULT_FILENAMES, WARMUP_DIR, hostile_character, override_path
from edgeserve.repository.onnx_refs import NotOnnx, external_locations

if TYPE_CHECKING:
    from edgeserve.repository.selection import BackendChoice


class Origin(enum.Enum):
    LOCAL = "local"
    API_CONFIG = "load-request-config"
    REQUEST_FILES = "load-request-files"


# Backends whose model file is a program (Python source; TorchScript).
CODE_BACKENDS = frozenset({"python", "neuron"})
TRUSTED = "code runs only from the local model repository or a signed bundle"
FIX_MOVE = "put the model in the model repository (or a signed bundle) and load it by name"
# File kinds a load request may not carry: programs, native libraries, TensorRT engines (NVIDIA:
# "serialized engines are executable artifacts"; a plugin embedded in one runs on deserialization).
_CODE_FILES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\.(py|pyw|pyc|pyo)$", re.I), "Python code"),
    (re.compile(r"\.(pt|pth|ts|jit)$", re.I), "a TorchScript program"),
    (re.compile(r"\.(plan|engine|trt)$", re.I), "a TensorRT engine (executable code)"),
    (re.compile(r"\.(so(\.\d+)*|pyd|dll|dylib)$", re.I), "a native library"),
)
# Words of parameter names that name files, folders or libraries (ONNX Runtime custom-op libraries,
# OpenVINO CONFIG_FILE / CACHE_DIR / extensions, TensorRT plugins, Triton's EXECUTION_ENV_PATH, ORT
# session entries such as *_file_folder_path).
_PATH_WORDS = frozenset({
    "lib", "library", "libraries", "plugin", "plugins", "extension", "extensions", "customop",
    "customops", "preload", "path", "paths", "file", "filename", "files", "folder", "dir", "directory",
})  # fmt: skip
_LIBRARY_VALUE = re.compile(r"\.(so(\.\d+)*|dll|dylib)$", re.I)


def _code_kind(name: str) -> str | None:
    return next((kind for pattern, kind in _CODE_FILES if pattern.search(name)), None)


def runs_code(backend_name: str, artifact: Path) -> bool:
    """Whether serving `artifact` with this backend executes it (a program or a TensorRT engine)."""
    return backend_name in CODE_BACKENDS or (backend_name == "tensorrt" and artifact.suffix != ".onnx")


def _identity(config: Any) -> tuple[str, str]:
    """(backend, model file) a config selects: what decides which code runs."""
    backend = config.backend or PLATFORM_BACKEND.get(config.platform, config.platform)
    key = config.backend or config.platform
    return backend, config.default_model_filename or DEFAULT_FILENAMES.get(key, "")


def _plain_name(value: str) -> bool:
    """One file name: no folders, no '..', not absolute, not hidden, no control characters."""
    plain = value == PurePosixPath(value).name and "\\" not in value and hostile_character(value) is None
    return bool(value) and plain and value[0] not in ".~"


def _inside(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


def _denied(where: str, field: str, problem: str) -> RepositoryError:
    return RepositoryError(where, field, problem, Status.PERMISSION_DENIED)


def check_request_files(name: str, files: Mapping[str, bytes]) -> None:
    """Before anything is written: no code, native library, engine or hidden file in a load request."""
    for key in files:
        relative = override_path(key)
        where = f"model '{name}': load file '{key}'"
        if any(part.startswith(".") for part in relative.parts):
            problem = "hidden files and folders are not accepted with a load request (runtime caches such "
            raise _denied(
                where, "path", problem + "as .engines/ hold TensorRT engines); send the model files"
            )
        kind = _code_kind(relative.name)
        if kind is not None:
            raise _denied(where, "", f"is {kind}, and {TRUSTED}, not from files sent with a load request; "
                          f"{FIX_MOVE}")  # fmt: skip


def check_paths(config: Any, where: str, model_dir: Path) -> None:
    """Every file a config names is a plain name inside its folder: default_model_filename in the
    version folder, label files in the model folder, warm-up data in <model>/warmup/. (What those
    folders hold is the device's own: `Provenance.check_version` refuses links out of version folders.)"""
    filename = config.default_model_filename
    if filename and not _plain_name(filename):
        raise RepositoryError(where, "default_model_filename", f"'{filename}' must be a file name in the "
                              "version folder (no '/', '..', absolute or hidden path); put the file in "
                              "<model>/<version>/ and name it, e.g. \"model.onnx\"")  # fmt: skip
    named: list[tuple[str, str, Path]] = []
    for tensor in config.output:
        if tensor.label_filename:
            named.append((f"output '{tensor.name}'.label_filename", tensor.label_filename, model_dir))
    for index, warmup in enumerate(config.model_warmup):
        for input_name, sample in warmup.inputs.items():
            if sample.WhichOneof("input_data_type") == "input_data_file":
                field = f"model_warmup[{index}].inputs['{input_name}'].input_data_file"
                named.append((field, sample.input_data_file, model_dir / WARMUP_DIR))
    for field, value, folder in named:
        if not _plain_name(value):
            raise RepositoryError(where, field, f"'{value}' must be a file name in {folder} (no '/', '..', "
                                  "absolute or hidden path); put the file there and name it")  # fmt: skip


def _named_values(config: Any) -> list[tuple[str, str, str]]:
    """(field, key, value) of everything in a config that a runtime could take as a file or library."""
    named = [("model_operations.op_library_filename", "op_library_filename", v)
             for v in config.model_operations.op_library_filename]  # fmt: skip
    named += [(f"parameters['{k}']", k, v.string_value) for k, v in config.parameters.items()]
    accelerators = config.optimization.execution_accelerators
    for kind in ("gpu_execution_accelerator", "cpu_execution_accelerator"):
        for index, accel in enumerate(getattr(accelerators, kind)):
            label = f"optimization.execution_accelerators.{kind}[{index}]"
            named.append((f"{label}.name", "name", accel.name))
            named += [(f"{label}.parameters['{k}']", k, v) for k, v in accel.parameters.items()]
    return named


def check_parameters(config: Any, where: str, own: Any | None = None) -> None:
    """A config sent over the API names no file, folder or library (it could make a runtime load a
    custom-op library, an extension or a plugin, or read and write outside the model), except the
    same value the model's own config (`own`) has there: that changes nothing."""
    kept = set(_named_values(own)) if own is not None else set()
    for field, key, value in _named_values(config):
        # Before `kept`: a model loaded with a sent config is of another trust level than the device's
        # own models, so it never joins their worker process, even under the group they use.
        if key == GROUP_PARAMETER:
            problem = "a config sent with a load request may not put a Python model in a shared worker "
            raise _denied(where, field, problem + "process (its models run with the device's own config); "
                          "remove it: the model then runs in a worker of its own")  # fmt: skip
        if (field, key, value) in kept:
            continue
        words = set(re.split(r"[^a-z0-9]+", key.lower())) | {key.lower().replace("_", "")}
        parts = value.replace("\\", "/").split("/")
        why = None
        if words & _PATH_WORDS:
            why = "its name says it names a file, folder or library"
        elif value.startswith(("/", "~", "\\")) or re.match(r"^[A-Za-z]:[\\/]", value) or ".." in parts:
            why = "its value is a path outside the model"
        elif _LIBRARY_VALUE.search(value.strip()):
            why = "its value names a native library"
        if why is not None:
            raise _denied(where, field, f"a config sent with a load request may not name files or libraries "
                          f"({why}); set it in the model's config.pbtxt on the device")  # fmt: skip


@dataclass(frozen=True)
class Provenance:
    """The origin of one load, carried from the manager to `prepare_version` and the served record."""

    name: str
    origin: Origin
    where: str
    # API_CONFIG: the sent config selects the same backend and model file as the model's own config,
    # so any code it runs is the model's own.
    own_code: bool = True
    # A folder of the operator's model repository (not a bundle's, not sent files): links are followed.
    operator_links: bool = False

    @property
    def from_load_request(self) -> bool:
        return self.origin is Origin.REQUEST_FILES

    def check_version(self, version: int, version_dir: Path, config: Any) -> None:
        """Before any backend reads the folder: nothing in it links outside it (but in the operator's
        repository), and (request files) no ONNX file points at external data outside it."""
        label = f"model '{self.name}' version {version}"
        walked = () if self.operator_links else os.walk(version_dir)
        for folder, dirs, files in walked:
            for entry in (*dirs, *files):
                path = Path(folder, entry)
                if path.is_symlink() and not _inside(path, version_dir):
                    problem = f"links to {path.resolve()}, outside the version folder {version_dir}"
                    fix = "only the model repository's own links are followed: put the file itself there"
                    raise _denied(f"{label}: {path}", "", f"{problem}; {fix}")
        if self.origin is Origin.REQUEST_FILES:
            onnx = {p for p in version_dir.rglob("*.onnx") if p.is_file()}
            named = version_dir / config.default_model_filename if config.default_model_filename else None
            if named is not None and named.is_file() and named.suffix != ".xml":
                onnx.add(named)
            for path in sorted(onnx):
                self._check_external_data(label, path, version_dir)

    def _check_external_data(self, label: str, path: Path, version_dir: Path) -> None:
        try:
            locations = external_locations(path.read_bytes())
        except (NotOnnx, OSError):
            return  # not ONNX: the runtime refuses it with its own message
        for location in locations:
            relative = PurePosixPath(location.replace("\\", "/"))
            escapes = not location or relative.is_absolute() or ".." in relative.parts or location[0] == "~"
            if escapes or not _inside(path.parent / relative, version_dir):
                problem = (
                    f"'{location}' is outside the version folder; send the external data file with "
                    'the model and name it relative to the model file, e.g. "model.onnx.data"'
                )
                raise _denied(f"{label}: {path.name}", "external_data.location", problem)

    def check_choice(self, choice: BackendChoice, version_dir: Path) -> BackendChoice:
        """The backend choice, refused when its file is outside the version folder or it would run code
        this origin may not run; such fallbacks are dropped; its options say where the files came from."""
        problem = self._refusal(choice, version_dir)
        if problem is not None:
            raise InferenceError(Status.PERMISSION_DENIED, problem)
        fallbacks = tuple(self._mark(f) for f in choice.fallbacks if self._refusal(f, version_dir) is None)
        return dataclasses.replace(self._mark(choice), fallbacks=fallbacks)

    def _refusal(self, choice: BackendChoice, version_dir: Path) -> str | None:
        if not self.operator_links and not _inside(choice.model_path, version_dir):
            return (
                f"model '{self.name}': {choice.model_path} is outside the version folder {version_dir}; "
                "model files must be inside it"
            )
        if not runs_code(choice.backend_name, choice.model_path):
            return None
        what = f"model '{self.name}': backend '{choice.backend_name}' would run {choice.model_path.name}"
        if self.origin is Origin.REQUEST_FILES:
            return f"{what}, which came with the load request, and {TRUSTED}; {FIX_MOVE}"
        if self.origin is Origin.API_CONFIG and not self.own_code:
            return (f"{what}, but the model's own config does not select it ({self.where} changes backend, "
                    "platform or default_model_filename), and a config sent with a load request may not "
                    "choose which code runs; send the backend, platform and default_model_filename of "
                    "the model's config.pbtxt, or change config.pbtxt on the device")  # fmt: skip
        return None

    def _mark(self, choice: BackendChoice) -> BackendChoice:
        if not self.from_load_request:
            return choice
        return dataclasses.replace(
            choice, options=dataclasses.replace(choice.options, from_load_request=True)
        )


def own_config(path: Path) -> Any | None:
    """A model folder's own config.pbtxt (empty when it has none; None when it does not parse)."""
    from tritonclient.grpc import model_config_pb2 as mc

    from edgeserve.repository.config import parse_pbtxt

    try:
        return parse_pbtxt(path) if path.is_file() else mc.ModelConfig()
    except InferenceError:
        return None


def admit(name: str, model_dir: Path, config: Any, where: str, origin: Origin,
          own: Any | None = None, repository: Path | None = None) -> Provenance:  # fmt: skip
    """Check a load's config for its origin (before any version is built); `own`: the model folder's
    own config (API_CONFIG; `own_config`), to tell whether the sent one changes which code runs;
    `repository`: the operator's model repository, whose links are followed."""
    check_paths(config, where, model_dir)
    links = origin is not Origin.REQUEST_FILES and repository is not None and model_dir.parent == repository
    if origin is Origin.LOCAL:
        return Provenance(name, origin, where, operator_links=links)
    check_parameters(config, where, own)
    backend, filename = _identity(config)
    code = backend in CODE_BACKENDS or bool(filename and _code_kind(filename) is not None)
    if origin is Origin.REQUEST_FILES:
        if code:
            raise _denied(where, "backend", f"'{backend or filename}' runs code, and {TRUSTED}, not from "
                          f"files sent with a load request; {FIX_MOVE}")  # fmt: skip
        return Provenance(name, origin, where)
    same = own is not None and _identity(own) == (backend, filename)
    if code and not same:
        chosen = f"'{backend or '(automatic)'}' with '{filename or '(its default file)'}'"
        raise _denied(where, "backend", f"{chosen} is not what the model's own config selects, and a config "
                      "sent with a load request may not choose which code runs; send the backend, platform "
                      "and default_model_filename of the model's config.pbtxt")  # fmt: skip
    return Provenance(name, origin, where, own_code=same, operator_links=links)
