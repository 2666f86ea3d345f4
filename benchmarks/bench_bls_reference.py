"""One BLS exec() of a 602 KB tensor, input passed by reference vs. copied (issue 35, callref.py):
the composition benchmark's `bls_hop` model (it times its exec() of the ONNX classifier on the input it
received, passed on unchanged) against the same model with references turned off for its calls (the
input copied into the event channel's half, as before), calls alternating one by one in one server so
both see the same load. Prints each one's exec() p50/p90, the ratio and the load average.

    python benchmarks/bench_bls_reference.py --calls 300 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import numpy as np
from common import progress
from composition_models import CONFIGS, HOP, classifier_onnx
from es_server import start_server

# The same model, its calls' references off: this execute's link (a copy per call) loses its region.
HOP_COPY = HOP.replace(
    "    def execute(self, requests):\n",
    "    def execute(self, requests):\n"
    "        from edgeserve.backends.python import pb_bls\n"
    "        pb_bls.current.get().call_region = None\n",
)


def write_repository(root: Path) -> Path:
    for name, config, source in (
        ("classifier", CONFIGS["classifier"], None),
        ("bls_hop", CONFIGS["bls_hop"], HOP),
        ("bls_hop_copy", CONFIGS["bls_hop"], HOP_COPY),
    ):
        (root / name / "1").mkdir(parents=True, exist_ok=True)
        (root / name / "config.pbtxt").write_text(f'name: "{name}"\n{config}')
        if source is not None:
            (root / name / "1" / "model.py").write_text(source)
    classifier_onnx(root / "classifier" / "1" / "model.onnx")
    return root


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=300, help="calls per model and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import tritonclient.grpc as grpcclient

    norm = np.random.default_rng(1).standard_normal((1, 3, 224, 224)).astype(np.float32)
    with tempfile.TemporaryDirectory(prefix="bench-bls-ref-") as folder:
        tmp = Path(folder)
        repo = write_repository(tmp / "repo")
        server = start_server(repo, tmp, args=["--no-zmq", "--log-level", "WARNING"], timeout=300)
        try:
            client = grpcclient.InferenceServerClient(server.grpc_url)
            tensor = grpcclient.InferInput("NORM", list(norm.shape), "FP32")
            tensor.set_data_from_numpy(norm)

            def hop(model: str) -> int:
                return int(client.infer(model, [tensor]).as_numpy("HOP_NS")[0])

            for model in ("bls_hop", "bls_hop_copy"):  # warm-up
                for _ in range(20):
                    hop(model)
            load = [os.getloadavg()[0]]
            times: dict[str, list[int]] = {"bls_hop": [], "bls_hop_copy": []}
            rounds: list[float] = []
            for number in range(1, args.rounds + 1):
                progress(f"round {number}/{args.rounds}")
                mine: dict[str, list[int]] = {"bls_hop": [], "bls_hop_copy": []}
                for _ in range(args.calls):
                    for model in mine:
                        mine[model].append(hop(model))
                for model, values in mine.items():
                    times[model].extend(values)
                rounds.append(statistics.median(mine["bls_hop"]) / statistics.median(mine["bls_hop_copy"]))
                load.append(os.getloadavg()[0])
        finally:
            server.stop()
    print("| exec() of 602 KB | p50 us | p90 us |\n|---|---|---|")
    for model, label in (("bls_hop_copy", "input copied (before)"), ("bls_hop", "input by reference")):
        values = sorted(times[model])
        p50, p90 = statistics.median(values) / 1e3, values[int(len(values) * 0.9)] / 1e3
        print(f"| {label} | {p50:.0f} | {p90:.0f} |")
    ratio = statistics.median(times["bls_hop"]) / statistics.median(times["bls_hop_copy"])
    print(f"\nby reference / copied, p50: {ratio:.2f} (rounds: {', '.join(f'{r:.2f}' for r in rounds)}); "
          f"load average (1 min) {min(load):.1f}-{max(load):.1f} on {os.cpu_count()} CPUs")  # fmt: skip


if __name__ == "__main__":
    main()
