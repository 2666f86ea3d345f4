"""The shared access policy (frontends/access.py) and Triton's restricted-API syntax
(protocol/restricted.py)."""

from __future__ import annotations

import pytest

from edgeserve.frontends import access
from edgeserve.frontends.access import AccessPolicy, Endpoint, RestrictedError
from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.protocol.restricted import (
    CATEGORIES,
    RestrictedGroups,
    Restriction,
    grpc_restrictions,
    http_restrictions,
    parse_group,
)


# -- Triton's syntax ---------------------------------------------------------------------------------
def test_categories_are_tritons() -> None:
    assert CATEGORIES == (
        "health", "metadata", "inference", "shared-memory", "model-config", "model-repository",
        "statistics", "trace", "logging",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("arg", "parsed"),
    [
        ("inference:infer-key=infer-value", (["inference"], "infer-key", "infer-value")),
        ("model-repository,shared-memory:a=b", (["model-repository", "shared-memory"], "a", "b")),
        # the first ':' ends the categories and the first '=' the key: the value keeps the rest
        ("health:k=a=b:c", (["health"], "k", "a=b:c")),
        ("health, metadata:k=v", (["health", "metadata"], "k", "v")),
    ],
)  # fmt: skip
def test_parse_group(arg: str, parsed: tuple[list[str], str, str]) -> None:
    assert parse_group(arg, "http-restricted-api", "api") == parsed


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        (
            "inference",
            "--http-restricted-api option format is '<api>[,<api>...]:<key>=<value>'. Got inference",
        ),
        ("inference:key", "option format is"),
        (":k=v", "option format is"),
        ("inference:=v", "option format is"),
        ("inference:k=", "option format is"),
        ("infer:k=v", "unknown restricted api 'infer'"),
        ("inference,,health:k=v", "unknown restricted api ''"),
        ("inference:bad key=v", "key 'bad key' must be an HTTP header name"),
        ("inference:Authorization=v", "bearer token's header"),
        ("inference:k= v", "without leading or trailing spaces"),
        ("inference:k=caf\u00e9", "printable ASCII"),
    ],
)
def test_parse_group_errors(arg: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(".", r"\.")):
        parse_group(arg, "http-restricted-api", "api")


def test_grpc_keys_become_triton_metadata_keys() -> None:
    table = grpc_restrictions(["inference,health:Infer-Key=v1", "model-repository:admin=v2"])
    assert table == {
        "inference": Restriction("triton-grpc-protocol-infer-key", "v1"),
        "health": Restriction("triton-grpc-protocol-infer-key", "v1"),
        "model-repository": Restriction("triton-grpc-protocol-admin", "v2"),
    }
    with pytest.raises(ValueError, match="must be letters, digits"):
        grpc_restrictions(["inference:key!=v"])
    with pytest.raises(ValueError, match="not ending in -bin"):
        grpc_restrictions(["inference:key-bin=v"])
    assert http_restrictions(["inference:Infer-Key=v"])["inference"] == Restriction("Infer-Key", "v")


def test_a_category_in_two_groups_is_refused_as_triton_does() -> None:
    with pytest.raises(
        ValueError, match="restricted protocol 'health' can not be specified in multiple config groups"
    ):
        grpc_restrictions(["health,inference:a=1", "metadata,health:b=2"])


def test_environment_form_separates_groups_with_semicolons() -> None:
    groups = RestrictedGroups.from_setting("inference,health:a=1; model-repository:b=2;", "env")
    assert groups == ["inference,health:a=1", "model-repository:b=2"]
    with pytest.raises(ValueError, match="expected a list"):
        RestrictedGroups.from_setting([1], "file: http.restricted_api")


# -- the policy ----------------------------------------------------------------------------------------
class FakePeer:
    def __init__(self, loopback: bool, headers: dict[str, str] | None = None, private: bool = False) -> None:
        self._loopback, self._private = loopback, private
        self.headers = {k.lower(): v for k, v in (headers or {}).items()}
        self.asked: list[str] = []

    def loopback(self) -> bool:
        return self._loopback

    def private(self) -> bool:
        return self._private

    def header(self, name: str) -> str | None:
        self.asked.append(name.lower())
        return self.headers.get(name.lower())


def refusal(
    policy: AccessPolicy, endpoint: Endpoint | None, peer: FakePeer
) -> tuple[Status, int, str] | None:
    if not policy.needs_check(endpoint):
        return None
    try:
        policy.check(endpoint, peer)
    except InferenceError as exc:
        return exc.status, exc.http_status, exc.message
    return None


TOKEN = {"Authorization": "Bearer s3cret-s3cret"}


def test_token_applies_to_network_peers_only_and_not_to_probes() -> None:
    policy = AccessPolicy("http", token="s3cret-s3cret")
    assert refusal(policy, access.INFERENCE, FakePeer(False)) == (
        Status.UNAUTHENTICATED, 401,
        "missing or wrong bearer token: send the header 'Authorization: Bearer <token>' ([http] token), "
        "or call from the appliance itself",
    )  # fmt: skip
    for wrong in ("Bearer s3cret", "bearer s3cret-s3cret-", "Basic s3cret-s3cret", "s3cret-s3cret", ""):
        assert refusal(policy, access.INFERENCE, FakePeer(False, {"Authorization": wrong})) is not None
    assert (
        refusal(policy, access.INFERENCE, FakePeer(False, {"Authorization": "bearer  s3cret-s3cret "}))
        is None
    )
    assert refusal(policy, access.INFERENCE, FakePeer(True)) is None
    assert refusal(policy, access.SERVER_HEALTH, FakePeer(False)) is None
    assert refusal(policy, access.MODEL_READY, FakePeer(False)) is not None
    assert refusal(policy, None, FakePeer(False)) is not None  # an unknown path: no enumeration without it
    assert not AccessPolicy("http", admin_loopback_only=False).needs_check(None)


