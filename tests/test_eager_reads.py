"""Eager reads (streamproc/nats/eager_reads.py): a read that arrives while nats-py's read loop waits
for it is handed over in the socket's callback, over real nats-servers (plain, TLS, restarted).

The frame-level law (the same calls, errors and parser state as the stock parser, whatever the
reads) is pinned in tests/test_fast_parser.py; here: that the path is taken, keeps order with what
goes through the read loop, reports slow consumers, passes exceptions on, and can be turned off.
"""

from __future__ import annotations

import asyncio
import ssl

import pytest
from helpers import wait_until
from nats.aio.client import Client

from streamproc.nats import fast_client
from streamproc.nats.buffered_reads import READ_SIZE
from streamproc.nats.eager_reads import EagerReads
from streamproc.nats.fast_client import STOCK_READS_ENV, FastClient
from streamproc.sim.embedded import EmbeddedNats

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(60)]


async def _connect(url: str, **options) -> FastClient:
    nc = FastClient()
    await nc.connect(servers=[url], **options)
    return nc


async def _paced(nc: Client, subject: str, count: int, headers: dict[str, str] | None = None) -> None:
    """One message per socket read on the other side: each one flushed, then a pause."""
    for i in range(count):
        await nc.publish(subject, b"%d" % i, headers=headers)
        await nc.flush()
        await asyncio.sleep(0.002)


def _inline_recorder(nc: FastClient, sub, seen: list) -> None:
    def handler(subject, reply, headers, data) -> bool:
        seen.append((data, asyncio.current_task()))
        return True
    nc.deliver_inline(sub, handler)


async def _received_paced(reader: FastClient, writer: Client, subject: str, count: int,
                          headers: dict[str, str] | None = None) -> list:
    """``count`` messages published one per read to ``subject``, as ``reader``'s inline handler saw
    them: (data, the task it ran in: None in the socket's callback), in publish order."""
    sub = await reader.subscribe(subject)
    seen: list = []
    _inline_recorder(reader, sub, seen)
    await reader.flush()
    await _paced(writer, subject, count, headers)
    await wait_until(lambda: len(seen) == count, 10, f"{count} messages on {subject}")
    assert [data for data, _ in seen] == [b"%d" % i for i in range(count)]
    return seen


async def test_a_message_arriving_while_the_read_loop_waits_is_handed_over_in_the_socket_callback(nats_url):
    reader, writer = await _connect(nats_url), await _connect(nats_url)
    try:
        seen = await _received_paced(reader, writer, "e.1", 50, {"Streamproc-Seq": "1"})
        eager = reader.eager
        assert type(eager) is EagerReads and eager.active
        # No task: the handler ran in data_received, not in the read loop (all but a few of them)
        assert sum(task is None for _, task in seen) >= 40 and eager.eager >= 40
    finally:
        await reader.close()
        await writer.close()


