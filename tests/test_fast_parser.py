"""FastParser (streamproc/nats/fast_parser.py) is nats-py's protocol parser, only faster.

Random sequences of server frames (MSG/HMSG with random subjects, sids, replies, header blocks and
payloads of 0 to over 64 KiB, interleaved PING/PONG/INFO/+OK/-ERR, and malformed frames: bad or
huge sizes, missing CRLFs, odd separators, garbage), cut at random read boundaries, give the same
calls, the same exceptions and the same parser state after every read as nats-py's own ``Parser``
(with robust.py's grammar, which the read loop uses). Then the same through real clients (pending
limits, slow consumers, max_msgs) and over a real nats-server.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from helpers import raw_hpub, raw_protocol, wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.protocol.parser import Parser

from streamproc.nats.fast_client import FastClient
from streamproc.nats.fast_parser import LATER, FastParser, parser_support
from streamproc.nats.robust import RobustClient, install_parser_fix

install_parser_fix()  # the grammar every streamproc connection parses with

# ------------------------------------------------------------------------------ frames

_TOKEN_BYTES = [c for c in range(256) if c not in b" \t\r\n"]
_token = st.one_of(
    st.sampled_from([b"P.results.r1", b"_INBOX.x.1", b"a", b"caf\xc3\xa9", b"a\x0bb", b"x\x0cy", b"\xff"]),
    st.lists(st.sampled_from(_TOKEN_BYTES), min_size=1, max_size=12).map(bytes),
)
_size = st.one_of(st.integers(0, 300), st.integers(65_000, 70_000))
_header_block = st.one_of(
    st.sampled_from([b"NATS/1.0\r\nStreamproc-Seq: 3\r\nStreamproc-Final: 0\r\n\r\n", b"NATS/1.0 503\r\n\r\n",
                     b"NATS/1.0 100 Idle Heartbeat\r\nNats-Last-Consumer: 1\r\n\r\n", b"NATS/1.0\r\n\r\n", b""]),
    st.binary(max_size=40),
)
_sep = st.sampled_from([b"  ", b"\t", b" \t", b"\t ", b"\x0b", b""])
_number = st.one_of(st.integers(0, 10**6).map(lambda n: str(n).encode()),
                    st.sampled_from([b"1a", b"-1", b"+1", b"1_0", b"\xd9\xa3", b"", b"0007", b"9" * 25]))
_control = st.sampled_from([
    b"PING\r\n", b"PONG\r\n", b"+OK\r\n", b"-ERR 'Stale Connection'\r\n", b"-ERR 'Authorization Violation'\r\n",
    b'INFO {"server_id":"x","max_payload":1048576}\r\n', b"PING \r\n", b"PONG\r\n\r\n", b"PING\r\n \r\n",
    b"ping\r\n", b"PINGX\r\n", b"+OK \r\n", b"-ERR\r\n", b"-ERR \r\n", b"INFO {bad\r\n", b"\r\n", b"XYZ 1\r\n",
    b"MSG a 1 5", b"PONG", b"P\r\n", b"HMSG a 1 2\r\n", b"MSG\r\n",
])


@st.composite
def _msg_frame(draw) -> bytes:
    """One MSG or HMSG frame: mostly well formed, sometimes broken in the ways the stock parser judges."""
    headers = draw(st.booleans())
    subject = draw(_token)
    sid = str(draw(st.sampled_from(range(1, 41)))).encode()
    reply = draw(st.one_of(st.none(), _token))
    block = draw(_header_block) if headers else b""
    seed = draw(st.binary(min_size=1, max_size=8))
    n = draw(_size)
    payload = (seed * (n // len(seed) + 1))[:n]
    hsize, total = str(len(block)).encode(), str(len(block) + n).encode()
    fault = draw(st.sampled_from([None] * 8 + ["sep", "token", "sid", "size", "hsize", "off", "crlf", "huge", "cut"]))
    if fault == "token":  # a tab, CR or LF inside the subject or the reply
        odd = draw(st.sampled_from([b"\t", b"\r", b"\n"]))
        if reply is not None and draw(st.booleans()):
            reply = odd + reply if draw(st.booleans()) else reply + odd
        else:
            subject = odd + subject if draw(st.booleans()) else subject + odd
    seps = [b" "] * 6
    if fault == "sep":
        seps[draw(st.integers(0, 5))] = draw(_sep)
    if fault == "sid":
        sid = draw(_number)
    if fault == "size":
        total = draw(_number)
    if fault == "hsize":
        hsize = draw(_number)
    if fault == "off":  # the declared size misses the payload's
        total = str(max(0, len(block) + n + draw(st.integers(-3, 3)))).encode()
    if fault == "huge":  # over any max_payload: the stock parser only waits for it
        total = str(draw(st.integers(2**21, 10**12))).encode()
    args = [subject, sid] + ([reply] if reply is not None else [])
    if headers:
        args += [hsize, total]
    else:
        args += [total]
    line = (b"HMSG" if headers else b"MSG") + b"".join(sep + arg for sep, arg in zip(seps, args))
    frame = line + b"\r\n" + block + payload + (b"" if fault == "crlf" else b"\r\n")
    if fault == "cut":
        frame = frame[:draw(st.integers(0, len(frame)))]
    return frame


_stream = st.lists(st.one_of(_msg_frame(), _msg_frame(), _msg_frame(), _control), max_size=14)


def _cuts(data: bytes, draw_points: list[int]) -> list[bytes]:
    points = sorted({p % (len(data) + 1) for p in draw_points})
    out, last = [], 0
    for p in points + [len(data)]:
        out.append(data[last:p])
        last = p
    return out


class _Recorder:
    """The client side of a parser: every call it gets, in order. Sids pick the path: a multiple of
    5 declines ``_msg_now`` (LATER), of 7 is a slow consumer, 13 raises, and a PONG or the error
    callback may reset the parser (a reconnect while it awaits)."""

    def __init__(self, reset_on_pong: bool) -> None:
        self.calls: list[tuple] = []
        self.reset_on_pong = reset_on_pong
        self.parser: Parser | None = None

    def _record(self, sid, subject, reply, payload, hdr) -> None:
        assert type(payload) is bytes and (hdr is None or type(hdr) is bytes)
        self.calls.append(("msg", sid, bytes(subject), bytes(reply), payload, hdr))
        if sid == 13:
            raise RuntimeError("callback failed")

    def _msg_now(self, sid, subject, reply, payload, hdr):
        if sid % 5 == 0:
            return LATER
        self._record(sid, subject, reply, payload, hdr)
        return ("slow", sid) if sid % 7 == 0 else None

    async def _process_msg(self, sid, subject, reply, payload, hdr) -> None:
        self._record(sid, subject, reply, payload, hdr)
        if sid % 7 == 0:
            await self._error_cb(("slow", sid))

    async def _error_cb(self, err) -> None:
        self.calls.append(("error_cb", err))
        if self.reset_on_pong and err[1] > 20:
            self.parser.reset()

    async def _process_ping(self) -> None:
        self.calls.append(("ping",))

    async def _process_pong(self) -> None:
        self.calls.append(("pong",))
        if self.reset_on_pong:
            self.parser.reset()

    async def _process_info(self, info) -> None:
        self.calls.append(("info", info))

    async def _process_err(self, err) -> None:
        self.calls.append(("err", err))


def _state(parser: Parser) -> tuple:
    waiting = parser.state == 2
    return (bytes(parser.buf), parser.state, parser.needed if waiting else None, parser.header_needed,
            dict(parser.msg_arg) if waiting else None)


async def _feed(parser_class: type, reads: list[bytes], reset_on_pong: bool,
                nc: _Recorder | None = None) -> tuple[list, list]:
    nc = nc if nc is not None else _Recorder(reset_on_pong)
    parser = nc.parser = parser_class(nc)
    states = []
    for read in reads:
        try:
            await parser.parse(read)
        except Exception as exc:  # noqa: BLE001  (the read loop stops at the first)
            nc.calls.append(("raised", type(exc).__name__, str(exc)))
            states.append(_state(parser))
            break
        states.append(_state(parser))
    return nc.calls, states


def test_the_fast_parser_mirrors_the_installed_grammar():
    assert parser_support() == (True, "parser")
    assert type(FastClient()._ps) is FastParser


def test_a_parser_grammar_other_than_the_mirrored_one_gets_the_stock_parser_and_a_warning(monkeypatch, caplog):
    from nats.protocol import parser as nats_parser

    from streamproc.nats import fast_client

    monkeypatch.setattr(nats_parser, "MSG_RE", nats_parser.re.compile(rb"\AMSG\s+(\S+)\s+(\S+)\s+((\S+)\s+)?(\d+)\r\n"))
    monkeypatch.setattr(fast_client, "_parser_ok", None)
    with caplog.at_level("WARNING", logger="streamproc.nats"):
        client = FastClient()
    assert type(client._ps) is Parser
    assert not client.calls_read_done  # the stock parser never calls it: the edge flushes its own way
    assert parser_support() == (False, "parser internals differ: MSG_RE (robust.py's)")
    assert "nats_fast_parser_disabled" in caplog.text


@settings(max_examples=700, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(_stream, st.lists(st.integers(0, 2**31), max_size=12), st.booleans())
def test_random_frames_cut_anywhere_give_the_stock_parsers_calls_errors_and_state(frames, points, reset_on_pong):
    reads = _cuts(b"".join(frames), points)
    fast = asyncio.run(_feed(FastParser, reads, reset_on_pong))
    stock = asyncio.run(_feed(Parser, reads, reset_on_pong))
    assert fast == stock


class _NoResetOnError(_Recorder):
    """A recorder whose error callback never resets the parser: nats-py's does not (a reset comes
    with a reconnect, whose read loop is a new task), and an eagerly reported error runs in a task
    of its own (eager_reads.py), not inside the parse it came from."""

    async def _error_cb(self, err) -> None:
        self.calls.append(("error_cb", err))


async def _feed_eagerly(reads: list[bytes], reset_on_pong: bool) -> tuple[list, list]:
    """What EagerReads does with each read: ``parse_now`` when the parser is between frames (the
    read loop parked, nothing buffered), the error callbacks it reports, then the read loop's
    ``parse`` of the rest it hands back; ``parse`` alone otherwise."""
    nc = _NoResetOnError(reset_on_pong)
    parser = nc.parser = FastParser(nc)
    states = []
    for read in reads:
        try:
            if not parser.buf and parser.state == 1:
                reported: list = []
                rest = parser.parse_now(read, reported.append)
                for err in reported:  # its task runs before the read loop wakes up for the rest
                    await nc._error_cb(err)
                if rest:
                    await parser.parse(rest)
            else:
                await parser.parse(read)
        except Exception as exc:  # noqa: BLE001  (set on the reader: the read loop stops at the first)
            nc.calls.append(("raised", type(exc).__name__, str(exc)))
            states.append(_state(parser))
            break
        states.append(_state(parser))
    return nc.calls, states


@settings(max_examples=700, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(_stream, st.lists(st.integers(0, 2**31), max_size=12), st.booleans())
def test_frames_handed_over_eagerly_give_the_stock_parsers_calls_errors_and_state(frames, points, reset_on_pong):
    """parse_now stops at the first frame that needs an await and hands back the bytes from it, the
    parser as before that frame: with the read loop parsing those, every call, error and state after
    each read is the stock parser's."""
    reads = _cuts(b"".join(frames), points)
    eager = asyncio.run(_feed_eagerly(reads, reset_on_pong))
    nc = _NoResetOnError(reset_on_pong)
    stock = asyncio.run(_feed(Parser, reads, reset_on_pong, nc))
    assert eager == stock


