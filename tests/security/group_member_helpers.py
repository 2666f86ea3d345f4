"""A member of the service's group (a camera pipeline's user, say), for tests/security/test_state_folder.py.

`service_group()` makes a group and a second user in it (useradd; the tests run as root) and removes
both afterwards. `run_as(user, steps)` starts this file with the test's interpreter as root (the
interpreter lives where only root may read), imports what it needs, takes on the user's groups as the
system gives them (setgroups, setgid, setuid) and only then runs `steps`, one JSON object per step:

- {"do": "rename", "src", "dst"}
- {"do": "write", "path", "data"}: create the file or cut it short, then write `data`
- {"do": "mkdir", "path"}
- {"do": "swap_link", "link", "target"}: a symlink made beside `link`, renamed over it
- {"do": "http", "port", "method", "path", "body"?}: one request to 127.0.0.1 -> {"status", "body"}

Each step answers {"ok": true, ...} or {"error": <errno name>, "message": ...}.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import json
import os
import pwd
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Member:
    user: str
    uid: int
    group: str
    gid: int  # the service's group; the user is in it as a supplementary group


@contextlib.contextmanager
def service_group() -> Iterator[Member]:
    tag = uuid.uuid4().hex[:6]
    group, user = f"es-svc-{tag}", f"es-cam-{tag}"
    subprocess.run(["groupadd", group], check=True, capture_output=True)
    try:
        subprocess.run(["useradd", "--no-create-home", "--no-user-group", "--groups", group,
                        "--shell", "/usr/sbin/nologin", user], check=True, capture_output=True)  # fmt: skip
        try:
            yield Member(user, pwd.getpwnam(user).pw_uid, group, grp.getgrnam(group).gr_gid)
        finally:
            subprocess.run(["userdel", user], check=False, capture_output=True)
    finally:
        subprocess.run(["groupdel", group], check=False, capture_output=True)


def run_as(user: str, steps: list[dict[str, Any]], timeout: float = 120.0) -> list[dict[str, Any]]:
    """Run `steps` in a fresh process acting as `user`; one answer per step."""
    done = subprocess.run([sys.executable, __file__, user], input=json.dumps(steps), capture_output=True,
                          text=True, timeout=timeout, cwd="/")  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{user}'s process failed ({done.returncode}):\n{done.stderr[-3000:]}")
    answers: list[dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    return answers


# -- the member's process ---------------------------------------------------------------------------------
def _become(user: str) -> None:
    entry = pwd.getpwnam(user)
    os.setgroups(os.getgrouplist(user, entry.pw_gid))
    os.setgid(entry.pw_gid)
    os.setuid(entry.pw_uid)
    if os.getuid() != entry.pw_uid or os.geteuid() != entry.pw_uid:
        raise SystemExit("could not become the user")


def _step(step: dict[str, Any]) -> dict[str, Any]:
    import http.client

    kind = step["do"]
    try:
        if kind == "rename":
            os.rename(step["src"], step["dst"])
        elif kind == "write":
            fd = os.open(step["path"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o755)
            with os.fdopen(fd, "w") as fh:
                fh.write(step["data"])
        elif kind == "mkdir":
            os.mkdir(step["path"])
        elif kind == "swap_link":
            beside = f"{step['link']}.{os.getpid()}"
            os.symlink(step["target"], beside)
            os.rename(beside, step["link"])
        elif kind == "http":
            connection = http.client.HTTPConnection("127.0.0.1", step["port"], timeout=60)
            try:
                body = json.dumps(step["body"]) if "body" in step else None
                connection.request(step["method"], step["path"], body, {"Content-Type": "application/json"})
                response = connection.getresponse()
                data = response.read()
            finally:
                connection.close()
            return {"ok": True, "status": response.status, "body": json.loads(data) if data else None}
        else:
            raise ValueError(f"unknown step {kind}")
    except OSError as exc:
        return {"error": errno.errorcode.get(exc.errno or 0, str(exc.errno)), "message": str(exc)}
    return {"ok": True}


def main() -> None:
    import encodings.idna  # noqa: F401  (http.client looks it up on first use)
    import http.client  # noqa: F401  (imported while the interpreter's files are still readable)

    user = sys.argv[1]
    steps = json.loads(sys.stdin.read())
    _become(user)
    print(json.dumps([_step(step) for step in steps]), flush=True)


if __name__ == "__main__":
    main()
