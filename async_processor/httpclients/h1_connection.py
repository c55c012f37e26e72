"""One HTTP/1.1 connection of the ``httptools`` client: an asyncio Protocol around llhttp.

A connection carries one exchange at a time: ``exchange`` writes a whole request and
waits for the answer the parser assembles from the callbacks below. Whatever ends an
exchange without a complete answer (a malformed answer, an answer over the limit, the
deadline, a cancelled caller, the peer closing early) closes the connection at once, so
the gateway sees the request abandoned and no half-read answer is ever reused. Only the
headers the retry rules read are kept; the body is read into a list of chunks checked
against the limit as they come (a declared length over it is refused before any body).

The answer is untrusted input. It is whole only when llhttp reports the message complete
(``on_message_complete``), with the body it framed; a clean close ends it only when llhttp
says the close delimits it (``llhttp_end``); a reset never does. Every other byte is
bounded too (``base.HEAD_LIMIT``, ``FIELD_LIMIT``, ``framing_allowance``), checked after
each read: at most one receive buffer past a limit, so nothing grows without bound and
nothing is re-copied quadratically.
"""

from __future__ import annotations

import asyncio
from typing import cast

from httptools import HttpParserError, HttpParserUpgrade, HttpResponseParser

from async_processor.errors import NoAnswer
from async_processor.headers import DROPPED_REASON_HEADER
from async_processor.httpclients.base import (
    FIELD_LIMIT,
    HEAD_LIMIT,
    Answer,
    AttemptTimeout,
    cut_short,
    framing_allowance,
    framing_too_large,
    too_large,
)
from async_processor.httpclients.llhttp_end import finish

Origin = tuple[str, str, int]  # scheme, host, port: the pool's key
_RETRY_AFTER = b"retry-after"
_DROPPED = DROPPED_REASON_HEADER.lower().encode()
LARGE_BODY = 1 << 16  # from here the body is written apart from the head


