"""ZeroMQ frontend: a ROUTER socket carrying the edgeserve local wire format (see README.md here).

Importing this package is cheap (the client imports `wire`); the server lives in `.server`.
"""
