"""Wire vocabulary shared by every frontend and client: datatypes, BYTES codec, errors, requests."""
