"""Runnable examples for the edgeserve client (see camera_pipeline.py)."""
