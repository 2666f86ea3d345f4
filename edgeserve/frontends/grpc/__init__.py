"""gRPC frontend: Triton's GRPCInferenceService (KServe V2 + Triton extensions) on grpc.aio."""
