"""Frontends translate one wire format each into `InferRequest` and call the one `DataPlane`."""