def test_admin_endpoints_are_loopback_only_whatever_the_token() -> None:
    policy = AccessPolicy("grpc", token="s3cret-s3cret")
    for endpoint in (access.MODEL_CONTROL, access.SHM_CONTROL, access.LOG_UPDATE):
        status = refusal(policy, endpoint, FakePeer(False, TOKEN))
        assert status is not None and status[:2] == (Status.PERMISSION_DENIED, 403)
        assert f"{endpoint.name} is allowed only from the appliance itself" in status[2]
        assert "[grpc] admin_loopback_only = false" in status[2]
        assert refusal(policy, endpoint, FakePeer(True)) is None
        assert refusal(AccessPolicy("grpc", token="s3cret-s3cret", admin_loopback_only=False), endpoint,
                       FakePeer(False, TOKEN)) is None  # fmt: skip
    for endpoint in (access.SHM_STATUS, access.LOG_READ, access.REPOSITORY_INDEX):
        assert refusal(policy, endpoint, FakePeer(False, TOKEN)) is None
    # the default: nothing to check on the inference path of an open policy
    assert not AccessPolicy("http").needs_check(access.INFERENCE)


def test_restricted_categories_need_their_header_from_every_peer_but_the_control_socket() -> None:
    table = http_restrictions(["inference:infer-key=infer-value"])
    policy = AccessPolicy("http", restricted=table, admin_loopback_only=False)
    for headers in ({}, {"infer-key": "infer-valuE"}, {"infer-key": "infer-value2"}):
        status = refusal(policy, access.INFERENCE, FakePeer(True, headers))
        assert status == (Status.UNAVAILABLE, 403, "This API is restricted, expecting header 'infer-key'")
    assert refusal(policy, access.INFERENCE, FakePeer(True, {"infer-key": "infer-value"})) is None
    assert refusal(policy, access.INFERENCE, FakePeer(True, private=True)) is None
    assert refusal(policy, access.METADATA, FakePeer(False)) is None
    grpc_policy = AccessPolicy("grpc", restricted=grpc_restrictions(["health:k=v"]))
    status = refusal(grpc_policy, access.SERVER_HEALTH, FakePeer(True))
    assert status == (
        Status.UNAVAILABLE,
        403,
        "This protocol is restricted, expecting header 'triton-grpc-protocol-k'",
    )
    error = RestrictedError("x")
    assert error.grpc_status_name == "UNAVAILABLE" and error.http_status == 403


def test_order_token_then_admin_then_restriction() -> None:
    policy = AccessPolicy(
        "http", token="s3cret-s3cret", restricted=http_restrictions(["model-repository:k=v"])
    )
    peer = FakePeer(False)
    assert refusal(policy, access.MODEL_CONTROL, peer) == (
        Status.UNAUTHENTICATED,
        401,
        policy._token_message(),
    )
    assert peer.asked == ["authorization"]  # a peer without the token learns nothing about the header
    status = refusal(policy, access.MODEL_CONTROL, FakePeer(False, {**TOKEN, "k": "v"}))
    assert status is not None and status[0] is Status.PERMISSION_DENIED
    assert refusal(policy, access.MODEL_CONTROL, FakePeer(True, {"k": "v"})) is None


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.9.8.7", True), ("::1", True), ("::ffff:127.0.0.1", True),
     ("::1%lo", True), ("192.168.1.2", False), ("::ffff:10.0.0.1", False), ("fe80::1%eth0", False),
     ("unix", False), ("", False)],
)  # fmt: skip
def test_loopback_addresses(host: str, loopback: bool) -> None:
    assert access.is_loopback_address(host) is loopback


def test_loopback_binds_and_exposure_warnings() -> None:
    assert all(
        access.is_loopback_bind(h) for h in ("127.0.0.1", "localhost", "::1", "[::1]", "unix:/run/x.sock")
    )
    assert not any(access.is_loopback_bind(h) for h in ("0.0.0.0", "", "::", "192.168.1.2", "example.com"))
    assert access.exposure_warnings("http", "127.0.0.1", "", False, False) == []
    open_wide = access.exposure_warnings("http", "0.0.0.0", "", False, False)
    assert len(open_wide) == 2 and "no token and no client certificates" in open_wide[0]
    assert "without TLS: tensors travel in clear text" in open_wide[1]
    clear_token = access.exposure_warnings("grpc", "10.0.0.2", "t" * 20, False, False)
    assert clear_token == [
        "[grpc] host = '10.0.0.2' listens beyond loopback without TLS: the bearer token and tensors travel "
        "in clear text (set [grpc] tls_cert and tls_key)"
    ]
    assert access.exposure_warnings("http", "0.0.0.0", "", True, True) == []
    assert access.exposure_warnings("http", "0.0.0.0", "t" * 20, True, False) == []
