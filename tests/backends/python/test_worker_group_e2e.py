"""python_worker_group and the memory breakdown behind a real `edgeserve serve` (issue 26, "a smaller
appliance"), with the small memory profile: two models of one group share one worker process, a model
without the parameter has its own, the workers import no runtime or frontend (their sys.modules and
/proc/<pid>/maps; the server's maps show the check can fail), /metrics and `edgeserve models list`
show RSS/PSS/USS per process and per model, and a crash of one member restarts the group together."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
from es_server import ROOT, RunningServer, start_server, wait_until
from memory_models import ask, mapped_libraries, write
from onnx_models import write_model
from tritonclient.utils import InferenceServerException

from edgeserve import procmem

pytestmark = pytest.mark.timeout(240)
GROUPED, SOLO, ONNX = ("ga", "gb"), "solo", "mlp"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("worker_group")
    repo = tmp / "repo"
    for name in GROUPED:
        write(repo, name, group="shared")
    write(repo, SOLO)
    write_model(repo, ONNX, config='backend: "onnxruntime"\nmax_batch_size: 4\n')
    loads = [arg for name in (*GROUPED, SOLO, ONNX) for arg in ("--load-model", name)]
    running = start_server(repo, tmp, args=loads, env={"EDGESERVE_RUNTIME_MEMORY_PROFILE": "small"})
    yield running
    running.stop()


def _metrics(server: RunningServer) -> dict[str, list[tuple[dict[str, str], float]]]:
    import urllib.request

    with urllib.request.urlopen(server.base + "/metrics", timeout=30) as response:
        text = response.read().decode()
    families = procmem.parse_metrics(text)
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        if family.name == "edgeserve_appliance_memory_bytes":
            families[family.name] = [(dict(s.labels), float(s.value)) for s in family.samples]
    return families


def test_the_small_profile_is_applied(server: RunningServer) -> None:
    assert "memory profile small ([runtime] memory_profile = small)" in server.log()


def test_a_group_shares_one_worker_and_others_do_not(server: RunningServer) -> None:
    (pid_a, _), (pid_b, _) = (ask(server.http_url, name) for name in GROUPED)
    pid_solo, _ = ask(server.http_url, SOLO)
    assert pid_a == pid_b, "the two models of python_worker_group 'shared' run in one process"
    assert pid_solo != pid_a, "a model without the parameter has a worker of its own"
    assert server.process.pid not in (pid_a, pid_solo)


def test_workers_import_only_what_their_model_needs(server: RunningServer) -> None:
    for name in (*GROUPED, SOLO):
        pid, heavy = ask(server.http_url, name)
        assert heavy == 0, f"{name}'s worker imported a runtime or a frontend"
        runtimes = {lib for lib in mapped_libraries(pid) if "onnxruntime" in lib or "openvino" in lib}
        assert not runtimes, f"{name}'s worker maps {runtimes}"
    # The same look at the server, which serves the ONNX model, finds the runtime: the check can fail.
    assert any("onnxruntime" in lib for lib in mapped_libraries(server.process.pid))


def test_metrics_break_memory_down_per_process_and_model(server: RunningServer) -> None:
    shared, _ = ask(server.http_url, GROUPED[0])
    solo, _ = ask(server.http_url, SOLO)
    families = _metrics(server)
    rows: dict[tuple[str, str], dict[str, float]] = {}
    models: dict[str, str] = {}
    for labels, value in families["edgeserve_process_memory_bytes"]:
        rows.setdefault((labels["process"], labels["pid"]), {})[labels["kind"]] = value
        models[labels["pid"]] = labels["models"]
    assert set(rows) == {("server", str(server.process.pid)), ("python_worker", str(shared)),
                         ("python_worker", str(solo))}  # fmt: skip
    assert models[str(shared)] == "ga,gb" and models[str(solo)] == SOLO
    for kinds in rows.values():
        assert kinds["rss"] >= kinds["pss"] >= kinds["uss"] > 0
    totals = {labels["kind"]: value for labels, value in families["edgeserve_appliance_memory_bytes"]}
    assert totals["rss"] == pytest.approx(sum(k["rss"] for k in rows.values()))
    per_model = {(labels["model"], labels["kind"]): value
                 for labels, value in families["edgeserve_model_memory_estimate_bytes"]}  # fmt: skip
    assert per_model[(ONNX, "weights")] > 0
    assert (
        per_model[("ga", "worker_rss")]
        == per_model[("gb", "worker_rss")]
        == rows[("python_worker", str(shared))]["rss"]
    )


def test_models_list_prints_the_breakdown(server: RunningServer) -> None:
    shared, _ = ask(server.http_url, GROUPED[0])
    result = subprocess.run([sys.executable, "-m", "edgeserve", "models", "list", "--url", server.base],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.split()[:2] == ["PROCESS", "PID"] for line in lines)
    worker = [line for line in lines if line.startswith("python_worker") and f" {shared} " in line]
    assert len(worker) == 1 and "ga,gb" in worker[0], result.stdout
    assert any(line.startswith("server ") and f" {server.process.pid} " in line for line in lines)
    weights = next(i for i, line in enumerate(lines) if "WEIGHTS MiB" in line)  # the per-model table
    assert any(line.split()[:2] == [ONNX, "1"] and float(line.split()[2]) >= 0 for line in lines[weights:])
    assert any(
        line.split()[:1] == ["ga"] and line.split()[3] == worker[0].split()[2] for line in lines[weights:]
    )


def test_a_member_crash_restarts_the_group_together(server: RunningServer) -> None:
    before, _ = ask(server.http_url, GROUPED[0])
    with pytest.raises(InferenceServerException):
        ask(server.http_url, GROUPED[0], value=-1.0)  # ga ends the shared process

    def regrouped() -> bool:
        try:
            pids = {ask(server.http_url, name)[0] for name in GROUPED}
        except InferenceServerException:
            return False
        return len(pids) == 1 and before not in pids

    assert wait_until(regrouped, timeout=60), server.log()[-3000:]
    assert server.alive()
