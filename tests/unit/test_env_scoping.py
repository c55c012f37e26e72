"""``ASYNC_PROCESSOR_*``: a command's own flags are scoped to it, every flag has a
variable, and a variable no flag reads is warned about instead of silently ignored.

``ASYNC_PROCESSOR_COUNT`` (meant for one command) changed ``results``, a misspelled
``ASYNC_PROCESSOR_CONCURENCY`` was ignored without a word, and ``status --json`` or
``dead-letters --limit`` had no variable at all.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from async_processor.cli.args import parse, subcommand_parser
from async_processor.cli.main import COMMANDS, main
from async_processor.config import load_config, parse_settings
from async_processor.config.environment import COMMANDS as ENV_COMMANDS
from tests.unit.test_config import sortedset_args


def results_parser() -> argparse.ArgumentParser:
    p = subcommand_parser("async-processor results", "test")
    p.add_argument("--count", type=int, default=0)
    p.add_argument("--transport-config-file", default="")
    return p


def test_the_environment_module_knows_every_command() -> None:
    assert set(ENV_COMMANDS) == set(COMMANDS)


def test_a_command_reads_its_scoped_variable_and_not_another_commands(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert parse(results_parser(), [], {"ASYNC_PROCESSOR_RESULTS_COUNT": "3"}).count == 3
    env = {"ASYNC_PROCESSOR_SUBMIT_COUNT": "3"}  # another command's: neither read nor warned
    assert parse(results_parser(), [], env).count == 0
    assert capsys.readouterr().err == ""


def test_the_unscoped_name_still_works_with_a_warning(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse(results_parser(), [], {"ASYNC_PROCESSOR_COUNT": "2"}).count == 2
    assert capsys.readouterr().err == (
        "async-processor results: warning: ASYNC_PROCESSOR_COUNT is read as --count: use "
        "ASYNC_PROCESSOR_RESULTS_COUNT (an unscoped name reaches every command)\n"
    )
    both = {"ASYNC_PROCESSOR_COUNT": "2", "ASYNC_PROCESSOR_RESULTS_COUNT": "5"}
    assert parse(results_parser(), [], both).count == 5  # the scoped one wins


def test_a_daemon_flag_keeps_its_shared_name(capsys: pytest.CaptureFixture[str]) -> None:
    env = {"ASYNC_PROCESSOR_TRANSPORT_CONFIG_FILE": "/etc/t.json"}
    assert parse(results_parser(), [], env).transport_config_file == "/etc/t.json"
    assert capsys.readouterr().err == ""


def test_a_misspelled_variable_is_named_with_the_closest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = load_config(sortedset_args(tmp_path), {"ASYNC_PROCESSOR_CONCURENCY": "8"})
    assert config.runtime.concurrency == 64  # ignored, as before, but no longer silently
    assert capsys.readouterr().err == (
        "async-processor run: warning: ignoring ASYNC_PROCESSOR_CONCURENCY: no flag of this "
        "command reads it (did you mean 'ASYNC_PROCESSOR_CONCURRENCY'?)\n"
    )
    parse(results_parser(), [], {"ASYNC_PROCESSOR_RESULTS_CONT": "1"})
    assert "ignoring ASYNC_PROCESSOR_RESULTS_CONT" in capsys.readouterr().err


def test_service_links_and_other_commands_variables_are_not_warned_about(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env = {
        "ASYNC_PROCESSOR_METRICS_SERVICE_HOST": "10.0.0.1",
        "ASYNC_PROCESSOR_METRICS_SERVICE_PORT": "9090",
        "ASYNC_PROCESSOR_PORT_9090_TCP_ADDR": "10.0.0.1",
        "ASYNC_PROCESSOR_METRICS_PORT": "tcp://10.0.0.1:9090",
        "ASYNC_PROCESSOR_RESULTS_COUNT": "3",
        "ASYNC_PROCESSOR_LOG_PAYLOADS": "0",
    }
    load_config(sortedset_args(tmp_path), env)
    assert capsys.readouterr().err == ""


def test_an_operator_commands_own_flags_have_scoped_variables(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def json_flag(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--json", action="store_true")
        parser.add_argument("--limit", type=int, default=20)

    env = {"ASYNC_PROCESSOR_STATUS_JSON": "true", "ASYNC_PROCESSOR_STATUS_LIMIT": "3"}
    settings = parse_settings(sortedset_args(tmp_path), env, prog="async-processor status",
                              extend=json_flag)  # fmt: skip
    assert settings.extra == {"json": True, "limit": 3}
    assert capsys.readouterr().err == ""


def test_dead_letters_help_names_the_scoped_variables(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["dead-letters", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "ASYNC_PROCESSOR_DEAD_LETTERS_LIMIT" in out and "ASYNC_PROCESSOR_DEAD_LETTERS_JSON" in out
    )


def test_status_json_from_the_environment(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.setenv("ASYNC_PROCESSOR_STATUS_JSON", "1")
    config = {"url": redis_url, "queues": [{"queue_name": "env-q", "igw_base_url": "http://g"}]}
    argv = ["status", "--transport", "redis-sortedset", "--transport-config", json.dumps(config)]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["queues"][0]["queue"] == "env-q"
