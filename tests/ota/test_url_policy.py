"""The URL policy of fleet downloads, unit by unit: the address classifier over many spellings of the
same places, the URL check, and the connect-time check (resolve once, connect to what was checked)."""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

import pytest

from edgeserve.ota import url_policy
from edgeserve.ota.url_policy import (
    LINK_LOCAL,
    LOOPBACK,
    NOT_UNICAST,
    UrlPolicy,
    UrlRefused,
    check_url,
    classify,
    connect_checked,
)

DEFAULT = UrlPolicy()

LOOPBACKS = [
    "127.0.0.1", "127.0.0.2", "127.255.255.254", "::1", "0.0.0.0", "0.1.2.3", "::",
    "::ffff:127.0.0.1", "::ffff:7f00:1", "::ffff:0.0.0.0",  # IPv4-mapped
    "::127.0.0.1",  # IPv4-compatible (deprecated)
    "64:ff9b::7f00:1",  # NAT64 well-known prefix
    "2002:7f00:1::1",  # 6to4 of 127.0.0.1
]  # fmt: skip
LINK_LOCALS = [
    "169.254.0.1", "169.254.169.254", "169.254.255.255", "fe80::1", "fe80::1%eth0", "febf::1",
    "::ffff:169.254.169.254", "::ffff:a9fe:a9fe", "64:ff9b::a9fe:a9fe",
]  # fmt: skip
NOT_UNICASTS = ["224.0.0.1", "239.255.255.250", "240.0.0.1", "255.255.255.255", "ff02::1", "::ffff:224.0.0.1"]
ALLOWED = [
    "10.0.0.1", "10.255.255.254", "172.16.0.1", "172.31.255.254", "192.168.1.10", "192.0.2.2",
    "100.64.0.1", "8.8.8.8", "1.1.1.1", "126.255.255.255", "128.0.0.1", "169.253.255.255", "169.255.0.1",
    "172.15.255.255", "172.32.0.1", "fd00::1", "fec0::1", "2001:4860:4860::8888",
    "::ffff:10.0.0.1", "::ffff:192.168.0.1", "::ffff:8.8.8.8", "2002:0808:0808::1",
]  # fmt: skip


@pytest.mark.parametrize("text", LOOPBACKS)
def test_loopback_forms(text: str) -> None:
    address = ipaddress.ip_address(text)
    assert classify(address)[0] == LOOPBACK
    refusal = DEFAULT.refusal(address)
    assert refusal is not None and "allow_loopback_urls" in refusal and "\n" not in refusal
    assert UrlPolicy(allow_loopback=True).refusal(address) is None
    assert UrlPolicy(allow_link_local=True).refusal(address) is not None


@pytest.mark.parametrize("text", LINK_LOCALS)
def test_link_local_forms(text: str) -> None:
    address = ipaddress.ip_address(text)
    assert classify(address)[0] == LINK_LOCAL
    assert DEFAULT.refusal(address) is not None
    assert UrlPolicy(allow_loopback=True).refusal(address) is not None
    assert UrlPolicy(allow_link_local=True).refusal(address) is None


def test_cloud_metadata_is_named() -> None:
    refusal = DEFAULT.refusal(ipaddress.ip_address("169.254.169.254"))
    assert refusal is not None and "metadata" in refusal


@pytest.mark.parametrize("text", NOT_UNICASTS)
def test_not_unicast_is_refused_whatever_the_settings(text: str) -> None:
    address = ipaddress.ip_address(text)
    assert classify(address)[0] == NOT_UNICAST
    assert UrlPolicy(True, True, True).refusal(address) is not None


@pytest.mark.parametrize("text", ALLOWED)
def test_lan_and_public_addresses_are_allowed(text: str) -> None:
    assert classify(ipaddress.ip_address(text)) == (None, "")
    assert DEFAULT.refusal(ipaddress.ip_address(text)) is None


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("file:///etc/passwd", r"must be http\(s\).*allow_file_urls"),
        ("/etc/passwd", r"must be http\(s\)"),
        ("ftp://mirror.example/b.esb", r"only http\(s\)"),
        ("gopher://127.0.0.1:70/", r"only http\(s\)"),
        ("http://127.0.0.1:8080/b.esb", r"127\.0\.0\.1 is a loopback address"),
        ("http://[::1]/b.esb", r"::1 is the loopback address"),
        ("http://[::ffff:127.0.0.1]:80/b.esb", r"IPv4 127\.0\.0\.1 inside"),
        ("http://0.0.0.0:8000/b.esb", r"0\.0\.0\.0"),
        ("http://169.254.169.254/latest/meta-data/", r"metadata"),
        ("http://[fe80::1%25eth0]/b.esb", r"link-local"),
        ("https://224.0.0.1/b.esb", r"not a unicast"),
        ("http:///b.esb", r"no host"),
        ("http://[zz::1]/b.esb", r"refused"),
    ],
)
def test_check_url_refuses(url: str, words: str) -> None:
    with pytest.raises(UrlRefused, match=words) as info:
        check_url(url, DEFAULT)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "url",
    ["http://192.168.1.5/b.esb", "https://10.0.0.2:8443/b.esb", "https://bundles.example/v2.esb",
     "HTTP://[fd00::5]/b.esb", "http://localhost/b.esb"],  # a name: checked once it is resolved
)  # fmt: skip
def test_check_url_allows(url: str) -> None:
    check_url(url, DEFAULT)


def test_file_urls_with_the_setting_but_never_as_a_redirect() -> None:
    check_url("file:///srv/b.esb", UrlPolicy(allow_file=True))
    check_url("/srv/b.esb", UrlPolicy(allow_file=True))
    with pytest.raises(UrlRefused, match="redirect to 'file:///etc/passwd' refused"):
        check_url("file:///etc/passwd", UrlPolicy(allow_file=True), redirect=True)


@pytest.mark.parametrize("name", ["localhost", "127.1", "0177.0.0.1", "0x7f.0.0.1", "2130706433", "0"])
def test_names_that_resolve_to_loopback_are_refused_before_connecting(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    connects: list[Any] = []
    monkeypatch.setattr(socket.socket, "connect", lambda self, addr: connects.append(addr))
    with pytest.raises(UrlRefused, match=rf"download from {name} refused: {name} resolves to"):
        connect_checked(name, 80, 5.0, None, DEFAULT)
    assert connects == []


def test_any_refused_address_refuses_the_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """A name resolving to a LAN address and to loopback (a rebinding set-up) is refused outright."""
    answers = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, 80)) for ip in ("10.1.2.3", "127.0.0.1")]
    monkeypatch.setattr(url_policy, "_resolve", lambda host, port: answers)
    with pytest.raises(UrlRefused, match=r"mirror\.test resolves to 127\.0\.0\.1"):
        connect_checked("mirror.test", 80, 5.0, None, DEFAULT)


def test_connects_to_the_address_it_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """One resolution per connection; the socket gets exactly the sockaddr that was checked."""
    calls: list[str] = []

    def resolve(host: str, port: int) -> list[tuple[Any, ...]]:
        calls.append(host)
        ip = "10.9.8.7" if len(calls) == 1 else "127.0.0.1"  # the name changes right after the check
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port))]

    connected: list[Any] = []
    monkeypatch.setattr(url_policy, "_resolve", resolve)
    monkeypatch.setattr(socket.socket, "connect", lambda self, addr: connected.append(addr))
    sock = connect_checked("rebind.test", 8080, 5.0, None, DEFAULT)
    sock.close()
    assert calls == ["rebind.test"] and connected == [("10.9.8.7", 8080)]
