"""FastClient (streamproc/nats/fast_client.py) is nats-py's behaviour, only faster.

Parse side: the same header dict (or the same robust pseudo-header) as the stock path for random
header blocks, through ``_process_msg``. Publish side: the same wire bytes, or the same exception
(type and text), as stock nats-py's ``publish`` for random subjects and headers. Outside the
supported nats-py range the stock path is used, and the processor still passes chunks through.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import subprocess
import sys

import pytest
from nats.errors import MaxPayloadError
import nats.errors
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.aio.subscription import Subscription

from streamproc.client.publisher import ChunkPublisher
from streamproc.client.results import follow
from streamproc.core.errors import ContractError
from streamproc.core.wire import (MAX_HEADER_LINES, UNREADABLE_HEADERS, Role, Subjects, chunk_headers, result_block,
                                  result_from_message, result_header_block, result_headers, Result, Verdict)
from streamproc.edge.replay import StoredMessage, _parts
from streamproc.nats import fast_client
from streamproc.nats.fast_client import (FastClient, adaptive_gap, _stock_header_block, encode_header_block, fast_path_support,
                                         new_client, parse_header_block)
from streamproc.nats.robust import RobustClient, flush_queued, header_block_size

# ------------------------------------------------------------------------------ parse side

_NAME_BYTES = st.binary(max_size=12) | st.sampled_from(
    [b"Streamproc-Seq", b" Nats-Msg-Id ", b"a b", b"x\x1cy", b"\x0bk", b"caf\xc3\xa9", b"", b"k\tv", b"\x00"])
_VALUE_BYTES = st.binary(max_size=16) | st.sampled_from([b" 12 ", b"\xff\xfe", b"a\rb", b"c\nd", b"\x85x\xa0"])
_LINE = st.one_of(
    st.tuples(_NAME_BYTES, st.sampled_from([b":", b": ", b":\t", b""]), _VALUE_BYTES).map(b"".join),
    st.binary(max_size=20),
)
_STATUS = st.sampled_from([b"\r\n", b" 503\r\n", b" 100 Idle Heartbeat\r\n", b" 404 No Messages\r\n",
                           b" \xff\xfe\r\n", b"\r", b"", b"X\r\n", b" 12"])
_BLOCKS = st.one_of(
    st.tuples(st.just(b"NATS/1.0"), _STATUS, st.lists(_LINE, max_size=6).map(b"\r\n".join),
              st.sampled_from([b"\r\n\r\n", b"\r\n", b""])).map(b"".join),
    st.binary(max_size=40),
    # Arbitrary bytes after a header line, as a raw-socket worker can send them (HPUB): any line,
    # name or value bytes (NUL, 0x80-0xff, lone CR or LF, colons), many lines.
    st.tuples(st.sampled_from([b"NATS/1.0\r\n", b"NATS/1.0 503\r\n", b"NATS/1.0"]), st.binary(max_size=300)).map(b"".join),
    st.lists(st.binary(max_size=24), max_size=40).map(lambda lines: b"NATS/1.0\r\n" + b"\r\n".join(lines) + b"\r\n\r\n"),
    # Around MAX_HEADER_LINES lines, with or without a status line: each side of the bound.
    st.tuples(st.sampled_from([b"NATS/1.0\r\n", b"NATS/1.0 100 Idle Heartbeat\r\n"]),
              st.lists(_LINE, min_size=MAX_HEADER_LINES - 6, max_size=MAX_HEADER_LINES + 2).map(b"\r\n".join),
              st.sampled_from([b"\r\n\r\n", b"\r\n"])).map(b"".join),
)


def _deliver(client: Client, headers: bytes | None) -> object:
    """Run ``client._process_msg`` for one message on a plain subscription; the message's headers,
    or the exception the stock path let escape."""

    async def run():
        errors: list[Exception] = []

        async def on_error(exc: Exception) -> None:
            errors.append(exc)

        client._error_cb = on_error
        sub = Subscription(client, 1, "s")
        client._subs[1] = sub
        await client._process_msg(1, b"s.x", b"", b"body", headers)
        msg = sub._pending_queue.get_nowait()
        assert msg.data == b"body" and msg.subject == "s.x" and not errors
        return msg.headers

    try:
        return asyncio.run(run())
    except Exception as exc:  # noqa: BLE001
        return ("raised", type(exc), str(exc))


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_BLOCKS)
def test_received_headers_are_the_stock_paths_on_random_header_blocks(block):
    fast = _deliver(FastClient(), block)
    lines = block.count(b"\n")
    if lines > MAX_HEADER_LINES:  # deliberately not nats-py's: not parsed (pinned below)
        assert fast == {UNREADABLE_HEADERS: f"{lines} lines, more than the {MAX_HEADER_LINES} a header block may hold"}
        return
    robust = _deliver(RobustClient(), block)  # nats-py's own parse, with the robust wrapper
    assert fast == robust
    stock = _deliver(Client(), block)
    if not (isinstance(stock, tuple) and stock[:1] == ("raised",)):
        assert fast == stock


def test_a_status_line_message_goes_to_nats_pys_own_parser():
    assert _deliver(FastClient(), b"NATS/1.0 503\r\n\r\n") == {"Status": "503"}


@pytest.mark.parametrize("head", [b"NATS/1.0\r\n", b"NATS/1.0 100 Idle Heartbeat\r\n"])
def test_a_header_block_of_more_than_max_header_lines_is_not_parsed_where_stock_nats_py_parses_it(head):
    """Each header line costs a Python step (~110 ms for ~95,000 filling max_payload): a block of more
    than MAX_HEADER_LINES lines (LF bytes) is counted in C and read as unreadable, naming the count and
    the bound, where stock nats-py parses every line; RobustClient (the stock path outside the supported
    nats-py range) keeps the bound. One within it is read as they read it; so is every block the edge's
    stored-result reader decodes."""
    def block(lines: int) -> bytes:  # ``lines`` LF bytes in all
        headers = b"".join(b"X-%d: v\r\n" % i for i in range(lines - 3))
        return head + b"Streamproc-Seq: 0\r\n" + headers + b"\r\n"

    subjects = Subjects()
    within, over = block(MAX_HEADER_LINES), block(MAX_HEADER_LINES + 1)
    assert (within.count(b"\n"), over.count(b"\n")) == (MAX_HEADER_LINES, MAX_HEADER_LINES + 1)
    read = _deliver(FastClient(), within)
    assert read == _deliver(Client(), within) == _deliver(RobustClient(), within)
    assert read["Streamproc-Seq"] == "0" and sum(k.startswith("X-") for k in read) == MAX_HEADER_LINES - 3
    mark = {UNREADABLE_HEADERS: f"{MAX_HEADER_LINES + 1} lines, more than the {MAX_HEADER_LINES} a header block may hold"}
    assert _deliver(FastClient(), over) == mark == _deliver(RobustClient(), over)
    assert _deliver(Client(), over)["Streamproc-Seq"] == "0"
    if head == b"NATS/1.0\r\n":  # the edge's stored results (replay.py) and inline handlers take this parser
        assert parse_header_block(within) == read and parse_header_block(over) == mark
        stored = StoredMessage(subject=subjects.result("r"), seq=1, hdrs=base64.b64encode(over).decode())
        assert _parts(stored)[1] == mark
    with pytest.raises(ContractError, match=f"unreadable header block \\({MAX_HEADER_LINES + 1} lines, more than "
                                            f"the {MAX_HEADER_LINES} a header block may hold\\)"):
        result_from_message(subjects, subjects.result("r"), mark, b"{}")


# ---------------------------------------------------------------------------- publish side

_TEXT = st.text(alphabet=st.sampled_from(list("aZ9-_.!~ \t\r\n:é\x1c\u2028\x85") + ["\ud800"]), max_size=10)
_KEYS = _TEXT | st.sampled_from(["Streamproc-Seq", "Nats-Msg-Id", " traceparent ", "", "  ", "a b", "k:"])
_VALUES = _TEXT | st.sampled_from(["0", " 12 ", "a\r\nb", "\n"]) | st.sampled_from([3, b"raw", None])
_SUBJECTS = st.sampled_from(["s.results.r1", "s.a b", "", "s.\r\n", "s.ok"])


def _connected(cls: type[Client]) -> Client:
    nc = cls()
    nc._status = Client.CONNECTED  # commands pile up in _pending; no flusher
    nc._flush_queue = None
    return nc


def _publish(cls: type[Client], subject: str, payload: bytes, headers) -> object:
    nc = _connected(cls)
    try:
        asyncio.run(nc.publish(subject, payload, headers=headers))
    except Exception as exc:  # noqa: BLE001
        return ("raised", type(exc), str(exc), exc.args)
    assert nc.stats["out_msgs"] == 1 and nc.stats["out_bytes"] == len(payload)
    return b"".join(nc._pending), nc._pending_data_size


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_SUBJECTS, st.binary(max_size=8), st.none() | st.dictionaries(_KEYS, _VALUES, max_size=5))
def test_published_wire_bytes_and_errors_are_stock_nats_pys_on_random_headers(subject, payload, headers):
    stock = _publish(Client, subject, payload, headers)
    assert _publish(FastClient, subject, payload, headers) == stock
    assert _publish(RobustClient, subject, payload, headers) == stock  # its max_payload check aside


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(_KEYS, _VALUES, max_size=5))
def test_the_header_block_size_robust_client_checks_is_the_stock_blocks_length(headers):
    try:
        stock = _stock_header_block(headers)
    except Exception:  # noqa: BLE001  (nats-py refuses these headers itself)
        return
    assert header_block_size(headers) == len(stock)


@pytest.mark.parametrize("cls", [FastClient, RobustClient])
def test_a_message_whose_header_block_and_body_exceed_max_payload_is_refused_before_it_is_written(cls):
    """nats-server counts both and closes the connection on more; stock nats-py counts the body only."""
    headers = {"Streamproc-Seq": "0", "Streamproc-Final": "true"}
    room = 1024 - len(_stock_header_block(headers))
    nc = _connected(cls)
    nc._max_payload = 1024
    asyncio.run(nc.publish("s.ok", b"x" * room, headers=headers))  # exactly max_payload: sent
    with pytest.raises(MaxPayloadError):
        asyncio.run(nc.publish("s.ok", b"x" * (room + 1), headers=headers))
    assert nc.stats["out_msgs"] == 1  # the refused one queued nothing
    stock = _connected(Client)
    stock._max_payload = 1024
    asyncio.run(stock.publish("s.ok", b"x" * (room + 1), headers=headers))  # what the server would close for


def test_header_keys_cached_as_valid_still_reject_the_invalid_ones():
    assert encode_header_block({"Streamproc-Seq": "1"}) == b"NATS/1.0\r\nStreamproc-Seq: 1\r\n\r\n"
    for bad in ({"Streamproc Seq": "1"}, {"Streamproc-Seq\r\nPUB x 1": "1"}):
        assert _publish(FastClient, "s", b"", bad) == _publish(Client, "s", b"", bad)
        assert _publish(FastClient, "s", b"", bad)[1].__name__ == "BadHeaderError"


_PLAIN = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7e), min_size=1, max_size=60)


@settings(max_examples=300, deadline=None)
@given(_PLAIN.filter(lambda s: not set(s) & set(".*>")), st.integers(0, 10**17), st.booleans(),
       st.none() | st.just("") | _PLAIN | _PLAIN.map(lambda s: f"0 {s} x"))
def test_a_preformatted_result_block_is_what_nats_py_sends_for_result_headers(rid, seq, final, traceparent):
    result = Result(rid, seq, b"", final, Verdict.PASSTHROUGH, None, traceparent, ())
    expected = _publish(Client, "s", b"b", result_headers(result))

    async def send() -> bytes:
        nc = _connected(FastClient)
        await nc.publish_header_block("s", b"b", result_header_block(rid, seq, final, traceparent))
        return b"".join(nc._pending), nc._pending_data_size

    assert asyncio.run(send()) == expected

    nc = _connected(FastClient)  # the inline handler's publish: no await, the same bytes and counts
    nc.publish_block_nowait("s", b"b", result_header_block(rid, seq, final, traceparent))
    assert (b"".join(nc._pending), nc._pending_data_size) == expected
    assert nc.stats["out_msgs"] == 1 and nc.stats["out_bytes"] == 1


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=20) | _PLAIN, st.integers(0, 10**17), st.booleans(), st.none() | st.sampled_from(list(Verdict)),
       st.none() | st.text(max_size=20), st.none() | st.just("") | st.text(max_size=20) | _PLAIN)
def test_a_durable_result_block_is_what_nats_py_sends_for_result_headers_or_none(rid, seq, final, verdict, error,
                                                                                 traceparent):
    """OutboxPump.send_nowait sends result_block(r) when it is not None, else the dict's encoding."""
    result = Result(rid, seq, b"", final, verdict, error, traceparent, ())
    block = result_block(result)
    if block is None:
        assert error is not None or not rid.isprintable() or rid != rid.strip() or not rid.isascii() \
            or (traceparent and (traceparent != traceparent.strip() or not traceparent.isprintable()
                                 or not traceparent.isascii()))
        return
    expected = _publish(Client, "s", b"b", result_headers(result))
    nc = _connected(FastClient)
    nc.enqueue("s", b"b", "", block)
    assert (b"".join(nc._pending), nc._pending_data_size) == expected


