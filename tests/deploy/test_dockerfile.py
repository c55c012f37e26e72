"""Dockerfile, checked statically (no Docker engine here): stages, user, entrypoint, contents.

A small parser reads the instructions (continuations joined, comments dropped) and splits
them into stages; the checks are what a reviewer would look for in the image definition.
The build itself, and the image run as the chart runs it, is tests/deploy/test_image.py.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import subprocess
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
COMPILERS = ("build-essential", "gcc", "g++", "clang", "make", "python3-dev", "libc6-dev")


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [rest for kw, rest in self.instructions if kw == keyword]

    def env(self) -> dict[str, str]:
        pairs = [p for rest in self.all("ENV") for p in shlex.split(rest)]
        return dict(p.split("=", 1) for p in pairs)


def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction, with backslash continuations joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, rest = (pending + line).partition(" ")
        out.append((keyword.upper(), " ".join(rest.split())))
        pending = ""
    assert not pending, "dangling line continuation"
    return out


def parse(text: str) -> list[Stage]:
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for keyword, rest in instructions(text):
        if keyword == "ARG" and not stages:
            name, _, default = rest.partition("=")
            args[name] = default
        elif keyword == "FROM":
            words = rest.split()
            base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], words[0])
            name = words[2] if len(words) > 2 and words[1].upper() == "AS" else ""
            stages.append(Stage(base, name))
        else:
            assert stages, f"{keyword} before the first FROM"
            stages[-1].instructions.append((keyword, rest))
    return stages


@pytest.fixture(scope="module")
def stages() -> list[Stage]:
    return parse(DOCKERFILE.read_text())


def test_multi_stage_on_slim_python_311_pinned_by_digest(stages: list[Stage]) -> None:
    assert len(stages) >= 2
    for stage in stages:
        # A tag moves; the digest fixes the bytes (the tag stays for readers).
        assert re.fullmatch(r"python:3\.11-slim(-\w+)?@sha256:[0-9a-f]{64}", stage.base), stage.base


def test_final_stage_runs_as_the_charts_non_root_user(stages: list[Stage]) -> None:
    users = stages[-1].all("USER")
    assert users, "the final stage sets no USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0, "numeric non-root UID (runAsNonRoot can verify it)"
    assert not gid or int(gid) != 0
    values = (ROOT / "charts" / "async-processor" / "values.yaml").read_text()
    assert f"runAsUser: {uid}" in values


def test_entrypoint_is_the_console_script(stages: list[Stage]) -> None:
    assert json.loads(stages[-1].all("ENTRYPOINT")[-1]) == ["async-processor"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "async-processor" in scripts
    assert json.loads(stages[-1].all("CMD")[-1]) == ["run"]


def test_no_compiler_or_package_install_in_the_final_stage(stages: list[Stage]) -> None:
    final = stages[-1]
    for command in final.all("RUN"):
        assert "pip install" not in command, command
        assert "apt-get install" not in command, command
        assert not [c for c in COMPILERS if re.search(rf"(^|\s){re.escape(c)}(\s|$)", command)]
    copies = final.all("COPY")
    earlier = {s.name for s in stages[:-1]}
    assert copies and all(c.startswith("--from=") for c in copies), copies
    assert {c.split()[0].removeprefix("--from=") for c in copies} <= earlier


def test_nothing_is_written_at_run_time(stages: list[Stage]) -> None:
    """Bytecode is compiled in the build stage and never written in the read-only image."""
    assert stages[-1].env()["PYTHONDONTWRITEBYTECODE"] == "1"
    assert stages[-1].env()["HOME"] == "/tmp"  # the chart's emptyDir
    assert any("compileall" in run for run in stages[0].all("RUN"))


def test_install_target_expands_for_any_extras(stages: list[Stage]) -> None:
    """The pip target is ``.[extras]``, or plain ``.`` when built with ``EXTRAS=``."""
    build = stages[0]
    default = next(r for r in build.all("ARG") if r.startswith("EXTRAS="))
    install = next(r for r in build.all("RUN") if "pip install --no-compile --no-deps" in r)
    target = shlex.split(install.split("pip install", 1)[1].split("&&")[0])[-1]
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert set(default.removeprefix("EXTRAS=").split(",")) <= set(optional["optional-dependencies"])

    def expand(extras: str) -> str:
        done = subprocess.run(
            ["sh", "-c", f'printf %s "{target}"'],
            env={"EXTRAS": extras},
            capture_output=True,
            text=True,
            check=True,
        )
        return done.stdout

    assert expand("") == "."
    assert expand("otel") == ".[otel]"


def test_dependencies_install_in_a_layer_before_the_source(stages: list[Stage]) -> None:
    """A source change must not invalidate the layer that installs grpcio & co."""
    build = stages[0].instructions
    deps = next(i for i, (kw, rest) in enumerate(build) if kw == "RUN" and "-r " in rest)
    source = next(i for i, (kw, r) in enumerate(build) if kw == "COPY" and "async_processor" in r)
    assert deps < source
    copied_before = [rest for kw, rest in build[:deps] if kw == "COPY"]
    assert copied_before == ["requirements-image.txt ./"], copied_before
    assert "--require-hashes" in build[deps][1] and "-r requirements-image.txt" in build[deps][1]
    package = next(rest for kw, rest in build[source:] if kw == "RUN" and "pip install" in rest)
    assert "--no-deps" in package  # the package layer installs nothing else


def locked() -> dict[str, tuple[str, list[str]]]:
    """requirements-image.txt: name -> (version, hashes)."""
    text = (ROOT / "requirements-image.txt").read_text().replace("\\\n", " ")
    pins = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, version = re.match(r"([\w.-]+)==([^\s;]+)", line).groups()
            pins[name] = (version, re.findall(r"--hash=sha256:([0-9a-f]{64})", line))
    return pins


def test_image_lock_pins_the_runtime_and_otel_at_constraints_versions() -> None:
    """Stale after a dependency change until `make image-lock` runs again."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    pins = {requirement_name(n): v for n, v in (x.split("==") for x in lines if "==" in x)}
    lock = locked()
    runtime = project["dependencies"] + project["optional-dependencies"]["otel"]
    assert {requirement_name(d) for d in runtime} <= lock.keys()
    for name, (version, hashes) in lock.items():
        assert hashes, f"{name} has no hash"
        assert pins.get(name, version) == version, f"{name}: {version} vs constraints {pins[name]}"
    assert set(lock) - set(pins) == {"async-timeout"}  # redis-py's, below Python 3.11.3


