"""Fleet simulation: N simulated device agents (each its own MQTT connection and will) on one local
mosquitto, and a staged rollout by edgeserve's FleetManager with some devices set to fail in a later wave,
so that the failure threshold trips, the rollout stops, and the failed wave is rolled back.

    python benchmarks/fleet_sim.py                         # 200 agents, canary 5%, waves of 40, 8% fail
    python benchmarks/fleet_sim.py --devices 300 --fail-wave 2 --pause 2 --install-s 3

The failing devices are `--fail-percent` of the FLEET, all placed in wave `--fail-wave` (the plan is
computed the way FleetManager.deploy computes it: sorted ids, canary first, then `--wave-size`), so the
failure ratio over the devices tried so far jumps above `--max-failure-ratio` after that wave.

Reports: time to connect the agents, the rollout's duration and devices per wave (with each wave's
duration), where it stopped and why, the rollback of the stopped wave (devices, duration), a check of
every device's final version against what the rollout semantics say it must be, the broker's $SYS
counters (messages received/sent, PUBLISH received/sent) before and after the rollout, CPU seconds of
this process and of mosquitto. JSON in benchmarks/results/fleet_sim-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import resource
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "fleet")]

from broker import Mosquitto, find_mosquitto  # noqa: E402
from sim_agent import Reactor, SimConfig, SimFleet  # noqa: E402

from edgeserve.fleet.fleet_cli import _progress_line  # noqa: E402
from edgeserve.fleet.manager import FleetManager, plan_waves  # noqa: E402

FLEET = "sim"


def raise_fd_limit(needed: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        target = hard if hard == resource.RLIM_INFINITY else min(hard, max(needed, soft))
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))  # mosquitto inherits it
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def cpu_of(pid: int) -> float:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", type=int, default=200)
    parser.add_argument("--canary", type=float, default=5.0, help="canary percent")
    parser.add_argument("--wave-size", type=int, default=40)
    parser.add_argument("--pause", type=float, default=1.0, help="seconds between waves")
    parser.add_argument("--max-failure-ratio", type=float, default=0.05)
    parser.add_argument("--fail-percent", type=float, default=8.0, help="percent of the fleet that fails")
    parser.add_argument("--fail-wave", type=int, default=3, help="the wave the failing devices are in")
    parser.add_argument("--install-s", type=float, default=2.0, help="mean simulated install time")
    parser.add_argument("--jitter", type=float, default=0.25, help="install time +- this fraction")
    parser.add_argument("--protocol", choices=["5", "3.1.1"], default="5")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--reactor",
        choices=["auto", "on", "off"],
        default="auto",
        help="agents on one epoll thread instead of a paho thread each (auto: above 300 agents; paho's "
        "select() loop cannot watch fds above 1023)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up the broker on `kill`
    if find_mosquitto() is None:
        print("mosquitto is not installed (apt-get install mosquitto)", file=sys.stderr)
        return 2

    fds = raise_fd_limit(4 * args.devices + 256)
    devices = [f"dev-{i:04d}" for i in range(args.devices)]
    waves = plan_waves(devices, args.canary, args.wave_size)
    if not 0 < args.fail_wave < len(waves):
        print(f"--fail-wave must be 1..{len(waves) - 1} (plan: {[len(w) for w in waves]})", file=sys.stderr)
        return 2
    fail_count = math.ceil(args.fail_percent / 100 * args.devices)
    if fail_count > len(waves[args.fail_wave]):
        print(f"{fail_count} failing devices do not fit in wave {args.fail_wave}", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    failing = set(rng.sample(waves[args.fail_wave], fail_count))
    print(
        f"fleet of {args.devices} simulated devices; plan {[len(w) for w in waves]}; "
        f"{fail_count} failing devices ({args.fail_percent:g}% of the fleet) in wave {args.fail_wave}; "
        f"fd limit {fds}",
        flush=True,
    )

    with tempfile.TemporaryDirectory(prefix="fleet-sim-") as tmp:
        broker = Mosquitto(Path(tmp) / "broker").start()
        use_reactor = args.reactor == "on" or (args.reactor == "auto" and args.devices > 300)
        reactor = Reactor() if use_reactor else None
        print(f"agents' network loops: {'one epoll reactor thread' if reactor else 'one paho thread each'}")
        sims = SimFleet(broker.url, FLEET, protocol=args.protocol, reactor=reactor)
        try:
            return run(args, broker, sims, devices, waves, failing, rng)
        finally:
            sims.stop()
            if reactor is not None:
                reactor.stop()
            broker.stop()


def run(
    args: argparse.Namespace,
    broker: Mosquitto,
    sims: SimFleet,
    devices: list[str],
    waves: list[list[str]],
    failing: set[str],
    rng: random.Random,
) -> int:
    assert broker.process is not None
    cpu_self0, cpu_broker0 = time.process_time(), cpu_of(broker.process.pid)
    t0 = time.monotonic()
    for index, device in enumerate(devices):
        install_s = args.install_s * (1 + rng.uniform(-args.jitter, args.jitter))
        sims.add(
            [device],
            SimConfig(install_s=install_s, fail=device in failing),
            active_version=6,
            previous_version=5,
        )
        if (index + 1) % 50 == 0:
            print(f"  {index + 1} agents connected ({time.monotonic() - t0:.1f} s)", flush=True)
    connect_s = time.monotonic() - t0
    print(f"{len(devices)} agents connected in {connect_s:.1f} s, each with its own connection", flush=True)

    with FleetManager(broker.url, FLEET, protocol=args.protocol) as manager:
        t1 = time.monotonic()
        listed = manager.devices(30)
        discover_s = time.monotonic() - t1
        online = sum(1 for r in listed if r["online"])
        print(f"manager: {len(listed)} devices listed ({online} online) in {discover_s:.2f} s", flush=True)
        sys_before = broker.sys_counters()
        agents_pub0 = sum(a.published for a in sims.agents.values())
        print(f"$SYS before the rollout: {sys_before}", flush=True)

        done_in_wave: dict[int, int] = {}

        def on_progress(event: dict[str, Any]) -> None:
            kind = event["event"]
            if kind in ("device", "rollback_device"):
                if event["status"] in ("SUCCEEDED", "FAILED", "REJECTED", "TIMEOUT") and kind == "device":
                    done_in_wave[event["wave"]] = done_in_wave.get(event["wave"], 0) + 1
                    size = len(waves[event["wave"]])
                    count = done_in_wave[event["wave"]]
                    if event["status"] != "SUCCEEDED" or count in (size, size // 2):
                        print(
                            f"  [{count}/{size}] {event['device']}: {event['status']} "
                            f"{event.get('error') or ''}".rstrip(),
                            flush=True,
                        )
                return
            line = _progress_line(event)
            if line:
                print(line if len(line) < 200 else line[:197] + "...", flush=True)

        cpu_self1, cpu_broker1 = time.process_time(), cpu_of(broker.process.pid)
        report = manager.deploy(
            "https://bundles.example/sim/bundle-v7.tar",
            None,
            "all",
            args.canary,
            args.wave_size,
            args.pause,
            args.max_failure_ratio,
            on_progress,
            timeout_s=max(60.0, args.install_s * 10),
        )
        cpu_self2, cpu_broker2 = time.process_time(), cpu_of(broker.process.pid)
        sys_after = broker.sys_counters()
        agents_pub = sum(a.published for a in sims.agents.values()) - agents_pub0
        final = {r["device"]: r for r in manager.devices(30)}

    # what the rollout semantics say every device must run now
    stopped_at = report["stopped_at_wave"]
    problems = []
    for index, wave in enumerate(waves):
        for device in wave:
            want = 7 if (stopped_at is None or index < stopped_at) else 6
            got = final[device]["active_version"]
            if got != want:
                problems.append(f"{device} (wave {index}) runs v{got}, expected v{want}")
            verbs = sims[device].verbs()
            if stopped_at is not None and index > stopped_at and verbs:
                problems.append(f"{device} (wave {index}, after the stop) received {verbs}")
            if stopped_at is not None and index == stopped_at:
                want_verbs = ["deploy_bundle"] if device in failing else ["deploy_bundle", "rollback"]
                if verbs != want_verbs:
                    problems.append(f"{device} (stopped wave) received {verbs}, expected {want_verbs}")
    delta = {k: sys_after.get(k, 0) - sys_before.get(k, 0) for k in sys_before if k != "clients/connected"}
    rollback = report["rollback"] or {}
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": "python benchmarks/fleet_sim.py " + " ".join(sys.argv[1:]),
        "devices": len(devices),
        "protocol": args.protocol,
        "agent_loops": "reactor" if sims.options.get("reactor") else "thread per agent",
        "install_s": args.install_s,
        "failing": sorted(failing),
        "connect_s": round(connect_s, 2),
        "discover_s": round(discover_s, 3),
        "rollout_s": report["duration_s"],
        "planned_waves": report["planned_waves"],
        "waves": [
            {k: w[k] for k in ("wave", "kind", "size", "succeeded", "duration_s", "failure_ratio")}
            | {"failed": len(w["failed"])}
            for w in report["waves"]
        ],
        "stopped_at_wave": stopped_at,
        "reason": report["reason"],
        "rollback": {
            "devices": len(rollback.get("devices", {})),
            "succeeded": report["counts"]["rolled_back"],
            "duration_s": rollback.get("duration_s"),
        },
        "counts": report["counts"],
        "sys_before": sys_before,
        "sys_after": sys_after,
        "sys_delta": delta,
        "publish_counted_by_clients": {
            "agents": agents_pub,
            "manager_commands": report["counts"]["tried"] + len(rollback.get("devices", {})),
        },
        "cpu_s": {
            "this_process_connect": round(cpu_self1 - cpu_self0, 2),
            "this_process_rollout": round(cpu_self2 - cpu_self1, 2),
            "mosquitto_connect": round(cpu_broker1 - cpu_broker0, 2),
            "mosquitto_rollout": round(cpu_broker2 - cpu_broker1, 2),
        },
        "problems": problems,
    }
    print("\n== summary ==")
    print(
        f"agents: {len(devices)} connected in {connect_s:.1f} s; listed by the manager in {discover_s:.2f} s"
    )
    print(f"rollout: {report['duration_s']:.1f} s, planned waves {report['planned_waves']}")
    for w in summary["waves"]:
        print(
            f"  wave {w['wave']} ({w['kind']}): {w['size']} devices, {w['succeeded']} succeeded, "
            f"{w['failed']} failed, {w['duration_s']:.2f} s, failure ratio so far {w['failure_ratio']}"
        )
    if stopped_at is not None:
        print(f"stopped after wave {stopped_at}: {report['reason']}")
        print(
            f"rollback of wave {stopped_at}: "
            f"{summary['rollback']['succeeded']}/{summary['rollback']['devices']} "
            f"devices back on v6 in {rollback.get('duration_s')} s; "
            f"{report['counts']['not_attempted']} devices of later waves never sent a command"
        )
    print(f"$SYS delta over the rollout: {delta}")
    print(f"PUBLISH packets the clients sent over the rollout: {summary['publish_counted_by_clients']}")
    print(f"CPU s: {summary['cpu_s']}")
    print(
        "final versions: "
        + ("all as expected" if not problems else f"{len(problems)} PROBLEMS: {problems[:5]}")
    )
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"fleet_sim-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(summary, indent=2))
    print(f"results: {out}")
    return 0 if not problems else 1


if __name__ == "__main__":
    raise SystemExit(main())
