"""Staged rollouts over the fleet: a canary wave, then waves; stop when the failure ratio passes the
threshold and roll the failed wave back (FleetManager.deploy)."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from typing import Protocol

from edgeserve.fleet.protocol import FINAL, SUCCEEDED, CommandError, check_args
from edgeserve.fleet.records import FleetError, Json, Pending, plan_waves, select_devices, timed_out

SKIPPED = "SKIPPED"  # deploy: the device was offline when the rollout started
NOT_ATTEMPTED = "NOT_ATTEMPTED"  # deploy: a later wave that was never sent because the rollout stopped

ProgressCallback = Callable[[Json], None]


class Fleet(Protocol):
    """What a rollout uses of the FleetManager that runs it (manager.py)."""

    def devices(self, timeout_s: float = 5.0) -> list[Json]: ...

    def device(self, device: str) -> Json | None: ...

    def sync(self, timeout_s: float) -> bool: ...

    def issue(
        self, device: str, verb: str, args: Json | None = None, timeout_s: float = 60.0, *,
        sink: queue.Queue[tuple[str, Json]] | None = None,
    ) -> Pending: ...  # fmt: skip

    def forget(self, pending: Pending) -> None: ...


class Rollout:
    def __init__(self, manager: Fleet) -> None:
        self.manager = manager

    def run(
        self,
        url: str,
        sha256: str | None = None,
        selector: str = "all",
        canary_percent: float = 10.0,
        wave_size: int = 10,
        pause_s: float = 0.0,
        max_failure_ratio: float = 0.0,
        on_progress: ProgressCallback | None = None,
        *,
        timeout_s: float = 600.0,
        rollback_timeout_s: float = 300.0,
        include_offline: bool = False,
        discover_timeout_s: float = 5.0,
    ) -> Json:
        """Staged rollout of a bundle (see ota/fleet.md): the canary wave, then waves of `wave_size`, each
        sent at once and waited for; after each wave the failure ratio over every device tried so far is
        checked, and above `max_failure_ratio` the rollout stops and the devices of that wave that had
        committed the new version are rolled back to the version they ran before. Offline devices are
        skipped (SKIPPED) unless `include_offline`."""
        args: Json = {"url": url}
        if sha256:
            args["sha256"] = sha256
        try:
            check_args("deploy_bundle", args)
        except CommandError as exc:
            raise FleetError(str(exc)) from None
        if not 0 <= max_failure_ratio <= 1:
            raise FleetError("max failure ratio must be between 0 and 1")
        emit = on_progress or (lambda event: None)
        started = time.monotonic()
        records = {r["device"]: r for r in self.manager.devices(discover_timeout_s)}
        selected = select_devices(records.values(), selector)
        skipped = [] if include_offline else [d for d in selected if not records[d]["online"]]
        targets = [d for d in selected if d not in skipped]
        waves = plan_waves(targets, canary_percent, wave_size)
        before = {d: records[d]["active_version"] for d in selected}
        outcomes: dict[str, Json] = {
            d: {
                "status": SKIPPED,
                "wave": None,
                "error": "offline at the start of the rollout",
                "previous_version": before[d],
            }
            for d in skipped
        }
        emit(
            {
                "event": "start",
                "url": url,
                "selected": len(selected),
                "skipped": skipped,
                "devices": targets,
                "waves": [len(w) for w in waves],
            }
        )
        wave_reports: list[Json] = []
        tried = failed = 0
        stopped_at: int | None = None
        reason = None
        rollback: Json = {}
        for index, wave in enumerate(waves):
            kind = "canary" if index == 0 and canary_percent > 0 else "wave"
            if index > 0 and pause_s > 0:
                emit({"event": "pause", "seconds": pause_s, "next_wave": index})
                time.sleep(pause_s)
            emit({"event": "wave_start", "wave": index, "kind": kind, "devices": wave})
            wave_started = time.monotonic()

            def on_update(device: str, body: Json, wave_no: int = index) -> None:
                emit(
                    {
                        "event": "device",
                        "wave": wave_no,
                        "device": device,
                        "status": body.get("status"),
                        "progress": body.get("progress"),
                        "message": body.get("message"),
                        "error": body.get("error"),
                    }
                )

            answers = send_many(self.manager, {d: args for d in wave}, "deploy_bundle", timeout_s, on_update)
            wave_failed = [d for d in wave if answers[d].get("status") != SUCCEEDED]
            for device in wave:
                answer = answers[device]
                outcomes[device] = {
                    "status": answer.get("status"),
                    "wave": index,
                    "previous_version": before[device],
                    "result": answer.get("result"),
                    "error": answer.get("error"),
                    "cmd_id": answer.get("cmd_id"),
                }
            tried += len(wave)
            failed += len(wave_failed)
            ratio = failed / tried if tried else 0.0
            report = {
                "wave": index,
                "kind": kind,
                "devices": wave,
                "size": len(wave),
                "succeeded": len(wave) - len(wave_failed),
                "failed": wave_failed,
                "failure_ratio": round(ratio, 4),
                "duration_s": round(time.monotonic() - wave_started, 3),
            }
            wave_reports.append(report)
            emit({"event": "wave_done", **report, "tried": tried, "failed_total": failed})
            if ratio > max_failure_ratio:
                stopped_at = index
                reason = (
                    f"failure ratio {failed}/{tried} = {ratio:.3f} is over {max_failure_ratio:g} "
                    f"after wave {index} ({kind})"
                )
                emit({"event": "stop", "wave": index, "reason": reason})
                rollback = self._roll_back_wave(wave, answers, before, rollback_timeout_s, emit, outcomes)
                break
        not_attempted = [
            d for w in waves[(stopped_at + 1) if stopped_at is not None else len(waves) :] for d in w
        ]
        for device in not_attempted:
            outcomes[device] = {"status": NOT_ATTEMPTED, "wave": None, "previous_version": before[device]}
        succeeded = sum(1 for o in outcomes.values() if o["status"] == SUCCEEDED)
        counts = {
            "selected": len(selected),
            "skipped_offline": len(skipped),
            "tried": tried,
            "succeeded": succeeded,
            "failed": failed,
            "not_attempted": len(not_attempted),
            "rolled_back": sum(
                1 for r in rollback.get("devices", {}).values() if r.get("status") == SUCCEEDED
            ),
        }
        result = {
            "url": url,
            "sha256": sha256,
            "selector": selector,
            "canary_percent": canary_percent,
            "wave_size": wave_size,
            "max_failure_ratio": max_failure_ratio,
            "waves": wave_reports,
            "planned_waves": [len(w) for w in waves],
            "stopped": stopped_at is not None,
            "stopped_at_wave": stopped_at,
            "reason": reason,
            "rollback": rollback or None,
            "devices": dict(sorted(outcomes.items())),
            "counts": counts,
            "duration_s": round(time.monotonic() - started, 3),
            "ok": stopped_at is None and failed == 0 and not skipped and bool(selected),
        }
        emit(
            {
                "event": "done",
                "ok": result["ok"],
                "stopped": result["stopped"],
                "counts": counts,
                "duration_s": result["duration_s"],
            }
        )
        return result

    def _roll_back_wave(
        self,
        wave: list[str],
        answers: dict[str, Json],
        before: dict[str, int | None],
        timeout_s: float,
        emit: ProgressCallback,
        outcomes: dict[str, Json],
    ) -> Json:
        """Roll back the devices of the stopped wave that committed the new version: SUCCEEDED, or a
        `reported` active version that moved away from the one before the rollout (a late commit after a
        timeout). A device whose install failed kept its old version by itself and gets nothing."""
        self.manager.sync(5.0)
        committed: dict[str, Json] = {}
        skipped: dict[str, str] = {}
        for device in wave:
            now = self.manager.device(device) or {}
            moved = now.get("active_version") is not None and now.get("active_version") != before[device]
            if answers[device].get("status") != SUCCEEDED and not moved:
                continue
            if before[device] is None:
                skipped[device] = "no active version before the rollout: nothing to roll back to"
                continue
            committed[device] = {"to_version": before[device]}
        emit({"event": "rollback_start", "devices": sorted(committed), "cannot": skipped})
        started = time.monotonic()

        def on_update(device: str, body: Json) -> None:
            emit(
                {
                    "event": "rollback_device",
                    "device": device,
                    "status": body.get("status"),
                    "progress": body.get("progress"),
                    "error": body.get("error"),
                }
            )

        answers_rb = send_many(self.manager, committed, "rollback", timeout_s, on_update) if committed else {}
        devices: dict[str, Json] = {}
        for device, answer in answers_rb.items():
            devices[device] = {
                "to_version": committed[device]["to_version"],
                "status": answer.get("status"),
                "error": answer.get("error"),
            }
            outcomes[device]["rollback"] = devices[device]
        for device, why in skipped.items():
            outcomes[device]["rollback"] = {"status": SKIPPED, "error": why}
        report = {"devices": devices, "cannot": skipped, "duration_s": round(time.monotonic() - started, 3)}
        emit({"event": "rollback_done", **report})
        return report


def send_many(
    manager: Fleet,
    targets: dict[str, Json],
    verb: str,
    timeout_s: float,
    on_update: Callable[[str, Json], None] | None = None,
) -> dict[str, Json]:
    """FleetManager.send_many: issue every command at once, then collect the final answers."""
    sink: queue.Queue[tuple[str, Json]] = queue.Queue()
    pendings: dict[str, Pending] = {}
    outcomes: dict[str, Json] = {}
    try:
        for device, args in targets.items():
            try:
                pendings[device] = manager.issue(device, verb, args, timeout_s, sink=sink)
            except FleetError as exc:
                outcomes[device] = {"status": "REJECTED", "error": f"not sent: {exc}"}
        by_cmd = {p.cmd_id: p for p in pendings.values()}
        deadline = time.monotonic() + timeout_s
        while len(outcomes) < len(targets):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                cmd_id, body = sink.get(timeout=left)
            except queue.Empty:
                break
            pending = by_cmd.get(cmd_id)
            if pending is None or pending.device in outcomes:
                continue
            pending.updates.append(body)
            if on_update is not None:
                on_update(pending.device, body)
            if body.get("status") in FINAL:
                outcomes[pending.device] = body
        for device, pending in pendings.items():
            if device not in outcomes:
                outcomes[device] = timed_out(pending, timeout_s)
                if on_update is not None:
                    on_update(device, outcomes[device])
    finally:
        for pending in pendings.values():
            manager.forget(pending)
    return outcomes
