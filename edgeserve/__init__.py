"""edgeserve: an inference appliance runtime for edge devices."""

__version__ = "0.1.0"
