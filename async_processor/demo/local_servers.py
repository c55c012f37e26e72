"""Local helper servers for the demo and the tests: a private Redis, the Pub/Sub emulator.

Stage: outside the daemon (``async-processor demo``; tests/fixtures/pubsub.py reuses the
emulator launcher). Input: what is installed (``redis-server`` or the ``demo`` extra's
fakeredis, the Debian package ``google-cloud-cli-pubsub-emulator`` and java). Output: a
server on a free 127.0.0.1 port, stopped again on exit. The emulator's launcher spawns
java, so it runs in its own process group and is stopped by that group.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

EMULATOR_PACKAGE = "google-cloud-cli-pubsub-emulator"
EMULATOR_PATH = Path("/usr/lib/google-cloud-sdk/platform/pubsub-emulator/bin/cloud-pubsub-emulator")
EMULATOR_START_TIMEOUT = 60.0  # a cold JVM
REDIS_START_TIMEOUT = 10.0


class ServerMissing(RuntimeError):
    """A local server the demo needs is not installed; the message says how to fix it."""


class EmulatorMissing(ServerMissing):
    """The emulator (or the java it needs) is not installed."""


class RedisMissing(ServerMissing):
    """Neither redis-server nor the ``demo`` extra's fakeredis is installed."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(
    port: int, timeout: float = 10.0, proc: subprocess.Popen[bytes] | None = None
) -> None:
    """Until 127.0.0.1:``port`` accepts connections; fails early if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


# -- Redis ----------------------------------------------------------------------------


@contextmanager
def embedded_redis() -> Iterator[str]:
    """A private Redis: redis-server if installed, else fakeredis (with Lua) over TCP."""
    binary = shutil.which("redis-server")
    with _redis_server(binary) if binary else _fake_redis() as url:
        yield url


@contextmanager
def _redis_server(binary: str) -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="async-processor-demo-") as data_dir:
        port = free_port()
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", data_dir, "--loglevel", "warning"]  # fmt: skip
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL)  # noqa: S603 - a binary from PATH
        try:
            wait_for_port(port, REDIS_START_TIMEOUT, proc)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            proc.wait()


@contextmanager
def _fake_redis() -> Iterator[str]:
    # fakeredis is demo-only (the ``demo`` extra), so the daemon's image does not carry it.
    try:
        import fakeredis
    except ImportError:
        raise RedisMissing(
            "no redis-server on PATH and fakeredis is not installed: install redis-server, "
            "pass --redis-url, or pip install 'async-processor[demo]'"
        ) from None
    server = fakeredis.TcpFakeServer(("127.0.0.1", 0), server_type="redis")
    thread = threading.Thread(target=server.serve_forever, name="fakeredis", daemon=True)
    thread.start()
    try:
        yield f"redis://127.0.0.1:{server.server_address[1]}/0"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


# -- Pub/Sub emulator -----------------------------------------------------------------


def find_emulator() -> str | None:
    """The launcher: on PATH, at the Debian package's path, or wherever ``dpkg -L`` says."""
    found = shutil.which("cloud-pubsub-emulator")
    if found:
        return found
    if EMULATOR_PATH.is_file():
        return str(EMULATOR_PATH)
    dpkg = shutil.which("dpkg")
    if dpkg is None:
        return None
    listing = subprocess.run(  # noqa: S603 - dpkg from PATH, fixed arguments
        [dpkg, "-L", EMULATOR_PACKAGE], capture_output=True, text=True, check=False
    )
    for line in listing.stdout.splitlines():
        if line.endswith("/bin/cloud-pubsub-emulator"):
            return line
    return None


@dataclass
class PubSubEmulator:
    port: int
    proc: subprocess.Popen[bytes]
    project: str

    @property
    def host(self) -> str:
        """The value for ``PUBSUB_EMULATOR_HOST``."""
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        """SIGTERM the launcher's process group (it spawns java), SIGKILL if it lingers."""
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def start_emulator(project: str, port: int | None = None) -> PubSubEmulator:
    """The emulator listening on ``port`` (a free one by default); EmulatorMissing if absent."""
    launcher = find_emulator()
    if launcher is None:
        raise EmulatorMissing(
            f"the Pub/Sub emulator is not installed: apt-get install {EMULATOR_PACKAGE}"
        )
    if shutil.which("java") is None:
        raise EmulatorMissing(
            "the Pub/Sub emulator needs java: apt-get install default-jre-headless"
        )
    port = port or free_port()
    proc = subprocess.Popen(  # noqa: S603 - the launcher found above
        [launcher, "--host=127.0.0.1", f"--port={port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group, so stop() reaches java too
    )
    emulator = PubSubEmulator(port=port, proc=proc, project=project)
    try:
        wait_for_port(port, EMULATOR_START_TIMEOUT, proc)
    except BaseException:
        emulator.stop()
        raise
    return emulator


@contextmanager
def pubsub_emulator(project: str) -> Iterator[PubSubEmulator]:
    """A running emulator with ``PUBSUB_EMULATOR_HOST`` pointing at it, both undone on exit."""
    emulator = start_emulator(project)
    before = os.environ.get("PUBSUB_EMULATOR_HOST")
    os.environ["PUBSUB_EMULATOR_HOST"] = emulator.host
    try:
        yield emulator
    finally:
        if before is None:
            os.environ.pop("PUBSUB_EMULATOR_HOST", None)
        else:
            os.environ["PUBSUB_EMULATOR_HOST"] = before
        emulator.stop()
