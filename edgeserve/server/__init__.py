"""The server process: one data plane shared by all frontends, and the app that wires them."""
