"""`bye` releases the client's regions, then replies (the wire spec's order): when the answer to
close() arrives, the server's registry no longer holds the client's ring. Checked at the moment the
reply is sent, so no timing is involved."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from zmq_harness import identity_model, running_frontend

from edgeserve.client import ZmqClient


def test_bye_releases_the_regions_before_it_answers() -> None:
    with tempfile.TemporaryDirectory(prefix="esz-bye-", dir="/tmp") as folder:
        endpoint = f"ipc://{Path(folder)}/bye.zmq"
        with running_frontend([identity_model("id_fp32", "FP32")], endpoint) as running:
            router = running.frontend._router
            assert router is not None
            registry = running.dataplane.shm
            sent: list[tuple[dict[str, Any], list[str]]] = []
            send = router.send

            def recording_send(frames: list[Any], *req_id: Any) -> BaseException | None:
                header = json.loads(bytes(frames[-1] if len(frames) == 2 else frames[1]))
                sent.append((header, registry.names()))  # the registry as the reply leaves
                return send(frames, *req_id)

            router.send = recording_send  # type: ignore[method-assign]
            client = ZmqClient(endpoint, timeout=10)
            ring = client.create_ring(slots=2, slot_size=64)
            assert ring.name in registry.names()
            bye_id = client._next_id
            client.close()
            answer = [names for header, names in sent if header.get("id") == bye_id]
            assert answer, sent
            assert ring.name not in answer[0]
