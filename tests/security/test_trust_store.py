"""The trust store under attack, on a real device (`edgeserve run` + fleet agent) and a real Mosquitto.

- The log-smuggling chain: a PEM key in a command's cmd_id or URL reaches the log only escaped; a
  set_config that moves the log file into the key folder is rejected; a local setting that does is
  refused at start; and a trust file with a key inside other text (what such a log file would hold)
  is ignored with a warning, so a bundle signed with the smuggled key is refused and its model.py
  never runs.
- A bundle key revoked by `revoke_key` is refused after a restart, even though its .pub file is still
  in the trust folder; the active bundle it signed keeps serving and health says so; a rollback to a
  bundle it signed is refused.
- Roles: a key in the command folder does not verify bundles.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cmdlimits_helpers import (
    Mosquitto,
    edgeserve,
    install_offline,
    key_id_of,
    manager_for,
    needs_mosquitto,
    signer,
    start_device,
    trust,
)
from ota_fixtures import status

from edgeserve.ota.signing import parse_public

pytestmark = [
    needs_mosquitto(),
    pytest.mark.timeout(400),
]

PY_CONFIG = """
name: "add_sub"
backend: "python"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""


def _evil_model(marker: Path) -> dict[str, bytes]:
    """A Python model whose model.py leaves a marker the moment anything imports it."""
    source = (
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('model.py ran')\n\n"
        "class TritonPythonModel:\n    def execute(self, requests):\n        return []\n"
    )
    return {"add_sub/config.pbtxt": PY_CONFIG.encode(), "add_sub/1/model.py": source.encode()}


def test_log_smuggling_attack_fails_at_every_step(tmp_path: Path) -> None:
    broker = Mosquitto(tmp_path / "broker").start()
    state = tmp_path / "state"
    fleet = signer(tmp_path, "fleet", state)
    trust(fleet, "bundles")
    install_offline(fleet, 1)
    attacker = signer(tmp_path, "attacker", state)  # never trusted by anyone
    pem = attacker.public.read_text()
    body = pem.splitlines()[1]
    device = start_device(broker, state, tmp_path)
    manager = manager_for(broker)
    try:
        # 1. The key as a command id and inside a URL: rejected, and logged only escaped.
        rejected = manager.wait(manager.send("get_status", cmd_id=pem))
        assert rejected["status"] == "REJECTED" and "cmd_id must be" in rejected["error"]
        bad_url = manager.wait(manager.send("deploy_bundle", {"url": "https://fleet.example/" + pem}))
        assert bad_url["status"] == "REJECTED" and "printable ASCII" in bad_url["error"]
        # 2. The log file moved into the key folder by a command: rejected, nothing written.
        trust_file = state / "trust" / "bundles" / "edgeserve.pub"
        moved = manager.wait(manager.send("set_config", {"logging": {"file": str(trust_file)}}))
        assert moved["status"] == "REJECTED" and "logging.file (path)" in moved["error"]
        assert not (state / "fleet" / "settings.toml").exists() and not trust_file.exists()
        log = device.log()
        assert "-----BEGIN PUBLIC KEY-----\\n" + body in log  # there, but escaped on one line
        assert not any(line.strip() in (body, "-----END PUBLIC KEY-----") for line in log.splitlines())
    finally:
        manager.close()
        device.stop()

    # 3. The same log file set locally: `edgeserve run` refuses to start (exit 2, a settings error).
    config = f'[logging]\nfile = "{trust_file}"\n'
    local = start_device_expecting_exit(broker, state, tmp_path / "local", config)
    assert "inside the trust folder" in local and not trust_file.exists()

    # 4. What an older version left behind: the log file in the key folder, a key inside its lines.
    trust_file.write_text(
        "2025-06-01 12:00:00 INFO edgeserve.fleet: fleet command " + pem + " on get_status rejected: ...\n"
    )
    with pytest.raises(ValueError, match="not exactly one PEM"):
        parse_public(trust_file.read_bytes())
    marker = tmp_path / "pwned"
    evil = attacker.bundle(2, extra=_evil_model(marker))
    device = start_device(broker, state, tmp_path / "again")
    manager = manager_for(broker)
    try:
        answer = manager.wait(manager.send("deploy_bundle", {"url": evil.as_uri()}))
        assert answer["status"] == "FAILED", answer
        assert f"signed by unknown key {key_id_of(attacker)}" in answer["error"], answer["error"]
        assert f"trusted: {key_id_of(fleet)})" in answer["error"]  # the smuggled key is not among them
        log = device.log()
        assert "edgeserve.pub ignored: not exactly one PEM public key" in log, log[-3000:]
        assert status(state)["active_version"] == 1 and status(state)["kept_versions"] == [1]
        assert device.get("/v2/models/mlp/ready") == 200
    finally:
        manager.close()
        device.stop()
        broker.kill()
    assert not marker.exists()  # model.py never ran
    assert not list((state / "ota" / "staging").glob("*/unpack"))