class _ReadDoneRecorder(_Recorder):
    """A recorder with ``read_done`` (FastClient's end-of-read hook, where the edge writes the SSE
    frames of the messages handed over): counts messages handed over since the hook last ran, and
    notes every await the parser begins while one handed over synchronously is still unwritten."""

    def __init__(self, reset_on_pong: bool) -> None:
        super().__init__(reset_on_pong)
        self.unwritten = 0  # messages handed over (either path) since read_done
        self.taken_now = 0  # of those, taken by _msg_now (no await between them and the frame)
        self.awaited_unwritten: list[tuple] = []

    def read_done(self) -> None:
        self.unwritten = self.taken_now = 0

    def _record(self, sid, subject, reply, payload, hdr) -> None:
        self.unwritten += 1
        super()._record(sid, subject, reply, payload, hdr)

    def _msg_now(self, sid, subject, reply, payload, hdr):
        result = super()._msg_now(sid, subject, reply, payload, hdr)
        if result is not LATER:
            self.taken_now += 1
        return result

    def _before_await(self, what: str) -> None:
        if self.taken_now:
            self.awaited_unwritten.append((what, self.taken_now))

    async def _process_msg(self, sid, subject, reply, payload, hdr) -> None:
        self._before_await("msg")
        await super()._process_msg(sid, subject, reply, payload, hdr)

    async def _error_cb(self, err) -> None:
        self._before_await("error_cb")
        await super()._error_cb(err)

    async def _process_ping(self) -> None:
        self._before_await("ping")
        await super()._process_ping()

    async def _process_pong(self) -> None:
        self._before_await("pong")
        await super()._process_pong()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(_stream, st.lists(st.integers(0, 2**31), max_size=12), st.booleans())
