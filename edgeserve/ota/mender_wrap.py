"""`edgeserve bundle mender-wrap`: a signed `.esb` wrapped, unchanged, into a Mender artifact for the
`edgeserve-bundle` Update Module, with `mender-artifact write module-image`. The artifact's one payload file
is the bundle itself, so `mender-artifact` alone makes the same artifact; this command adds the provides
(and optional depends) a Mender server groups and gates deployments by:

    edgeserve-bundle.<name>.version           the bundle's version
    edgeserve-bundle.<name>.security_version  its security_version (0 for bundles without one)

and clears `edgeserve-bundle.<name>.*` on install, so a device's provides always describe what it serves.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODULE_TYPE = "edgeserve-bundle"


@dataclass
class WrapRequest:
    bundle: Path
    device_types: list[str]
    out: Path | None = None
    artifact_name: str | None = None
    signing_key: Path | None = None  # Mender's own artifact signature (RSA/ECDSA), besides the bundle's
    trust: Path | None = None  # verify the bundle against these keys before wrapping
    depends_version: int | None = None
    depends_security_version: int | None = None
    tool: str = "mender-artifact"
    extra: list[str] = field(default_factory=list)


def manifest_of(request: WrapRequest) -> dict[str, Any]:
    """The bundle's manifest: verified with `trust`, else read (the device verifies it in any case)."""
    from edgeserve.ota.archive import read_header
    from edgeserve.ota.build import verify_bundle
    from edgeserve.ota.manifest import parse_manifest

    if request.trust is not None:
        return verify_bundle(request.bundle, request.trust)[0].to_dict()
    return parse_manifest(read_header(request.bundle)[0]).to_dict()


def wrap_command(request: WrapRequest, manifest: dict[str, Any]) -> list[str]:
    name, version = str(manifest["name"]), int(manifest["version"])
    security = manifest.get("security_version", 0)
    out = request.out or request.bundle.with_name(f"{name}-v{version}.mender")
    command = [
        request.tool,
        "write",
        "module-image",
        "--type",
        MODULE_TYPE,
        "--file",
        str(request.bundle),
        "--artifact-name",
        request.artifact_name or f"{name}-v{version}",
        "--output-path",
        str(out),
    ]
    # provides edgeserve-bundle.<name>.version, and clears edgeserve-bundle.<name>.* first
    command += ["--software-filesystem", MODULE_TYPE, "--software-name", name, "--software-version",
                str(version), "--provides", f"{MODULE_TYPE}.{name}.security_version:{security}"]  # fmt: skip
    for device_type in request.device_types:
        command += ["--device-type", device_type]
    if request.depends_version is not None:
        command += ["--depends", f"{MODULE_TYPE}.{name}.version:{request.depends_version}"]
    if request.depends_security_version is not None:
        command += ["--depends", f"{MODULE_TYPE}.{name}.security_version:{request.depends_security_version}"]
    if request.signing_key is not None:
        command += ["--key", str(request.signing_key)]
    return command + request.extra


def add_command(actions: Any) -> None:
    wrap = actions.add_parser(
        "mender-wrap", help="wrap a bundle into a Mender artifact for the edgeserve-bundle Update Module"
    )
    wrap.add_argument("bundle", type=Path)
    wrap.add_argument("--device-type", "-t", action="append", required=True, dest="device_types",
                      help="Mender device type the artifact is for (repeatable)")  # fmt: skip
    wrap.add_argument("--out", "-o", type=Path, help="the .mender file (default: <name>-v<version>.mender)")
    wrap.add_argument("--artifact-name", "-n", help="default: <bundle name>-v<version>")
    wrap.add_argument(
        "--key",
        "-k",
        type=Path,
        dest="signing_key",
        help="Mender artifact signing key (devices check it with ArtifactVerifyKey)",
    )
    wrap.add_argument("--trust", type=Path, help="verify the bundle against this folder of *.pub keys first")
    wrap.add_argument(
        "--depends-version",
        type=int,
        help="install only over this version of the same bundle (a Mender depends)",
    )
    wrap.add_argument("--depends-security-version", type=int, help="install only over this security_version")
    wrap.add_argument("--mender-artifact", default="mender-artifact", dest="tool", help="the tool to run")
    wrap.set_defaults(func=_wrap)


def _wrap(args: argparse.Namespace) -> int:
    from edgeserve.ota.errors import BundleRefused

    request = WrapRequest(args.bundle, args.device_types, args.out, args.artifact_name, args.signing_key,
                          args.trust, args.depends_version, args.depends_security_version,
                          args.tool)  # fmt: skip
    try:
        manifest = manifest_of(request)
    except (BundleRefused, OSError) as exc:
        print(f"edgeserve: {request.bundle}: refused: {exc}", file=sys.stderr)
        return 1
    command = wrap_command(request, manifest)
    if shutil.which(request.tool) is None:
        print(f"edgeserve: {request.tool} not found (apt-get install mender-artifact)", file=sys.stderr)
        return 1
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        print(f"edgeserve: mender-artifact failed: {result.stderr.strip() or result.stdout.strip()}",
              file=sys.stderr)  # fmt: skip
        return 1
    out = command[command.index("--output-path") + 1]
    print(f"{out}: {manifest['name']} v{manifest['version']} (security_version "
          f"{manifest.get('security_version', 0)}) for {', '.join(request.device_types)}")  # fmt: skip
    return 0
