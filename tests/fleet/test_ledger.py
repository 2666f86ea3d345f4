"""The command ledger (edgeserve/fleet/ledger.py) on real files, with a clock the test sets: an accepted
command is remembered until it expires whatever arrives meanwhile, refusals never push one out, the cap
refuses new commands instead of forgetting live ones, and all of it holds across a restart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgeserve.fleet.ledger import CLOCK_SKEW_S, KEEP_REFUSALS, RUNNING, CommandLedger, LedgerFull

DAY = 86400.0


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def ledger(tmp_path: Path, clock: Clock, cap: int = 4096) -> CommandLedger:
    return CommandLedger(tmp_path / "commands.json", DAY, max_accepted=cap, clock=clock)


def test_an_accepted_command_outlives_any_number_of_refusals(tmp_path: Path) -> None:
    clock = Clock()
    book = ledger(tmp_path, clock)
    book.accept({"real": {"status": RUNNING}}, clock.now + 3600)
    book.record("real", {"status": "SUCCEEDED"})
    for number in range(5000):
        book.refuse(f"job:flood-{number}:1", {"status": "REJECTED"})
    assert (book.get("real") or {}).get("status") == "SUCCEEDED"
    assert book.get("job:flood-0:1") is None  # refusals: a small structure of their own
    assert book.get(f"job:flood-{4999}:1") is not None
    assert len(book) == 1
    assert set(json.loads((tmp_path / "commands.json").read_text())) == {"real"}  # refusals not on disk
    assert KEEP_REFUSALS < 5000


def test_a_command_is_forgotten_only_after_it_expired(tmp_path: Path) -> None:
    clock = Clock()
    book = ledger(tmp_path, clock)
    book.accept({"soon": {"status": "SUCCEEDED"}}, clock.now + 60)
    clock.now += 60 + CLOCK_SKEW_S - 1  # expired, but a clock corrected by the skew could take it again
    book.accept({"other": {"status": "SUCCEEDED"}}, clock.now + 60)
    assert book.get("soon") is not None
    clock.now += 2
    book.accept({"third": {"status": "SUCCEEDED"}}, clock.now + 60)
    assert book.get("soon") is None and book.get("other") is not None


def test_expires_at_is_bounded_by_the_lifetime_setting(tmp_path: Path) -> None:
    clock = Clock()
    book = ledger(tmp_path, clock)
    book.accept({"far": {"status": "SUCCEEDED"}}, clock.now + 365 * DAY)
    clock.now += DAY + 2 * CLOCK_SKEW_S + 1
    book.accept({"next": {"status": "SUCCEEDED"}}, clock.now + 60)
    assert book.get("far") is None


def test_at_the_cap_a_new_command_is_refused_and_no_live_one_forgotten(tmp_path: Path) -> None:
    clock = Clock()
    book = ledger(tmp_path, clock, cap=3)
    for number in range(3):
        book.accept({f"live-{number}": {"status": "SUCCEEDED"}}, clock.now + 600 + number)
    with pytest.raises(LedgerFull, match=r"holds 3 accepted commands .* in \d+ s"):
        book.accept({"one-more": {"status": RUNNING}}, clock.now + 600)
    with pytest.raises(LedgerFull):  # a job and its command go in together or not at all
        ledger(tmp_path, clock, cap=4).accept({"a": {}, "b": {}}, clock.now + 600)
    assert [book.get(f"live-{n}") is not None for n in range(3)] == [True, True, True]
    assert book.get("one-more") is None
    clock.now += 600 + CLOCK_SKEW_S + 1  # live-0 expired: room again
    book.accept({"one-more": {"status": RUNNING}}, clock.now + 600)
    assert book.get("live-0") is None and book.get("one-more") is not None


def test_running_entries_stay_until_their_outcome_is_recorded(tmp_path: Path) -> None:
    clock = Clock()
    book = ledger(tmp_path, clock)
    book.accept({"long": {"status": RUNNING, "verb": "deploy_bundle"}}, clock.now + 60)
    clock.now += 10 * DAY
    book.accept({"later": {"status": "SUCCEEDED"}}, clock.now + 60)
    assert book.get("long") is not None
    # The device restarted: the interrupted command ends FAILED, then ages out like any other.
    again = ledger(tmp_path, clock)
    assert [answer["status"] for _, _, answer in again.fail_interrupted()] == ["FAILED"]
    assert (again.get("long") or {}).get("status") == "FAILED"
    clock.now += 10 * DAY
    again.accept({"x": {"status": "SUCCEEDED"}}, clock.now + 60)
    assert again.get("long") is None


def test_the_ledger_holds_across_a_restart_and_reads_an_older_file(tmp_path: Path) -> None:
    clock = Clock()
    book = ledger(tmp_path, clock)
    book.accept({"kept": {"status": "SUCCEEDED"}}, clock.now + 3600)
    assert ledger(tmp_path, clock).get("kept") is not None
    # An older release's file: no "until". Each entry is kept as long as any command could be.
    older = {"old": {"verb": "rollback", "status": "SUCCEEDED", "at": clock.now}}
    (tmp_path / "commands.json").write_text(json.dumps(older))
    book = ledger(tmp_path, clock)
    clock.now += DAY
    book.accept({"new": {"status": "SUCCEEDED"}}, clock.now + 60)
    assert book.get("old") is not None
    clock.now += 2 * CLOCK_SKEW_S + 1
    book.accept({"newer": {"status": "SUCCEEDED"}}, clock.now + 60)
    assert book.get("old") is None
    (tmp_path / "commands.json").write_text("[" * 100_000)  # garbage: an empty ledger, no crash
    assert len(ledger(tmp_path, clock)) == 0