@settings(max_examples=300, deadline=None)
@given(_PLAIN.filter(lambda s: not set(s) & set(".*>")), st.integers(0, 10**17), st.booleans(),
       st.none() | _PLAIN, st.binary(max_size=64), st.sampled_from(["p", "streamproc", "a" * 40]))
def test_a_passthrough_result_never_exceeds_the_room_checked_before_inline_delivery(rid, seq, final, traceparent,
                                                                                     body, prefix):
    """FastClient._process_msg lets a message go inline only with room in the pending buffer for
    len(payload) + len(received headers) + 2 * len(subject) + 256 bytes: the result command must fit."""
    subjects = Subjects(prefix)
    subject = subjects.chunk(rid, Role.AGG)
    headers = _stock_header_block(chunk_headers(rid, Role.AGG, seq, final=final, traceparent=traceparent))
    nc = _connected(FastClient)
    nc.publish_block_nowait(subjects.result(rid), body, result_header_block(rid, seq, final, traceparent))
    assert nc._pending_data_size <= len(body) + len(headers) + 2 * len(subject.encode()) + 256


# ------------------------------------------------------------------------------ inline delivery

async def _until(done, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not done():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(30)
async def test_no_message_is_delivered_inline_while_an_earlier_one_is_queued_or_in_its_callback(client, fast_client):
    nc = fast_client
    release = asyncio.Event()
    queued: list[bytes] = []
    inline: list[bytes] = []

    async def cb(msg) -> None:
        queued.append(msg.data)
        if msg.data == b"slow":
            await release.wait()

    def handler(subject: str, reply: str, headers, data: bytes) -> bool:
        assert subject == "inline.x" and reply == "" and headers == {"K": "v"}
        if data == b"slow":
            return False
        inline.append(data)
        return True

    sub = await nc.subscribe("inline.>", cb=cb)
    nc.deliver_inline(sub, handler)
    await nc.flush()
    for data in (b"slow", b"a", b"b"):
        await client.publish("inline.x", data, headers={"K": "v"})
    await client.flush()
    await _until(lambda: len(queued) >= 1)
    await asyncio.sleep(0.2)  # a and b have arrived; "slow" is still in its callback
    assert inline == [] and queued == [b"slow"]
    release.set()
    await _until(lambda: len(queued) >= 3)
    assert queued == [b"slow", b"a", b"b"] and inline == []  # in order, behind it
    await client.publish("inline.x", b"c", headers={"K": "v"})  # nothing ahead of it now
    await client.flush()
    await _until(lambda: len(inline) >= 1)
    assert inline == [b"c"] and queued == [b"slow", b"a", b"b"]

    nc._max_pending_size, limit = 1, nc._max_pending_size  # no room for a result: the queue
    await client.publish("inline.x", b"d", headers={"K": "v"})
    await client.flush()
    await _until(lambda: len(queued) >= 4)
    nc._max_pending_size = limit
    assert queued[3] == b"d" and inline == [b"c"]
    nc.stop_inline(sub)
    await client.publish("inline.x", b"e", headers={"K": "v"})
    await client.flush()
    await _until(lambda: len(queued) >= 5)
    assert queued[4] == b"e" and inline == [b"c"]


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(30)
async def test_a_fused_path_that_raises_inline_ends_its_request_with_an_internal_error(client, start_processor):
    """The exception is handed to the queue path, which handles that message as it would have
    (an ``internal`` error result); every other request is still passed through."""
    async with start_processor("in-process", format="sglang", mode="core") as rp:
        core = rp.processor.input
        fused = core._fused
        # (subject, called inline: in the client's read loop task, or with no task at all when the
        # socket's read was handed over eagerly, eager_reads.py; not in the subscription's callback)
        calls: list[tuple[str, bool]] = []

        def flaky(subject, headers, body, now):
            calls.append((subject, asyncio.current_task() in (None, rp.processor.nc._reading_task)))
            if ".boom." in subject:
                raise RuntimeError("fused path bug")
            return fused(subject, headers, body, now)

        core._fused = flaky
        async with follow(client, rp.subjects, "boom", timeout=10) as boom, \
                follow(client, rp.subjects, "fine", timeout=10) as fine:
            publisher = ChunkPublisher(client, rp.subjects)
            await publisher.publish_leg("boom", "agg", [b"x"])
            await publisher.publish_leg("fine", "agg", [b"one", b"two"])
            failed = await boom.collect()
            passed = await fine.collect()
        assert len(failed) == 1 and failed[0].final and failed[0].error == "internal"
        assert b"fused path bug" in failed[0].body
        assert [r.body for r in passed] == [b"one", b"two"] and passed[-1].final
        # once, inline; the queue path re-raised it without a second call
        assert core._inline_error is None and calls[0] == (rp.subjects.chunk("boom", "agg"), True)
        assert [c for c in calls if c[0] == rp.subjects.chunk("boom", "agg")] == [calls[0]]


# ------------------------------------------------------------------------- version range

def test_the_fast_path_is_used_only_inside_the_supported_nats_py_range():
    assert fast_path_support("2.16.0")[0] and fast_path_support("2.16.7")[0]
    for version in ("2.15.3", "2.17.0", "3.0.0", "0.0.0"):
        usable, reason = fast_path_support(version)
        assert not usable and version in reason and "supported range" in reason
    assert fast_path_support()[0], "the installed nats-py is the one the fast path was written for"
    assert type(new_client()) is FastClient


@pytest.mark.parametrize("prop, meaning", [
    ("is_connected", lambda self: self._status == Client.CONNECTED),  # draining no longer counted
    ("is_closed", lambda self: self._status in (Client.CLOSED, Client.DISCONNECTED)),
    ("is_draining_pubs", lambda self: False),
    # eager_reads.py's test per read reads _status for is_closed and is_reconnecting
    ("is_reconnecting", lambda self: self._status in (Client.RECONNECTING, Client.CONNECTING)),
])
def test_the_fast_path_is_off_when_nats_py_connection_states_mean_something_else(monkeypatch, prop, meaning):
    """The publish checks and the eager reads read ``_status`` against the states nats-py 2.16's
    properties name; a nats-py whose properties say otherwise for any state gets the stock path."""
    assert fast_path_support()[0]
    monkeypatch.setattr(Client, prop, property(meaning))
    usable, reason = fast_path_support()
    assert not usable and "connection states" in reason


@pytest.mark.parametrize("change", ["metadata", "track_sequences"])
def test_the_fast_path_is_off_when_nats_py_tracks_an_ordered_consumer_otherwise(monkeypatch, change):
    """``FastClient._ordered_now`` does ``Msg.Metadata._get_metadata_fields`` and
    ``_JSI.track_sequences`` inline; a nats-py where they do something else gets the stock path."""
    from nats.aio.msg import Msg
    from nats.js.client import JetStreamContext

    assert fast_path_support()[0]
    if change == "metadata":  # e.g. a reply of 10 tokens taken too
        fields = Msg.Metadata._get_metadata_fields
        monkeypatch.setattr(Msg.Metadata, "_get_metadata_fields", classmethod(
            lambda cls, reply: reply.split(".") if reply and reply.count(".") == 9 else fields(reply)))
    else:  # e.g. a third attribute kept per message
        track = JetStreamContext._JSI.track_sequences

        def tracking(self, reply):
            track(self, reply)
            self._last_seen = reply
        monkeypatch.setattr(JetStreamContext._JSI, "track_sequences", tracking)
    usable, reason = fast_path_support()
    assert not usable and "ordered consumer bookkeeping" in reason


def test_a_connection_state_nats_py_adds_turns_the_fast_path_off(monkeypatch):
    """A later nats-py with a state of its own (here 7, connected for ``is_connected``) would be
    read as disconnected by the one ``_status`` read: every small state number is checked."""
    connected = Client.is_connected
    monkeypatch.setattr(Client, "is_connected", property(lambda self: self._status == 7 or connected.fget(self)))
    usable, reason = fast_path_support()
    assert not usable and "connection states" in reason


def test_a_nats_py_without_a_state_name_still_imports_and_gets_the_stock_path():
    """The states are read with getattr at import: a missing one must not break importing the
    client (connection.py imports it), only turn the fast path off."""
    code = ("from nats.aio.client import Client; del Client.DRAINING_SUBS; "
            "from streamproc.nats import connection; from streamproc.nats.fast_client import fast_path_support; "
            "print(fast_path_support())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("(False,") and "connection states" in done.stdout


class _EmptyWriter:
    """A socket transport that is not behind: a timer write goes straight to it."""

    max_size = 64 * 1024

    def __init__(self) -> None:
        self.written: list[bytes] = []

    def get_write_buffer_size(self) -> int:
        return 0


class _Transport:
    def __init__(self, writer: _EmptyWriter) -> None:
        self._io_writer = type("W", (), {"transport": writer})()
        self.writer = writer

    def writelines(self, lines) -> None:
        self.writer.written.extend(lines)


@pytest.mark.parametrize("status, writes", [
    (Client.CONNECTED, True), (Client.DRAINING_SUBS, True), (Client.DRAINING_PUBS, True),
    (Client.RECONNECTING, False), (Client.DISCONNECTED, False), (Client.CLOSED, False),
])
@pytest.mark.anyio
async def test_a_timer_write_goes_out_in_every_state_nats_py_calls_connected(status, writes):
    """``_write_pending_now`` writes while nats-py's ``is_connected`` is true (draining included: a
    drain's last publishes must leave) and keeps the commands for the reconnect otherwise."""
    nc = FastClient()
    nc._status = Client.CONNECTED
    nc._max_pending_size = 1 << 20
    nc._flush_queue = None
    nc.enqueue("a.b", b"x", checked=True)
    writer = _EmptyWriter()
    nc._transport = _Transport(writer)
    nc._status = status
    nc._write_pending_now()
    assert bool(writer.written) is writes and bool(nc._pending) is not writes


@pytest.mark.parametrize("status, error, unbuffered", [
    (Client.CLOSED, nats.errors.ConnectionClosedError, nats.errors.ConnectionClosedError),
    (Client.DRAINING_PUBS, nats.errors.ConnectionDrainingError, nats.errors.ConnectionDrainingError),
    # not connected: queued for the reconnect while the pending buffer has room, refused without one
    (Client.RECONNECTING, None, nats.errors.OutboundBufferLimitError),
    (Client.DISCONNECTED, None, nats.errors.OutboundBufferLimitError),
    (Client.DRAINING_SUBS, None, None),  # connected, as nats-py's is_connected says while draining
    (Client.CONNECTED, None, None),
])
@pytest.mark.parametrize("buffered", [True, False])
def test_enqueue_raises_what_stock_publish_raises_in_each_connection_state(status, error, unbuffered, buffered):
    """The one ``_status`` read in the publish checks answers as nats-py 2.16's three properties
    do in ``Client.publish`` (closed, draining pubs, then not connected with a full buffer)."""
    nc = FastClient()
    nc._status = status
    nc._max_pending_size = (1 << 20) if buffered else 0
    nc._flush_queue = None
    expected = error if buffered else unbuffered
    if expected is None:
        nc.enqueue("a.b", b"x", checked=True)
        assert nc._pending and nc._pending[-1].startswith(b"PUB a.b  1\r\n")
    else:
        with pytest.raises(expected):
            nc.enqueue("a.b", b"x", checked=True)
        assert not nc._pending


@pytest.fixture
def unsupported_nats_py(monkeypatch):
    monkeypatch.setattr(fast_client._client, "__version__", "2.99.0")
    monkeypatch.setattr(fast_client, "_support", None)
    yield
    fast_client._support = None


def test_an_unsupported_nats_py_gets_the_stock_path_and_a_warning(unsupported_nats_py, caplog):
    with caplog.at_level(logging.WARNING, logger="streamproc.nats"):
        nc = new_client()
    assert type(nc) is RobustClient and not hasattr(nc, "publish_header_block")
    assert "nats_fast_path_disabled" in caplog.text and "2.99.0" in caplog.text


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(30)
async def test_the_processor_on_the_stock_path_still_passes_chunks_through(unsupported_nats_py, client,
                                                                             start_processor):
    bodies = [b"one", b"two", b"\xffthree"]
    async with start_processor("in-process", format="sglang", mode="core") as rp:
        assert type(rp.processor.nc) is RobustClient and rp.processor.input._fused is None
        async with follow(client, rp.subjects, "stock", timeout=10) as results:
            await ChunkPublisher(client, rp.subjects).publish_leg("stock", "agg", bodies)
            got = await results.collect()
    assert [r.body for r in got] == bodies and [r.seq for r in got] == [0, 1, 2]
    assert all(r.verdict is Verdict.PASSTHROUGH for r in got) and got[-1].final


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(30)
async def test_the_processor_on_the_fast_path_passes_chunks_through(client, start_processor):
    bodies = [b"one", b"two", b"\xffthree"]
    async with start_processor("in-process", format="sglang", mode="core") as rp:
        assert type(rp.processor.nc) is FastClient and rp.processor.input._fused is not None
        async with follow(client, rp.subjects, "fast", timeout=10) as results:
            await ChunkPublisher(client, rp.subjects).publish_leg("fast", "agg", bodies)
            got = await results.collect()
        assert rp.processor.stats.passthrough == 3
    assert [r.body for r in got] == bodies and [r.seq for r in got] == [0, 1, 2]
    assert all(r.verdict is Verdict.PASSTHROUGH for r in got) and got[-1].final


# ------------------------------------------------------------------------------ coalesced writes

async def _arrivals(client, subject: str) -> tuple[list[tuple[bytes, float]], asyncio.Event]:
    got: list[tuple[bytes, float]] = []
    event = asyncio.Event()

    async def on(msg) -> None:
        got.append((msg.data, asyncio.get_running_loop().time()))
        event.set()

    await client.subscribe(subject, cb=on)
    await client.flush()
    return got, event


def _writes(nc: FastClient) -> list[tuple[float, bytes]]:
    """Each socket write ``nc`` makes from now on: (the loop's time at it, the bytes). Timed at the
    writer, not at a subscriber: an arrival also waits for nats-server and for the other
    connection's reads, which a loaded machine stretches by a quarter second and more (arrivals
    0.26 s after an immediate write, gaps between two writes 0.5 s apart seen 0.29 s apart), while
    these tests pin what the client decides."""
    writes: list[tuple[float, bytes]] = []
    loop = asyncio.get_running_loop()
    transport = nc._transport
    writelines = transport.writelines

    def recorded(payload) -> None:
        writes.append((loop.time(), b"".join(payload)))
        writelines(payload)

    transport.writelines = recorded
    return writes


def _write_of(writes: list[tuple[float, bytes]], payload: bytes) -> int | None:
    """The index of the first write that carried the publish of ``payload`` (None: none yet)."""
    for n, (_, data) in enumerate(writes):
        if b"\r\n" + payload + b"\r\n" in data:
            return n
    return None


async def _pinged(writes: list[tuple[float, bytes]]) -> None:
    """Until the PONG to nats-server's first PING (2-2.4 s after connect; the next comes 2 minutes
    later) was written: a write whenever the machine's pace put it, which would take a deferred
    publish along or start an interval of its own."""
    await _until(lambda: any(b"PONG\r\n" in data for _, data in writes))


async def _written_at_once(writes: list[tuple[float, bytes]], payload: bytes) -> int:
    """The write that carried ``payload``, made within a few loop passes: at once, however loaded
    the machine (a write that waited for an interval or a linger would need its timer's time)."""
    for _ in range(5):
        if (n := _write_of(writes, payload)) is not None:
            return n
        await asyncio.sleep(0)
    raise AssertionError(f"{payload!r} not written within 5 loop passes: {writes}")


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(30)
async def test_a_deferred_publish_leaves_with_the_next_write_or_after_its_linger(client, fast_client):
    got, _ = await _arrivals(client, "deferred")
    nc = fast_client
    loop = asyncio.get_running_loop()
    writes = _writes(nc)
    await _pinged(writes)
    nc.defer_linger = 0.5
    sent = loop.time()
    await nc.publish_deferred("deferred", b"c")  # nothing else: leaves at its linger
    due = nc._deferred.when()
    assert sent + nc.defer_linger <= due <= loop.time() + nc.defer_linger
    await _until(lambda: got)
    n = _write_of(writes, b"c")
    assert n is not None and writes[n][0] >= due  # the linger's timer wrote it
    nc.defer_linger = 0.0  # off: a plain publish
    await nc.publish_deferred("deferred", b"d")
    assert nc._deferred is None
    await _written_at_once(writes, b"d")
    # Far longer than anything here could hold the loop up: only the write of b can take a along.
    nc.defer_linger = 10.0
    await nc.publish_deferred("deferred", b"a")
    await asyncio.sleep(0.2)
    assert _write_of(writes, b"a") is None  # waiting for a write to ride on
    await nc.publish("deferred", b"b")  # a write: takes the deferred one along, first
    n = await _written_at_once(writes, b"b")
    assert _write_of(writes, b"a") == n and writes[n][1].index(b"\r\na\r\n") < writes[n][1].index(b"\r\nb\r\n")
    while len(got) < 4:
        await asyncio.sleep(0.01)
    assert [d for d, _ in got] == [b"c", b"d", b"a", b"b"]


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(30)
async def test_publishes_within_the_flush_interval_of_a_write_leave_together_after_it(client, fast_client):
    got, _ = await _arrivals(client, "interval")
    nc = fast_client
    writes = _writes(nc)
    nc.flush_interval = 1.0  # y and z below leave together unless the loop is held up 0.9 s between them
    await _pinged(writes)
    await asyncio.sleep(1.1)  # the connect's own writes and the PONG are older than the interval
    await nc.publish("interval", b"x")  # quiet before: written at once
    x = await _written_at_once(writes, b"x")
    await nc.publish("interval", b"y")  # within the interval of x's write: waits for the rest of it
    await asyncio.sleep(0.1)
    await nc.publish("interval", b"z")
    while len(got) < 3:
        await asyncio.sleep(0.005)
    assert [d for d, _ in got] == [b"x", b"y", b"z"]
    y = _write_of(writes, b"y")
    assert y is not None and _write_of(writes, b"z") == y  # y and z in one write
    assert writes[y][0] - writes[x][0] >= nc.flush_interval - 0.01  # not before the interval ran out


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(30)
async def test_what_before_write_enqueues_leaves_in_that_write_and_what_it_keeps_back_in_the_next(client, fast_client):
    """The durable pump stages results until the client writes (OutboxPump.stage_writes): the hook
    runs at each timer write, its publishes join that write, and when it says it kept some back
    (its byte budget was spent) another write follows after the interval."""
    got, _ = await _arrivals(client, "staged")
    nc = fast_client
    loop = asyncio.get_running_loop()
    writes = _writes(nc)
    nc.flush_interval = 0.3
    staged = [b"a", b"b", b"c"]
    calls: list[float] = []

    def before_write() -> bool:
        calls.append(loop.time())
        if staged:
            nc.enqueue("staged", staged.pop(0))
        return bool(staged)

    nc.before_write = before_write
    await _pinged(writes)
    await asyncio.sleep(0.4)
    nc.stage_write()  # quiet before: a write at once, which takes "a"
    await _written_at_once(writes, b"a")
    while len(got) < 3:
        await asyncio.sleep(0.005)
    assert [d for d, _ in got] == [b"a", b"b", b"c"]
    a, b, c = (_write_of(writes, d) for d in (b"a", b"b", b"c"))
    assert a is not None and b is not None and c is not None and a < b < c  # one per write
    assert writes[b][0] - writes[a][0] >= 0.29 and writes[c][0] - writes[b][0] >= 0.29  # an interval apart
    await asyncio.sleep(0.4)
    assert len(calls) == 3  # nothing kept back after "c": no more writes
    assert nc.room_for_writes() == nc._max_pending_size // 2


def test_the_write_gap_is_the_flush_interval_at_light_load_and_shrinks_with_the_write_rate():
    # 2 ms interval, 12 commands per write wanted: 8 commands every 2 ms (2,000 chunks/s, a result
    # and an ack each) keep the whole interval; 36 every 2 ms (9,000 chunks/s) wait a third of it;
    # a drain never goes below an eighth; nothing measured yet: the interval.
    assert adaptive_gap(0.002, 8, 0.002, 12) == 0.002
    assert adaptive_gap(0.002, 36, 0.002, 12) == pytest.approx(0.002 / 3)
    assert adaptive_gap(0.002, 1000, 0.002, 12) == 0.002 / 8
    assert adaptive_gap(0.002, 0, 0, 12) == 0.002


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(30)
async def test_publishes_coming_faster_than_the_interval_gathers_them_leave_after_a_shorter_gap(client, fast_client):
    got, _ = await _arrivals(client, "gap")
    nc = fast_client
    writes = _writes(nc)
    nc.flush_interval = 0.4
    nc.coalesce_commands = 2  # 2 publishes every 10 ms: the gap falls to its floor, 50 ms, even if a loaded
    decided = []  # the least gap between writes the client holds to, once the rate is known
    for n in range(0, 200, 2):  # machine stretches each 10 ms sleep to 40 ms
        await nc.publish("gap", b"%d" % n)
        await nc.publish("gap", b"%d" % (n + 1))
        await asyncio.sleep(0.01)
        if n >= 100:
            decided.append(nc.write_gap())
    while len(got) < 200:
        await asyncio.sleep(0.01)
    assert [d for d, _ in got] == [b"%d" % n for n in range(200)]
    first = _write_of(writes, b"100")  # after the first second the rate is known
    assert first is not None
    late = [t for t, _ in writes[first:]]
    gaps = sorted(b - a for a, b in zip(late, late[1:]))
    # Not the 0.4 s interval: writes every ~50 ms. The gap the client decided on, each time; the
    # gaps between its writes at the median: a write the loaded machine held up is not the
    # interval's doing (beside two CPU burners one gap of 0.38 s in a run, two of 0.23 s of 13 in
    # another); had the writes waited for the interval, every gap would be 0.4 s or more.
    assert max(decided) < 0.2, decided
    assert len(gaps) >= 4 and gaps[len(gaps) // 2] < 0.2, gaps
    assert nc.write_gap() == pytest.approx(0.05)


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(30)
async def test_reads_pause_after_a_small_write_at_light_load_but_not_while_the_gap_is_shortened(fast_client):
    nc = fast_client
    nc.flush_interval = 0.4
    nc.pause_reads = True
    nc.coalesce_commands = 2
    await asyncio.sleep(0.5)
    nc.enqueue("pause", b"alone")  # after a quiet spell: written at once, then reads pause
    await _until(lambda: nc._resume_timer is not None)
    await _until(lambda: nc._resume_timer is None)  # resumed after the interval
    for n in range(150):  # a publish every 10 ms: the gap falls to its floor
        nc.enqueue("pause", b"%d" % n)
        await asyncio.sleep(0.01)
        if n > 100:
            assert nc.write_gap() < nc.flush_interval and nc._resume_timer is None


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(30)
@pytest.mark.parametrize("client_class", [RobustClient, FastClient])
async def test_a_cancelled_flush_does_not_stop_the_connection_reading(client, nats_url, client_class):
    """nats-py 2.16 sets the result of the oldest PONG waiter without looking: the cancelled flush's
    future raised InvalidStateError in the read loop, which then stopped reading for good (seen once
    in CI as a traceback from a processor killed mid-migration)."""
    nc = client_class()
    await nc.connect(servers=[nats_url])
    try:
        sub = await nc.subscribe("after.pong")
        await nc.flush()
        flushing = asyncio.get_running_loop().create_task(nc.flush())
        await asyncio.sleep(0)  # its PING is queued, its PONG not back yet
        flushing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await flushing
        await asyncio.sleep(0.2)  # the PONG arrives for a cancelled waiter
        await client.publish("after.pong", b"still reading")
        await client.flush()
        msg = await sub.next_msg(timeout=5)
        assert msg.data == b"still reading" and not nc._reading_task.done()
    finally:
        await nc.close()


class WireRecorder:
    """A minimal NATS server on a free port: INFO, PONG for every PING, and every command line the
    client sends after its CONNECT, in arrival order."""

    def __init__(self) -> None:
        self.lines: list[bytes] = []
        self.server: asyncio.AbstractServer | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return "nats://127.0.0.1:%d" % self.server.sockets[0].getsockname()[1]

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b'INFO {"server_id":"rec","version":"2.10.0","max_payload":1048576,"headers":true,"proto":1}\r\n')
        connected = False
        while line := await reader.readline():
            if line.startswith(b"PING"):
                writer.write(b"PONG\r\n")
            if connected:
                self.lines.append(line.split(b" ")[0].strip())
            connected = connected or line.startswith(b"CONNECT")


@pytest.mark.anyio
@pytest.mark.timeout(30)
@pytest.mark.parametrize("client_class", [Client, RobustClient, FastClient])
async def test_flush_after_subscribe_writes_the_sub_before_its_ping(client_class):
    """A PONG must mean the server has everything sent before the flush: nats-py 2.16's
    ``Client._send_ping`` writes PING ahead of the SUB still queued for its flusher task (pinned
    here, so an upstream fix shows), and another connection's publish could then miss the
    subscription (the first two messages of test_publishes_coming_faster_... were lost under load).
    RobustClient and FastClient write the queued commands first."""
    recorder = WireRecorder()
    async with recorder as url:
        nc = client_class()
        await nc.connect(servers=[url], allow_reconnect=False)
        try:
            recorder.lines.clear()  # the handshake's PING
            await nc.subscribe("ordered")
            await nc.flush()
            wire = [line for line in recorder.lines if line in (b"SUB", b"PING")][:2]
        finally:
            await nc.close()
    expected = [b"PING", b"SUB"] if client_class is Client else [b"SUB", b"PING"]
    assert wire == expected, wire


@pytest.mark.anyio
@pytest.mark.timeout(30)
@pytest.mark.parametrize("client_class", [Client, RobustClient])
async def test_flush_queued_writes_the_sub_before_the_ping_on_any_client(client_class):
    """The client helpers (``follow``, ``ResultCollector``) take the caller's connection, often a
    stock nats-py one: ``flush_queued`` has its flusher write the SUB before the PING."""
    recorder = WireRecorder()
    async with recorder as url:
        nc = client_class()
        await nc.connect(servers=[url], allow_reconnect=False)
        try:
            recorder.lines.clear()
            await nc.subscribe("ordered")
            await flush_queued(nc)
            wire = [line for line in recorder.lines if line in (b"SUB", b"PING")][:2]
        finally:
            await nc.close()
    assert wire == [b"SUB", b"PING"], wire


async def _pong_on_ping(nc: FastClient) -> None:
    """``nc`` answers each message on ``ping`` inline with its payload's first 8 bytes on ``pong``
    (small answers: reads pause after their writes)."""
    def handler(subject: str, reply: str, headers, data: bytes) -> bool:
        nc.enqueue("pong", data[:8])
        return True

    sub = await nc.subscribe("ping")
    nc.deliver_inline(sub, handler)
    await nc.flush()


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(30)
async def test_a_write_due_when_a_read_ends_leaves_in_that_reads_loop_pass(client, fast_client):
    """A reply enqueued by an inline handler, when the write gap has passed, is written at the end of
    the read that made it, not from a timer due at once (one more loop pass per write at light load)."""
    nc = fast_client
    nc.flush_interval = 0.3
    got, _ = await _arrivals(client, "pong")
    seen: list[tuple[int, bool]] = []

    def handler(subject: str, reply: str, headers, data: bytes) -> bool:
        loop = asyncio.get_running_loop()
        if nc._last_write + nc.write_gap() > loop.time():
            return False  # a write of nc's own came within the gap (a PONG to the server's PING): not this case
        nc.enqueue("pong", data)
        # Runs in the next loop pass, ahead of any timer that falls due in it.
        loop.call_soon(lambda: seen.append((nc._pending_data_size, nc._write_timer is None)))
        return True

    sub = await nc.subscribe("ping")
    nc.deliver_inline(sub, handler)
    await nc.flush()
    await asyncio.sleep(2.5)  # past nats-server's first PING to a new client (2 s; our PONG is a write too)
    for n in range(3):
        await asyncio.sleep(0.4)  # a quiet spell: each reply is due at once
        await client.publish("ping", b"%d" % n)
        await client.flush()
        await asyncio.sleep(0.1)
    assert len(seen) >= 2
    assert seen == [(0, True)] * len(seen)  # written before the next loop pass; no timer left


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(30)
async def test_what_arrives_while_reads_pause_is_read_and_answered_when_the_pause_ends_without_resuming_reads(
        client, fast_client):
    """The resume timer reads what arrived during the pause itself; when that read's answer pauses
    reads again, the transport is never resumed in between (no epoll_ctl pair, no loop pass for the
    read and another for its write). Once a pause ends with nothing to read, reads resume."""
    nc = fast_client
    nc.flush_interval = 0.5
    nc.pause_reads = True
    await _pong_on_ping(nc)
    transport = nc._transport._io_writer.transport
    resumes: list[float] = []
    resume = transport.resume_reading

    def counting_resume() -> None:
        resumes.append(asyncio.get_running_loop().time())
        resume()

    transport.resume_reading = counting_resume
    got: list[tuple[bytes, int]] = []

    async def on_pong(msg) -> None:  # each pong brings the next ping, which arrives while reads pause
        got.append((msg.data, len(resumes)))
        if len(got) < 5:
            await client.publish("ping", b"%d" % len(got))

    await client.subscribe("pong", cb=on_pong)
    await client.flush()
    await asyncio.sleep(0.6)
    await client.publish("ping", b"0")
    await client.flush()
    await _until(lambda: len(got) >= 5)
    assert [d for d, _ in got] == [b"0", b"1", b"2", b"3", b"4"]
    assert [r for _, r in got] == [0] * 5  # every ping read by the resume timer, reads never resumed
    await _until(lambda: resumes)  # the pause after the last pong found nothing: reads resume
    await asyncio.sleep(0.6)
    sent = asyncio.get_running_loop().time()
    await client.publish("ping", b"5")
    await client.flush()
    await _until(lambda: len(got) >= 6)
    assert got[5][0] == b"5" and asyncio.get_running_loop().time() - sent < 0.4  # read and answered at once


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(30)
async def test_more_than_a_read_arriving_during_a_pause_is_all_answered_in_order_a_read_or_two_per_pause(
        client, fast_client):
    """Over three reads' worth (64 KiB each) arrives during a pause, and the answers are small (reads
    pause after each of their writes): what the resume timer's read leaves in the socket is read at
    the next pauses' ends, nothing waits longer. (Before the timer read, the loop took one or two
    reads per pause here too: a small write pauses reads whatever the socket holds.)"""
    nc = fast_client
    nc.flush_interval = 0.5
    nc.pause_reads = True
    await _pong_on_ping(nc)
    got, _ = await _arrivals(client, "pong")
    await asyncio.sleep(0.6)
    await client.publish("ping", b"first")  # answered at once; reads pause for 0.5 s
    await client.flush()
    await _until(lambda: len(got) >= 1)
    big = [b"%d" % n + b"x" * 30_000 for n in range(8)]  # 240 KB during the pause
    for data in big:
        await client.publish("ping", data)
    await client.flush()
    await _until(lambda: len(got) >= 9)
    assert [d for d, _ in got] == [b"first", *(b[:8] for b in big)]
    times = [t for _, t in got[1:]]
    assert max(times) - min(times) < 2.25  # 240 KB: at most four reads, a gap (0.5 s) apart