def test_read_done_follows_every_handed_over_message_before_any_await_and_at_the_end_of_each_read(
        frames, points, reset_on_pong):
    """The edge no longer schedules a loop pass to write a read's direct SSE frames (edge/direct.py
    WriteBatch): it relies on ``read_done``. So the parser runs it before it awaits anything (a task
    could write to the same stream meanwhile) and when each read ends, also by an exception."""
    reads = _cuts(b"".join(frames), points)

    async def feed() -> _ReadDoneRecorder:
        nc = _ReadDoneRecorder(reset_on_pong)
        parser = nc.parser = FastParser(nc)
        for read in reads:
            try:
                await parser.parse(read)
            except Exception:  # noqa: BLE001  (the read loop stops at the first)
                assert nc.unwritten == 0, "a read that raised left messages unwritten"
                break
            assert nc.unwritten == 0, "a read ended with messages unwritten"
        return nc

    nc = asyncio.run(feed())
    assert nc.awaited_unwritten == []


def test_a_message_the_stock_parser_hands_over_is_followed_by_read_done_before_that_parser_awaits():
    """A line the fast parser does not read (``+OK`` here) hands the rest of the read to nats-py's
    parser, which calls ``_process_msg`` per message and may await between two (here a slow
    consumer's error callback). FastClient runs ``read_done`` after each such message, so the
    edge's direct SSE frames of the first do not wait through that await."""

    async def run() -> list[str]:
        nc = FastClient()
        events: list[str] = []

        async def on_error(exc: Exception) -> None:
            events.append("error_cb")

        class Recording(asyncio.Queue):
            def put_nowait(self, item) -> None:
                events.append(f"msg {item.data.decode()}")
                super().put_nowait(item)

        taken, full = Subscription(nc, 1, "a"), Subscription(nc, 2, "b", pending_msgs_limit=1)
        taken._pending_queue = Recording()
        full._pending_queue.put_nowait(None)  # full: its next message is a slow consumer's drop
        nc._subs.update({1: taken, 2: full})
        nc._error_cb = on_error
        nc.read_done = lambda: events.append("done")
        await nc._ps.parse(b"+OK\r\nMSG a 1 1\r\nx\r\nMSG b 2 1\r\ny\r\n")
        return events

    events = asyncio.run(run())
    taken_at, awaited_at = events.index("msg x"), events.index("error_cb")
    assert taken_at < awaited_at and "done" in events[taken_at:awaited_at] and events[-1] == "done", events


