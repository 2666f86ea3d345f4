"""Fuzz a real edgeserve server on loopback: `python tests/fuzz/run_fuzz.py --seconds 1800 --seed 7`.

Bounded in time (--seconds) and count (--max-requests), seedable (--seed: the same seed sends the same
requests), loopback only. Exits 1 on any 5xx / INTERNAL / UNKNOWN answer to client garbage, a hang,
a crash or a failed correct request; --report writes the figures as JSON. See fuzz_engine.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fuzz_engine import FRONTENDS, Options, run

from edgeserve.bench.options import from_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="wall-clock budget (default 60)")
    parser.add_argument("--max-requests", type=int, default=0, help="stop after this many (0: no limit)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--frontends", default=",".join(FRONTENDS), help=f"comma list of {', '.join(FRONTENDS)}"
    )
    parser.add_argument("--batch", type=int, default=50, help="requests between liveness checks")
    parser.add_argument("--timeout", type=float, default=10.0, help="per-request timeout in seconds")
    parser.add_argument("--report", type=Path, help="write the JSON report here")
    args = parser.parse_args(argv)
    frontends = tuple(f.strip() for f in args.frontends.split(",") if f.strip())
    unknown = [f for f in frontends if f not in FRONTENDS]
    if unknown:
        parser.error(f"unknown frontend(s) {unknown}; choose from {', '.join(FRONTENDS)}")
    options = from_args(Options, args, frontends=frontends)
    report = run(options)
    report["command"] = " ".join(
        ["python", "tests/fuzz/run_fuzz.py", *(argv if argv is not None else sys.argv[1:])]
    )
    text = json.dumps(report, indent=2)
    if args.report:
        args.report.write_text(text + "\n")
    print(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
