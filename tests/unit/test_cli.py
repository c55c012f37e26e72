"""The CLI: subcommand dispatch, check-config output, one-line config errors (exit 2)."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from async_processor.cli import main as cli
from async_processor.config import AppConfig
from async_processor.errors import ConfigError

QUEUE = {"queue_name": "q1", "igw_base_url": "http://gw:8000"}


@pytest.fixture
def transport_file(tmp_path: Path) -> str:
    path = tmp_path / "transport.json"
    path.write_text(json.dumps({"url": "redis://app:hunter2@redis:6379/0", "queues": [QUEUE]}))
    return str(path)


@pytest.fixture
def fake_processor(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """A stand-in ``async_processor.pipeline.processor`` recording what it was given."""
    calls: dict[str, Any] = {}
    module = types.ModuleType("async_processor.pipeline.processor")

    async def run(config: AppConfig) -> None:
        calls["run"] = config
        calls["loop"] = type(asyncio.get_running_loop()).__module__
        calls["gc"] = gc.get_threshold()[0], gc.get_freeze_count()
        if calls.get("fail"):
            raise ExceptionGroup("task group", [ConfigError("pool gate: unknown gate type 'x'")])

    def validate_plugins(config: AppConfig) -> None:
        calls["validated"] = config
        if calls.get("fail"):
            raise ConfigError("unknown gate type 'prometheus-saturaton' (known: constant)")

    module.run = run  # type: ignore[attr-defined]
    module.validate_plugins = validate_plugins  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "async_processor.pipeline.daemon", module)
    logging_calls: list[tuple[str, str]] = []
    monkeypatch.setattr(cli, "configure_logging", lambda lvl, fmt: logging_calls.append((lvl, fmt)))
    return types.SimpleNamespace(calls=calls, logging=logging_calls)


def test_flags_only_means_run(transport_file: str, fake_processor: types.SimpleNamespace) -> None:
    argv = ["--transport", "redis-sortedset", "--transport-config-file", transport_file]
    env = {"ASYNC_PROCESSOR_LOG_FORMAT": "json"}
    assert cli.main(argv, env) == 0
    config = fake_processor.calls["run"]
    assert isinstance(config, AppConfig) and config.transport == "redis-sortedset"
    assert fake_processor.logging == [("info", "json")]
    assert cli.main(["run", *argv, "--concurrency", "3", "--log-level", "debug"], {}) == 0
    assert fake_processor.calls["run"].runtime.concurrency == 3
    assert fake_processor.logging[-1] == ("debug", "auto")


def test_the_daemon_runs_on_uvloop(
    transport_file: str, fake_processor: types.SimpleNamespace
) -> None:
    # Chosen on paired measurements (cli.run): asyncio's own loop moved fewer messages.
    argv = ["--transport", "redis-sortedset", "--transport-config-file", transport_file]
    assert cli.main(argv, {}) == 0
    assert fake_processor.calls["loop"].startswith("uvloop")


@pytest.fixture
def gc_restored() -> Iterator[None]:
    """The collector's settings as they were: the daemon's tuning is for its process."""
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


@pytest.mark.usefixtures("gc_restored")
def test_the_daemon_runs_with_startup_frozen_and_a_large_young_generation(
    transport_file: str, fake_processor: types.SimpleNamespace
) -> None:
    # Measured in cli.run: at 700 the collector walked every in-flight message's objects
    # many times a second (bench.littles_law).
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)
    argv = ["--transport", "redis-sortedset", "--transport-config-file", transport_file]
    assert cli.main(argv, {}) == 0
    young, frozen = fake_processor.calls["gc"]
    assert young == cli.GC_YOUNG_THRESHOLD > 700
    assert frozen > 10_000  # the modules and config loaded at start, never garbage


def test_config_error_from_the_processor_group_exits_2(
    transport_file: str, fake_processor: types.SimpleNamespace, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_processor.calls["fail"] = True
    code = cli.main(["run", "--transport-config-file", transport_file], {})
    assert code == 2
    err = capsys.readouterr().err
    assert err == "async-processor: config error: pool gate: unknown gate type 'x'\n"


def test_check_config_masks_secrets(
    tmp_path: Path,
    transport_file: str,
    fake_processor: types.SimpleNamespace,
    capsys: pytest.CaptureFixture[str],
) -> None:
    token = tmp_path / "token"
    token.write_text("tok-XYZ-secret")
    argv = ["check-config", "--transport", "redis-sortedset", "--transport-config-file",
            transport_file, "--metrics-bearer-token-file", str(token)]  # fmt: skip
    assert cli.main(argv, {}) == 0
    out = capsys.readouterr().out
    printed = json.loads(out)
    assert printed["transport_config"]["url"] == "redis://app:***@redis:6379/0"
    assert printed["runtime"]["metrics_bearer_token"] == "***"
    assert "hunter2" not in out and "tok-XYZ-secret" not in out
    assert printed["transport_config"]["queues"][0]["queue_name"] == "q1"
    assert "run" not in fake_processor.calls
    assert fake_processor.calls["validated"].transport == "redis-sortedset"


def test_check_config_masks_query_passwords_and_secret_static_headers(
    tmp_path: Path, fake_processor: types.SimpleNamespace, capsys: pytest.CaptureFixture[str]
) -> None:
    transport = {"url": "redis://redis:6379/0?password=hunter2", "queues": [QUEUE]}
    headers = {"x-access-key": {"value": "ak-1"}, "Authorization": {"value": "Bearer b-1"},
               "x-tenant": {"value": "t1"}}  # fmt: skip
    transforms = {"requestTransforms": [
        {"name": "h", "type": "set_headers", "parameters": {"headers": headers}}]}  # fmt: skip
    (tmp_path / "t.json").write_text(json.dumps(transport))
    (tmp_path / "x.json").write_text(json.dumps(transforms))
    argv = ["check-config", "--transport-config-file", str(tmp_path / "t.json"),
            "--transform-config-file", str(tmp_path / "x.json")]  # fmt: skip
    assert cli.main(argv, {}) == 0
    out = capsys.readouterr().out
    for secret in ("hunter2", "ak-1", "b-1"):
        assert secret not in out
    printed = json.loads(out)
    assert printed["transport_config"]["url"] == "redis://redis:6379/0?password=***"
    shown = printed["transforms"]["requestTransforms"][0]["parameters"]["headers"]
    assert shown == {"x-access-key": "***", "Authorization": "***", "x-tenant": {"value": "t1"}}


@pytest.mark.parametrize(
    ("headers", "shown"),
    [
        ({"x-access-key": {"value": "ak-1\n"}}, "headers.x-access-key: *** is not a legal"),
        ({"Authorization": {"value": "Bearer b-1\r"}}, "headers.Authorization: *** is not"),
    ],
)
def test_config_errors_do_not_echo_secret_values(
    tmp_path: Path, headers: dict[str, Any], shown: str, capsys: pytest.CaptureFixture[str]
) -> None:
    transforms = {"requestTransforms": [
        {"name": "h", "type": "set_headers", "parameters": {"headers": headers}}]}  # fmt: skip
    (tmp_path / "x.json").write_text(json.dumps(transforms))
    argv = ["check-config", "--transport-config",
            json.dumps({"url": "redis://h:1/0?password=hunter2", "queues": [QUEUE]}),
            "--transform-config-file", str(tmp_path / "x.json")]  # fmt: skip
    assert cli.main(argv, {}) == 2
    err = capsys.readouterr().err
    assert shown in err
    for secret in ("ak-1", "b-1", "hunter2"):
        assert secret not in err


def test_check_config_reports_plugin_errors(
    transport_file: str, fake_processor: types.SimpleNamespace, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_processor.calls["fail"] = True
    assert cli.main(["check-config", "--transport-config-file", transport_file], {}) == 2
    assert "prometheus-saturaton" in capsys.readouterr().err


def test_check_config_without_a_processor_module(
    transport_file: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "_optional", lambda name: None)
    assert cli.main(["check-config", "--transport-config-file", transport_file], {}) == 0
    assert json.loads(capsys.readouterr().out)["transport"] == "redis-pubsub"


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["check-config"],
        ["run", "--bogus"],
        ["--transport", "kafka", "--transport-config", "{}"],
        ["check-config", "--transport-config", "{not json"],
        ["check-config", "--transport-config", '{"url": "redis://h:1", "queues": []}'],
        ["check-config", "--transport-config", '{"url": "redis://h:1"}', "--concurrency", "x"],
        ["check-config", "--transport-config-file", "/nonexistent/t.json"],
        ["check-config", "--transport-config", "{}", "--tls-key", "/etc/hostname"],
    ],
)
def test_every_config_error_is_one_line_and_exit_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv, {}) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("async-processor: config error: ")
    assert "Traceback" not in captured.err


def test_env_flag_errors_name_the_variable(capsys: pytest.CaptureFixture[str]) -> None:
    env = {"ASYNC_PROCESSOR_HEALTH_PORT": "-1", "REDIS_URL": "redis://h:1"}
    assert cli.main(["check-config", "--transport-config", json.dumps({"queues": [QUEUE]})], env)
    assert "ASYNC_PROCESSOR_HEALTH_PORT='-1'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "module", "expected"),
    [
        (["sim", "--port", "1"], "sim.app", ["--port", "1"]),
        (["demo"], "demo.run", []),
        (["submit", "--queue", "q"], "client.commands", ["submit", "--queue", "q"]),
        (["results", "-n", "3"], "client.commands", ["results", "-n", "3"]),
        (["cancel", "id-1"], "client.commands", ["cancel", "id-1"]),
    ],
)
def test_delegated_subcommands_get_the_rest_of_argv(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], module: str, expected: list[str]
) -> None:
    seen: list[list[str]] = []

    def fake_main(args: list[str]) -> int:
        seen.append(args)
        return 7

    fake = types.ModuleType(f"async_processor.{module}")
    fake.main = fake_main  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, f"async_processor.{module}", fake)
    assert cli.main(argv, {}) == 7
    assert seen == [expected]


def test_missing_delegate_module_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "_optional", lambda name: None)
    with pytest.raises(SystemExit, match=r"async_processor\.sim\.app is not available"):
        cli.main(["sim"], {})


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"], {}) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in cli.COMMANDS), out  # one page lists every command
    with pytest.raises(SystemExit) as exited:
        cli.main(["run", "--help"], {})
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "--request-timeout DURATION" in out and "ASYNC_PROCESSOR_REQUEST_TIMEOUT" in out
    assert "--metrics-port PORT" in out and "--transport-config-file FILE" in out
    assert "--gate-wait-timeout DURATION" in out and "--concurrency N" in out
    assert "default: 5m" in out and "default: 64" in out
    assert "(default: ;" not in out and "(default: )" not in out
    # Each default once: no option help carries two "default" notes.
    assert not [line for line in out.split("\n  --") if line.count("(default") > 1]


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"], {}) == 0
    assert capsys.readouterr().out.strip() == f"async-processor {cli._version()}"


def test_unknown_command_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["stauts"], {}) == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'stauts'" in err and "check-config" in err
    assert "unrecognized arguments" not in err


@pytest.mark.parametrize("command", ["sim", "demo", "submit", "results", "cancel"])
def test_every_delegated_flag_has_help_and_a_typed_metavar(command: str) -> None:
    from async_processor.client import commands as producer_cli
    from async_processor.demo import run as demo
    from async_processor.sim import app as simulator

    parser = {"sim": simulator._parser, "demo": demo._parser}.get(
        command, lambda: producer_cli._parser(command)
    )()
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"{command} {action.option_strings} has no help"
            typed = action.nargs == 0 or action.metavar or action.choices
            assert typed, f"{command} {action.option_strings}"


def test_sim_and_demo_take_go_durations_and_plain_seconds() -> None:
    from async_processor.cli import args as cliargs
    from async_processor.demo import run as demo
    from async_processor.sim import app as simulator

    for text in ("50ms", "0.05"):
        sim = cliargs.parse(simulator._parser(), ["--latency", text, "--retry-after", "2s"], {})
        assert (sim.latency, sim.retry_after) == (0.05, 2.0)
    defaults = cliargs.parse(demo._parser(), [], {})
    assert (defaults.latency, defaults.timeout) == (0.05, 120.0)
    assert cliargs.parse(demo._parser(), ["--timeout", "1m30s"], {}).timeout == 90.0
    for bad in ("soon", "-5", "inf", "nan"):
        with pytest.raises(SystemExit):
            cliargs.parse(demo._parser(), ["--timeout", bad], {})


def test_a_kubernetes_service_link_is_not_a_flag_value() -> None:
    """A Service named async-processor injects ASYNC_PROCESSOR_PORT=tcp://... everywhere."""
    from async_processor.cli import args as cliargs
    from async_processor.sim import app as simulator

    env = {"ASYNC_PROCESSOR_PORT": "tcp://10.0.0.7:9090", "ASYNC_PROCESSOR_LATENCY": "2s"}
    args = cliargs.parse(simulator._parser(), [], env)
    assert (args.port, args.latency) == (8000, 2.0)


