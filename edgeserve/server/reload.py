"""SIGHUP in the server: re-read the settings and apply what can change without dropping a request.

The supervisor decides (settings_tools.LIVE_SETTINGS) whether a change needs a restart; the server
applies the live part here, whether it runs under the supervisor or alone (`edgeserve serve`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from edgeserve.config import ConfigError, Settings
from edgeserve.logs import set_level
from edgeserve.protocol.errors import InferenceError
from edgeserve.settings_tools import changed_fields, is_live

if TYPE_CHECKING:
    from edgeserve.server.app import Server

log = logging.getLogger("edgeserve.server")


def _startup_models(settings: Settings, everything: Callable[[], set[str]]) -> set[str]:
    server = settings.server
    if server.model_control_mode == "none" or "*" in server.load_models:
        return everything()
    return set(server.load_models)


async def reload_settings(server: Server, load: Callable[[], Settings]) -> list[str]:
    """Apply the live changes in place (every part holds the same Settings object); returns them."""
    try:
        new = load()
    except ConfigError as exc:
        log.error("reload refused, keeping the running settings: %s", exc)
        return []
    current = server.settings
    changed = changed_fields(current, new)
    later = [name for name in changed if not is_live(name)]
    if later:
        log.warning("reload: %s need a restart to take effect (the supervisor restarts for them)",
                    ", ".join(later))  # fmt: skip
    applied = [name for name in changed if is_live(name)]

    def everything() -> set[str]:
        return set(server.repository.folders())

    old_models = _startup_models(current, everything)
    current.logging.level = new.logging.level
    set_level(new.logging.level)
    current.server.exit_timeout_s = new.server.exit_timeout_s
    current.supervisor = new.supervisor
    shm = server.shm
    current.shm.allow_client_shm = shm.allow_client_shm = new.shm.allow_client_shm
    current.shm.key_prefixes = list(new.shm.key_prefixes)
    shm.key_prefixes = [p.lstrip("/") for p in new.shm.key_prefixes]
    current.shm.max_regions = shm.max_regions = new.shm.max_regions
    current.shm.registration = shm.registration = new.shm.registration
    current.zmq.max_inflight_per_client = new.zmq.max_inflight_per_client
    current.zmq.inline_max_us = new.zmq.inline_max_us
    current.http.inline_max_us = new.http.inline_max_us
    current.grpc.inline_max_us = new.grpc.inline_max_us
    for frontend in server.frontends:
        apply = getattr(frontend, "apply_limits", None)
        if apply is not None:
            apply(current)
    current.server.load_models = list(new.server.load_models)
    await _apply_model_list(server, old_models, _startup_models(current, everything))
    if applied:
        log.info("reload: applied live: %s", ", ".join(applied))
    else:
        log.info("reload: nothing to apply live")
    return applied


async def _apply_model_list(server: Server, old: set[str], new: set[str]) -> None:
    """Load what the list gained (and new folders under "*"), unload what it lost."""
    if server.settings.server.model_control_mode == "none" and old == new:
        return
    serving = {e["name"] for e in server.repository.index() if e.get("state") in ("READY", "LOADING")}
    on_demand = server.repository.budget.residency.on_demand  # loaded by their next request instead
    for name in sorted(n for n in new - serving if not on_demand(n)):
        try:
            await server.repository.load(name)
            log.info("reload: loaded %s", name)
        except InferenceError as exc:
            log.error("reload: cannot load %s: %s", name, exc.message)
    for name in sorted((old - new) & serving):
        try:
            await server.repository.unload(name)
            log.info("reload: unloaded %s", name)
        except InferenceError as exc:
            log.error("reload: cannot unload %s: %s", name, exc.message)
