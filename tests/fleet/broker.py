"""A real mosquitto for the fleet tests and the fleet simulation: a generated config on a free loopback
port, persistence in a temporary folder (retained messages survive `restart()`), `$SYS` every second.

    broker = Mosquitto(tmp_dir).start()              # plain listener, anonymous
    broker = Mosquitto(tmp_dir, tls=True).start()    # TLS, client certificates required (see TestPki)
    broker = Mosquitto(tmp_dir, users={"ops": "pw"}).start()   # username/password, no anonymous
    broker.url, broker.kill(), broker.restart(), broker.sys_counters()

Not a test module: tests/fleet/conftest.py makes fixtures of it; benchmarks/fleet_sim.py imports it.
"""

from __future__ import annotations

import datetime as dt
import getpass
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from loopback_ports import free_port

MOSQUITTO_CANDIDATES = ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto", "/opt/homebrew/sbin/mosquitto")
SYS_COUNTERS = (
    "messages/received",
    "messages/sent",
    "publish/messages/received",
    "publish/messages/sent",
    "clients/connected",
)


def find_mosquitto() -> str | None:
    found = shutil.which("mosquitto")
    if found:
        return found
    return next((c for c in MOSQUITTO_CANDIDATES if os.access(c, os.X_OK)), None)


def needs_mosquitto() -> Any:
    """The pytest mark that skips where no mosquitto binary is installed."""
    import pytest

    return pytest.mark.skipif(
        find_mosquitto() is None, reason="mosquitto is not installed (apt install mosquitto)"
    )


@dataclass(frozen=True)
class CertFiles:
    cert: str
    key: str


class TestPki:
    """A throwaway CA (EC P-256) and certificates signed by it, written under `folder`."""

    __test__ = False  # not a pytest class

    def __init__(self, folder: Path) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        self._x509, self._hashes, self._ser, self._ec, self._oid = x509, hashes, serialization, ec, NameOID
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self._ca_key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "edgeserve fleet test CA")])
        now = dt.datetime.now(dt.timezone.utc)
        self._ca_cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self._ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._ca_key, hashes.SHA256())
        )
        self.ca_file = str(folder / "ca.crt")
        Path(self.ca_file).write_bytes(self._ca_cert.public_bytes(serialization.Encoding.PEM))
        self.server = self.issue("127.0.0.1", server=True)

    def issue(self, common_name: str, *, server: bool = False, signer_key: Any = None) -> CertFiles:
        """A certificate for `common_name` (a client certificate, or the server's with SAN 127.0.0.1 and
        localhost). `signer_key` other than the CA's gives a certificate the broker must refuse."""
        x509, oid = self._x509, self._oid
        key = self._ec.generate_private_key(self._ec.SECP256R1())
        now = dt.datetime.now(dt.timezone.utc)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(oid.COMMON_NAME, common_name)]))
            .issuer_name(self._ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        )
        usage = (
            x509.oid.ExtendedKeyUsageOID.SERVER_AUTH if server else x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH
        )
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
                ),
                critical=False,
            )
        cert = builder.sign(signer_key or self._ca_key, self._hashes.SHA256())
        stem = self.folder / f"{common_name.replace('/', '_')}-{uuid.uuid4().hex[:6]}"
        cert_path, key_path = Path(f"{stem}.crt"), Path(f"{stem}.key")
        cert_path.write_bytes(cert.public_bytes(self._ser.Encoding.PEM))
        key_path.write_bytes(
            key.private_bytes(self._ser.Encoding.PEM, self._ser.PrivateFormat.PKCS8, self._ser.NoEncryption())
        )
        key_path.chmod(0o600)
        return CertFiles(str(cert_path), str(key_path))

    def rogue(self, common_name: str) -> CertFiles:
        """A client certificate signed by a key that is not the CA's."""
        return self.issue(common_name, signer_key=self._ec.generate_private_key(self._ec.SECP256R1()))


