"""Loaded at start-up by the server process of the issue-35 serving tests (PYTHONPATH): the in-process
stand-in for decoupled Python models (tests/server/decoupled_stub.py)."""

import decoupled_stub

decoupled_stub.install()
