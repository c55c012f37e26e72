"""The ``HttpClient`` contract against a gateway that misbehaves, for every client.

A raw socket gateway answers each request with scripted bytes: malformed status lines and
chunk sizes, answers cut short or longer than declared, connections closed while idle or
with the request unanswered. Also refused before anything is sent: header fields that
would smuggle a line of their own. What the retry rules see must not depend on the client
(``--http-client``), and no request may reach the gateway twice behind their back.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import pytest

from async_processor.errors import NoAnswer
from async_processor.httpclients.base import (
    Answer,
    AnswerTooLarge,
    AttemptTimeout,
    HttpClient,
    Unsendable,
)
from tests.fixtures.httpclients import each_loop  # noqa: F401 (each loop)

pytestmark = pytest.mark.anyio
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
# (bytes written, then): "keep" reads the next request, "close" hangs up at once,
# "idle-close" hangs up a moment later, "garbage" writes a forged answer a moment later,
# "early" answers as soon as the head is in and only drains the body after; "early-keep"
# answers as soon as the head is in, then reads the body and the next request on.
Reply = tuple[bytes, str]
FORGED = b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nforged"


@dataclass
class Raw:
    url: str
    replies: Callable[[int], Reply]  # by request number, from 1
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    serving: set[tuple[asyncio.Task[None], asyncio.StreamWriter]] = field(default_factory=set)


async def _one_request(reader: asyncio.StreamReader, raw: Raw) -> tuple[Reply, int]:
    """The reply, and the length of the body left unread (an early answer's)."""
    head = await reader.readuntil(b"\r\n\r\n")
    reply = raw.replies(len(raw.requests) + 1)
    declared = re.search(rb"(?im)^content-length: *(\d+)", head)
    length = int(declared.group(1)) if declared else 0
    early = reply[1].startswith("early")
    raw.requests.append(head + await reader.readexactly(0 if early else length))
    return reply, length if early else 0


async def _serve(raw: Raw, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    raw.connections += 1
    task = asyncio.current_task()
    assert task is not None
    raw.serving.add((task, writer))
    try:
        while True:
            (data, then), unread = await _one_request(reader, raw)
            writer.write(data)
            await writer.drain()
            if then == "early-keep":
                await reader.readexactly(unread)
            elif then != "keep":
                break
        while then == "early" and await reader.read(1 << 20):  # the body nobody waited for
            pass
        if then in ("idle-close", "garbage"):
            await asyncio.sleep(0.1)
            writer.write(FORGED if then == "garbage" else b"")
            await writer.drain()
            await reader.read() if then == "garbage" else None  # held open until the client goes
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


@asynccontextmanager
async def raw_gateway(replies: Callable[[int], Reply]) -> AsyncIterator[Raw]:
    raw = Raw("", replies)
    server = await asyncio.start_server(lambda r, w: _serve(raw, r, w), "127.0.0.1", 0)
    raw.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
    async with server:
        try:
            yield raw
        finally:  # connections the client keeps are cut, so no handler outlives the test
            for task, writer in raw.serving:
                writer.transport.abort()
                await task


def first_then_ok(first: Reply) -> Callable[[int], Reply]:
    return lambda n: first if n == 1 else (OK, "keep")


async def _post(client: HttpClient, url: str, headers: dict[str, str] | None = None) -> Answer:
    sent = headers or {"Content-Type": "application/json"}
    return await client.post(url, b'{"p":1}', sent, timeout=3, limit=4096)


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 2x0 OK\r\nContent-Length: 2\r\n\r\nok",
        b"HTXP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nno colon here\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nok\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-2\r\nok\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1ffffffffffffffff\r\nok\r\n",
    ],
    ids=["status", "protocol", "header", "two-lengths", "chunk-size", "negative", "overflow"],
)
async def test_a_malformed_answer_is_a_retryable_no_answer(
    client: HttpClient, reply: bytes
) -> None:
    async with raw_gateway(first_then_ok((reply, "keep"))) as raw:
        with pytest.raises(NoAnswer) as caught:
            await _post(client, raw.url)
        assert (await _post(client, raw.url)).body == b"ok"  # on a connection of its own
    assert not caught.value.fatal
    assert not isinstance(caught.value, AttemptTimeout)  # refused when seen, not waited out
    assert raw.connections == 2


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nshort\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Len",
    ],
    ids=["length", "chunked", "head"],
)
async def test_an_answer_cut_short_is_no_answer_not_a_short_body(
    client: HttpClient, reply: bytes
) -> None:
    async with raw_gateway(first_then_ok((reply, "close"))) as raw:
        with pytest.raises(NoAnswer) as caught:
            await _post(client, raw.url)
    assert not caught.value.fatal


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 10000000\r\n\r\nyyyy",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1000\r\n" + b"y" * 4096
        + b"\r\n1\r\ny\r\n",
    ],
    ids=["length", "chunked"],
)  # fmt: skip
async def test_an_answer_over_the_limit_is_refused_before_it_ends(
    client: HttpClient, client_name: str, reply: bytes, request: pytest.FixtureRequest
) -> None:
    """The gateway never finishes these answers: a client that waited for the end would
    time out (``AttemptTimeout``) instead of refusing them."""
    if client_name == "pyreqwest":  # strict: news when it changes
        reason = "pyreqwest 0.15 hands back the head only once 64 KiB of body or its end came"
        request.applymarker(pytest.mark.xfail(strict=True, raises=AttemptTimeout, reason=reason))
    async with raw_gateway(first_then_ok((reply, "keep"))) as raw:
        with pytest.raises(AnswerTooLarge):
            await _post(client, raw.url)


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 200 OK\r\nX-Long: " + b"a" * (1 << 20),
        b"HTTP/1.1 200 OK\r\n" + b"X-Many: a\r\n" * (1 << 17),
    ],
    ids=["one-header", "many-headers"],
)
async def test_an_endless_head_is_refused_before_it_ends(client: HttpClient, reply: bytes) -> None:
    """The gateway never ends the head: a client that kept reading it would hold it all
    (the limit on the body says nothing of it) and time out instead of refusing it."""
    async with raw_gateway(first_then_ok((reply, "keep"))) as raw:
        with pytest.raises(NoAnswer) as caught:
            await _post(client, raw.url)
        assert (await _post(client, raw.url)).body == b"ok"  # on a connection of its own
    assert not isinstance(caught.value, AttemptTimeout)


