"""nats-py's protocol parser with MSG/HMSG frames read by C-level bytes operations (issue 14, target 2).

A py-spy profile of the edge at 2,000 SSE events/s put the largest share left in the NATS read:
nats-py 2.16's ``Parser.parse`` (``nats/protocol/parser.py``) tries a regex per frame, copies each
frame out of a ``bytearray`` and deletes it from the front, and awaits ``Client._process_msg`` (a
coroutine) per message. :class:`FastParser` reads the frames of one socket read from one ``bytes``
object: ``find`` for the line end, ``split`` for the arguments, one slice per payload and header
block, and a plain call of the client's ``_msg_now`` (``FastClient``), which finishes a plain
subscription's message without a coroutine (the same stats, pending-limit and slow-consumer
accounting, queue or inline handler, in the same order). A message ``_msg_now`` declines (JetStream,
old-style request, unknown sid, inline status header) is awaited through ``_process_msg`` as before.

Only frames whose meaning is certain take this path: a control line (up to the first CRLF) of
``MSG``/``HMSG`` and arguments separated by single spaces (two before the size read as no reply,
as the grammar reads them), with no tab, CR or LF, the right count, and ASCII-digit sid and sizes;
and ``PING``/``PONG`` lines that a non-blank byte (or the end of the data) follows. For those, the grammar the read loop uses (nats-py's
``MSG_RE``/``HMSG_RE`` with robust.py's space/tab separators, ``PING_RE``, ``PONG_RE``) matches the
same line with the same groups (robust.py's separators never span a line end; nats-py's own did).
Anything else (INFO, ``+OK``, ``-ERR``, tabs or runs of blanks, malformed lines, digit tokens over
18 characters) goes, with the rest of the data, to nats-py's own ``Parser.parse``: the same
callbacks, the same errors. Between calls the parser's state (``buf``, ``state``, ``needed``,
``header_needed``, ``msg_arg``) is what the stock parser would leave, so a frame split across
reads is finished by either. tests/test_fast_parser.py pins all of it against the stock parser on
random frame sequences cut at random read boundaries. Cost per frame on the 2 GHz machine
(isolated, 32 KiB reads of the edge's result frames): ~2.9 µs against the stock parser's ~6.3,
the ``Msg``, queue and fan-out after it not counted (docs/benchmarks.md). :meth:`FastParser.parse_now`
runs the same frame loop without a coroutine, for a read that arrives while the read loop waits
(``eager_reads.py``), and hands back the bytes from the first frame that needs an await; the same
tests pin it.
"""

from __future__ import annotations

from typing import Any, Callable

from nats.protocol import parser as _parser
from nats.protocol.parser import AWAITING_CONTROL_LINE, AWAITING_MSG_PAYLOAD, Parser

from .robust import _HMSG, _MSG

# What ``FastClient._msg_now`` answers for a message it did not handle: await ``_process_msg``.
LATER = object()

_CRLF = b"\r\n"
_BLANK = frozenset(b" \t\n\r\x0b\x0c")
_M, _H, _P = ord("M"), ord("H"), ord("P")


def parser_support() -> tuple[bool, str]:
    """(usable, reason): nats-py's parser is the one whose grammar :class:`FastParser` mirrors."""
    checks = {
        "MSG_RE (robust.py's)": getattr(getattr(_parser, "MSG_RE", None), "pattern", None) == _MSG,
        "HMSG_RE (robust.py's)": getattr(getattr(_parser, "HMSG_RE", None), "pattern", None) == _HMSG,
        "PING_RE": getattr(getattr(_parser, "PING_RE", None), "pattern", None) == b"\\APING\\s*\r\n",
        "PONG_RE": getattr(getattr(_parser, "PONG_RE", None), "pattern", None) == b"\\APONG\\s*\r\n",
        "states": (AWAITING_CONTROL_LINE, AWAITING_MSG_PAYLOAD, _parser.CRLF_SIZE) == (1, 2, 2),
        "Parser fields": {"buf", "state", "needed", "header_needed", "msg_arg"} <= set(vars(Parser())),
    }
    wrong = [name for name, ok in checks.items() if not ok]
    return (not wrong), ("parser internals differ: " + ", ".join(wrong)) if wrong else "parser"


def _number(token: bytes) -> int | None:
    """An ASCII-digit token's value (``\\d+`` in the grammar), remembered; None for anything else."""
    if len(token) > 18 or not token.isdigit():
        return None
    value = int(token)
    if len(_NUMBERS) >= _MAX_NUMBERS:
        _NUMBERS.clear()
    _NUMBERS[token] = value
    return value


