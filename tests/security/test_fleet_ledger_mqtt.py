"""The command ledger and bounded parsing on the es/v1 MQTT surface, attacked as a broker publisher (no
key) and as a careless signer would: a real device (`edgeserve run` + its fleet agent) on a real
Mosquitto.

- a flood of refused (unsigned) commands does not flush the ledger: the captured signed command,
  published again within its lifetime, is answered with its first outcome and not run again;
- a signed command nested 2000 levels deep is REJECTED with the reason (it used to end the handler with a
  RecursionError: no answer at all), and the next command runs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from cmdlimits_helpers import (
    Lab,
    needs_mosquitto,
    running_lab,
)

pytestmark = [needs_mosquitto(), pytest.mark.timeout(600)]

FLOOD = 1001  # one more than the 1000 entries the ledger used to keep, oldest forgotten first
SET_INFO = {"logging": {"level": "INFO"}}


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    with running_lab(tmp_path_factory.mktemp("fleet-ledger")) as running:
        yield running


def _text(cmd_id: str, args: Any) -> str:
    now = datetime.now(timezone.utc)
    stamp = "%Y-%m-%dT%H:%M:%SZ"
    return (
        f'{{"cmd_id": "{cmd_id}", "issued_at": "{now.strftime(stamp)}", '
        f'"expires_at": "{(now + timedelta(seconds=600)).strftime(stamp)}", "args": {args}}}'
    )


def test_a_flood_of_refused_commands_does_not_flush_the_ledger(lab: Lab) -> None:
    manager = lab.manager
    topic = f"{manager.base}/cmd/set_config"
    captured = manager.wrap(topic, _text("flush-target", json.dumps(SET_INFO)))
    manager.send("set_config", raw=captured, cmd_id="flush-target")
    assert manager.wait("flush-target")["status"] == "SUCCEEDED"
    for number in range(FLOOD):  # each costs its sender nothing
        manager.send("set_config", SET_INFO, unsigned=True, cmd_id=f"flood-{number}")
    last = manager.wait(f"flood-{FLOOD - 1}", timeout_s=300)
    assert last["status"] == "REJECTED" and "unsigned" in last["error"], last
    assert "flush-target" in lab.ledger() and not any(k.startswith("flood-") for k in lab.ledger())
    manager.answers.pop("flush-target")
    manager.send("set_config", raw=captured, cmd_id="flush-target")  # the captured bytes, again
    again = manager.wait("flush-target")
    assert again["status"] == "SUCCEEDED" and again.get("duplicate") is True, again
    assert [a["status"] for a in manager.all_answers("flush-target")] == ["SUCCEEDED"]  # never ACCEPTED


def test_a_command_nested_2000_deep_is_rejected_and_the_next_runs(lab: Lab) -> None:
    manager = lab.manager
    topic = f"{manager.base}/cmd/set_config"
    deep = manager.wrap(topic, _text("deep-1", "[" * 2000 + "]" * 2000))  # signed: it reaches the parser
    manager.send("set_config", raw=deep, cmd_id="deep-1")
    answer = manager.wait("deep-1", timeout_s=60)
    assert answer["status"] == "REJECTED" and "levels deep, over the limit of 16" in answer["error"], answer
    assert "deep-1" not in lab.ledger()
    assert manager.wait(manager.send("get_status"))["status"] == "SUCCEEDED"