def start_device_expecting_exit(broker: Mosquitto, state: Path, tmp: Path, extra: str) -> str:
    """`edgeserve run` with `extra` settings that must make it exit 2 at once; its output."""
    from appliance import start_appliance

    (tmp / "empty").mkdir(parents=True)
    app = start_appliance(tmp / "empty", tmp, args=["--state-dir", str(state)], config=extra,
                          env={"EDGESERVE_SERVER_STATE_DIR": ""})  # fmt: skip
    try:
        assert app.process.wait(60) == 2, app.log()
    finally:
        app.stop()
    return app.log()


def test_a_revoked_bundle_key_stays_revoked_after_a_restart(tmp_path: Path) -> None:
    broker = Mosquitto(tmp_path / "broker").start()
    state = tmp_path / "state"
    key_a, key_b = signer(tmp_path, "fleet-a", state), signer(tmp_path, "fleet-b", state)
    trust(key_a, "bundles")
    trust(key_b, "bundles")
    install_offline(key_a, 1)
    leaked = key_id_of(key_a)
    device = start_device(broker, state, tmp_path)
    manager = manager_for(broker)
    try:
        revoked = manager.wait(manager.send("revoke_key", {"key_id": leaked, "role": "bundle"}))
        assert revoked["status"] == "SUCCEEDED", revoked
        assert revoked["result"] == {"key_id": leaked, "role": "bundle", "revoked": True, "already": False,
                                          "known_here": True, "active_signer_revoked": True}  # fmt: skip
        health = manager.wait_on("health", lambda b: any("revoked key" in c for c in b.get("checks", [])))
        assert health["status"] == "degraded"
        command = manager.wait(manager.send("revoke_key", {"key_id": leaked, "role": "command"}))
        assert command["status"] == "REJECTED" and "signed by that key itself" in command["error"], command
    finally:
        manager.close()
        device.stop()

    assert (key_a.state / "trust" / "bundles" / "fleet-a.pub").exists()  # its file is still trusted...
    device = start_device(broker, state, tmp_path / "restarted")
    manager = manager_for(broker)
    try:
        info = manager.wait_on("info", lambda b: "trust" in b and b.get("boot_id"))
        assert info["trust"]["revoked_bundle_keys"] == [leaked] and info["trust"]["active_signer_revoked"]
        assert device.get("/v2/models/mlp/ready") == 200  # ...and the bundle it signed keeps serving
        refused = manager.wait(manager.send("deploy_bundle", {"url": key_a.bundle(2).as_uri()}))
        assert refused["status"] == "FAILED" and f"revoked key {leaked}" in refused["error"], refused
        assert status(state)["active_version"] == 1
        fixed = manager.wait(manager.send("deploy_bundle", {"url": key_b.bundle(3).as_uri()}))
        assert fixed["status"] == "SUCCEEDED", fixed
        manager.wait_on("health", lambda b: not any("is signed by revoked" in c for c in b["checks"]), 60)
        back = manager.wait(manager.send("rollback", {"to_version": 1}))
        assert back["status"] == "FAILED" and f"signed by revoked key {leaked}" in back["error"], back
        assert status(state)["active_version"] == 3
        again = manager.wait(manager.send("revoke_key", {"key_id": leaked, "role": "bundle"}))
        assert again["status"] == "SUCCEEDED" and again["result"]["already"] is True
    finally:
        manager.close()
        device.stop()
        broker.kill()
    recorded = json.loads((state / "revoked-keys.json").read_text())
    assert list(recorded["bundle"]) == [leaked] and recorded["bundle"][leaked]["by"].startswith(
        "fleet command "
    )