class Mosquitto:
    """One mosquitto process; see the module text."""

    def __init__(
        self,
        folder: Path,
        *,
        tls: bool = False,
        users: dict[str, str] | None = None,
        max_connections: int = -1,
        binary: str | None = None,
    ) -> None:
        self.binary = binary or find_mosquitto()
        if self.binary is None:
            raise FileNotFoundError("mosquitto is not installed")
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.tls = tls
        self.users = users or {}
        self.max_connections = max_connections
        self.pki = TestPki(folder / "pki") if tls else None
        self.process: subprocess.Popen[bytes] | None = None
        self.conf = folder / "mosquitto.conf"
        self.log = folder / "mosquitto.log"
        (folder / "data").mkdir(exist_ok=True)

    @property
    def url(self) -> str:
        return f"{'mqtts' if self.tls else 'mqtt'}://127.0.0.1:{self.port}"

    def _write_config(self) -> None:
        lines = [
            f"user {getpass.getuser()}",  # running as root: do not drop to the 'mosquitto' user
            "per_listener_settings false",
            f"listener {self.port} 127.0.0.1",
            f"max_connections {self.max_connections}",
            "persistence true",
            f"persistence_location {self.folder / 'data'}/",
            "autosave_interval 1",  # a SIGKILLed broker loses at most a second of retained messages
            "sys_interval 1",
            f"log_dest file {self.log}",
            "log_type error",
            "log_type warning",
            "log_type notice",
            "log_type information",
            "connection_messages true",
            "max_queued_messages 10000",
        ]
        if self.users:
            passwd = self.folder / "passwd"
            self._write_passwords(passwd)
            lines += ["allow_anonymous false", f"password_file {passwd}"]
        else:
            lines.append("allow_anonymous true")
        if self.pki is not None:
            lines += [
                f"cafile {self.pki.ca_file}",
                f"certfile {self.pki.server.cert}",
                f"keyfile {self.pki.server.key}",
                "require_certificate true",
                "use_identity_as_username true",
                "tls_version tlsv1.2",
            ]
        self.conf.write_text("\n".join(lines) + "\n")

    def _write_passwords(self, path: Path) -> None:
        tool = shutil.which("mosquitto_passwd") or (
            "/usr/bin/mosquitto_passwd" if os.access("/usr/bin/mosquitto_passwd", os.X_OK) else None
        )
        path.write_text("")
        if tool is None:
            raise FileNotFoundError("mosquitto_passwd is not installed (it comes with mosquitto)")
        for user, password in self.users.items():
            subprocess.run([tool, "-b", str(path), user, password], check=True, capture_output=True)

    def start(self, timeout_s: float = 10.0) -> Mosquitto:
        if self.process is not None and self.process.poll() is None:
            return self
        self._write_config()
        env = dict(os.environ)
        self.process = subprocess.Popen(
            [str(self.binary), "-c", str(self.conf)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                raise RuntimeError(f"mosquitto exited with {self.process.returncode}: {err}{self.log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"mosquitto did not listen on {self.port} within {timeout_s} s{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n" + "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM: mosquitto saves its persistence file and exits."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def restart(self, *, hard: bool = False) -> Mosquitto:
        """Stop (or SIGKILL with `hard`) and start again on the same port with the same persistence."""
        self.kill() if hard else self.stop()
        for _ in range(50):  # the port may linger a moment
            try:
                return self.start()
            except RuntimeError as exc:
                if "Address already in use" not in str(exc):
                    raise
                time.sleep(0.1)
        return self.start()

    # -- clients for tests and the benchmark -------------------------------------------------------------

    def client_options(self, name: str = "client") -> dict[str, Any]:
        """Keyword arguments for FleetManager / SimAgent: TLS files (a fresh client cert) or credentials."""
        options: dict[str, Any] = {}
        if self.pki is not None:
            certs = self.pki.issue(name)
            options.update(ca_file=self.pki.ca_file, cert_file=certs.cert, key_file=certs.key)
        if self.users:
            user, password = next(iter(self.users.items()))
            options.update(username=user, password=password)
        return options

    def sys_counters(self, timeout_s: float = 5.0, settle_s: float = 2.5) -> dict[str, int]:
        """The broker's $SYS counters (published every second): waits `settle_s` so that the retained values
        are current (the $SYS clock has whole-second steps: up to 2 s), then reads them with a short-lived
        client. Note: mosquitto 2.0.11's publish/messages/received does not count retained PUBLISHes."""
        import paho.mqtt.client as mqtt

        time.sleep(settle_s)
        values: dict[str, int] = {}
        done = threading.Event()

        def on_message(client: Any, userdata: Any, msg: Any) -> None:
            leaf = msg.topic.removeprefix("$SYS/broker/")
            if leaf in SYS_COUNTERS:
                try:
                    values[leaf] = int(msg.payload.decode())
                except ValueError:
                    return
                if all(k in values for k in SYS_COUNTERS):
                    done.set()

        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"sys-{uuid.uuid4().hex[:8]}")
        options = self.client_options("sys-reader")
        if "ca_file" in options:
            client.tls_set(
                ca_certs=options["ca_file"], certfile=options["cert_file"], keyfile=options["key_file"]
            )
        if "username" in options:
            client.username_pw_set(options["username"], options["password"])
        client.on_message = on_message
        client.on_connect = lambda c, *a: c.subscribe([(f"$SYS/broker/{k}", 0) for k in SYS_COUNTERS])
        client.connect("127.0.0.1", self.port)
        client.loop_start()
        try:
            done.wait(timeout_s)
        finally:
            client.disconnect()
            client.loop_stop()
        return values


class Spy:
    """A raw paho client that records every message published under `topics` (filters), from its
    subscription on (properties included)."""

    def __init__(self, broker: Mosquitto, *topics: str, protocol: int = 5) -> None:  # 5: mqtt.MQTTv5
        import paho.mqtt.client as mqtt

        self.messages: list[mqtt.MQTTMessage] = []
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="spy", protocol=protocol)
        subscribed = threading.Event()
        self.client.on_message = lambda c, u, m: self.messages.append(m)
        self.client.on_subscribe = lambda *a: subscribed.set()
        self.client.on_connect = lambda c, *a: c.subscribe([(t, 1) for t in topics])
        self.client.connect("127.0.0.1", broker.port)
        self.client.loop_start()
        assert subscribed.wait(5)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()
