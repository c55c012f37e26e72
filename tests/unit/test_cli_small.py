"""Small operator-facing fixes: status says "now", progress bars only on a terminal, and
the operator commands' help lists only the flags that matter to them, with choices."""

from __future__ import annotations

import io
import time

import pytest

from async_processor.cli.main import main
from async_processor.client.commands import Progress
from async_processor.ops.status_table import QueueStatus, Status, render


def test_status_says_now_for_a_deadline_due_now() -> None:
    now = time.time()
    table = render(Status("redis-sortedset", now, [QueueStatus("q", "p", oldest_deadline=now)]))
    assert "in 0s" not in table and " now" in table
    later = render(
        Status("redis-sortedset", now, [QueueStatus("q", "p", oldest_deadline=now + 70)])
    )
    assert "in 1m10s" in later


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty", [True, False])
def test_progress_draws_a_bar_only_on_a_terminal(tty: bool) -> None:
    stream = _Stream(tty)
    progress = Progress("submitted", 4, stream)
    progress.advance(4)
    progress.finish()
    text = stream.getvalue()
    assert ("[" in text and "#" in text) is tty
    assert ("\r" in text) is tty
    assert text.rstrip("\n").split("\r")[-1].startswith("submitted ")
    if not tty:
        assert text.splitlines()[-1].startswith("submitted 4/4 (")


@pytest.mark.parametrize("command", ["status", "dead-letters", "exporter"])
def test_operator_help_lists_the_config_flags_not_the_daemons_tuning(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit, match="0"):
        main([command, "--help"])
    out = capsys.readouterr().out
    assert "--transport-config-file" in out and "--transport {redis-sortedset," in out
    for noise in ("--concurrency", "--request-timeout", "--shed-pause", "--tls-cert"):
        assert noise not in out, noise
    assert "ignores) the other flags of 'async-processor run'" in " ".join(out.split())
    if command == "dead-letters":
        assert "{list,show,replay,purge}" in out


def test_status_still_accepts_the_daemons_other_flags(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["status", "--concurrency", "8", "--transport", "redis-sortedset",
            "--transport-config", '{"url": "redis://127.0.0.1:1", "queues": []}']  # fmt: skip
    assert main(argv) == 2  # the config's problem, not "unrecognized arguments"
    assert "queues: at least one queue is required" in capsys.readouterr().err


def test_run_help_shows_the_choices_of_closed_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="0"):
        main(["run", "--help"])
    out = capsys.readouterr().out
    assert "--budget-scope {in-flight,fetch}" in out
    assert "--http-client {httptools,aiohttp,pyreqwest}" in out
