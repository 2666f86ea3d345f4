"""The Mender inventory script's body (ota/mender/mender-inventory-edgeserve): the active bundle, its models
and the backends serving them, as `key=value` lines (a repeated key is a list in the Mender UI). Read-only:
the store, the active bundle's manifest and the runtime plan the supervisor writes in the state folder."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from edgeserve import __version__


def _clean(value: object) -> str:
    """One line, no '=' confusion in keys; Mender reads everything after the first '=' as the value."""
    return " ".join(str(value).split())


def inventory(state_dir: Path) -> list[str]:
    from edgeserve.ota.store import Store

    store = Store(state_dir)
    status = store.status()
    lines = [f"edgeserve_version={__version__}", f"edgeserve_install_state={status['state']}"]
    active = store.active()
    if active is None:
        lines.append("edgeserve_bundle=none")
    else:
        lines += [f"edgeserve_bundle={active.name}", f"edgeserve_bundle_version={active.version}"]
        if status["previous_version"] is not None:
            lines.append(f"edgeserve_bundle_previous_version={status['previous_version']}")
        manifest = _json(active.path / "manifest.json")
        lines.append(f"edgeserve_security_version={manifest.get('security_version', 0)}")
        models = _section(manifest, "models")
        for model, versions in sorted(models.items()):
            shown = ",".join(str(v) for v in versions) if isinstance(versions, list) else versions
            lines.append(f"edgeserve_model={_clean(model)}:{_clean(shown)}")
    plan = _json(state_dir / "runtime-plan.json")
    served = _section(plan, "models")
    for model, info in sorted(served.items()):
        if isinstance(info, dict) and info.get("backend"):
            lines.append(f"edgeserve_backend={_clean(model)}:{_clean(info['backend'])}")
    runtimes = _section(plan, "runtimes")
    for name, info in sorted(runtimes.items()):
        if isinstance(info, dict) and info.get("available"):
            lines.append(f"edgeserve_runtime={_clean(name)}:{_clean(info.get('version') or '?')}")
    return lines


def _section(data: dict[str, Any], key: str) -> dict[str, Any]:
    value = data.get(key)
    return value if isinstance(value, dict) else {}


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def main() -> int:
    from edgeserve.ota.mender_module import ModuleError, load_module_config

    try:
        state_dir = load_module_config().state_dir
    except ModuleError as exc:
        print(f"edgeserve inventory: {exc}", file=sys.stderr)
        return 1
    print("\n".join(inventory(state_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
