"""The suite's port picker (tests/loopback_ports.py) across test processes: two suites side by side
have xdist workers of the same names, so they walk the same slice of ports; the machine-wide
reservation must keep them from handing one port to two servers, and a process's reservations must end
with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import loopback_ports

TESTS = Path(__file__).resolve().parent
# The same worker name and the same random start: without reservations both walks give the same ports.
CHILD = f"""
import json, random, sys
random.seed(7)
sys.path.insert(0, {str(TESTS)!r})
import loopback_ports
print(json.dumps([loopback_ports.free_port() for _ in range(20)]), flush=True)
sys.stdin.read()  # keep the reservations until told to exit
"""


def _picker(tmp_path: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTEST_XDIST_WORKER": "gw5", "TMPDIR": str(tmp_path)}
    return subprocess.Popen(
        [sys.executable, "-c", CHILD], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def _ports(child: subprocess.Popen[str]) -> list[int]:
    assert child.stdout is not None
    return [int(p) for p in json.loads(child.stdout.readline())]


def _stop(child: subprocess.Popen[str]) -> None:
    assert child.stdin is not None
    child.stdin.close()
    child.wait(timeout=60)


def test_two_test_processes_walking_the_same_slice_never_get_the_same_port(tmp_path: Path) -> None:
    first = _picker(tmp_path)
    try:
        ports_a = _ports(first)
        second = _picker(tmp_path)
        try:
            ports_b = _ports(second)
        finally:
            _stop(second)
    finally:
        _stop(first)
    assert len(set(ports_a)) == 20
    assert len(set(ports_b)) == 20
    assert not set(ports_a) & set(ports_b)
    low, high = loopback_ports._window()
    if high:  # the usual case: ports no outgoing connection takes
        assert all(low <= port < high for port in ports_a + ports_b)


def test_a_process_s_reservations_end_with_it(tmp_path: Path) -> None:
    first = _picker(tmp_path)
    ports_a = _ports(first)
    _stop(first)
    again = _picker(tmp_path)  # the same walk: the ports the first one held are free again
    try:
        ports_again = _ports(again)
    finally:
        _stop(again)
    if loopback_ports._window()[1]:
        assert ports_again == ports_a
    assert (tmp_path / "edgeserve-test-ports").is_dir()
