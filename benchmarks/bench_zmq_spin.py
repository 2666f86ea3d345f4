"""How many requests the ZeroMQ thread catches while it spins (`[zmq] spin_us`), on this box: a
measurement, not a test (the decisions are tested with an injected clock in
tests/frontends/zmq/test_zmq_spin.py). For each spin window: back-to-back requests from one client
(the thread should stay awake and catch most of them), then requests `--gap-ms` apart (the moving
average of the gaps should turn spinning off: no further hits).

    python benchmarks/bench_zmq_spin.py                       # windows 10000 and 200 us, 0 for reference
    python benchmarks/bench_zmq_spin.py --spin-us 500 --requests 200 --gap-ms 30

A busy box catches fewer back-to-back requests (the client and the server share the cores); that is
what this reports, with the request count next to it. Only the servers started here are stopped.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_parser, progress  # puts tests/ on sys.path (es_server, onnx_models)
from es_server import scrape, start_server
from onnx_models import write_model

from edgeserve.client import ZmqClient


def measure(spin_us: int, requests: int, spaced: int, gap_ms: float, tmp: Path) -> dict[str, float]:
    repo = tmp / f"models-{spin_us}"
    config = 'backend: "onnxruntime"\nmax_batch_size: 8\n'
    write_model(repo, "ident", "identity", datatype="FP32", config=config)
    server = start_server(repo, tmp, env={"EDGESERVE_ZMQ_SPIN_US": str(spin_us)})
    try:
        data = np.ones((1, 16), np.float32)
        with ZmqClient(server.zmq_endpoint, timeout=10, spin_us=0) as client:
            client.infer("ident", {"INPUT0": data})
            before = scrape(server.base, "edgeserve_zmq_")["edgeserve_zmq_spin_hits_total"]
            for _ in range(requests):
                client.infer("ident", {"INPUT0": data})
            close = scrape(server.base, "edgeserve_zmq_")["edgeserve_zmq_spin_hits_total"] - before
            for _ in range(spaced):
                time.sleep(gap_ms / 1000)
                client.infer("ident", {"INPUT0": data})
            after = scrape(server.base, "edgeserve_zmq_")["edgeserve_zmq_spin_hits_total"] - before - close
    finally:
        server.stop()
    return {"spin_us": spin_us, "back_to_back": requests, "caught": close, "caught_share": close / requests,
            "spaced": spaced, "caught_spaced": after}  # fmt: skip


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--spin-us", default="10000,200,0", help="windows to measure, comma-separated")
    parser.add_argument("--requests", type=int, default=100, help="back-to-back requests per window")
    parser.add_argument("--spaced", type=int, default=30, help="requests --gap-ms apart afterwards")
    parser.add_argument("--gap-ms", type=float, default=30.0)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-spin-", dir="/tmp") as tmp:
        for spin_us in (int(s) for s in args.spin_us.split(",")):
            progress(f"spin_us={spin_us}")
            rows.append(measure(spin_us, args.requests, args.spaced, args.gap_ms, Path(tmp)))
    print(f"{'spin_us':>8} {'back-to-back caught':>22} {'spaced caught':>14}")
    for row in rows:
        caught = f"{int(row['caught'])}/{row['back_to_back']} ({row['caught_share']:.0%})"
        print(f"{row['spin_us']:>8} {caught:>22} {int(row['caught_spaced']):>8}/{row['spaced']}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