def test_parse_now_hands_back_the_frame_that_needs_an_await_and_keeps_an_unfinished_one():
    calls: list = []

    class Client:
        def _msg_now(self, sid, subject, reply, payload, hdr):
            calls.append((sid, payload))
            return LATER if sid == 5 else ("slow", sid) if sid == 7 else None

    parser = FastParser(Client())
    later = b"MSG a 5 1\r\nb\r\nMSG a 1 1\r\nc\r\n"
    assert parser.parse_now(b"MSG a 1 1\r\na\r\n" + later, calls.append) == later
    assert calls == [(1, b"a"), (5, b"b")] and parser.state == 1 and not parser.buf  # 5 declined: nothing done
    calls.clear()
    assert parser.parse_now(b"MSG a 7 1\r\nx\r\nPING\r\n", calls.append) == b"PING\r\n"
    assert calls == [(7, b"x"), ("slow", 7)]  # taken, reported, then the rest is the read loop's
    assert parser.parse_now(b"PING\r\nMSG a 1 1\r\nc\r\n", calls.append) == b"PING\r\nMSG a 1 1\r\nc\r\n"
    assert parser.parse_now(b"INFO {}\r\n", calls.append) == b"INFO {}\r\n"
    assert parser.parse_now(b"MSG a 1 5\r\nab", calls.append) == b""  # unfinished: kept, as parse keeps it
    assert parser.state == 2 and bytes(parser.buf) == b"ab" and parser.needed == 5