class Connection(asyncio.BufferedProtocol):
    # Slots, not a dict: one of these is held per request in flight (issue 13's memory).
    __slots__ = (
        "answered", "buffer", "chunked", "chunks", "dropped", "fed", "idle_since",
        "keep_alive", "limit", "origin", "parser", "retry_after", "size", "status",
        "transport", "waiter",
    )  # fmt: skip

    def __init__(self, origin: Origin, buffer: memoryview) -> None:
        self.origin = origin
        self.buffer = buffer  # the client's receive buffer: read into, parsed, let go at once
        self.transport: asyncio.Transport | None = None
        # Made when an answer's first bytes arrive, let go when it is complete: a parser is
        # ~0.85 KB and a request waits seconds before its answer starts (issue 13's memory).
        self.parser: HttpResponseParser | None = None
        self.waiter: asyncio.Future[Answer] | None = None
        self.idle_since = 0.0
        self._reset(0)

    def _reset(self, limit: int) -> None:
        self.limit = limit
        self.fed = 0  # bytes of this exchange's answers read (interim ones too)
        self.chunked = 0  # chunks framed so far
        self.answered = False  # some byte of the answer arrived
        self._interim_done()

    def _interim_done(self) -> None:
        """Ready for the (next) answer's head: what an interim answer set is forgotten,
        but not the bytes it took (``fed``), so endless 1xx answers meet the head limit."""
        self.status = 0
        self.chunks: list[bytes] = []
        self.size = 0
        self.retry_after: str | None = None
        self.dropped = ""
        self.keep_alive = False  # read when the answer ends: llhttp forgets it after

    @property
    def usable(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    async def exchange(
        self, head: bytes, body: bytes | memoryview, deadline: float, limit: int,
        loop: asyncio.AbstractEventLoop,
    ) -> Answer:  # fmt: skip
        """Send the request and return the answer, by ``deadline``. ``head`` and ``body``
        are not held once written: they would be, by this frame, for as long as the answer
        takes (the body may be the only reference left to a message's bytes)."""
        assert self.transport is not None  # the pool hands out usable ones only
        waiter: asyncio.Future[Answer] = loop.create_future()
        self.waiter = waiter
        self._reset(limit)
        timer = loop.call_at(deadline, self._time_out)
        if len(body) < LARGE_BODY:  # one write, one segment; the copy is not kept once sent
            self.transport.write(head + body)
        else:  # not copied behind the head
            self.transport.write(head)
            self.transport.write(body)
        del head, body
        try:
            return await waiter
        except BaseException:  # cancelled or failed: the gateway must see the request end
            self.close()
            raise
        finally:
            timer.cancel()
            self.waiter = None

    def reusable(self) -> bool:
        """Kept alive, and the whole request went out: an answer that came before the end
        of the body (a refusal) leaves the rest of it to be read as the next request."""
        return self.usable and self.keep_alive and not self._unsent()

    def _unsent(self) -> int:
        return self.transport.get_write_buffer_size() if self.transport is not None else 0

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _fail(self, error: NoAnswer) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(error)
        self.close()

    def _time_out(self) -> None:
        self._fail(AttemptTimeout())

    def _pending(self) -> bool:
        return self.waiter is not None and not self.waiter.done()

    # asyncio.BufferedProtocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is not an asyncio.Transport subclass).
        self.transport = cast(asyncio.Transport, transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.buffer

    def buffer_updated(self, nbytes: int) -> None:
        if not self._pending():  # bytes nobody asked for: the connection is out of step
            self.close()
            return
        self.answered = True
        self.fed += nbytes
        if self.parser is None:
            self.parser = HttpResponseParser(self)
        try:
            self.parser.feed_data(self.buffer[:nbytes])
        except HttpParserUpgrade:
            self._fail(NoAnswer("the gateway switched protocols", reason="bad_status"))
        except HttpParserError as exc:
            self._fail(NoAnswer(f"malformed answer from the gateway: {exc}", reason="malformed"))
        else:
            self._bound()

    def _bound(self) -> None:
        """Ends the exchange once the answer's bytes outside its body pass their limits."""
        if not self._pending():
            return
        if not self.status and self.fed > HEAD_LIMIT:
            error = f"the gateway's answer head is over {HEAD_LIMIT} bytes"
            self._fail(NoAnswer(error, reason="head_too_large"))
        elif self.fed - self.size > framing_allowance(self.chunked):
            self._fail(framing_too_large())

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self._pending():
            return
        if exc is None and self.parser is not None and finish is not None:
            finish(self.parser)  # completes an answer the close delimits, and no other
        if not self._pending():
            return
        if not self.answered:
            reason = f": {exc}" if exc else ""
            error = f"the gateway closed the connection before answering{reason}"
            self._fail(NoAnswer(error, reason="closed"))
        else:
            self._fail(cut_short(exc))

    # httptools callbacks (called from feed_data)

    def on_message_begin(self) -> None:
        if not self._pending():  # a second answer to one request
            self._fail(NoAnswer("an answer nobody asked for", reason="malformed"))

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) + len(value) > FIELD_LIMIT:
            error = f"a header or trailer field of the gateway's answer is over {FIELD_LIMIT} bytes"
            self._fail(NoAnswer(error, reason="head_too_large"))
            return
        name = name.lower()
        if name == _RETRY_AFTER:
            self.retry_after = value.decode("latin-1")
        elif name == _DROPPED:
            self.dropped = value.decode("latin-1")
        elif name == b"content-length" and value.isdigit() and int(value) > self.limit:
            self._fail(too_large(int(value), self.limit))  # refused before any body

    def on_headers_complete(self) -> None:
        assert self.parser is not None  # callbacks come from its feed_data
        self.status = self.parser.get_status_code()

    def on_chunk_header(self) -> None:
        self.chunked += 1

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size > self.limit:
            self._fail(too_large(None, self.limit))
        elif self._pending():
            self.chunks.append(body)

    def on_message_complete(self) -> None:
        if 100 <= self.status < 200:  # an interim answer (100 Continue, 103): the real one follows
            self._interim_done()
            return
        if self._pending() and self.waiter is not None and self.parser is not None:
            self.keep_alive = self.parser.should_keep_alive()
            self.parser = None  # the next answer gets a fresh one (only bytes nobody asked
            # for could follow this one's, and they close the connection)
            chunks = self.chunks
            body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            try:
                answer = Answer(self.status, body, self.retry_after, self.dropped)
            except NoAnswer as error:  # a status outside 200-599
                self._fail(error)
                return
            self.waiter.set_result(answer)
