"""The fixtures' servers survive losing their port to another process.

``free_port()`` closes its probe socket before the server binds, so under parallel suites
another process can take the port first: the server then exits ("address already in use")
or, worse, someone else answers there and the test talks to the wrong server. Both are
retried on a new port, and a server that merely starts slowly is waited for.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator

import pytest

from tests.fixtures import servers
from tests.fixtures.servers import PortTaken, owns_port, start_on_free_port, stop_process

SERVE = [sys.executable, "-m", "http.server", "--bind", "127.0.0.1"]
SLEEP = [sys.executable, "-c", "import time; time.sleep(30)"]


@pytest.fixture
def taken() -> Iterator[int]:
    """A port another process (here: the test) already listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def ports_in_turn(monkeypatch: pytest.MonkeyPatch, *first: int) -> None:
    """free_port() hands out ``first`` before real free ports."""
    queue, real = list(first), servers.free_port
    monkeypatch.setattr(servers, "free_port", lambda: queue.pop(0) if queue else real())


def test_a_server_that_lost_its_port_is_started_on_another(
    monkeypatch: pytest.MonkeyPatch, taken: int
) -> None:
    ports_in_turn(monkeypatch, taken)
    port, proc = start_on_free_port(lambda p: [*SERVE, str(p)])
    try:
        assert port != taken
        assert owns_port(proc.pid, port)
    finally:
        stop_process(proc)


def test_another_process_answering_on_the_port_is_not_taken_for_the_server(
    monkeypatch: pytest.MonkeyPatch, taken: int
) -> None:
    monkeypatch.setattr(servers, "PORT_ATTEMPTS", 1)
    ports_in_turn(monkeypatch, taken)
    # It never listens, but something answers on its port: not ours, so not started.
    with pytest.raises(PortTaken, match=f"another process answers on {taken}"):
        start_on_free_port(lambda p: SLEEP)


def test_ownership_is_read_from_the_process_sockets(taken: int) -> None:
    port, proc = start_on_free_port(lambda p: [*SERVE, str(p)])
    try:
        assert owns_port(proc.pid, port)
        assert not owns_port(proc.pid, taken)
    finally:
        stop_process(proc)
