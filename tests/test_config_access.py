"""[http]/[grpc] access settings: TOML and environment forms, validation messages (file, field, fix),
Triton's flags on `edgeserve serve` / `edgeserve run`, and `edgeserve config check` warnings."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgeserve import cli
from edgeserve.config import ConfigError, load_settings


def settings_file(tmp: Path, text: str) -> Path:
    path = tmp / "edgeserve.toml"
    path.write_text(text)
    return path


def test_toml_and_environment_forms(tmp_path: Path) -> None:
    path = settings_file(
        tmp_path,
        """
[http]
token = "a-long-enough-token-0123"
admin_loopback_only = false
restricted_api = ["model-repository,shared-memory:admin-key=admin-value", "inference:infer-key=infer-value"]
[grpc]
restricted_protocol = ["health:k=v"]
""",
    )
    settings = load_settings(path, environ={})
    assert settings.http.token == "a-long-enough-token-0123" and settings.http.admin_loopback_only is False
    assert settings.http.restricted_api == [
        "model-repository,shared-memory:admin-key=admin-value",
        "inference:infer-key=infer-value",
    ]
    assert settings.grpc.restricted_protocol == ["health:k=v"]
    env = {
        "EDGESERVE_HTTP_TOKEN": "from-the-environment-0123",
        "EDGESERVE_HTTP_RESTRICTED_API": "model-repository,shared-memory:a=1;inference:b=2",
        "EDGESERVE_GRPC_RESTRICTED_PROTOCOL": "inference,health:c=3",
        "EDGESERVE_HTTP_ADMIN_LOOPBACK_ONLY": "true",
    }
    settings = load_settings(path, environ=env)
    assert settings.http.token == "from-the-environment-0123" and settings.http.admin_loopback_only
    assert settings.http.restricted_api == ["model-repository,shared-memory:a=1", "inference:b=2"]
    assert settings.grpc.restricted_protocol == ["inference,health:c=3"]
    defaults = load_settings(None, environ={})
    assert (defaults.http.token, defaults.http.admin_loopback_only, defaults.http.restricted_api) == (
        "",
        True,
        [],
    )
    assert defaults.http.tls_cert is None and defaults.grpc.restricted_protocol == []


NOT_TOGETHER = "tls_cert and tls_key must be set together"
BAD_SETTINGS = [
    ('[http]\nrestricted_api = ["inference"]', "http.restricted_api: --http-restricted-api option format"),
    ('[http]\nrestricted_api = ["inferenc:k=v"]', "http.restricted_api: unknown restricted api 'inferenc'"),
    (
        '[grpc]\nrestricted_protocol = ["health:a=1", "health:b=2"]',
        "grpc.restricted_protocol: restricted protocol 'health' can not be specified in multiple config",
    ),
    ("[http]\nrestricted_api = [1]", "http.restricted_api: expected a list"),
    ('[http]\ntls_cert = "/nonexistent/cert.pem"', f"http.tls_cert: {NOT_TOGETHER}"),
    ('[grpc]\ntls_key = "/nonexistent/key.pem"', f"grpc.tls_cert: {NOT_TOGETHER}"),
    (
        '[http]\ntls_cert = "/no/c.pem"\ntls_key = "/no/k.pem"',
        "http.tls_cert: /no/c.pem is not a readable file",
    ),
    ('[http]\ntls_client_ca = "/no/ca.pem"', "http.tls_client_ca: client certificates need TLS"),
    ('[http]\ntoken = "two words"', "http.token: must be printable ASCII without spaces"),
    ('[grpc]\ntoken = "tab\\tinside"', "grpc.token: must be printable ASCII"),
    ("[http]\nadmin_loopback_only = 1", "http.admin_loopback_only: expected true or false"),
    ('[http]\nrestricted_apis = ["inference:k=v"]', "did you mean 'restricted_api'"),
]


@pytest.mark.parametrize(("text", "message"), BAD_SETTINGS)
def test_validation_names_the_file_the_field_and_the_fix(tmp_path: Path, text: str, message: str) -> None:
    path = settings_file(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ={})
    assert str(info.value).startswith(f"{path}: ")
    assert message in str(info.value)


def test_environment_groups_are_validated_too() -> None:
    with pytest.raises(ConfigError, match=r"settings: http\.restricted_api: unknown restricted api 'bogus'"):
        load_settings(None, environ={"EDGESERVE_HTTP_RESTRICTED_API": "bogus:k=v"})


# -- Triton's flags ------------------------------------------------------------------------------------
def parse(*argv: str) -> object:
    return cli.build_parser().parse_args(list(argv))


@pytest.mark.parametrize("command", ["serve", "run"])
def test_tritons_flag_syntax_is_accepted_repeated_and_forwarded(command: str) -> None:
    args = parse(
        command,
        "--http-restricted-api=model-repository,shared-memory:admin-key=admin-value",
        "--http-restricted-api", "inference:infer-key=infer-value",
        "--grpc-restricted-protocol=health,inference:k=v=w",
    )  # fmt: skip
    overrides = cli._overrides(args)  # type: ignore[arg-type]
    assert overrides["http"]["restricted_api"] == [
        "model-repository,shared-memory:admin-key=admin-value",
        "inference:infer-key=infer-value",
    ]
    assert overrides["grpc"]["restricted_protocol"] == ["health,inference:k=v=w"]
    settings = load_settings(None, environ={}, overrides=overrides)
    assert settings.grpc.restricted_protocol == ["health,inference:k=v=w"]
    # `run` hands them to its `serve` child unchanged
    flags = cli._serve_flags(args)  # type: ignore[arg-type]
    child = cli._overrides(parse("serve", *flags))  # type: ignore[arg-type]
    assert child["http"] == overrides["http"] and child["grpc"] == overrides["grpc"]


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--http-restricted-api=inference", "format is '<api>[,<api>...]:<key>=<value>'. Got inference"),
        ("--http-restricted-api=foo:k=v", "unknown restricted api 'foo'"),
        ("--grpc-restricted-protocol=foo:k=v", "unknown restricted protocol 'foo'"),
        ("--grpc-restricted-protocol=health:k", "--grpc-restricted-protocol option format is"),
    ],
)  # fmt: skip
def test_bad_flags_are_one_line_and_exit_2(
    flag: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parse("serve", flag)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_category_in_two_flag_groups_is_refused_at_load() -> None:
    args = parse("serve", "--http-restricted-api=health:a=1", "--http-restricted-api=health,metadata:b=2")
    message = "http.restricted_api: restricted api 'health' can not be specified in multiple config groups"
    with pytest.raises(ConfigError, match=message):
        load_settings(None, environ={}, overrides=cli._overrides(args))  # type: ignore[arg-type]


# -- config check --------------------------------------------------------------------------------------
def test_config_check_warns_about_risky_settings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = settings_file(
        tmp_path,
        """