@pytest.mark.parametrize("data", [
    b"MSG a 1 999999999999\r\nxx",  # huge declared size: both wait
    b"MSG a 1x 2\r\nab\r\n",  # bad sid: malformed MSG
    b"MSG a 1 2\r\nabXYMSG b 1 1\r\nc\r\n",  # missing CRLF after the payload: two bytes skipped, unchecked
    b"MSG a 1 2 3\r\n",  # too many arguments: unknown protocol
    b"HMSG a 1 9 4\r\nabcd\r\nMSG b 1 0\r\n\r\n",  # header size over the frame's
    b"MSG a\t1 1\r\nx\r\n",  # a tab separates, as the server's splitArg does
    b"PING\r\n\r\nMSG a 1 0\r\n\r\n",  # PING_RE's \s* runs over the next line
    b"INFO {bad\r\n", b"-ERR\r\n", b"-ERR 'x'\r\nPONG\r\n", b"X" * 5000 + b"\r\n",
    b"MSG a 1 " + b"9" * 5000 + b"\r\n",  # over int()'s digit limit: malformed MSG, not a ValueError
    b"MSG  1 5\r\nhello\r\n", b"MSG a\rb 1 1\r\nx\r\n", b"MSG a 1 r\nb 1\r\nx\r\n", b"MSG \ta 1 1\r\nx\r\n", b"HMSG a 1  2 2\r\nxy\r\n",
])
def test_malformed_frames_give_the_stock_parsers_result(data):
    for reads in ([data], [data[:7], data[7:]], [bytes([b]) for b in data]):
        assert asyncio.run(_feed(FastParser, reads, False)) == asyncio.run(_feed(Parser, reads, False))


# ------------------------------------------------------------------------------ through real clients

_HEADERED = st.one_of(st.none(), st.sampled_from([
    b"NATS/1.0\r\nStreamproc-Seq: 3\r\nX: y\r\n\r\n", b"NATS/1.0 503\r\n\r\n", b"NATS/1.0\r\n\r\n",
    b"NATS/1.0 404 No Messages\r\n\r\n", b"NATS/1.0\r\nk: \xff\r\n\r\n"]))


def _observe(client: Client) -> dict:
    subs = {sid: (sub._received, sub._pending_size, sub._pending_queue.qsize()) for sid, sub in client._subs.items()}
    return {"subs": subs, "in_msgs": client.stats["in_msgs"], "in_bytes": client.stats["in_bytes"]}


async def _through(client: Client, reads: list[bytes]) -> tuple:
    errors: list = []

    async def on_error(exc: Exception) -> None:
        errors.append((type(exc).__name__, exc.sid, exc.subject))

    client._error_cb = on_error
    subs = [Subscription(client, 1, "a", pending_msgs_limit=3), Subscription(client, 2, "b", max_msgs=4),
            Subscription(client, 3, "c", pending_bytes_limit=200), Subscription(client, 4, "d")]
    subs[3]._future = asyncio.get_running_loop().create_future()  # an old-style request: nats-py's own path
    queues = {sub._id: sub._pending_queue for sub in subs}
    for sub in subs:
        client._subs[sub._id] = sub
    seen = []
    for read in reads:
        try:
            await client._ps.parse(read)
        except Exception as exc:  # noqa: BLE001  (a second reply to an old-style request; the read loop stops)
            seen.append(("raised", type(exc).__name__))
            break
        seen.append(_observe(client))
    msgs = {sid: [(m.subject, m.reply, m.data, m.headers, m._sid) for m in q._queue] for sid, q in queues.items()}
    return seen, msgs, errors, subs[3]._future.done() and subs[3]._future.result().data


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from([1, 2, 3, 4, 9]), _token, st.one_of(st.none(), _token), _HEADERED,
                          st.sampled_from([0, 1, 50, 100]).map(lambda n: b"b" * n)), max_size=16),
       st.lists(st.integers(0, 2**31), max_size=8))
