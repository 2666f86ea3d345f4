"""Triton's `logging` extension mapped onto Python logging.

Used only while `DataPlane` has no `log_settings(updates) -> settings` method of its own (the gRPC and
HTTP frontends must share one implementation; this one is written to be moved there unchanged).

Triton's switches are independent; Python has one level, so the most verbose enabled switch wins:
log_verbose_level > 0 -> DEBUG, else log_info -> INFO, else log_warning -> WARNING, else ERROR.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from edgeserve.protocol.errors import InferenceError, Status, invalid_arg

SettingValue = bool | int | str

_TYPES: dict[str, type] = {
    "log_file": str,
    "log_info": bool,
    "log_warning": bool,
    "log_error": bool,
    "log_verbose_level": int,
    "log_format": str,
}


def current() -> dict[str, SettingValue]:
    level = logging.getLogger().getEffectiveLevel()
    return {
        "log_file": "",
        "log_info": level <= logging.INFO,
        "log_warning": level <= logging.WARNING,
        "log_error": level <= logging.ERROR,
        "log_verbose_level": 1 if level <= logging.DEBUG else 0,
        "log_format": "default",
    }


def log_settings(updates: Mapping[str, SettingValue] | None = None) -> dict[str, SettingValue]:
    """Apply `updates` (all or nothing) and return the settings now in force."""
    settings = current()
    for key, value in (updates or {}).items():
        want = _TYPES.get(key)
        if want is None:
            raise invalid_arg(f"unknown log setting '{key}'; known: {', '.join(_TYPES)}")
        if type(value) is not want:  # bool is an int subclass: compare exactly
            raise invalid_arg(f"log setting '{key}' must be a {want.__name__}, got {value!r}")
        if key == "log_file" and value:
            raise InferenceError(
                Status.UNSUPPORTED, "log_file cannot be set: edgeserve logs to stderr (journald)"
            )
        if key == "log_format" and value != "default":
            raise InferenceError(
                Status.UNSUPPORTED, "log_format is fixed at run time; set [logging] format (text|json)"
            )
        if key == "log_verbose_level" and not 0 <= int(value) < 2**32:
            raise invalid_arg(f"log_verbose_level must be a uint32, got {value}")
        settings[key] = value
    if updates:
        if settings["log_verbose_level"]:
            level = logging.DEBUG
        elif settings["log_info"]:
            level = logging.INFO
        elif settings["log_warning"]:
            level = logging.WARNING
        else:
            level = logging.ERROR
        logging.getLogger().setLevel(level)
    return current()