[http]
host = "0.0.0.0"
admin_loopback_only = false
[grpc]
host = "0.0.0.0"
token = "short"
[zmq]
endpoints = ["ipc:///tmp/x.zmq", "tcp://*:5555", "tcp://127.0.0.1:5556"]
""",
    )
    assert cli.main(["config", "check", "--config", str(path)]) == 0
    out, err = capsys.readouterr()
    assert "valid" in out
    warnings = [line for line in err.splitlines() if line.startswith("edgeserve config: warning: ")]
    text = "\n".join(warnings)
    assert "[http] host = '0.0.0.0' listens beyond loopback with no token" in text
    assert "[http] admin_loopback_only = false" in text
    assert "[grpc] token is 5 characters" in text
    assert "[grpc] host = '0.0.0.0' listens beyond loopback without TLS: the bearer token" in text
    assert "[zmq] endpoint 'tcp://*:5555'" in text
    assert "endpoint 'tcp://127.0.0.1:5556'" not in text and "endpoint 'ipc:" not in text
    assert len(warnings) == 6, text


def test_config_check_of_the_defaults_is_quiet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["config", "check", "--config", str(settings_file(tmp_path, ""))]) == 0
    assert "warning" not in capsys.readouterr().err


def test_config_check_does_not_print_secrets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = settings_file(
        tmp_path,
        """
[http]
token = "http-secret-0123456789"
restricted_api = ["inference,health:infer-key=infer-secret"]
[grpc]
token = "grpc-secret-0123456789"
[fleet]
password = "broker-secret"
""",
    )
    assert cli.main(["config", "check", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    for secret in ("http-secret", "grpc-secret", "infer-secret", "broker-secret"):
        assert secret not in out
    assert 'token = "<set>"' in out and '["inference,health:infer-key=<set>"]' in out
