"""The data plane every frontend calls (dataplane.py), the checks a request passes (validation.py) and
the ensembles it runs (ensemble*.py). edgeserve/app.py is the server process that wires it all."""
