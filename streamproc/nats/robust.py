"""A nats-py client that survives messages nats-py itself cannot read.

Three inputs any publisher can send make nats-py 2.x lose or kill its connection, and with it every
other request's in-flight chunks:

1. **VT or FF in a subject token.** nats-server splits protocol arguments on space and tab only
   (``splitArg`` in server/parser.go), so ``a\\x0bb`` is one token and is delivered. nats-py's
   ``MSG_RE``/``HMSG_RE`` (``nats/protocol/parser.py``) separate arguments with the regex class ``\\s``,
   which also matches VT and FF: the subject splits, ``int(sid)`` fails, ``ProtocolError`` drops the
   connection, and the reconnect meets the next poison message.
2. **A subject that is not UTF-8.** ``Client._build_message`` decodes it strictly; the
   ``UnicodeDecodeError`` escapes the read loop, which then stops reading for good.
3. **A header block that does not decode** (e.g. a forged inline status line with non-UTF-8 text):
   ``Client._process_headers`` raises, with the same effect as 2.

The fix, in order of preference: 1 is a module-level regex in nats-py, so :func:`install_parser_fix`
replaces the two patterns with ones that split on space/tab like the server (only if they are the
exact patterns this was written against; otherwise it leaves them alone and says so). 2 and 3 are
methods, overridden in :class:`RobustClient`: the subject is decoded with ``surrogateescape`` (the
request-id rule rejects it later, as a contract error) and unreadable headers become one
``Streamproc-Unreadable-Headers`` pseudo-header that the chunk parser rejects.
The upstream bug report text is in docs/operations.md ("limits and abuse").

A fourth way needs no hostile input: a ``flush()`` whose caller is cancelled (a stop, a timeout
around it) leaves its cancelled PONG future in ``Client._pongs``; when that PONG arrives,
``Client._process_pong`` calls ``set_result`` on it, ``InvalidStateError`` escapes the parser, and
``_read_loop`` (which breaks on any ``Exception``) stops reading for good, with one "nats:
encountered error" traceback. :meth:`RobustClient._process_pong` skips a waiter that is done.

A fifth, on the publishing side: nats-server counts a message's header block and body together
against ``max_payload`` and closes a connection that publishes more ("Maximum Payload Violation"),
losing everything written with it; nats-py checks the body alone. A worker's chunk of exactly
``max_payload`` with a short header block has a result with a longer one.
:meth:`RobustClient._send_publish` raises ``MaxPayloadError`` for such a message instead (as
``FastClient._append`` does on the fast path).

A sixth makes ``flush()`` lie rather than lose anything: nats-py 2.16's ``Client._send_ping`` writes
PING straight to the socket, ahead of the commands still waiting in ``_pending`` for the flusher
task, so the PONG can come back before the server has a SUB queued just before it, and another
connection's publish then finds no subscription (seen under load in tests/test_inline_dispatch.py
and tests/test_fast_client.py: the first two messages after ``subscribe(); flush()`` lost).
:meth:`RobustClient._send_ping` writes ``_pending`` first, so a PONG means "everything before it
arrived".

A seventh needs only publish permission on a JetStream ordered consumer's delivery subject (an
inbox): nats-py 2.16 ``Client._process_msg`` reads the reply subject of every message there that is
not a control message as a ``$JS.ACK`` subject (its "checkOrderedMsgs": ``Msg.Metadata.
_get_metadata_fields``, then ``int()`` of two tokens). Any other reply raises ``NotJSMessageError``
(or ``ValueError``), which ends the read loop: the connection stays "connected", reads nothing
more, reports nothing, until its pings go unanswered. For the edge that is every stream (its
results ring is an ordered consumer). Forged control messages (no payload, a ``Status: 100``
header or status line) do the same: a heartbeat whose ``Nats-Last-Consumer`` is not a number
(``ValueError``), one whose ``Nats-Consumer-Stalled`` is not a subject nats-py can publish to
(``BadSubjectError`` from the flow-control reply it sends there); and one naming a subject it can
publish to, or a ``Flow…`` request with such a reply, makes the client publish there with its own
permissions. :meth:`RobustClient._process_msg`, for a JetStream subscription, drops a control
message (as nats-py reads it) whose flow-control reply is not a ``$JS.FC`` subject, and a message
whose reading raises one of those three errors (nats-server refuses a client's publish with a
``$JS.ACK`` reply, so a message from JetStream is never one of them; a stored message with an empty
body and any headers is not a control message and goes on as before); it counts them in
:attr:`RobustClient.foreign_messages` and logs them, rate-limited. A forged heartbeat with a
numeric but wrong ``Nats-Last-Consumer`` still makes nats-py remake an ordered consumer (as a real
gap would): no message is lost, and each needs a real message since the last remake.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable

from nats import errors
from nats.aio.client import Client
from nats.js import api
from nats.protocol import parser as _parser

from ..core.wire import MAX_UNREADABLE_REASON, UNREADABLE_HEADERS, over_header_lines
from ..logs import LogLimiter, error_text, log_event
from .internals import require_stock_support

log = logging.getLogger("streamproc.nats")

# The patterns nats-py 2.x ships (nats/protocol/parser.py), and the same grammar with the separators
# the server uses. Tokens exclude only space, tab, CR and LF.
_UPSTREAM_MSG = b"\\AMSG\\s+([^\\s]+)\\s+([^\\s]+)\\s+(([^\\s]+)[^\\S\r\n]+)?(\\d+)\r\n"
_UPSTREAM_HMSG = b"\\AHMSG\\s+([^\\s]+)\\s+([^\\s]+)\\s+(([^\\s]+)[^\\S\r\n]+)?([\\d]+)\\s+(\\d+)\r\n"
_MSG = rb"\AMSG[ \t]+([^ \t\r\n]+)[ \t]+([^ \t\r\n]+)[ \t]+(([^ \t\r\n]+)[ \t]+)?(\d+)\r\n"
_HMSG = rb"\AHMSG[ \t]+([^ \t\r\n]+)[ \t]+([^ \t\r\n]+)[ \t]+(([^ \t\r\n]+)[ \t]+)?(\d+)[ \t]+(\d+)\r\n"

_installed: bool | None = None


def install_parser_fix() -> bool:
    """Make nats-py split MSG/HMSG arguments on space and tab only. Idempotent; True when in effect."""
    global _installed
    if _installed is not None:
        return _installed
    msg_re, hmsg_re = getattr(_parser, "MSG_RE", None), getattr(_parser, "HMSG_RE", None)
    if msg_re is not None and msg_re.pattern == _MSG and hmsg_re is not None and hmsg_re.pattern == _HMSG:
        _installed = True
    elif msg_re is not None and msg_re.pattern == _UPSTREAM_MSG and hmsg_re is not None \
            and hmsg_re.pattern == _UPSTREAM_HMSG:
        _parser.MSG_RE = re.compile(_MSG)
        _parser.HMSG_RE = re.compile(_HMSG)
        _installed = True
    else:  # a nats-py release with another parser: maybe fixed, maybe not; never patch blind
        _installed = False
        log_event(log, logging.WARNING, "nats_parser_fix_skipped",
                  reason="nats-py's MSG_RE/HMSG_RE differ from the patterns the fix was written for")
    return _installed


class RobustClient(Client):
    """nats-py's client, minus the ways one hostile message ends its read loop (see the module doc)."""

    def __init__(self) -> None:
        # Every client streamproc makes is one of these (new_client, connect below, FastClient): the
        # one stock-internals check runs here, so no path makes one on a nats-py lacking its fixes.
        require_stock_support()
        install_parser_fix()
        super().__init__()
        self.foreign_messages = 0  # dropped from a JetStream consumer's inbox: not from JetStream (module doc)
        self.on_foreign: Callable[[], None] | None = None  # the owner's metric counts each drop too
        self._foreign_log = LogLimiter(log)

    async def _process_msg(self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes) -> None:
        sub = self._subs.get(sid)
        if getattr(sub, "_jsi", None) is None:  # not JetStream: nats-py's (and the other fixes')
            await super()._process_msg(sid, subject, reply, data, headers)  # type: ignore[arg-type]
            return
        if not data and headers:  # maybe a control message: judged as nats-py will read it
            hdr = await self._process_headers(headers)
            control = self._is_control_message(data, hdr) if hdr else None
            if control and not _flow_control_is_jetstream(control, reply, hdr):  # type: ignore[arg-type]
                self._drop_foreign(subject, reply, f"{control}: a flow-control reply that is not a $JS.FC subject")
                return
        try:
            await super()._process_msg(sid, subject, reply, data, headers)  # type: ignore[arg-type]
        except (errors.NotJSMessageError, errors.BadSubjectError, ValueError) as exc:
            # nats-py's reading of what a sender chose: a reply as a $JS.ACK subject, a heartbeat's
            # Nats-Last-Consumer as a number, a flow-control reply as a subject (module doc, the seventh)
            self._drop_foreign(subject, reply, error_text(exc))

    def _drop_foreign(self, subject: bytes, reply: bytes, error: str) -> None:
        self.foreign_messages += 1
        if self.on_foreign is not None:
            self.on_foreign()
        self._foreign_log.log(logging.WARNING, "foreign_message_dropped",
                              subject=subject.decode("utf-8", "replace")[:200],
                              reply=reply.decode("utf-8", "replace")[:200], error=error[:200],
                              problem="a message on a JetStream consumer's inbox that nats-py cannot take: "
                                      "not from JetStream")

    def _build_message(self, sid: int, subject: bytes, reply: bytes, data: bytes,
                       headers: dict[str, str] | None) -> Any:
        # Upstream decodes strictly; surrogateescape keeps every byte and never raises.
        return self.msg_class(subject=subject.decode("utf-8", "surrogateescape"),
                              reply=reply.decode("utf-8", "surrogateescape"),
                              data=data, headers=headers, _client=self, _sid=sid)

    async def _process_headers(self, headers: bytes) -> dict[str, str] | None:
        # nats-py takes one Python step a line (~1 us): a block of ~95,000 lines filling max_payload
        # held the read loop ~110 ms per message. Counted in C, over the bound it is not parsed.
        over = over_header_lines(headers) if headers else None
        if over is not None:
            return over
        try:
            return await super()._process_headers(headers)
        except Exception as exc:  # noqa: BLE001  (any failure here would end the read loop)
            return {UNREADABLE_HEADERS: f"{type(exc).__name__}: {exc}"[:MAX_UNREADABLE_REASON]}


    async def _send_publish(self, subject: str, reply: str, payload: bytes, payload_size: int,
                            headers: dict[str, Any] | None) -> None:
        if headers is not None and payload_size + header_block_size(headers) > self._max_payload:
            raise errors.MaxPayloadError
        await super()._send_publish(subject, reply, payload, payload_size, headers)

    async def _send_ping(self, future: Any = None) -> None:
        self._write_pending()
        await super()._send_ping(future)

    def _write_pending(self) -> int:
        """Write the queued commands now (as nats-py's flusher would); how many were written."""
        if self._pending_data_size <= 0 or self._transport is None:
            return 0
        commands = len(self._pending)
        self._transport.writelines(self._pending[:])
        self._pending = []
        self._pending_data_size = 0
        return commands

    async def _process_pong(self) -> None:
        # nats-py 2.16 Client._process_pong, minus set_result on a waiter that is done already.
        if self._pongs:
            future = self._pongs.pop(0)
            if not future.done():
                future.set_result(True)
            self._pongs_received += 1
            self._pings_outstanding = 0


