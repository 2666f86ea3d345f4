"""KServe V2 / Triton HTTP/REST frontend (aiohttp)."""
