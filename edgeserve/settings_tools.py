"""What a settings change means (live or restart) and `edgeserve config check`'s effective-settings view.

Kept apart from config.py (loading and validation) and free of heavy imports: the supervisor uses it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from edgeserve.config import Settings, to_dict

# Fields the running server applies on SIGHUP without a restart ("section.*" = the whole section).
# Everything else (ports, endpoints, TLS, the repository folder, runtime choices) rebinds sockets or
# rebuilds models, so the supervisor restarts the server gracefully for it.
LIVE_SETTINGS = frozenset(
    {
        "logging.level",
        "server.load_models",
        "server.exit_timeout_s",
        "shm.allow_client_shm",
        "shm.key_prefixes",
        "shm.max_regions",
        "shm.registration",
        "zmq.max_inflight_per_client",
        "zmq.inline_max_us",
        "http.inline_max_us",
        "grpc.inline_max_us",
        "supervisor.*",
        "ota.*",
        "fleet.*",  # the supervisor reconnects its agent; the server has nothing to do with it
    }
)


def is_live(name: str) -> bool:
    return name in LIVE_SETTINGS or f"{name.split('.', 1)[0]}.*" in LIVE_SETTINGS


def changed_fields(old: Settings, new: Settings) -> list[str]:
    """ "section.key" of every value that differs between two settings."""
    before, after = to_dict(old), to_dict(new)
    return sorted(
        f"{section}.{key}"
        for section, values in after.items()
        for key, value in values.items()
        if before.get(section, {}).get(key) != value
    )


def restart_fields(old: Settings, new: Settings) -> list[str]:
    """The changed fields the server cannot apply live."""
    return [name for name in changed_fields(old, new) if not is_live(name)]


OVERLAY = Path("fleet") / "settings.toml"  # under the state folder: what `set_config` persisted


def load_layered(
    path: Path | None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[Settings, dict[str, str]]:
    """File, then the fleet overlay in the state folder, then environment, then flags."""
    from edgeserve.config import load_settings_with_sources

    settings, sources = load_settings_with_sources(path, environ, overrides)
    overlay = resolve_state_dir(settings, sources, environ)[0] / OVERLAY
    if not overlay.is_file():
        return settings, sources
    return load_settings_with_sources(path, environ, overrides, overlay=overlay)


def load_layered_with_overlay(
    path: Path | None, overrides: Mapping[str, Mapping[str, Any]] | None, overlay: Path
) -> tuple[Settings, dict[str, str]]:
    from edgeserve.config import load_settings_with_sources

    return load_settings_with_sources(path, None, overrides, overlay=overlay)


def toml_text(data: Mapping[str, Mapping[str, Any]]) -> str:
    """A settings file from {section: {key: value}} (the value types settings use)."""
    lines: list[str] = ["# Written by edgeserve for the fleet manager (set_config). Edit with care."]
    for section, values in data.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


def resolve_state_dir(
    settings: Settings, sources: Mapping[str, str], environ: Mapping[str, str] | None = None
) -> tuple[Path, str]:
    """The state folder and why: a configured one wins, then systemd's $STATE_DIRECTORY, then the
    default when it can be written, then the user's ~/.local/state (a developer's box, not root)."""
    env = os.environ if environ is None else environ
    configured = settings.server.state_dir
    if "server.state_dir" in sources:
        return configured, sources["server.state_dir"]
    from_systemd = env.get("STATE_DIRECTORY", "").split(":")[0]
    if from_systemd:
        return Path(from_systemd), "$STATE_DIRECTORY (systemd StateDirectory=)"
    if _writable(configured):
        return configured, "default"
    home = Path(env.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "edgeserve"
    return home, f"default {configured} is not writable by this user"


def _writable(path: Path) -> bool:
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            return False
        probe = probe.parent
    return probe.is_dir() and os.access(probe, os.W_OK | os.X_OK)


def _toml_value(value: Any) -> str:
    if value is None:
        return '""'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


# Secrets `config check` shows as "<set>" (its output ends up in tickets and chats); restricted-API
# groups keep their categories and header names, not the values.
SECRET_SETTINGS = frozenset({"http.token", "grpc.token", "fleet.password"})
SECRET_GROUPS = frozenset({"http.restricted_api", "grpc.restricted_protocol"})


def _masked(name: str, value: Any) -> Any:
    if name in SECRET_SETTINGS and value:
        return "<set>"
    if name in SECRET_GROUPS:
        return [group.partition("=")[0] + "=<set>" for group in value]
    return value


def render_effective(settings: Settings, sources: Mapping[str, str]) -> str:
    """The effective settings as TOML, each value annotated with where it came from (secrets masked)."""
    lines: list[str] = []
    for section, values in to_dict(settings).items():
        values = {key: _masked(f"{section}.{key}", value) for key, value in values.items()}
        lines.append(f"[{section}]")
        width = max(len(key) + 3 + len(_toml_value(v)) for key, v in values.items())
        for key, value in values.items():
            text = f"{key} = {_toml_value(value)}"
            origin = sources.get(f"{section}.{key}", "default")
            live = ", live on reload" if is_live(f"{section}.{key}") else ""
            lines.append(f"{text:<{width}}  # {origin}{live}")
        lines.append("")
    return "\n".join(lines)
