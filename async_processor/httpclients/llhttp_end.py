"""The end of an answer the connection's close delimits, as llhttp (not header text) decides.

Stage: the ``httptools`` client's parser, at a clean close. Input: the answer's
``HttpResponseParser``. Output: ``finish`` asks llhttp whether the close ends the message
it is parsing (no length and no chunking was framed: RFC 9112 §6.3 rule 8); when it does,
llhttp calls ``on_message_complete`` itself, else the answer was cut short.

httptools 0.9 does not wrap ``llhttp_finish``, but its extension exports it; the parser's
``llhttp_t*`` is the object's first field after the Cython header and vtable. That layout
is checked once on import (llhttp_t's ``data`` must point back at the parser object); a
build where it does not hold gets ``finish = None``, and every answer the close would
delimit is then taken as cut short (a retry, never a wrong result).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

from httptools import HttpResponseParser
from httptools.parser import parser as _extension

# CPython object header (refcount, type) + Cython's vtable pointer, then ``_cparser``.
_CPARSER_OFFSET = 3 * ctypes.sizeof(ctypes.c_void_p)
# llhttp_t: int32 _index, void* _span_pos0, void* _span_cb0, int32 error, char* reason,
# char* error_pos, then void* data (httptools sets it to the parser object).
_DATA_OFFSET = 6 * ctypes.sizeof(ctypes.c_void_p)


def _llhttp_t(parser: HttpResponseParser) -> int:
    pointer = ctypes.c_void_p.from_address(id(parser) + _CPARSER_OFFSET).value
    return pointer or 0


def _bind() -> Callable[[HttpResponseParser], bool] | None:
    try:
        # PyDLL: the GIL stays held, since llhttp calls back into Python (on_message_complete).
        llhttp_finish = ctypes.PyDLL(_extension.__file__).llhttp_finish
    except (OSError, AttributeError):
        return None
    llhttp_finish.argtypes = [ctypes.c_void_p]
    llhttp_finish.restype = ctypes.c_int
    probe = HttpResponseParser(object())
    cparser = _llhttp_t(probe)
    if not cparser or ctypes.c_void_p.from_address(cparser + _DATA_OFFSET).value != id(probe):
        return None

    def finish(parser: HttpResponseParser) -> bool:
        """True when the close ends the message (llhttp then called on_message_complete)."""
        error: int = llhttp_finish(_llhttp_t(parser))
        return error == 0  # HPE_OK; else HPE_INVALID_EOF_STATE

    return finish


finish = _bind()
