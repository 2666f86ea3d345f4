"""edgeserve/procmem.py without a server: the supervisor is counted only while it is our parent (a
stale or forged EDGESERVE_SUPERVISED_BY names no other process), and the `edgeserve models list`
tables from /metrics samples (a group's worker once in the total, each of its models beside it)."""

from __future__ import annotations

import os

from edgeserve import procmem

MIB = 2**20


def test_the_supervisor_is_our_parent_or_nobody() -> None:
    parent = os.getppid()
    assert procmem.supervisor_pid({"EDGESERVE_SUPERVISED_BY": str(parent)}) == parent
    assert procmem.supervisor_pid({"EDGESERVE_SUPERVISED_BY": "1" if parent != 1 else "2"}) is None
    assert procmem.supervisor_pid({"EDGESERVE_SUPERVISED_BY": "x"}) is None
    assert procmem.supervisor_pid({}) is None


def test_this_process_measures_itself() -> None:
    (me,) = [p for p in procmem.processes() if p.role == procmem.SERVER]
    assert me.pid == os.getpid() and me.rss >= me.uss > 0


def test_the_tables_count_a_group_worker_once() -> None:
    def process(role: str, pid: str, models: str, rss: float) -> list[tuple[dict[str, str], float]]:
        labels = {"process": role, "pid": pid, "name": "", "models": models}
        return [
            ({**labels, "kind": kind}, rss * share * MIB)
            for kind, share in zip(procmem.KINDS, (1, 0.8, 0.6), strict=True)
        ]

    families = {
        "edgeserve_process_memory_bytes": [
            *process("server", "10", "", 200),
            *process("supervisor", "9", "", 30),
            *process("python_worker", "11", "a,b", 50),
        ],
        "edgeserve_model_memory_estimate_bytes": [
            ({"model": "a", "version": "1", "kind": "worker_rss"}, 50 * MIB),
            ({"model": "b", "version": "1", "kind": "worker_rss"}, 50 * MIB),
            ({"model": "det", "version": "1", "kind": "weights"}, 4.5 * MIB),
        ],
    }
    lines = procmem.render(families).splitlines()
    assert [line.split()[0] for line in lines[1:4]] == ["supervisor", "server", "python_worker"]
    assert lines[4].split()[:2] == ["total", "280.0"]  # 200 + 30 + 50: the worker once
    assert any(line.split()[:3] == ["det", "1", "4.5"] for line in lines)
    assert sum(1 for line in lines if line.split()[:1] in (["a"], ["b"]) and "50.0" in line) == 2
