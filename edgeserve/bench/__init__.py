"""On-device performance tools: `edgeserve bench` (the device's perf_analyzer) and `edgeserve tune`
(the device's Model Analyzer).

`bench` drives a running edgeserve, or any KServe V2 server, over HTTP, gRPC, gRPC streaming, ZeroMQ
and ZeroMQ + shared memory, at fixed concurrency levels or at a fixed Poisson request rate, in
measurement windows repeated until stable. `tune` starts a server of its own on loopback, loads one
candidate config after another through the repository API and measures each with the bench engine.

Nothing here imports a runtime (onnxruntime, openvino): it only talks to servers.

    edgeserve bench mlp --protocol grpc --concurrency 1,2,4,8 --csv mlp.csv --plot mlp.png
    edgeserve tune mlp --latency-budget-ms 5 --max-seconds 120
"""

from edgeserve.bench.errors import BenchError

__all__ = ["BenchError"]