def test_image_lock_holds_no_dev_bench_or_demo_package() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    dev_only = {requirement_name(d) for e in ("dev", "bench", "demo") for d in extras[e]}
    assert "pytest" in dev_only and not dev_only & locked().keys()


def requirement_name(spec: str) -> str:
    return re.split(r"[\[<>=!~; ]", spec, maxsplit=1)[0].lower().replace("_", "-")


def test_constraints_pin_every_declared_dependency() -> None:
    """constraints.txt (Dockerfile, CI, make venv) pins each package pyproject names."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    pins = dict(line.split("==") for line in lines if line and not line.startswith("#"))
    pinned = {requirement_name(name) for name in pins}
    extras = project["optional-dependencies"].values()
    declared = project["dependencies"] + [d for extra in extras for d in extra]
    names = {requirement_name(d) for d in declared} - {project["name"]}
    assert names <= pinned, names - pinned
    assert all(re.fullmatch(r"[\w.+!]+", v) for v in pins.values())
    assert "-c constraints.txt" in (ROOT / "Makefile").read_text()


def test_every_lua_script_ships_as_package_data() -> None:
    """A script left out of package-data loads from a checkout but not from the image."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    globs = setuptools["package-data"]["async_processor"]
    package = ROOT / "async_processor"
    scripts = [p.relative_to(package).as_posix() for p in package.rglob("*.lua")]
    assert "redis/lua/leased_rate_take.lua" in scripts  # a gate's, beside the transports'
    assert "redis/lua/replay_dead_letter.lua" in scripts
    for script in scripts:
        assert any(fnmatch.fnmatch(script, g) for g in globs), script


def test_fakeredis_is_demo_only() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("fakeredis")]
    assert any(d.startswith("fakeredis[lua]") for d in project["optional-dependencies"]["demo"])
    assert "demo" in re.search(r"EXTRAS := (.*)", (ROOT / "Makefile").read_text()).group(1)


def test_exposed_ports_match_the_daemon_defaults(stages: list[Stage]) -> None:
    from async_processor.config import RuntimeConfig

    defaults = RuntimeConfig()
    exposed = {int(p) for rest in stages[-1].all("EXPOSE") for p in rest.split()}
    assert exposed == {defaults.health_port, defaults.metrics_port}


def ignored(path: str, patterns: list[str]) -> bool:
    """.dockerignore semantics for plain patterns: last match wins, ``!`` re-includes.

    Enough for our file (``*`` then re-includes); not a full Go filepath.Match port.
    """
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.removeprefix("!").rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatchcase(p, pattern) for p in prefixes):
            result = not negate
    return result


def test_build_context_holds_what_the_build_copies(stages: list[Stage]) -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [p.strip() for p in lines if p.strip() and not p.startswith("#")]
    sources = [
        src
        for copy in stages[0].all("COPY")
        if not copy.startswith("--from=")
        for src in copy.split()[:-1]
    ]
    assert sources
    for src in sources:
        assert (ROOT / src).exists(), src
        assert not ignored(src, patterns), f"{src} is excluded by .dockerignore"
    assert not ignored("async_processor/redis/lua/claim.lua", patterns)
    for private in (".venv/bin/python", ".git/config", "tests/conftest.py"):
        assert ignored(private, patterns), private


def test_the_parser_sees_a_root_user_and_a_compiler() -> None:
    """The checks above can fail: a bad Dockerfile trips them."""
    bad = parse(
        "ARG B=python:3.11-slim\nFROM ${B} AS build\nRUN true\n"
        "FROM ${B}\nRUN apt-get install -y \\\n  build-essential\nUSER root\n"
    )
    assert bad[1].base == "python:3.11-slim"
    assert bad[1].all("USER") == ["root"]
    with pytest.raises(AssertionError):
        test_no_compiler_or_package_install_in_the_final_stage(bad)
    with pytest.raises((AssertionError, ValueError)):
        test_final_stage_runs_as_the_charts_non_root_user(bad)


def test_ci_builds_the_image_before_the_suite_that_runs_it() -> None:
    """.ci/run: `make image`, then `make test` (whose tests/ hold test_image.py)."""
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    steps = [line for line in lines if "make " in line and not line.startswith("#")]
    assert [s.split("make ", 1)[1] for s in steps] == ["image", "test"]
    assert (ROOT / "tests" / "deploy" / "test_image.py").exists()
    assert re.search(r"^image-test: .*\bimage\b", (ROOT / "Makefile").read_text(), re.M)