def test_clients_reading_random_messages_queue_count_and_drop_as_stock_nats_py(messages, points):
    data = b"".join(
        (b"HMSG %s %d %s%d %d\r\n%s%s\r\n" % (subject, sid, reply + b" " if reply else b"", len(hdr),
                                             len(hdr) + len(body), hdr, body) if hdr is not None else
         b"MSG %s %d %s%d\r\n%s\r\n" % (subject, sid, reply + b" " if reply else b"", len(body), body))
        for sid, subject, reply, hdr, body in messages)
    reads = _cuts(data, points)
    fast, robust = FastClient(), RobustClient()
    assert type(fast._ps) is FastParser and type(robust._ps) is Parser
    assert asyncio.run(_through(fast, reads)) == asyncio.run(_through(robust, reads))


# ------------------------------------------------------------------------------ over a real server


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(60)
async def test_a_fast_client_receives_what_a_stock_client_receives_from_a_real_server(nats_url):
    rng = random.Random(14)
    frames, sent = [], []
    for i in range(400):
        size = rng.choice([0, 1, 7, 300, 4000, 70_000])
        body = rng.randbytes(size)
        subject = b"t.%d.%s" % (i % 7, rng.choice([b"a", b"caf\xc3\xa9", b"x\x0by", b"\xff"]))
        block = rng.choice([b"", b"NATS/1.0\r\nStreamproc-Seq: %d\r\nX-A: b\r\n\r\n" % i, b"NATS/1.0\r\n\r\n"])
        frames.append(raw_hpub(subject, block, body) if block else b"PUB %s %d\r\n%s\r\n" % (subject, size, body))
        sent.append(subject)
    fast, stock = FastClient(), RobustClient()
    await fast.connect(servers=[nats_url])
    await stock.connect(servers=[nats_url])
    try:
        assert type(fast._ps) is FastParser and type(stock._ps) is Parser
        subs = [await nc.subscribe("t.>", pending_msgs_limit=0, pending_bytes_limit=0) for nc in (fast, stock)]
        await fast.flush()
        await stock.flush()
        await raw_protocol(nats_url, frames)
        got = []
        for sub in subs:
            msgs = [await asyncio.wait_for(sub.next_msg(), 10) for _ in sent]
            got.append([(m.subject, m.reply, m.data, m.headers) for m in msgs])
        assert got[0] == got[1]
        assert [m[0] for m in got[0]] == [s.decode("utf-8", "surrogateescape") for s in sent]
        await fast.flush()  # a PONG through the fast path
        assert fast.stats["in_msgs"] == stock.stats["in_msgs"] == len(sent)
    finally:
        await fast.close()
        await stock.close()


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(60)
async def test_an_ordered_consumer_reads_in_the_read_loop_as_stock_nats_py_and_still_resets_on_a_gap(nats_url):
    """The edge's results stream is read by one ordered consumer: its data messages take
    ``FastClient._msg_now`` (no coroutine, no stock header parser) with nats-py's sequence tracking;
    empty payloads (control messages carry none) and a delivery gap go to nats-py, which resets the
    consumer from the last stream sequence delivered, so every message still comes once, in order."""
    from nats.js.api import StreamConfig

    fast, stock = FastClient(), RobustClient()
    await fast.connect(servers=[nats_url])
    await stock.connect(servers=[nats_url])
    try:
        await stock.jetstream().add_stream(StreamConfig(name="ORD", subjects=["ord.>"]))
        stock_calls = []
        upstream = FastClient._process_msg

        async def counted(*args):
            stock_calls.append(args[0])
            await upstream(fast, *args)
        fast._process_msg = counted
        subs = [await nc.jetstream().subscribe("ord.>", ordered_consumer=True) for nc in (fast, stock)]
        rng = random.Random(7)
        sent = []

        async def publish(n: int) -> None:
            for _ in range(n):
                i = len(sent)
                body = b"" if i % 10 == 3 else rng.randbytes(rng.choice([1, 40, 3000]))
                headers = {"Streamproc-Seq": str(i), "X-A": "b"} if i % 3 else None
                await stock.jetstream().publish(f"ord.{i % 4}", body, headers=headers)
                sent.append((f"ord.{i % 4}", body, headers))

        async def read(n: int) -> list[list]:
            return [[(m.subject, m.data, m.headers, m.metadata.sequence.stream)
                     for m in [await asyncio.wait_for(sub.next_msg(), 10) for _ in range(n)]] for sub in subs]

        await publish(30)
        first = await read(30)
        assert first[0] == first[1]
        assert [(s, d, h) for s, d, h, _ in first[0]] == sent
        assert 0 < len(stock_calls) < 10  # the empty payloads (and nothing else) went to nats-py
        jsis = [sub._sub._jsi for sub in subs]
        assert [(j._sseq, j._dseq, j._fciseq) for j in jsis] == [(30, 31, 30)] * 2
        assert jsis[0]._cmeta.split(".")[5:7] == jsis[1]._cmeta.split(".")[5:7] == ["30", "30"]
        sids = [sub._sub._id for sub in subs]
        for jsi in jsis:  # as if a delivery were lost: nats-py recreates the consumer after _sseq
            jsi._dseq += 3
        await publish(20)
        second = await read(20)
        assert second[0] == second[1]
        assert [(s, d, h) for s, d, h, _ in second[0]] == sent[30:]
        assert all(sub._sub._id != sid for sub, sid in zip(subs, sids))  # both reset
    finally:
        await fast.close()
        await stock.close()


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(60)
async def test_an_ordered_consumer_past_its_pending_limit_drops_as_stock_nats_py_does(nats_url):
    """An ordered consumer nobody reads, with room for 3 messages: each later one is a
    ``SlowConsumerError`` and dropped, yet counted as delivered (nats-py's sequence tracking runs
    before its queue refuses), the same on the fast path (which hands a message that would not fit
    to nats-py) as on stock nats-py; what was queued is read in order afterwards."""
    from nats.js.api import StreamConfig

    errors: dict[str, list[str]] = {"fast": [], "stock": []}

    def on_error(name: str):
        async def cb(exc: Exception) -> None:
            errors[name].append(type(exc).__name__)
        return cb

    fast, stock = FastClient(), RobustClient()
    await fast.connect(servers=[nats_url], error_cb=on_error("fast"))
    await stock.connect(servers=[nats_url], error_cb=on_error("stock"))
    try:
        await stock.jetstream().add_stream(StreamConfig(name="FULL", subjects=["full.>"]))
        subs = [await nc.jetstream().subscribe("full.>", ordered_consumer=True, pending_msgs_limit=3)
                for nc in (fast, stock)]
        for i in range(10):
            await stock.jetstream().publish(f"full.{i % 2}", b"m%d" % i, headers={"Streamproc-Seq": str(i)})
        await wait_until(lambda: len(errors["fast"]) == len(errors["stock"]) == 7, 10, "7 drops each")
        assert errors["fast"] == errors["stock"] == ["SlowConsumerError"] * 7
        jsis = [sub._sub._jsi for sub in subs]
        assert [(j._sseq, j._dseq, j._fciseq) for j in jsis] == [(10, 11, 10)] * 2
        assert jsis[0]._cmeta.split(".")[5:7] == jsis[1]._cmeta.split(".")[5:7] == ["10", "10"]
        got = [[(m.data, m.headers) for m in [await asyncio.wait_for(sub.next_msg(), 10) for _ in range(3)]]
               for sub in subs]
        assert got[0] == got[1] == [(b"m%d" % i, {"Streamproc-Seq": str(i)}) for i in range(3)]
    finally:
        await fast.close()
        await stock.close()

