"""A config sent with a load request may not put a Python model into a shared worker process
(`python_worker_group`, issue 26): models loaded with such a config are of another trust level than the
device's own, and the two never share a process.

Tried as an attacker would, over the real HTTP repository API of a real server whose on-device models
`ga` and `gb` share the worker group "shared": a load of another local Python model with a config that
names the group (the same value its own config.pbtxt has, and another one), and a reload of `gb` with
such a config. Each is refused with PERMISSION_DENIED and a message naming the parameter; the model's
code did not run (its model.py writes a marker when imported), it is not ready, no worker process was
started, and the group's worker still serves `ga` and `gb`. The legitimate path: the same model loaded
with a sent config without the parameter runs in a worker of its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from code_origin_helpers import load
from es_server import RunningServer, start_server
from memory_models import ask, json_config, worker_pids, write

pytestmark = pytest.mark.timeout(240)


@dataclass
class Appliance:
    server: RunningServer
    marker: Path  # written when api_py's model.py is imported


@pytest.fixture(scope="module")
def appliance(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Appliance]:
    tmp = tmp_path_factory.mktemp("memory_group_load")
    repo = tmp / "repo"
    write(repo, "ga", group="shared")
    write(repo, "gb", group="shared")
    marker = tmp / "api_py.ran"
    write(repo, "api_py", group="shared", marker=marker)  # its own config names the group too
    write(repo, "bad_group", group="../../shared;x")  # a hostile name in a device config (a bundle's)
    server = start_server(repo, tmp, args=["--load-model", "ga", "--load-model", "gb"])
    yield Appliance(server, marker)
    server.stop()


@pytest.mark.parametrize("group", ["shared", "other"])
def test_a_sent_config_may_not_choose_a_worker_group(appliance: Appliance, group: str) -> None:
    server = appliance.server
    shared, _ = ask(server.http_url, "ga")
    workers = sorted(worker_pids(server.process.pid))
    status, message = load("http", server, "api_py", config=json_config(group))
    assert status == "PERMISSION_DENIED", message
    assert "parameters['python_worker_group']" in message and "load request" in message, message
    assert "worker of its own" in message  # the fix
    assert not appliance.marker.exists(), "the model's code ran"
    assert not appliance.server.model_ready("api_py")
    assert sorted(worker_pids(server.process.pid)) == workers, "a worker process was started"
    assert ask(server.http_url, "ga")[0] == ask(server.http_url, "gb")[0] == shared


def test_a_reload_of_a_grouped_model_with_a_sent_group_is_refused(appliance: Appliance) -> None:
    server = appliance.server
    shared, _ = ask(server.http_url, "gb")
    status, message = load("http", server, "gb", config=json_config("shared"))
    assert status == "PERMISSION_DENIED" and "python_worker_group" in message, message
    assert appliance.server.model_ready("gb")  # the version on the device keeps serving, in its group
    assert ask(server.http_url, "gb")[0] == ask(server.http_url, "ga")[0] == shared


def test_a_model_loaded_with_a_sent_config_never_shares_the_group_worker(appliance: Appliance) -> None:
    server = appliance.server
    shared, _ = ask(server.http_url, "ga")
    status, message = load("http", server, "api_py", config=json_config())
    assert status == "OK", message
    own, heavy = ask(server.http_url, "api_py")
    assert own != shared and own != server.process.pid and heavy == 0
    assert ask(server.http_url, "ga")[0] == ask(server.http_url, "gb")[0] == shared


def test_a_hostile_group_name_fails_its_load_with_the_field_and_the_fix(appliance: Appliance) -> None:
    server = appliance.server
    workers = sorted(worker_pids(server.process.pid))
    status, message = load("http", server, "bad_group")
    assert status != "OK" and "python_worker_group" in message and "use 1-64" in message, message
    assert not server.model_ready("bad_group")
    assert sorted(worker_pids(server.process.pid)) == workers, "a worker process was started"
    assert server.model_ready("ga") and server.alive()