def test_delegated_flags_read_async_processor_env_and_flags_win() -> None:
    from async_processor.cli import args as cliargs
    from async_processor.demo import run as demo

    env = {"ASYNC_PROCESSOR_COUNT": "7", "ASYNC_PROCESSOR_TIMEOUT": "5s"}
    env["ASYNC_PROCESSOR_WORKERS"] = ""  # empty means unset, as for run
    args = cliargs.parse(demo._parser(), ["--count", "9"], env)
    assert (args.count, args.timeout, args.workers) == (9, 5.0, 64)


def test_python_dash_m_entry_point() -> None:
    env = {"PATH": os.environ.get("PATH", ""), "ASYNC_PROCESSOR_CONCURRENCY": "zero"}
    done = subprocess.run(
        [sys.executable, "-m", "async_processor", "--transport-config", "{}"],
        capture_output=True, text=True, env=env, timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.startswith("async-processor: config error: ")
    assert len(done.stderr.splitlines()) == 1


def test_gate_config_error_names_the_queue_and_the_misspelled_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "t.json"
    config.write_text(json.dumps({"url": "redis://127.0.0.1:1", "queues": [{
        "queue_name": "q1", "igw_base_url": "http://gw", "gate_type": "redis-quota",
        "gate_params": {"adress": "h:1", "limit": 3}}]}))  # fmt: skip
    code = cli.main(["check-config", "--transport", "redis-sortedset",
                 "--transport-config-file", str(config)], env={})  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err == (
        "async-processor: config error: queue 'q1': gate 'redis-quota': adress: "
        "Extra inputs are not permitted (did you mean 'address'?)"
    )
