"""Links in the operator's own model repository are followed (repository/origin.py): a model file, a
version folder or a model folder that links to a data partition, and Kubernetes' ConfigMap / projected
volume layout (`model.onnx -> ..data/model.onnx`, `..data -> ..2026_11_29_...`), served by a real
server and answered over HTTP and gRPC with tritonclient. Files of a bundle or sent with a load
request never resolve outside their version folder."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from es_server import RunningServer, start_server
from onnx_models import build_add_sub

from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.repository.config import parse_json
from edgeserve.repository.origin import Origin, admit

pytestmark = pytest.mark.timeout(300)
ORT_CONFIG = 'backend: "onnxruntime"\nmax_batch_size: 8\n'
STAMP = "..2026_11_29_09_00_00.123456789"  # kubelet's AtomicWriter names its payload folders so


def _projected(folder: Path, files: dict[str, bytes]) -> Path:
    """A folder as kubelet writes a ConfigMap / Secret / projected volume: the payload in a hidden
    timestamped folder, `..data` linking to it, and every top-level entry a link through `..data`."""
    for name, data in files.items():
        path = folder / STAMP / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (folder / "..data").symlink_to(STAMP)
    for top in sorted({name.split("/")[0] for name in files}):
        (folder / top).symlink_to(f"..data/{top}")
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("links")
    onnx = build_add_sub(tmp / "add_sub.onnx").read_bytes()
    data, repo = tmp / "data", tmp / "repo"  # a data partition, and the model repository
    (data / "version1").mkdir(parents=True)
    (data / "version1" / "model.onnx").write_bytes(onnx)
    (data / "whole" / "1").mkdir(parents=True)
    (data / "whole" / "config.pbtxt").write_text(ORT_CONFIG)
    (data / "whole" / "1" / "model.onnx").write_bytes(onnx)
    for name in ("file_link", "version_link", "k8s_linked"):
        (repo / name).mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(ORT_CONFIG)
    (repo / "file_link" / "1").mkdir()
    (repo / "file_link" / "1" / "model.onnx").symlink_to(data / "version1" / "model.onnx")
    (repo / "version_link" / "1").symlink_to(data / "version1")
    (repo / "model_link").symlink_to(data / "whole")
    # A ConfigMap mounted as the model folder (items: config.pbtxt, 1/model.onnx) ...
    _projected(repo / "k8s_model", {"config.pbtxt": ORT_CONFIG.encode(), "1/model.onnx": onnx})
    # ... and one mounted elsewhere, its model.onnx linked into the repository by the operator.
    _projected(data / "configmap", {"model.onnx": onnx})
    (repo / "k8s_linked" / "1").mkdir()
    (repo / "k8s_linked" / "1" / "model.onnx").symlink_to(data / "configmap" / "model.onnx")
    running = start_server(repo, tmp)
    yield running
    running.stop()


def _add_sub(protocol: str, server: RunningServer, name: str) -> list[float]:
    module: Any = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(server.http_url if protocol == "http" else server.grpc_url)
    try:
        a, b = np.full((1, 16), 3, np.float32), np.ones((1, 16), np.float32)
        tensors = [module.InferInput(n, [1, 16], "FP32") for n in ("INPUT0", "INPUT1")]
        tensors[0].set_data_from_numpy(a)
        tensors[1].set_data_from_numpy(b)
        result = client.infer(name, tensors)
        return [float(result.as_numpy("OUTPUT0")[0, 0]), float(result.as_numpy("OUTPUT1")[0, 0])]
    finally:
        client.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("name", ["file_link", "version_link", "model_link", "k8s_model", "k8s_linked"])
def test_links_the_operator_put_in_the_repository_are_followed(
    server: RunningServer, protocol: str, name: str
) -> None:
    assert server.model_ready(name), server.log()
    assert _add_sub(protocol, server, name) == [4.0, 2.0]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_linked_model_reloads_over_the_api(server: RunningServer, protocol: str) -> None:
    client: Any = (
        httpclient.InferenceServerClient(server.http_url)
        if protocol == "http"
        else grpcclient.InferenceServerClient(server.grpc_url)
    )
    try:
        client.load_model("k8s_linked")
        client.load_model("file_link", config=json.dumps({"backend": "onnxruntime", "max_batch_size": 4}))
    finally:
        client.close()
    assert _add_sub(protocol, server, "k8s_linked") == [4.0, 2.0]
    assert _add_sub(protocol, server, "file_link") == [4.0, 2.0]


def _linked_out(model_dir: Path, target: Path) -> Path:
    (model_dir / "1").mkdir(parents=True)
    target.write_bytes(b"secret weights")
    (model_dir / "1" / "model.onnx").symlink_to(target)
    return model_dir


def _refusal(model_dir: Path, origin: Origin, repository: Path) -> InferenceError:
    config = parse_json(json.dumps({"backend": "onnxruntime"}), "test")
    trust = admit("m", model_dir, config, "test", origin, repository=repository)
    with pytest.raises(InferenceError) as raised:
        trust.check_version(1, model_dir / "1", config)
    return raised.value


def test_a_bundles_files_never_resolve_outside_their_version_folder(tmp_path: Path) -> None:
    bundle = _linked_out(tmp_path / "state/ota/bundles/vision-v1/models/m", tmp_path / "elsewhere.onnx")
    error = _refusal(bundle, Origin.LOCAL, tmp_path / "repo")
    assert error.status is Status.PERMISSION_DENIED and "outside the version folder" in error.message
    assert "only the model repository's own links are followed" in error.message


def test_files_sent_with_a_load_request_never_resolve_outside_even_in_the_repository(tmp_path: Path) -> None:
    """Request files are never written as links; even if a folder of them held one, it is refused."""
    sent = _linked_out(tmp_path / "repo" / "m", tmp_path / "elsewhere.onnx")
    error = _refusal(sent, Origin.REQUEST_FILES, tmp_path / "repo")
    assert error.status is Status.PERMISSION_DENIED and "outside the version folder" in error.message
    # The same folder as the operator's own model is followed.
    config = parse_json(json.dumps({"backend": "onnxruntime"}), "test")
    own = admit("m", sent, config, "test", Origin.LOCAL, repository=tmp_path / "repo")
    own.check_version(1, sent / "1", config)