_FLOW_CONTROL_REPLY = "$JS.FC."


def _flow_control_is_jetstream(control: str, reply: bytes, hdr: dict[str, str]) -> bool:
    """Whether the flow-control reply nats-py 2.16 would publish for this control message (its
    ``_process_msg``: a ``Flow…`` message's reply, an ``Idle…`` heartbeat's ``Nats-Consumer-Stalled``)
    is JetStream's, ``$JS.FC.<stream>.<consumer>.<id>`` (nats-server ``consumer.fcReply``). nats-py
    publishes an empty message there whatever it is: a subject it refuses raised out of its read
    loop; any other made the client publish wherever the sender said, with its permissions."""
    if control.startswith("Flow"):
        return not reply or reply.startswith(_FLOW_CONTROL_REPLY.encode())
    if control.startswith("Idle"):
        stalled = hdr.get(api.Header.CONSUMER_STALLED)
        return not stalled or stalled.startswith(_FLOW_CONTROL_REPLY)
    return True


async def flush_queued(nc: Client) -> None:
    """``nc.flush()`` that returns only once the server has every command queued before it (a SUB),
    whatever client ``nc`` is: on a stock nats-py client the queued commands are written (its
    flusher task, awaited) before the PING that ``flush`` writes ahead of them (the sixth way above)."""
    if not isinstance(nc, RobustClient):
        await nc._flush_pending(force_flush=True)  # nats-py 2.x: resolves once the flusher wrote _pending
    await nc.flush()


async def connect(**options: Any) -> RobustClient:
    """``nats.connect`` with a :class:`RobustClient` (the stock path on any nats-py release, never the
    fast path; :class:`~streamproc.core.errors.NatsPyUnsupported` when nats-py lacks its internals)."""
    nc = RobustClient()
    await nc.connect(**options)
    return nc


def header_block_size(headers: dict[str, Any]) -> int:
    """Bytes of the header block nats-py 2.x's ``Client._send_publish`` builds for ``headers``
    (``NATS/1.0``, ``key: value`` lines of the stripped, non-empty keys and stripped values, the
    blank line; CR and LF in a value become one space each, so they keep their length); 0 for
    headers that nats-py will refuse itself, so its own error is the one raised."""
    try:
        size = 12  # "NATS/1.0\r\n" and the closing "\r\n"
        for k, v in headers.items():
            key = k.strip()
            if key:
                size += len(key.encode()) + len(v.strip().encode()) + 4  # ": " and "\r\n"
        return size
    except Exception:  # noqa: BLE001  (not str: nats-py raises its own error for it)
        return 0
