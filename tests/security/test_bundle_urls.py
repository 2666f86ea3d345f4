"""Fleet-initiated downloads under the URL policy (issue 22, "Bundles"): the device's installer is asked
to fetch, as a `deploy_bundle` would ask it (origin="fleet"), from places it must not reach:

- file:// URLs and local paths (the device's own files) unless `[ota] allow_file_urls`;
- its loopback (its own APIs), 0.0.0.0, link-local and the cloud metadata address, in every spelling
  (IPv4-mapped, decimal, octal, short, names), unless `allow_loopback_urls` / `allow_link_local_urls`;
- a redirect from an allowed LAN host to any of those, and a name that re-resolves to loopback (DNS
  rebinding) on the next connection.

Each refusal is a FAILED install with code "url", the server behind the refused address never sees a
request, and nothing stays in ota/downloads. LAN hosts stay allowed; the operator's own installs are
not limited. Bundles that pass the URL check are signed by an untrusted key, so that their install is
refused at the signature: the download demonstrably happened, and no trial server is needed.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bundle_helpers import downloads, install, lan_address
from bundle_server import BundleServer
from ota_fixtures import Fleet, make_fleet

from edgeserve.ota import url_policy
from edgeserve.ota.url_policy import UrlPolicy

FLEET = {"origin": "fleet"}


@pytest.fixture
def fleet(tmp_path: Path) -> Fleet:
    return make_fleet(tmp_path)


@pytest.fixture
def stranger_bundle(tmp_path: Path) -> bytes:
    """A bundle signed by a key the device does not trust."""
    return make_fleet(tmp_path / "stranger").bundle(2).read_bytes()


@pytest.fixture
def loopback_server(stranger_bundle: bytes) -> Iterator[BundleServer]:
    with BundleServer() as server:
        server.add("/b.esb", stranger_bundle)
        yield server


@pytest.fixture
def lan() -> str:
    address = lan_address()
    if address is None:
        pytest.skip("this machine has no LAN (non-loopback, non-link-local) IPv4 address to serve from")
    return address


def _refused(fleet: Fleet, url: str, words: str, **kwargs: Any) -> str:
    outcome = install(fleet.state, url, **{**FLEET, **kwargs})
    assert outcome.state == "FAILED" and outcome.code == "url", outcome
    assert words in outcome.reason and "\n" not in outcome.reason, outcome.reason
    assert downloads(fleet.state) == []
    return outcome.reason


def _got_past_the_url_check(fleet: Fleet, url: str, **kwargs: Any) -> None:
    outcome = install(fleet.state, url, **kwargs)
    assert outcome.code == "signature", outcome  # downloaded, then refused for its key
    assert downloads(fleet.state) == []


# ------------------------------------------------------------------------------------------ local files
def test_file_urls_and_paths_are_refused_for_the_fleet(
    fleet: Fleet, tmp_path: Path, stranger_bundle: bytes
) -> None:
    local = tmp_path / "on-the-device.esb"
    local.write_bytes(stranger_bundle)
    for source in (local.as_uri(), str(local), "file:///etc/passwd"):
        _refused(
            fleet, source, "a fleet download must be http(s):// (local files only with [ota] allow_file_urls"
        )
    assert Path("/etc/passwd").read_bytes()  # (read by nobody: the refusal came first)
    _got_past_the_url_check(fleet, local.as_uri(), urls=UrlPolicy(allow_file=True), **FLEET)
    _got_past_the_url_check(fleet, str(local))  # the operator's own install


# ----------------------------------------------------------------------------------- loopback and co
LOOPBACK_URLS = [
    ("http://127.0.0.1:{port}/b.esb", "127.0.0.1 is a loopback address"),
    ("http://127.0.0.2:{port}/b.esb", "127.0.0.2 is a loopback address"),
    ("http://localhost:{port}/b.esb", "localhost resolves to"),
    ("http://127.1:{port}/b.esb", "resolves to 127.0.0.1"),
    ("http://2130706433:{port}/b.esb", "resolves to 127.0.0.1"),
    ("http://0177.0.0.1:{port}/b.esb", "resolves to 127.0.0.1"),
    ("http://0.0.0.0:{port}/b.esb", "0.0.0.0 is in 0.0.0.0/8"),
    ("http://[::1]:{port}/b.esb", "::1 is the loopback address"),
    ("http://[::ffff:127.0.0.1]:{port}/b.esb", "IPv4 127.0.0.1 inside an IPv6 address"),
    ("https://[::ffff:7f00:1]:{port}/b.esb", "IPv4 127.0.0.1 inside an IPv6 address"),
]
LINK_LOCAL_URLS = [
    ("http://169.254.169.254/latest/meta-data/iam/security-credentials/", "the cloud metadata service"),
    ("http://[::ffff:169.254.169.254]/latest/meta-data/", "the cloud metadata service"),
    ("http://169.254.10.20:{port}/b.esb", "a link-local address"),
    ("http://[fe80::1%25lo]:{port}/b.esb", "a link-local address"),
]


@pytest.mark.parametrize(("template", "words"), LOOPBACK_URLS + LINK_LOCAL_URLS)
def test_loopback_and_link_local_urls_are_refused_by_default(
    fleet: Fleet, loopback_server: BundleServer, template: str, words: str
) -> None:
    url = template.format(port=loopback_server.port)
    _refused(fleet, url, words)
    assert loopback_server.requests() == []  # the device never connected
    setting = "allow_link_local_urls" if (template, words) in LINK_LOCAL_URLS else "allow_loopback_urls"
    assert f"[ota] {setting} = true allows it" in _refused(fleet, url, words)


def test_allow_loopback_urls_lets_a_lab_fleet_use_loopback(
    fleet: Fleet, loopback_server: BundleServer
) -> None:
    url = loopback_server.url("/b.esb")
    _got_past_the_url_check(fleet, url, urls=UrlPolicy(allow_loopback=True), **FLEET)
    _got_past_the_url_check(fleet, url)  # the operator's own install: no URL rules
    assert len(loopback_server.requests("/b.esb")) == 2


# --------------------------------------------------------------------------------------- LAN, redirects
@pytest.fixture
def lan_server(lan: str, stranger_bundle: bytes) -> Iterator[BundleServer]:
    with BundleServer(host=lan) as server:
        server.add("/b.esb", stranger_bundle)
        yield server


def test_lan_hosts_stay_allowed(fleet: Fleet, lan_server: BundleServer) -> None:
    _got_past_the_url_check(fleet, lan_server.url("/b.esb"), **FLEET)
    moved = lan_server.add("/old.esb", b"", status=301, extra_headers={"Location": "/b.esb"})
    _got_past_the_url_check(fleet, moved, **FLEET)  # a redirect inside the LAN is followed
    assert len(lan_server.requests("/b.esb")) == 2


@pytest.mark.parametrize(
    ("location", "words"),
    [
        (
            "http://127.0.0.1:{port}/b.esb",
            "redirect to 'http://127.0.0.1:{port}/b.esb' refused: 127.0.0.1 is a loopback",
        ),
        ("http://[::ffff:127.0.0.1]:{port}/b.esb", "IPv4 127.0.0.1 inside an IPv6 address"),
        ("http://localhost:{port}/b.esb", "download from localhost refused: localhost resolves to"),
        ("http://169.254.169.254/latest/meta-data/", "the cloud metadata service"),
        ("file:///etc/passwd", "redirect to 'file:///etc/passwd' refused: only http(s)"),
        ("ftp://127.0.0.1/b.esb", "refused: only http(s)"),
    ],
)
def test_a_redirect_from_a_lan_host_to_a_refused_place_is_refused(
    fleet: Fleet, lan_server: BundleServer, loopback_server: BundleServer, location: str, words: str
) -> None:
    target = location.format(port=loopback_server.port)
    url = lan_server.add("/evil.esb", b"", status=302, extra_headers={"Location": target})
    _refused(fleet, url, words.format(port=loopback_server.port))
    assert len(lan_server.requests("/evil.esb")) == 1 and loopback_server.requests() == []


def test_a_name_is_checked_where_it_connects_dns_rebinding(
    fleet: Fleet, lan: str, lan_server: BundleServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`mirror.test` answers the LAN address once, then 127.0.0.1 (a rebinding DNS server). The first
    connection goes to the address that was checked; the redirect's new connection resolves again, sees
    loopback and is refused."""
    resolved: list[str] = []

    def rebinding(host: str, port: int) -> list[tuple[Any, ...]]:
        if host != "mirror.test":
            return socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
        address = lan if not resolved else "127.0.0.1"
        resolved.append(address)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port))]

    monkeypatch.setattr(url_policy, "_resolve", rebinding)
    port = lan_server.port
    _got_past_the_url_check(fleet, f"http://mirror.test:{port}/b.esb", **FLEET)
    assert resolved == [lan] and len(lan_server.requests("/b.esb")) == 1

    resolved.clear()
    hop = lan_server.add(
        "/hop.esb", b"", status=302, extra_headers={"Location": f"http://mirror.test:{port}/b.esb"}
    )
    _refused(
        fleet, hop.replace(lan, "mirror.test"), "mirror.test resolves to 127.0.0.1 is a loopback address"
    )
    assert resolved == [lan, "127.0.0.1"] and len(lan_server.requests("/b.esb")) == 1