def test_a_key_in_the_command_folder_does_not_verify_bundles(tmp_path: Path) -> None:
    state = tmp_path / "state"
    commands_only = signer(tmp_path, "commands-only", state)
    trust(commands_only, "commands")
    bundles_key = signer(tmp_path, "bundles-key", state)
    trust(bundles_key, "bundles")
    bundle = commands_only.bundle(1)
    result = edgeserve("bundle", "install", str(bundle), "--state-dir", str(state))
    assert result.returncode != 0
    assert f"signed by unknown key {key_id_of(commands_only)} (trusted: {key_id_of(bundles_key)})" in (
        result.stdout + result.stderr
    )
    assert status(state)["active_version"] is None
    install_offline(bundles_key, 2)  # the bundle key in its own folder does
    assert status(state)["active_version"] == 2


def test_a_revoked_command_key_signs_nothing_more_even_after_a_restart(tmp_path: Path) -> None:
    """A leaked command key is revoked by a command signed with itself (the fleet still holds it): its
    next command is REJECTED although its .pub is still in the (read-only) command folder, the fleet's
    second key keeps commanding the device, and the revocation holds after a restart. The thief cannot
    use the leaked key to revoke the fleet's other command key (the lock-out attack)."""
    from fleet_keys import COMMAND_KEY, OTHER_KEY
    from fleet_keys import trust as trust_command_key

    broker = Mosquitto(tmp_path / "broker").start()
    state = tmp_path / "state"
    fleet = signer(tmp_path, "fleet", state)
    trust(fleet, "bundles")
    install_offline(fleet, 1)
    trust_command_key(state / "trust" / "commands", OTHER_KEY, "second")  # the rotation's new key
    leaked = key_id_of_private(COMMAND_KEY)
    device = start_device(broker, state, tmp_path)
    manager = manager_for(broker)
    try:
        other = key_id_of_private(OTHER_KEY)
        lockout = manager.wait(manager.send("revoke_key", {"key_id": other, "role": "command"}))
        assert lockout["status"] == "REJECTED" and "signed by that key itself" in lockout["error"], lockout
        done = manager.wait(manager.send("revoke_key", {"key_id": leaked, "role": "command"}))
        assert done["status"] == "SUCCEEDED" and done["result"]["known_here"] is True, done
        refused = manager.wait(manager.send("get_status"))  # signed with the leaked key
        assert refused["status"] == "REJECTED" and "not a trusted command key" in refused["error"], refused
        assert manager.wait(manager.send("get_status", key=OTHER_KEY))["status"] == "SUCCEEDED"
    finally:
        manager.close()
        device.stop()
    assert (state / "trust" / "commands" / "test-commands.pub").exists()  # the file is still there
    device = start_device(broker, state, tmp_path / "restarted")
    manager = manager_for(broker)
    try:
        refused = manager.wait(manager.send("get_status"))
        assert refused["status"] == "REJECTED" and "not a trusted command key" in refused["error"], refused
        assert manager.wait(manager.send("get_status", key=OTHER_KEY))["status"] == "SUCCEEDED"
    finally:
        manager.close()
        device.stop()
        broker.stop()


def key_id_of_private(key: object) -> str:
    from edgeserve.ota.signing import key_id

    return key_id(key.public_key())  # type: ignore[attr-defined]
