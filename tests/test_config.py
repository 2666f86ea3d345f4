from __future__ import annotations

from pathlib import Path

import pytest

from edgeserve.config import ConfigError, load_settings


def test_defaults_are_valid() -> None:
    settings = load_settings(environ={})
    assert settings.http.port == 8000 and settings.grpc.port == 8001
    assert settings.server.model_repository == Path("models")


def test_file_env_and_cli_layering(tmp_path: Path) -> None:
    path = tmp_path / "edgeserve.toml"
    path.write_text('[http]\nport = 9000\nhost = "0.0.0.0"\n[shm]\nkey_prefixes = ["cam"]\n')
    settings = load_settings(
        path,
        environ={"EDGESERVE_HTTP_PORT": "9100", "EDGESERVE_GRPC_TOKEN": "s3cret"},
        overrides={"grpc": {"port": 9200}},
    )
    assert settings.http.port == 9100  # env beats the file
    assert settings.http.host == "0.0.0.0"
    assert settings.grpc.port == 9200  # command line beats both
    assert settings.grpc.token == "s3cret"
    assert settings.shm.key_prefixes == ["cam"]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("[http]\nport = 70000\n", "http.port: 70000 is not a TCP port"),
        ('[http]\nport = "x"\n', "http.port: expected an integer"),
        ("[htp]\nport = 1\n", "[htp]: unknown section"),
        ("[http]\nprot = 1\n", "http.prot: unknown setting"),
        ('[server]\nmodel_control_mode = "poll"\n', "server.model_control_mode"),
        ('[grpc]\ntls_cert = "/a.pem"\n', "tls_cert and tls_key must be set together"),
        ("[zmq]\ninline_max_us = -1\n", "zmq.inline_max_us: must be 0"),
        ("[http]\ninline_max_us = -5\n", "http.inline_max_us: must be 0"),
        ("[grpc]\ninline_max_us = -5\n", "grpc.inline_max_us: must be 0"),
        ("[zmq]\nspin_us = -5\n", "zmq.spin_us: must be 0 (never spin) up to 10000"),
        ("[zmq]\nspin_us = 20000\n", "zmq.spin_us: must be 0 (never spin) up to 10000"),
        ('[server]\nevent_loop = "trio"\n', "server.event_loop: 'trio' is not one of auto, uvloop, asyncio"),
        ("[http\n", "not valid TOML"),
        ('[fleet]\ndevice_id = "manager"\n', "fleet.device_id: 'manager' is reserved for the fleet tools"),
    ],
)
def test_errors_name_file_field_and_fix(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ={})
    assert str(path) in str(info.value)
    assert fragment in str(info.value)


def test_env_error_names_the_environment() -> None:
    with pytest.raises(ConfigError, match=r"environment \(EDGESERVE_\*\): shm.allow_client_shm"):
        load_settings(environ={"EDGESERVE_SHM_ALLOW_CLIENT_SHM": "maybe"})


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="settings file not found"):
        load_settings(Path("/nonexistent/edgeserve.toml"), environ={})
