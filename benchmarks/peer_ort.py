"""Inside a peer's venv (MLServer, Ray Serve): an ONNX Runtime session built with the options edgeserve's
instance runs with (peers.ort_spec writes them). Imports nothing but onnxruntime."""

from __future__ import annotations

from typing import Any


def ort_session(spec: dict[str, Any]) -> Any:
    """Inside a peer's venv: an InferenceSession with `spec`'s options (the peers call this)."""
    import onnxruntime as ort

    opts = spec["ort"]
    so = ort.SessionOptions()
    so.intra_op_num_threads = opts["intra_op_num_threads"]
    so.inter_op_num_threads = opts["inter_op_num_threads"]
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, opts["graph_optimization_level"])
    so.enable_cpu_mem_arena = opts["enable_cpu_mem_arena"]
    so.enable_mem_pattern = opts["enable_mem_pattern"]
    for key, value in opts["config_entries"].items():
        so.add_session_config_entry(key, value)
    so.log_severity_level = 3
    return ort.InferenceSession(spec["model_path"], so, providers=["CPUExecutionProvider"])
