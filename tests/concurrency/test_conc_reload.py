"""New versions loaded over the repository API while concurrent clients keep sending, to an ONNX
Runtime and a Python model, over every wire: each answer must come from a version that was serving
(the newest one loaded when the request was sent, or one loaded while it was in flight), none is lost
or refused, and its `model_version` says the version its values came from. A request naming the
version that was current when it was sent gets that version's answer, or a clear refusal once a newer
version replaced it.

Replay a seed: EDGESERVE_CONC_SEEDS=<seed> pytest tests/concurrency/test_conc_reload.py
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
from conc_models import RELOADABLE, Repository
from conc_server import SEEDS_ENV, endpoints, seeds, start
from conc_transports import Call
from conc_wires import TRANSPORTS, connect
from es_server import RunningServer
from workload import Mix, Progress, VersionWindow, reload_rounds, run_clients

pytestmark = pytest.mark.timeout(300)

CLIENTS = 24
LOADS = 3
EVERY_OPS = 60  # finished ops between loads (and after the last one)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Repository:
    return Repository(tmp_path_factory.mktemp("conc_reload") / "models", reloadable=RELOADABLE)


@pytest.fixture(scope="module")
def server(repo: Repository) -> Iterator[RunningServer]:
    running = start(repo, repo.root.parent)
    yield running
    running.stop()


@pytest.mark.parametrize("seed", seeds((301, 302)))
def test_reload_during_traffic_answers_from_a_serving_version(
    server: RunningServer, repo: Repository, seed: int
) -> None:
    first = max(repo.versions.values())
    window = VersionWindow(first)
    progress = Progress()
    stop = threading.Event()
    problems: list[str] = []
    controller = threading.Thread(
        target=lambda: problems.extend(
            reload_rounds(endpoints(server), repo, window, progress, stop, LOADS, EVERY_OPS)
        )
    )
    controller.start()
    mix = Mix(stateless=RELOADABLE, p_versioned=0.2, p_repeat=0.0)
    report = run_clients(
        endpoints(server), seed, CLIENTS, mix, run=seed, stop=stop, window=window, progress=progress
    )
    controller.join(60)
    replay = f"{SEEDS_ENV}={seed} pytest tests/concurrency/test_conc_reload.py"
    assert problems == [], report.render(replay)
    assert report.ok, report.render(replay)
    assert max(repo.versions.values()) == first + LOADS
    assert server.alive(), server.log()[-4000:]
    # Once the loads returned, every wire gets the newest version.
    x = np.arange(4, dtype=np.float32)[None, :]
    for name in TRANSPORTS:
        transport = connect(name, endpoints(server))
        try:
            for model in RELOADABLE:
                answer = transport.run([Call(model.name, {"X": x}, ["Y"], f"final-{name}")], False)[0]
                assert answer.error is None, f"{name} {model.name}: {answer.error}"
                assert answer.outputs is not None
                want = model.with_version(first + LOADS).expected(x)
                np.testing.assert_array_equal(answer.outputs["Y"], want, err_msg=f"{name} {model.name}")
        finally:
            transport.close()