async def test_reads_land_in_the_connections_own_buffer_and_a_message_larger_than_it_arrives_whole(
        nats_url, monkeypatch):
    """The transport reads into one buffer per connection (a ``BufferedProtocol``: no 256 KiB
    allocation per read) and each read is copied out before the next: a message spanning several
    reads, between small ones, arrives byte for byte."""
    buffers: list = []
    get_buffer = EagerReads.get_buffer

    def recorded(self, sizehint: int):
        buffers.append((self, get_buffer(self, sizehint)))
        return buffers[-1][1]

    monkeypatch.setattr(EagerReads, "get_buffer", recorded)
    reader, writer = await _connect(nats_url), await _connect(nats_url)
    try:
        transport = reader._transport._io_writer.transport
        assert isinstance(transport.get_protocol(), EagerReads)
        assert isinstance(transport.get_protocol(), asyncio.BufferedProtocol)
        big = bytes(range(256)) * (READ_SIZE * 3 // 256 + 7)  # three buffers and a bit
        assert READ_SIZE < len(big) <= reader.max_payload
        sub = await reader.subscribe("big")
        seen: list = []
        _inline_recorder(reader, sub, seen)
        await reader.flush()
        sent = [b"a", big, b"b", big[::-1], b"c"]
        for body in sent:
            await writer.publish("big", body)
        await writer.flush()
        await wait_until(lambda: len(seen) == len(sent), 10, "every message")
        assert [data for data, _ in seen] == sent
        mine = [buffer for protocol, buffer in buffers if protocol is reader.eager]
        assert len(mine) >= 4 and all(buffer is mine[0] for buffer in mine)  # one buffer, every read
    finally:
        await reader.close()
        await writer.close()


async def test_a_message_arriving_while_the_read_loop_is_busy_waits_behind_the_frames_it_holds(nats_url):
    """The read loop suspends inside a frame (a plain JetStream push consumer's message dropped as a
    slow consumer: its report awaits an error callback that sleeps, as the edge's closes a feed),
    with a plain message p0 behind it in the same read. A plain message p1 that arrives during
    the sleep must not be handed over eagerly before p0: the loop is not parked in ``read()``.
    (From a review: without the parked check p1 overtook p0 here; no other test noticed.)"""
    from nats.js.api import StreamConfig

    async def slow_error_cb(exc: Exception) -> None:
        await asyncio.sleep(0.3)

    reader, writer = await _connect(nats_url, error_cb=slow_error_cb), await _connect(nats_url)
    try:
        js = writer.jetstream()
        await js.add_stream(StreamConfig(name="EAGER", subjects=["js.>"]))
        plain = await reader.subscribe("p.x")
        seen: list = []
        _inline_recorder(reader, plain, seen)
        await reader.jetstream().subscribe("js.>", pending_msgs_limit=1)  # nobody reads it: the 2nd is dropped
        await reader.flush()
        await js.publish("js.a", b"j1")
        await asyncio.sleep(0.05)
        socket_transport = reader._transport._io_writer.transport
        socket_transport.pause_reading()  # as FastClient's pause_reads does: j2 and p0 arrive in one read
        await js.publish("js.a", b"j2")
        await writer.publish("p.x", b"p0")
        await writer.flush()
        await asyncio.sleep(0.05)
        socket_transport.resume_reading()
        await asyncio.sleep(0.05)  # the read loop is in the error callback's sleep now
        await writer.publish("p.x", b"p1")
        await writer.flush()
        await wait_until(lambda: len(seen) == 2, 10, "p0 and p1")
        assert [data for data, _ in seen] == [b"p0", b"p1"]
        assert reader.eager is not None and reader.eager.fed >= 2  # the read with j2, and p1's
    finally:
        await reader.close()
        await writer.close()


async def test_a_protocol_made_inactive_feeds_every_read_to_the_read_loop(nats_url):
    """A read loop that ended (a reconnect's new one has its own protocol) leaves its EagerReads
    inactive: reads then go to the reader, never parsed by a protocol no read loop stands behind."""
    reader, writer = await _connect(nats_url), await _connect(nats_url)
    try:
        await reader.flush()
        eager = reader.eager
        assert eager is not None
        eager.active = False
        before = eager.eager
        seen = await _received_paced(reader, writer, "i.1", 10)
        assert eager.eager == before and eager.fed >= 10
        assert all(task is reader._reading_task for _, task in seen)
    finally:
        await reader.close()
        await writer.close()


async def test_slow_consumer_drops_are_reported_once_each_as_on_the_stock_path(nats_url, monkeypatch):
    """A subscription nobody reads, limited to 2 pending messages: each drop past that reaches the
    error callback once, with reads handed over eagerly as without them."""
    counts = {}
    for mode in ("eager", "stock"):
        if mode == "stock":
            monkeypatch.setenv(STOCK_READS_ENV, "1")
        errors: list = []

        async def on_error(exc: Exception) -> None:
            errors.append((type(exc).__name__, exc.sid))

        reader, writer = await _connect(nats_url, error_cb=on_error), await _connect(nats_url)
        try:
            sub = await reader.subscribe(f"s.{mode}", pending_msgs_limit=2)
            await reader.flush()
            await _paced(writer, f"s.{mode}", 8)
            await wait_until(lambda: len(errors) == 6, 10, f"6 slow-consumer reports ({mode})")
            await asyncio.sleep(0.1)
            counts[mode] = (errors, sub._pending_queue.qsize())
            assert (reader.eager is not None) == (mode == "eager")
            if mode == "eager":
                assert reader.eager.eager >= 6
        finally:
            await reader.close()
            await writer.close()
    assert [name for name, _ in counts["eager"][0]] == ["SlowConsumerError"] * 6
    assert len(counts["eager"][0]) == len(counts["stock"][0]) and counts["eager"][1] == counts["stock"][1] == 2


async def test_an_error_callback_that_raises_on_an_eager_report_is_logged(nats_url, caplog):
    async def broken_error_cb(exc: Exception) -> None:
        raise RuntimeError("callback bug")

    reader, writer = await _connect(nats_url, error_cb=broken_error_cb), await _connect(nats_url)
    try:
        await reader.subscribe("s.x", pending_msgs_limit=1)  # nobody reads it: each one past the first is dropped
        await reader.flush()
        with caplog.at_level("ERROR", logger="streamproc.nats"):
            await _paced(writer, "s.x", 3)
            await wait_until(lambda: caplog.text.count("event=nats_error_callback_failed") == 2, 10,
                             "two failed reports logged")
        assert "callback bug" in caplog.text and reader.eager is not None and reader.eager.eager >= 2
        assert not reader.eager.reports  # none left pending
    finally:
        await reader.close()
        await writer.close()


def _raise_on_boom(reader: FastClient, monkeypatch, events: list[str]) -> None:
    """Make handing over a message whose payload is ``boom`` raise (a handler bug), noted in ``events``."""
    took = reader._msg_now

    def broken_msg(sid, subject, reply, data, headers):
        if data == b"boom":
            events.append("boom")
            raise RuntimeError("handler bug")
        return took(sid, subject, reply, data, headers)

    monkeypatch.setattr(reader, "_msg_now", broken_msg)


@pytest.mark.parametrize("broken", ["_msg_now", "read_done"])
async def test_an_exception_in_the_handover_ends_the_read_loop_as_one_from_parse_does(nats_url, monkeypatch, broken):
    """nats-py's read loop stops at an exception from ``parse`` (a message's handling, or the
    read's end hook) and the socket stays open; one raised while a read is handed over eagerly is
    set on the reader, so the read loop meets it there and stops the same way. Raised out of
    ``data_received`` instead, asyncio would close the socket under nats-py."""
    for mode in ("eager", "stock"):
        if mode == "stock":
            monkeypatch.setenv(STOCK_READS_ENV, "1")
        reader, writer = await _connect(nats_url), await _connect(nats_url)
        try:
            await reader.subscribe("x.>")
            await reader.flush()
            armed = [False]

            def broken_done() -> None:
                if armed[0]:
                    raise RuntimeError("read_done bug")

            if broken == "_msg_now":
                _raise_on_boom(reader, monkeypatch, [])
            else:
                monkeypatch.setattr(reader, "read_done", broken_done, raising=False)
                armed[0] = True
            await writer.publish("x.1", b"boom")
            await writer.flush()
            await wait_until(lambda: reader._reading_task.done(), 10, f"the read loop stopped ({mode})")
            assert reader._reading_task.exception() is None  # it broke out of its loop, as nats-py's does
            await asyncio.sleep(0.3)  # not a lost connection (the transport's fatal error): no reconnect
            assert reader.stats["reconnects"] == 0 and not reader.is_reconnecting
            assert not reader._transport._io_writer.transport.is_closing(), mode
        finally:
            monkeypatch.undo()
            await reader.close()
            await writer.close()


@pytest.mark.parametrize("mode", ["eager", "read loop"])
async def test_a_read_whose_handling_raises_still_ends_with_read_done(nats_url, monkeypatch, mode):
    """The edge writes the SSE frames of the messages a read handed over in ``read_done`` and
    schedules nothing else (edge/direct.py WriteBatch), so the hook runs also when a message's
    handling raised, on both paths."""
    if mode == "read loop":
        monkeypatch.setenv(STOCK_READS_ENV, "1")
    reader, writer = await _connect(nats_url), await _connect(nats_url)
    try:
        await reader.subscribe("x.>")
        await reader.flush()
        events: list[str] = []
        _raise_on_boom(reader, monkeypatch, events)
        monkeypatch.setattr(reader, "read_done", lambda: events.append("done"), raising=False)
        await writer.publish("x.1", b"boom")
        await writer.flush()
        await wait_until(lambda: reader._reading_task.done(), 10, f"the read loop stopped ({mode})")
        assert "boom" in events and events[-1] == "done", events
        assert (reader.eager is None) == (mode == "read loop")
    finally:
        monkeypatch.undo()
        await reader.close()
        await writer.close()


async def test_with_STOCK_NATS_READS_set_every_read_goes_through_the_read_loop(nats_url, monkeypatch):
    monkeypatch.setenv(STOCK_READS_ENV, "1")
    reader, writer = await _connect(nats_url), await _connect(nats_url)
    try:
        seen = await _received_paced(reader, writer, "e.1", 10)
        assert reader.eager is None and all(task is reader._reading_task for _, task in seen)
        assert not fast_client.eager_reads_wanted()
    finally:
        await reader.close()
        await writer.close()


async def test_over_tls_reads_are_handed_over_eagerly_too(tmp_path):
    from nats_auth import Certificates

    certs = Certificates(tmp_path)
    with EmbeddedNats(jetstream=False, config=certs.tls_block(verify=False)) as server:
        context = ssl.create_default_context(cafile=str(certs.ca))
        reader, writer = await _connect(server.url, tls=context), await _connect(server.url, tls=context)
        try:
            await _received_paced(reader, writer, "t.1", 30)
            assert reader.eager is not None and reader.eager.eager >= 20
        finally:
            await reader.close()
            await writer.close()


async def test_after_a_server_restart_the_new_connection_reads_eagerly_and_the_old_protocol_is_inactive():
    with EmbeddedNats(jetstream=False) as server:
        reader = await _connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
        try:
            await reader.flush()  # its read loop runs (and installed EagerReads)
            before = reader.eager
            server.restart(kill=True)
            await wait_until(lambda: reader.is_connected and reader.eager is not before, 20, "reconnected")
            assert before is not None and not before.active and reader.eager.active
            writer = await _connect(server.url)
            try:
                await _received_paced(reader, writer, "r.1", 10)
                assert reader.eager.eager > 0
            finally:
                await writer.close()
        finally:
            await reader.close()
