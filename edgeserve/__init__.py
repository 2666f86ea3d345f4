"""edgeserve: an inference appliance runtime for edge devices."""

__version__ = "0.1.0"
# What ServerMetadata reports as the protocol-compatible server version (Triton clients parse it).
TRITON_COMPAT_VERSION = "2.63.0"