async def test_an_answer_delimited_by_the_close_is_whole(client: HttpClient) -> None:
    reply = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end"
    async with raw_gateway(first_then_ok((reply, "close"))) as raw:
        answer = await _post(client, raw.url)
    assert answer.body == b"until the end"


async def test_interim_answers_are_skipped(client: HttpClient) -> None:
    reply = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + OK
    async with raw_gateway(first_then_ok((reply, "keep"))) as raw:
        answer = await _post(client, raw.url)
    assert (answer.status, answer.body) == (200, b"ok")


async def test_credentials_in_the_url_are_sent_as_basic_auth(client: HttpClient) -> None:
    """A gateway URL with ``user:password@`` (percent-encoded), the host only in Host."""
    async with raw_gateway(lambda n: (OK, "keep")) as raw:
        await _post(client, raw.url.replace("http://", "http://us%20er:p%40ss@"))
    head = raw.requests[0].lower()
    assert b"\r\nauthorization: basic dxmgzxi6cebzcw==\r\n" in head  # "us er:p@ss"
    assert re.search(rb"\r\nhost: 127\.0\.0\.1:\d+\r\n", head)


async def test_a_kept_alive_connection_carries_the_next_request(client: HttpClient) -> None:
    async with raw_gateway(lambda n: (OK, "keep")) as raw:
        for _ in range(3):
            assert (await _post(client, raw.url)).body == b"ok"
    assert (raw.connections, len(raw.requests)) == (1, 3)


async def test_connection_close_is_honoured(client: HttpClient) -> None:
    closing = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"
    async with raw_gateway(first_then_ok((closing, "keep"))) as raw:  # the socket stays open
        await _post(client, raw.url)
        assert (await _post(client, raw.url)).body == b"ok"
    assert raw.connections == 2


