"""Backends: a small protocol (base.py); each heavy runtime is imported inside its own module only."""
