"""The durable pump's staging at the client's write (``OutboxPump.stage_writes``,
``FastClient.before_write``), on a real ``FastClient`` whose transport stands in for a socket:
one that is behind (its buffer never drains, the flusher task stuck in ``drain()``) cannot be
held in that state on loopback for the fraction of a second these tests need. Written by a
review that found each of these cases broken; the live paths are in ``test_durable.py``."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from nats.aio.client import Client

from streamproc.core.events import Result
from streamproc.core.outbox import Outbox, OutboxConfig
from streamproc.nats.fast_client import FastClient
from streamproc.nats.durable.outbox_pump import OutboxPump


class BehindWriter:
    """An asyncio socket transport whose buffer is not empty: the socket is behind."""

    max_size = 64 * 1024

    def __init__(self) -> None:
        self.buffered = 1
        self.written: list[bytes] = []

    def get_write_buffer_size(self) -> int:
        return self.buffered


class Transport:
    def __init__(self, writer: BehindWriter) -> None:
        self._io_writer = SimpleNamespace(transport=writer)
        self.writer = writer

    def writelines(self, lines) -> None:
        self.writer.written.extend(lines)


def _client(writer: BehindWriter, interval: float = 0.002) -> FastClient:
    nc = FastClient()
    nc._status = Client.CONNECTED
    nc._max_pending_size = 2 * 1024 * 1024  # nats-py's default pending_size
    nc._max_payload = 1024 * 1024
    nc._flush_queue = asyncio.Queue()  # the flusher task is inside drain(): nobody takes from it
    nc._transport = Transport(writer)
    nc.flush_interval = interval
    nc._last_write = asyncio.get_running_loop().time()
    return nc


def _pump(nc: FastClient, batch_limit: int = 1) -> OutboxPump:
    outbox = Outbox(OutboxConfig(batch_limit=batch_limit))
    pump = OutboxPump(nc, "p.results.", outbox, clock=time.monotonic, notify=lambda n: None,
                      give_up=lambda g: None)
    pump._reply_prefix = "_INBOX.abc."
    pump._cut = len(pump._reply_prefix)
    assert pump.stage_writes()
    return pump


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_socket_that_is_behind_does_not_make_the_write_timer_spin():
    """While the flusher waits in drain() (the socket is behind), every timer write hands over to
    it. With staged results left over (room_for_writes() spent), the next timer write was set at
    _last_write + gap, already past since nothing was written: the timer fired every loop
    iteration (29,112 times in 0.2 s) for as long as the socket stayed behind. Now it comes a
    full interval later."""
    writer = BehindWriter()
    nc = _client(writer, interval=0.002)
    pump = _pump(nc)
    calls = 0
    hook = nc.before_write

    def counted() -> bool:
        nonlocal calls
        calls += 1
        return hook()

    nc.before_write = counted
    # 40 requests of 64 KiB each: 2.5 MiB, more than the 1 MiB of room before the backlog mark.
    for i in range(40):
        pump.take([Result(f"r{i}", 0, b"x" * 65536, False)], f"r{i}")
    pump.release()
    await asyncio.sleep(0.2)
    writer.buffered = 0
    assert calls <= 0.2 / 0.002 * 1.5 + 5, f"{calls} timer writes in 0.2 s with a 2 ms interval"


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_one_staged_write_stays_near_the_backlog_mark_with_small_results():
    """A write takes what fits before the client's write buffer is backlogged: the budget is
    counted in bytes on the wire (Outbox.sending, wire_size), not in result bodies, which for
    token-sized results are the smaller part (counted as bodies, one write took 3.4x the room)."""
    writer = BehindWriter()
    writer.buffered = 0
    nc = _client(writer)
    pump = _pump(nc, batch_limit=64)
    rid = "req-0123456789abcdef0123456789abcdef"  # a request id of a usual length (uuid hex)
    for i in range(400):  # 400 requests (16,000 results: 8 partitions' max_ack_pending), 40 results of 40 bytes each queued (e.g. after a reconnect)
        r = f"{rid}-{i}"
        pump.take([Result(r, s, b'{"token":"abcdefghijklmnopqrstuv"}'[:40], False) for s in range(40)], r)
    room = nc.room_for_writes()
    nc.before_write()
    grown = nc._pending_data_size
    assert room * 0.7 < grown <= room  # near the backlog mark, never past it (wire_size over-estimates a little)
    assert pump.outbox.ready  # the rest waits for the next write


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_with_a_wrapped_publish_nothing_is_staged_and_the_awaiting_pump_sends_batches():
    """Tracing wraps publish: no enqueue, no staging, and pump() still sends a request's queued
    results as one fast batch."""
    writer = BehindWriter()
    writer.buffered = 0
    nc = _client(writer)
    sent: list[tuple[str, str]] = []

    async def traced(subject, payload=b"", reply="", headers=None):
        sent.append((subject, reply))
        await nc.publish(subject, payload, reply, headers)

    outbox = Outbox(OutboxConfig(batch_limit=64))
    pump = OutboxPump(nc, "p.results.", outbox, clock=time.monotonic, notify=lambda n: None,
                      give_up=lambda g: None, publish=traced)
    pump._reply_prefix = "_INBOX.abc."
    assert not pump.inline and not pump.stage_writes() and nc.before_write is None
    pump.take([Result("r", 0, b"a", False)], "r")
    await pump.pump()
    outbox.on_puback(sent[0][1][len("_INBOX.abc."):], b'{"stream":"R","seq":1}', time.monotonic())
    pump.take([Result("r", s, b"b", False) for s in (1, 2, 3)], "r")
    # seq 1 is the head now; 2 and 3 queued behind it: one batch of three
    await pump.pump()
    assert [r.split(".")[-3:] for _, r in sent[1:]] == [["1", "0", "$FI"], ["2", "1", "$FI"], ["3", "2", "$FI"]]


def _pump_with_a_nak() -> tuple[BehindWriter, FastClient, OutboxPump]:
    """A pump on a writable stand-in socket whose outbox has one NAK to send (a hand-over's)."""
    writer = BehindWriter()
    writer.buffered = 0
    nc = _client(writer, interval=0.01)
    pump = _pump(nc)
    pump.outbox.nak([SimpleNamespace(reply="$JS.ACK.CHUNKS.c0.1.2.3.4.5")])
    return writer, nc, pump


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_controls_staged_before_the_pump_is_closed_still_leave():
    """DurableInput.stop NAKs what it hands over, then flushes the connection and stops the pump.
    Staged, the NAKs were not in _pending for that flush, and a timer write after stop() found
    the pump closed: the chunks waited ack_wait for redelivery instead of going to the next owner
    at once. The pump hands over what is staged before it closes (and the stop before its flush)."""
    writer, nc, pump = _pump_with_a_nak()
    await pump.pump()  # staged
    pump.flush_staged()  # as DurableInput.stop does before its flush
    assert b"-NAK" in b"".join(nc._pending)


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_pump_stopped_with_controls_staged_hands_them_to_the_client_first():
    """The same without the stop's own hand-over: the pump's stop() hands them over."""
    writer, nc, pump = _pump_with_a_nak()
    await pump.pump()  # as DurableInput.stop does after _hand_over
    flushed = b"".join(nc._pending)  # what nc.flush() would write ahead of its PING
    await pump.stop()
    await asyncio.sleep(0.05)
    wire = flushed + b"".join(writer.written) + b"".join(nc._pending)
    assert b"-NAK" in flushed or b"-NAK" in wire, "the hand-over's NAK never left"


@pytest.mark.anyio
@pytest.mark.timeout(30)
@pytest.mark.parametrize("request_id", ["a b", "a\tb", "a\r\nPUB x 1", " a", "a "])
async def test_a_result_whose_subject_nats_py_refuses_is_not_written(request_id):
    """Results with a plain id skip nats-py's subject checks (they could not fail); any other id
    still goes through them: a result the core made for an id with whitespace in it (which no
    chunk path lets through) fails its publish like stock nats-py's, and nothing reaches the wire
    that nats-server would read as a broken or injected command. A plain id beside it is written."""
    writer = BehindWriter()
    nc = _client(writer)
    pump = _pump(nc)
    pump.take([Result(request_id, 0, b"bad", True)], request_id)
    pump.take([Result("plain-id", 0, b"good", True)], "plain-id")
    pump.send_nowait()
    written = b"".join(nc._pending)
    assert b"HPUB p.results.plain-id _INBOX.abc." in written and b"good" in written
    assert b"bad" not in written and request_id.encode() not in written
    assert pump.outbox.stats.publish_errors == 1  # send_failed: sent again at the next tick, as any failed publish


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_results_with_a_plain_id_skip_the_subject_checks_and_others_do_not(monkeypatch):
    """The cut itself (benchmarks/call_counts.py): a plain id's result is enqueued without nats-py's
    subject checks (two per result), an id with a space still gets them."""
    import nats.aio.client as nats_client

    checked: list[str] = []
    original = nats_client._validate_subject

    def counting(subject: str, **kwargs) -> None:
        checked.append(subject)
        original(subject, **kwargs)

    monkeypatch.setattr(nats_client, "_validate_subject", counting)
    nc = _client(BehindWriter())
    pump = _pump(nc)
    pump.take([Result("plain-id", 0, b"good", True)], "plain-id")
    pump.send_nowait()
    assert checked == [] and b"HPUB p.results.plain-id " in b"".join(nc._pending)
    pump.take([Result("a b", 0, b"bad", True)], "a b")
    pump.send_nowait()
    assert checked == ["p.results.a b"]  # refused there: the reply is never checked, nothing is written
