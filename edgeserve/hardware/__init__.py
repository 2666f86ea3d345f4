"""Hardware detection, device profiles and the runtime plan (which backend runs each model here, and why).

probes/      pure functions over an injectable filesystem root (default "/"): never raise on odd files
runtimes.py  which runtimes this install can import (no heavy import)
profile.py   device profiles (devices/*.toml + a user folder) and matching
plan.py      per-model plan: profile preference ∩ importable runtime ∩ artifacts, with reasons
accuracy.py  the accuracy guard for lower precisions (bf16/fp16 vs fp32 at warm-up)
selector.py  PlanSelector: the plan as the repository's backend selector
cli.py       `edgeserve detect`
"""
