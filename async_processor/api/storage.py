"""Where file bytes live: a directory today, behind ``Storage`` so an object store can follow.

Stage: the API's file storage. Input: file ids and byte chunks. Output: stored files,
read back in chunks (or at given offsets). A write goes to a temporary file that becomes
the file only on ``commit``: a refused or interrupted upload leaves nothing under the
file's name.
"""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Protocol

import anyio

READ_CHUNK = 256 * 1024
_ID = re.compile(r"^[A-Za-z0-9_-]{1,100}$")


class Writer(Protocol):
    async def write(self, chunk: bytes) -> None: ...
    async def commit(self) -> None: ...
    async def discard(self) -> None: ...


class Storage(Protocol):
    async def writer(self, file_id: str) -> Writer: ...
    def reader(self, file_id: str) -> AsyncIterator[bytes]: ...
    async def read_at(self, file_id: str, spans: Sequence[tuple[int, int]]) -> list[bytes]: ...
    async def delete(self, file_id: str) -> None: ...


@asynccontextmanager
async def writing(storage: Storage, file_id: str) -> AsyncIterator[Writer]:
    """A writer that commits when the block ends, and leaves nothing if it fails."""
    writer = await storage.writer(file_id)
    try:
        yield writer
        await writer.commit()
    except BaseException:
        await writer.discard()
        raise


class DirWriter:
    def __init__(self, temporary: Path, final: Path) -> None:
        self._temporary, self._final = temporary, final
        self._file = temporary.open("wb")

    async def write(self, chunk: bytes) -> None:
        await anyio.to_thread.run_sync(self._file.write, chunk)

    async def commit(self) -> None:
        def done() -> None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._temporary, self._final)

        await anyio.to_thread.run_sync(done)

    async def discard(self) -> None:
        self._file.close()
        self._temporary.unlink(missing_ok=True)


class DirStorage:
    """One file per id in ``root``; temporaries (``.tmp-*``) are swept at start."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-*"):
            stale.unlink(missing_ok=True)

    def _path(self, file_id: str) -> Path:
        if not _ID.match(file_id):  # ids are ours, but never let one name another path
            raise ValueError(f"bad file id {file_id!r}")
        return self.root / file_id

    async def writer(self, file_id: str) -> DirWriter:
        final = self._path(file_id)
        return DirWriter(final.with_name(f".tmp-{file_id}-{os.getpid()}"), final)

    async def reader(self, file_id: str) -> AsyncIterator[bytes]:
        handle = await anyio.open_file(self._path(file_id), "rb")
        async with handle:
            while chunk := await handle.read(READ_CHUNK):
                yield chunk

    async def read_at(self, file_id: str, spans: Sequence[tuple[int, int]]) -> list[bytes]:
        """The bytes at each (offset, size) of the file, in one open."""

        def read() -> list[bytes]:
            with self._path(file_id).open("rb") as handle:
                found = []
                for offset, size in spans:
                    handle.seek(offset)
                    found.append(handle.read(size))
                return found

        return await anyio.to_thread.run_sync(read)

    async def delete(self, file_id: str) -> None:
        self._path(file_id).unlink(missing_ok=True)