@pytest.mark.parametrize("then", ["keep", "garbage"], ids=["at-once", "while-idle"])
async def test_bytes_past_the_answer_are_never_taken_for_the_next_one(
    client: HttpClient, client_name: str, then: str, request: pytest.FixtureRequest
) -> None:
    """A connection with bytes nobody asked for is out of step: it is not used again (a
    server's ``408`` on an idle connection before it hangs up is one such answer)."""
    if client_name == "aiohttp" and then == "garbage":  # strict: news when it changes
        reason = "aiohttp 3.14 keeps what an idle connection received as the next answer"
        request.applymarker(pytest.mark.xfail(strict=True, raises=AssertionError, reason=reason))
    first = OK + FORGED if then == "keep" else OK
    async with raw_gateway(first_then_ok((first, then))) as raw:
        assert (await _post(client, raw.url)).body == b"ok"
        await anyio.sleep(0.3)
        assert (await _post(client, raw.url)).body == b"ok"
    assert raw.connections == 2


async def test_an_answer_before_the_end_of_the_body_ends_the_connection(
    client_name: str, client: HttpClient
) -> None:
    """The rest of the body is still on its way: on the same connection the gateway would
    read it as the next request. pyreqwest (hyper) keeps no such connection either, but
    its own way: it sends the rest of the body behind the answer and reuses the connection
    once the body is out (sound framing: the gateway reads the rest as body). Whether the
    next request finds it free then hangs on timing, so it gets a gateway that reads the
    body and serves on, and must be answered on whichever connection it takes."""
    big = b"x" * (64 * 10**6)  # more than loopback's socket buffers hold
    reusing = client_name == "pyreqwest"
    async with raw_gateway(first_then_ok((OK, "early-keep" if reusing else "early"))) as raw:
        first = await client.post(raw.url, big, {}, timeout=10, limit=4096)
        assert (await _post(client, raw.url)).body == b"ok"
    assert first.body == b"ok"
    assert raw.connections in ((1, 2) if reusing else (2,))


async def test_an_idle_connection_the_gateway_closed_is_not_used(client: HttpClient) -> None:
    async with raw_gateway(first_then_ok((OK, "idle-close"))) as raw:
        await _post(client, raw.url)
        await anyio.sleep(0.3)  # the gateway has hung up on the idle connection
        assert (await _post(client, raw.url)).body == b"ok"
    assert (raw.connections, len(raw.requests)) == (2, 2)


async def test_a_request_lost_after_it_was_sent_is_not_resent(client: HttpClient) -> None:
    """The gateway read the second request and hung up: it may have started the work, so
    the client says so (a retryable ``NoAnswer``) and leaves resending to the retry rules."""
    async with raw_gateway(lambda n: (OK, "keep") if n == 1 else (b"", "close")) as raw:
        await _post(client, raw.url)
        with pytest.raises(NoAnswer) as caught:
            await _post(client, raw.url)
    assert not caught.value.fatal
    assert len(raw.requests) == 2


@pytest.mark.parametrize(
    "headers",
    [
        {"x-a": "1\r\nx-injected: 1"},
        {"x-a": "1\nx-injected: 1"},
        {"x-a": "1\rx-injected: 1"},
        {"x-a": "1\x00"},
        {"x-a\r\nx-injected": "1"},
        {"x-a: 2\r\nx-b": "1"},
        {"x a": "1"},
        {"": "1"},
        {"content-length": "2"},
        {"Transfer-Encoding": "chunked"},
        {"Expect": "100-continue"},
    ],
    ids=[
        "crlf",
        "lf",
        "cr",
        "nul",
        "name-crlf",
        "name-colon",
        "name-space",
        "no-name",
        "length",
        "chunked",
        "expect",
    ],
)
async def test_a_header_that_could_smuggle_a_line_is_refused(
    client: HttpClient, headers: dict[str, str]
) -> None:
    async with raw_gateway(lambda n: (OK, "keep")) as raw:
        with pytest.raises(Unsendable) as caught:
            await _post(client, raw.url, headers)
        assert (await _post(client, raw.url)).body == b"ok"
    assert caught.value.fatal
    assert len(raw.requests) == 1
    assert b"injected" not in raw.requests[0]
