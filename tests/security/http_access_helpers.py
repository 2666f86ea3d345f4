"""Helpers of the HTTP/gRPC access tests: a non-loopback address of this box (so a test can be a
network peer for real), a real server listening on every interface, and a small PKI for TLS."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from es_server import ROOT, SIDE_BY_SIDE_ENV, RunningServer, free_port, server_command, start_server
from onnx_models import MLP_CONFIG, write_model

TOKEN = "t0ken-for-the-access-tests-0123456789"
# A fast start: no runtime race on the test model.
FAST = {"EDGESERVE_RUNTIME_RACE_BUDGET_S": "0"}


def network_address() -> str:
    """An address of this box that is not loopback: a connection to it comes from a network peer."""
    candidates: list[str] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET: picks the outgoing interface, sends nothing
            candidates.append(probe.getsockname()[0])
        except OSError:
            pass
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        candidates += subprocess.run(
            ["hostname", "-I"], capture_output=True, text=True, timeout=5
        ).stdout.split()
    for address in candidates:
        ip = ipaddress.ip_address(address)
        if ip.version == 4 and not ip.is_loopback and not ip.is_unspecified:
            return address
    pytest.skip("this box has no non-loopback IPv4 address to act as a network peer from")


def model_repository(tmp: Path) -> Path:
    repo = tmp / "repo"
    write_model(repo, "mlp", "mlp", config=MLP_CONFIG)
    return repo


def start_exposed(
    tmp: Path, args: list[str] | None = None, env: dict[str, str] | None = None
) -> RunningServer:
    """`edgeserve serve` on every interface (0.0.0.0): reachable from loopback and `network_address()`."""
    return start_server(
        model_repository(tmp), tmp, args=["--host", "0.0.0.0", *(args or [])], env={**FAST, **(env or {})}
    )


def start_probed(
    tmp: Path,
    ready: Callable[[RunningServer], bool],
    args: list[str],
    env: dict[str, str],
    timeout: float = 120,
) -> RunningServer:
    """As es_server.start_server, for a server its plain-HTTP probe cannot reach (HTTPS): `ready` decides."""
    repo = model_repository(tmp)
    http_port, grpc_port = free_port(), free_port()
    zmq = f"ipc://{tmp}/edgeserve-{http_port}.zmq"
    log_path = tmp / f"server-{http_port}.log"
    command = server_command("serve", repo, http_port, grpc_port, zmq, args)
    full_env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "EDGESERVE_SERVER_STATE_DIR": str(tmp / "state"),
        **SIDE_BY_SIDE_ENV,
        **FAST,
        **env,
    }
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT)
    server = RunningServer(process, http_port, grpc_port, zmq, log_path, repo, env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"edgeserve exited with {process.returncode}:\n{server.log()}")
        if ready(server):
            return server
        time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"edgeserve did not become ready in {timeout}s:\n{server.log()}")


# -- a small PKI ---------------------------------------------------------------------------------------
@dataclass
class Pki:
    ca: Path  # the CA that signs the server and the good client
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path  # a client certificate from another CA
    rogue_key: Path


def make_pki(folder: Path, server_ips: list[str]) -> Pki:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def name(text: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])

    def write(stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> tuple[Path, Path]:
        cert_path, key_path = folder / f"{stem}.crt", folder / f"{stem}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        return cert_path, key_path

    def issue(
        subject: str, issuer: x509.Name, signer: ec.EllipticCurvePrivateKey,
        san: list[x509.GeneralName] | None = None, usage: list[x509.ObjectIdentifier] | None = None,
    ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:  # fmt: skip
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        )
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        if usage:
            builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        return builder.sign(signer, hashes.SHA256()), key

    def self_signed_ca(subject: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(name(subject))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
            )
            .sign(key, hashes.SHA256())
        )
        return cert, key

    ca_cert, ca_key = self_signed_ca("edgeserve test CA")
    ca_path, _ = write("ca", ca_cert, ca_key)
    san: list[x509.GeneralName] = [x509.DNSName("localhost")]
    san += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ["127.0.0.1", *server_ips]]
    server = issue("edgeserve", ca_cert.subject, ca_key, san=san, usage=[ExtendedKeyUsageOID.SERVER_AUTH])
    client = issue("camera-app", ca_cert.subject, ca_key, usage=[ExtendedKeyUsageOID.CLIENT_AUTH])
    rogue_ca, rogue_ca_key = self_signed_ca("someone else's CA")
    rogue = issue("intruder", rogue_ca.subject, rogue_ca_key, usage=[ExtendedKeyUsageOID.CLIENT_AUTH])
    server_cert, server_key = write("server", *server)
    client_cert, client_key = write("client", *client)
    rogue_cert, rogue_key = write("rogue", *rogue)
    return Pki(ca_path, server_cert, server_key, client_cert, client_key, rogue_cert, rogue_key)