# Digit token -> int: sids, header sizes and most payload sizes repeat, and int(bytes) is the
# costliest call per frame after the line's split (~0.23 µs on the 2 GHz machine; a lookup ~0.05).
_NUMBERS: dict[bytes, int] = {}
_MAX_NUMBERS = 4096


# What ``FastParser._frames`` stopped at (besides ``LATER``): a PING or PONG line, a frame whose
# handling must be reported to the error callback, or a line the stock parser must read.
PING, PONG, ERROR, STOCK = object(), object(), object(), object()


class FastParser(Parser):
    """nats-py's ``Parser`` (see the module doc); ``nc`` must have ``_msg_now`` (``FastClient``)."""

    async def parse(self, data: bytes = b"") -> None:
        buf = self.buf
        if buf:  # a frame split across reads: go on from where this parser (or the stock one) stopped
            if self.state == AWAITING_MSG_PAYLOAD and len(buf) + len(data) < self.needed + 2:
                buf.extend(data)  # a large payload still arriving: gather it as the stock parser does
                return
            buf.extend(data)
            data = bytes(buf)
            del buf[:]
        nc = self.nc
        done_hook = getattr(nc, "read_done", None)
        try:
            end = len(data)
            pos = 0
            while pos < end:
                pos, stop, arg = self._frames(data, pos)  # on an exception it keeps the rest itself
                if stop is None:
                    break
                try:
                    if done_hook is not None:  # what was handed over leaves before anything can suspend
                        done_hook()
                    if stop is LATER:
                        await nc._process_msg(*arg[:5])
                    elif stop is ERROR:
                        await nc._error_cb(arg)
                    elif stop is PING:
                        await nc._process_ping()
                    elif stop is PONG:
                        await nc._process_pong()
                    else:  # STOCK: the stock parser reads from here, with everything after it
                        break
                except BaseException:
                    if self.buf is buf and pos < end:  # as the stock parser leaves it: the frame taken, the rest kept
                        buf.extend(data[pos:])
                    raise
                if self.buf is not buf:  # reset() (a reconnect) while awaiting: the stock loop stops too
                    return
            if pos < end:
                buf.extend(data[pos:] if pos else data)
                if self.state == AWAITING_CONTROL_LINE and _CRLF in buf:  # after STOCK: the hook ran before its break
                    await Parser.parse(self)  # what this parser does not read, with everything after it
        finally:
            # Every frame of this read handed over, also when one raised or a reconnect reset the
            # parser (FastClient.read_done): nothing taken waits for a later read.
            if done_hook is not None:
                done_hook()

    def parse_now(self, data: bytes, report: Callable[[Any], None]) -> bytes:
        """The frames of ``data`` handed over without a coroutine, for a read the read loop is not
        waiting behind (``eager_reads.py``): the parser must be between frames (nothing buffered).
        Stops at the first frame that needs an await (a message ``_msg_now`` declines, PING, PONG,
        anything the stock parser reads) and answers the bytes from that frame on, the parser's
        state as before it: the read loop's to parse, in order. A frame whose message ``_msg_now``
        took but must report (``SlowConsumerError``) is passed to ``report`` and ends the call after
        it, so the report is made before the rest is read. ``b""``: all of ``data`` is handed over,
        or its unfinished last frame kept as ``parse`` would keep it."""
        assert not self.buf and self.state == AWAITING_CONTROL_LINE
        end = len(data)
        pos, stop, arg = self._frames(data, 0)
        if stop is None:  # used up, or an unfinished frame (a line without its CRLF, or a payload short)
            if pos < end:
                self.buf.extend(data[pos:] if pos else data)  # the next read finishes it, as in parse
            return b""
        if stop is ERROR:
            report(arg)
            return data[pos:]
        if stop is LATER:  # _msg_now did nothing: the frame from its line, for _process_msg in the read loop
            return data[arg[5]:]
        if stop is STOCK:
            return data[pos:]
        return data[arg:]  # PING, PONG: from their line

    def _frames(self, data: bytes, pos: int) -> tuple[int, Any, Any]:
        """Hand the frames of ``data`` from ``pos`` to ``_msg_now`` until one needs more than a
        call. Answers ``(pos, stop, arg)``: ``stop`` None when the data is used up or ends inside a
        frame (the parser's state then says which, ``pos`` where the rest starts); ``LATER`` with
        the message's arguments and its line's start (``pos`` after the frame); ``ERROR`` with what
        to report (``pos`` after the frame); ``PING``/``PONG`` with their line's start (``pos``
        after the line); ``STOCK`` (``pos`` at the line's start)."""
        buf = self.buf
        take = self.nc._msg_now
        numbers = _NUMBERS
        end = len(data)
        waiting = self.state == AWAITING_MSG_PAYLOAD
        try:
            while pos < end:
                start = pos
                if waiting:  # a frame whose line an earlier read held
                    needed = self.needed
                    if end < needed + 2:
                        break
                    arg = self.msg_arg
                    subject, sid, reply = arg["subject"], arg["sid"], arg["reply"]
                    hsize = self.header_needed
                    self.header_needed = 0
                    self.state = AWAITING_CONTROL_LINE
                    waiting = False
                else:
                    eol = data.find(_CRLF, pos)
                    if eol < 0:
                        break  # no pattern of the stock parser matches before a CRLF: it waits too
                    first = data[pos]
                    if first == _H:
                        line = data[pos:eol]
                        parts = line.split(b" ")
                        n = len(parts)
                        if n == 5:
                            op, subject, sid_text, hsize_text, size = parts
                            reply = b""
                        elif n == 6:
                            op, subject, sid_text, reply, hsize_text, size = parts
                        else:
                            return pos, STOCK, None
                        if op != b"HMSG":
                            return pos, STOCK, None
                        got = numbers.get(hsize_text)  # int | None: `got`, so hsize stays an int (mypyc)
                        if got is None:
                            got = _number(hsize_text)
                            if got is None:
                                return pos, STOCK, None
                        hsize = got
                    elif first == _M:
                        line = data[pos:eol]
                        parts = line.split(b" ")
                        n = len(parts)
                        if n == 4:
                            op, subject, sid_text, size = parts
                            reply = b""
                        elif n == 5:
                            op, subject, sid_text, reply, size = parts
                        else:
                            return pos, STOCK, None
                        if op != b"MSG":
                            return pos, STOCK, None
                        hsize = 0
                    elif first == _P and eol - pos == 4 and (eol + 2 == end or data[eol + 2] not in _BLANK):
                        op = data[pos:eol]
                        if op == b"PING":
                            return eol + 2, PING, pos
                        if op == b"PONG":
                            return eol + 2, PONG, pos
                        return pos, STOCK, None
                    else:
                        return pos, STOCK, None
                    # Separators other than one space, and CR or LF inside a token, are the stock
                    # parser's to judge (int needles: a one-byte bytes needle costs 3x more). An empty
                    # reply (two spaces before the size) is what the grammar reads there too: none.
                    if not subject or 9 in line or 13 in line or 10 in line:
                        return pos, STOCK, None
                    sid = numbers.get(sid_text)
                    if sid is None:
                        sid = _number(sid_text)
                        if sid is None:
                            return pos, STOCK, None
                    got = numbers.get(size)
                    if got is None:
                        got = _number(size)
                        if got is None:
                            return pos, STOCK, None
                    needed = got
                    pos = eol + 2
                    if end - pos < needed + 2:  # the stock parser's state after the line
                        arg = self.msg_arg
                        arg["subject"] = subject
                        arg["sid"] = sid
                        arg["reply"] = reply
                        self.needed = needed
                        self.header_needed = hsize
                        self.state = AWAITING_MSG_PAYLOAD
                        break
                # The frame: header block and payload as the stock parser cuts them (it does not check
                # the CRLF after the payload; a header size over the frame's reads past it, as here).
                if hsize > 0:
                    hdr = data[pos:pos + hsize]
                    # b"" for a header size over the frame's, as Python's slice gives (mypyc's raised SystemError)
                    payload = data[pos + hsize:pos + needed] if hsize < needed else b""
                else:
                    hdr = None
                    payload = data[pos:pos + needed]
                pos += needed + 2
                done = take(sid, subject, reply, payload, hdr)
                if done is not None:
                    if done is LATER:
                        return pos, LATER, (sid, subject, reply, payload, hdr, start)
                    return pos, ERROR, done
        except BaseException:
            if self.buf is buf and pos < end:  # as the stock parser leaves it: the frame taken, the rest kept
                buf.extend(data[pos:])
            raise
        return pos, None, None


__all__ = ["FastParser", "LATER", "parser_support"]
