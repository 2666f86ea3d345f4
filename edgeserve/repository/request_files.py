"""Files sent with a load request (Triton's `file:<version>/<name>`), checked before anything is written.

In order: every name is a plain relative path (layout.override_path: no '..', control or hidden
characters); no file is code, a native library, an engine or hidden (origin.check_request_files);
each file and all of them together fit `[repository] load_file_max_bytes` / `load_files_max_bytes`;
and every file is one the model reads. Files the model never reads would only fill the disk (and
could wait there for a later load to pick them up), so they are refused by name.

What a model reads, all relative to the model folder:
- in each version folder `<n>/`: its model file (`default_model_filename`, else the default names of
  its backend or platform, else of every backend), an OpenVINO IR's weights (`model.xml` ->
  `model.bin`), and the external data an ONNX model file names (onnx_refs.py);
- `config.pbtxt`, the `label_filename` of its outputs, its warm-up `input_data_file`s in `warmup/`.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from edgeserve.backends.base import PLATFORM_BACKEND
from edgeserve.config import RepositorySection
from edgeserve.protocol.errors import RepositoryError
from edgeserve.repository.config import parse_override
from edgeserve.repository.layout import CONFIG_FILE, WARMUP_DIR, is_version_name, override_path, shown
from edgeserve.repository.onnx_refs import NotOnnx, external_locations
from edgeserve.repository.origin import check_request_files
from edgeserve.server.ensemble_graph import is_ensemble

# The model files each backend reads by default: its `artifacts` (tests/repository/test_request_files.py
# checks they agree), written here so that checking a request imports no runtime.
ARTIFACTS: dict[str, tuple[str, ...]] = {
    "onnxruntime": ("model.onnx",),
    "openvino": ("model.xml", "model.onnx"),
    "tensorrt": ("model.plan", "model.onnx"),
    "python": ("model.py",),
    "neuron": ("model.pt",),
}
_SHOWN_FILES = 8  # names listed in a refusal; the count says how many more


def check(name: str, config_json: str | None, files: Mapping[str, bytes], limits: RepositorySection) -> None:
    """Refuse the request (RepositoryError, nothing written) unless every file is a plain name, no
    code, within the size limits and read by the model its config describes."""
    paths: dict[str, str] = {}
    for key in files:
        path = override_path(key).as_posix()
        if path in paths.values():  # "file:1/m.onnx" and "1/m.onnx" (the prefix is optional)
            raise RepositoryError(f"model '{name}': load file {shown(key)}", "path", "is sent twice")
        paths[key] = path
    check_request_files(name, files)
    _check_sizes(name, files, limits)
    config = _config(name, config_json, files)
    wanted = used(config, {paths[key]: data for key, data in files.items()})
    unused = sorted(key for key, path in paths.items() if path not in wanted)
    if unused:
        listed = ", ".join(shown(key) for key in unused[:_SHOWN_FILES])
        more = f" and {len(unused) - _SHOWN_FILES} more" if len(unused) > _SHOWN_FILES else ""
        problem = (
            f"the model does not read {listed}{more}; send only the files its config uses: "
            "<version>/ its model file (e.g. 1/model.onnx) and the external data it names, or 1/model.xml "
            "and 1/model.bin; config.pbtxt, its label files and warmup/ data"
        )
        raise RepositoryError(f"model '{name}': load files", "", problem)


def _check_sizes(name: str, files: Mapping[str, bytes], limits: RepositorySection) -> None:
    total = 0
    for key, data in files.items():
        size = len(data)
        total += size
        if size > limits.load_file_max_bytes:
            raise RepositoryError(f"model '{name}': load file {shown(key)}", "size", f"{size} bytes is over "
                                  f"the limit of {limits.load_file_max_bytes} bytes a file ([repository] "
                                  "load_file_max_bytes); put a model this large in the model repository "
                                  "(or a signed bundle) and load it by name")  # fmt: skip
    if total > limits.load_files_max_bytes:
        raise RepositoryError(f"model '{name}': load files", "size", f"{total} bytes in {len(files)} files "
                              f"is over the limit of {limits.load_files_max_bytes} bytes a request "
                              "([repository] load_files_max_bytes); put a model this large in the model "
                              "repository (or a signed bundle) and load it by name")  # fmt: skip


def _config(name: str, config_json: str | None, files: Mapping[str, bytes]) -> Any:
    """The config the load will use: the one sent, else a config.pbtxt sent as a file, else none."""
    if config_json:
        return parse_override(config_json, f"load request config for '{name}'")
    for key, data in files.items():
        if override_path(key).as_posix() == CONFIG_FILE:
            where = f"model '{name}': load file {shown(key)}"
            try:
                text = bytes(data).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise RepositoryError(where, "", f"is not UTF-8 text: {exc}") from None
            return parse_override(text, where)
    return mc.ModelConfig()


def model_files(config: Any) -> tuple[str, ...]:
    """The names a version folder's model file may have under this config (an ensemble has none)."""
    if is_ensemble(config):
        return ()
    if config.default_model_filename:
        return (config.default_model_filename,)
    backend = config.backend or PLATFORM_BACKEND.get(config.platform, "")
    if backend in ARTIFACTS:
        return ARTIFACTS[backend]
    return tuple(dict.fromkeys(n for names in ARTIFACTS.values() for n in names))


def used(config: Any, files: Mapping[str, bytes]) -> set[str]:
    """The paths among `files` (relative posix paths -> content) the model reads."""
    wanted = {CONFIG_FILE}
    wanted |= {tensor.label_filename for tensor in config.output if tensor.label_filename}
    for warmup in config.model_warmup:
        for sample in warmup.inputs.values():
            if sample.WhichOneof("input_data_type") == "input_data_file":
                wanted.add(f"{WARMUP_DIR}/{sample.input_data_file}")
    versions = {PurePosixPath(path).parts[0] for path in files if "/" in path}
    for version in sorted(v for v in versions if is_version_name(v)):
        for model_name in model_files(config):
            model = posixpath.normpath(f"{version}/{model_name}")
            if model not in files:
                continue
            wanted.add(model)
            if model.endswith(".xml"):
                wanted.add(model[: -len(".xml")] + ".bin")  # OpenVINO reads the IR's weights beside it
            wanted |= _external_data(model, files[model])
    return wanted


def _external_data(model: str, data: bytes) -> set[str]:
    """The external data files an ONNX model file names, relative to its folder (none when not ONNX)."""
    try:
        locations = external_locations(data)
    except NotOnnx:
        return set()  # not ONNX: the runtime refuses it with its own message
    folder = posixpath.dirname(model)
    # One that points outside the folder matches no sent file; origin.py refuses it after the write.
    return {posixpath.normpath(posixpath.join(folder, loc.replace("\\", "/"))) for loc in locations if loc}
