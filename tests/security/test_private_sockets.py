"""A member of the service's group races the appliance's start for its private sockets.

The systemd install's folders are the group's to enter (RuntimeDirectoryMode=0750, Group=edgeserve) and
its umask leaves new files group-writable (UMask=0007), for the camera clients' ZeroMQ socket. The
server's control socket (`<runtime dir>/server.sock`: the whole admin API, no restricted-API headers)
and the supervisor's install socket (`<state dir>/supervisor.sock`) used to be born with that mode and
chmod'ed to 0600 after listening: a group member connecting in between kept the connection. They are
0600 from birth now (edgeserve/private_socket.py). The ZeroMQ socket stays the group's.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "supervisor"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from appliance import start_appliance
from onnx_models import write_model
from socket_attacker import GROUP_MEMBER, finish, run, start

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="plays another user: needs root")

SERVICE_GROUP = os.getegid()  # the appliance runs with the test's group: the attacker joins it
STARTS = 3  # the finding: the group member got in at 3 of 3 starts


@pytest.fixture
def public() -> Iterator[Path]:
    """Folders laid out as the unit makes them: reachable by the group, not by others."""
    folder = Path(tempfile.mkdtemp(prefix="es-race-", dir="/tmp"))
    folder.chmod(0o755)
    for name in ("run", "state"):
        (folder / name).mkdir()
        (folder / name).chmod(0o750)  # RuntimeDirectoryMode= / StateDirectoryMode=
        os.chown(folder / name, 0, SERVICE_GROUP)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_a_group_member_racing_the_start_never_gets_the_control_or_install_socket(public: Path) -> None:
    repo = public / "repo"
    write_model(repo, "mlp", "mlp")
    control, install = public / "run" / "server.sock", public / "state" / "supervisor.sock"
    for attempt in range(STARTS):
        control.unlink(missing_ok=True)  # a new race each time, not the last start's file
        attacker = start(GROUP_MEMBER, [SERVICE_GROUP], "race", str(control), str(install))
        old_umask = os.umask(0o007)  # the unit's UMask=, which the supervisor and server inherit
        try:
            app = start_appliance(repo, public, env={"RUNTIME_DIRECTORY": str(public / "run")})
        finally:
            os.umask(old_umask)
        try:
            app.wait_ready(timeout=120)
            # the attacker has been at both names while they exist (it tries thousands of times a second)
            assert control.exists() and install.exists()
            stats = finish(attacker)
            for path in (control, install):
                seen = stats[str(path)]
                assert seen["connected"] == 0, f"start {attempt}: {path} let a group member in: {seen}"
                assert seen["denied"] > 0, f"start {attempt}: the race never reached {path}: {seen}"
                # Whoever wins the race, never a moment with a wider mode: the name came by rename,
                # with its mode, and its mode never changed afterwards (a chmod after listening did).
                assert seen["events"] == ["moved in"], f"start {attempt}: {path}: {seen}"
                assert stat.S_IMODE(path.stat().st_mode) == 0o600
            assert not list((public / "run").glob(".b-*")) and not list((public / "state").glob(".b-*"))
            # ... while the camera clients of the group still reach the ZeroMQ socket
            assert run(GROUP_MEMBER, [SERVICE_GROUP], "ping", app.zmq_endpoint) == {"ok": True}
        finally:
            if attacker.poll() is None:
                attacker.kill()
            app.stop()
