"""Per-model scheduling: dynamic batcher, queue policy, instance pool, statistics."""
