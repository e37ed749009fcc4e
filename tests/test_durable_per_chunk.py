"""Work the durable processor does once per chunk, pinned by what it calls (docs/benchmarks.md,
"Durable calls per chunk, third pass"): the same results, fewer calls. The figures per chunk are
benchmarks/call_counts.py's; these tests pin each cut where it was made."""

from __future__ import annotations

import pytest
from nats.aio.client import Client

from streamproc.core.wire import MAX_HEADER_LINES, UNREADABLE_HEADERS, Role, chunk_headers
from streamproc.nats import fast_client
from streamproc.nats.fast_client import FastClient, encode_header_block, parse_header_block


def test_a_header_block_within_the_line_bound_is_parsed_without_an_over_header_lines_call(monkeypatch):
    """The line count is taken inline; over_header_lines (the unreadable mark) runs only for a block over the bound."""
    calls: list[bytes] = []
    over = fast_client.over_header_lines

    def counted(block: bytes):
        calls.append(block)
        return over(block)

    monkeypatch.setattr(fast_client, "over_header_lines", counted)
    headers = chunk_headers("r1", Role.DECODE, 3, final=True, format="sglang")
    honest = encode_header_block(headers)
    assert parse_header_block(honest) == headers
    assert calls == []

    long = b"NATS/1.0\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(MAX_HEADER_LINES)) + b"\r\n"
    lines = long.count(b"\n")
    assert parse_header_block(long) == {
        UNREADABLE_HEADERS: f"{lines} lines, more than the {MAX_HEADER_LINES} a header block may hold"}
    assert calls == [long]


class _CountedLen(bytes):
    """A payload that counts the reads of its length (each a C call on the per-chunk path)."""

    reads = 0

    def __len__(self) -> int:
        type(self).reads += 1
        return super().__len__()


@pytest.mark.parametrize("block", [None, b"NATS/1.0\r\nStreamproc-Seq: 1\r\n\r\n"])
def test_an_enqueued_publish_reads_its_payloads_length_once(block, monkeypatch):
    """A durable result (a header block) and an ack (none) each pass enqueue's max_payload check
    and _append's command line, max_payload sum and out_bytes on one length read; the bytes are unchanged."""
    monkeypatch.setattr(_CountedLen, "reads", 0)
    nc = FastClient()
    nc._status = Client.CONNECTED
    nc._max_pending_size = 1 << 20
    nc._flush_queue = None
    nc.flush_interval = 0.0
    nc.enqueue("a.b", _CountedLen(b"body"), "r.1", block, checked=True)
    assert _CountedLen.reads == 1
    head = b"PUB a.b r.1 4\r\n" if block is None else b"HPUB a.b r.1 %d %d\r\n" % (len(block), len(block) + 4)
    assert nc._pending == [head + (block or b"") + b"body\r\n"]
    assert nc.stats["out_bytes"] == 4 and nc._pending_data_size == len(nc._pending[0])


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(60)
async def test_a_durable_chunk_is_read_from_its_raw_header_block_in_one_pass(client, nats_url, monkeypatch):
    """The durable processor's inline chunk handler gets the raw header block and reads the chunk from it
    (chunk_from_block), without parse_header_block's dict (docs/benchmarks.md, "Durable chunks read from
    the raw header block"); the results are the chunks' bodies, in order."""
    from streamproc.nats.durable import deliveries

    parsed: list[bytes] = []
    read: list[type] = []
    two_step = fast_client.parse_header_block
    one_pass = deliveries.chunk_from_block

    def counted_parse(block: bytes):
        parsed.append(block)
        return two_step(block)

    def counted_read(parse, subject, headers, body, token=None):
        read.append(type(headers))
        return one_pass(parse, subject, headers, body, token)

    monkeypatch.setattr(fast_client, "parse_header_block", counted_parse)
    monkeypatch.setattr(deliveries, "chunk_from_block", counted_read)
    count = 40
    await paced_chunks_stored_in_order(client, nats_url, "raw-1", count)
    assert read and set(read) == {bytes}, read
    chunk_blocks = [b for b in parsed if b"Streamproc-Seq" in b]
    # A chunk the inline handler declines (a new request's lookup, a backlogged write buffer) is parsed for
    # its Msg; the others never are. Before the raw read every chunk was parsed: count of count.
    assert len(chunk_blocks) <= count - len(read) + 2, (len(chunk_blocks), len(read))
    assert len(read) >= count // 2


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(60)
async def test_a_puback_read_inline_is_settled_in_the_inline_handler_itself(client, nats_url, monkeypatch):
    """A PubAck (a fast batch's or a lone result's) handed over in the read loop is settled by the pump's
    inline handler without a settling call of its own (docs/benchmarks.md, "Durable CPU, fourth pass"),
    and a queued one by the callback through the same code; the results are the chunks' bodies, in order."""
    import sys

    from streamproc.core.outbox import Outbox

    callers: list[str] = []
    batch_reply, puback = Outbox.on_batch_reply, Outbox.on_puback

    def on_batch_reply(self, *args):
        callers.append(sys._getframe(1).f_code.co_name)
        return batch_reply(self, *args)

    def on_puback(self, *args):
        callers.append(sys._getframe(1).f_code.co_name)
        return puback(self, *args)

    monkeypatch.setattr(Outbox, "on_batch_reply", on_batch_reply)
    monkeypatch.setattr(Outbox, "on_puback", on_puback)
    await paced_chunks_stored_in_order(client, nats_url, "ack-1", 40)
    assert callers and set(callers) == {"_on_reply_inline"}, sorted(set(callers))


async def paced_chunks_stored_in_order(client, nats_url: str, request_id: str, count: int) -> None:
    """``count`` aggregated chunks of ``request_id`` through a durable Processor, one a read (paced, as at
    2,000 chunks/s), then the results stream must hold their bodies in seq order."""
    import anyio

    from streamproc.client.publisher import ChunkPublisher
    from streamproc.nats.processor import Processor

    from durable_helpers import durable_settings, stored_results
    from helpers import wait_until

    settings = durable_settings(nats_url)
    async with Processor(settings) as p:
        publisher = ChunkPublisher(client, settings.subjects)
        for seq in range(count):
            await publisher.publish(request_id, "agg", seq, b"body-%d" % seq, final=seq == count - 1)
            await anyio.sleep(0.005)  # one chunk a read, as at a paced load
        await wait_until(lambda: p.snapshot()["chunks"] == count, 15, "every chunk decided")
        stored = await stored_results(client.jetstream(), settings.subjects)
    assert [(s.seq, s.body) for s in stored[request_id]] == [(seq, b"body-%d" % seq) for seq in range(count)]


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(60)
async def test_the_inline_chunk_and_puback_handlers_make_no_backlogged_call(client, nats_url, monkeypatch):
    """The durable inline handlers test the write buffer's backlog with ``FastClient.backlogged``'s rule
    written out, not a call of it (one Python call per chunk and per PubAck read inline; docs/benchmarks.md,
    "Durable CPU, fifth pass")."""
    import sys

    callers: list[str] = []
    backlogged = FastClient.backlogged

    def counted(self):
        callers.append(sys._getframe(1).f_code.co_name)
        return backlogged(self)

    monkeypatch.setattr(FastClient, "backlogged", counted)
    await paced_chunks_stored_in_order(client, nats_url, "nobl-1", 40)
    # pump_nowait (the awaited pump after a declined chunk: a new request's lookup) still asks
    assert not {"on_message_inline", "_on_reply_inline"} & set(callers), callers


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(60)
async def test_the_inline_handlers_decline_a_message_exactly_when_the_write_buffer_is_backlogged(
        client, nats_url, monkeypatch):
    """Every other chunk and PubAck handed to an inline handler meets a write buffer just over half full
    (padded for that call, restored after it): each of them is declined (queued for its callback, as with
    ``backlogged()`` True), and the others are taken inline; the results stay in order."""
    accept = FastClient._accept
    seen: list[tuple[str, bool, bool]] = []  # (kind, padded, declined)

    def padded_accept(self, sub, sid, subject, reply, data, headers, hdr, reply_text=None):
        if not self._handlers_inline or sid not in self._handlers_inline or self._max_pending_size <= 0:
            return accept(self, sub, sid, subject, reply, data, headers, hdr, reply_text)
        kind = "chunk" if reply.startswith(b"$JS.ACK.") else "puback" if b'"stream"' in data else "other"
        padded = sum(k == kind for k, _, _ in seen) % 2 == 1  # every other one of its kind
        pad = self._max_pending_size // 2 + 1 - self._pending_data_size if padded else 0
        assert pad >= 0
        self._pending_data_size += pad
        assert self.backlogged() is padded
        queued = sub._pending_queue._unfinished_tasks
        try:
            return accept(self, sub, sid, subject, reply, data, headers, hdr, reply_text)
        finally:
            self._pending_data_size -= pad
            seen.append((kind, padded, sub._pending_queue._unfinished_tasks > queued))

    monkeypatch.setattr(FastClient, "_accept", padded_accept)
    await paced_chunks_stored_in_order(client, nats_url, "bl-1", 40)
    for kind in ("chunk", "puback"):
        padded = [declined for k, p, declined in seen if k == kind and p]
        plain = [declined for k, p, declined in seen if k == kind and not p]
        assert padded and all(padded), (kind, seen)
        assert plain and not all(plain), (kind, seen)  # taken inline when not backlogged


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(60)
async def test_the_inline_handlers_call_stage_write_only_when_no_write_is_set(client, nats_url, monkeypatch):
    """``FastClient.stage_write`` does nothing while ``_write_timer`` is set (a timer, or the read's end): the
    inline chunk and PubAck handlers do not call it then (docs/benchmarks.md, "Durable CPU, fifth pass"), and
    every result is still written and stored in order."""
    import sys

    calls: list[tuple[str, bool]] = []  # (caller, a write was set)
    stage_write = FastClient.stage_write

    def counted(self):
        calls.append((sys._getframe(1).f_code.co_name, self._write_timer is not None))
        return stage_write(self)

    monkeypatch.setattr(FastClient, "stage_write", counted)
    await paced_chunks_stored_in_order(client, nats_url, "stage-1", 40)
    inline = [(caller, set_) for caller, set_ in calls if caller in ("on_message_inline", "_on_reply_inline")]
    assert inline, calls  # the handlers do stage writes
    assert not [c for c in inline if c[1]], inline


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(60)
async def test_the_inline_chunk_handler_decides_a_chunk_without_a_decide_call(client, nats_url, monkeypatch):
    """The inline chunk handler hands a chunk to the correlator itself, ``decide``'s try written out (one
    Python call per chunk less; docs/benchmarks.md, "Durable CPU, seventh pass"); a chunk it declines (its
    request's first, which needs a lookup) is still decided through ``decide``; the results are the chunks'
    bodies, in order."""
    import sys

    from streamproc.core.correlator import Correlator

    callers: list[str] = []
    receive = Correlator.receive

    def counted(self, chunk, now):
        callers.append(sys._getframe(1).f_code.co_name)
        return receive(self, chunk, now)

    monkeypatch.setattr(Correlator, "receive", counted)
    count = 40
    await paced_chunks_stored_in_order(client, nats_url, "decide-1", count)
    assert len(callers) == count, callers
    assert set(callers) <= {"on_message_inline", "decide"}, callers
    assert callers.count("on_message_inline") >= count // 2, callers


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(60)
async def test_the_inline_chunk_handler_calls_offload_only_for_decisions_with_a_work(client, nats_url, monkeypatch):
    """``DurableInput._offload`` returns decisions without a ``Work`` as they are: the inline chunk handler
    calls it only when one is among them (one Python call per chunk less; docs/benchmarks.md, "Durable CPU,
    seventh pass"); aggregated chunks make none, and their results are the chunks' bodies, in order."""
    import sys

    from streamproc.core.correlator import Work
    from streamproc.nats.durable.input import DurableInput

    calls: list[tuple[str, bool]] = []  # (caller, a Work among the decisions)
    offload = DurableInput._offload

    def counted(self, decisions, received=None):
        calls.append((sys._getframe(1).f_code.co_name, any(d.__class__ is Work for d in decisions)))
        return offload(self, decisions, received)

    monkeypatch.setattr(DurableInput, "_offload", counted)
    await paced_chunks_stored_in_order(client, nats_url, "offload-1", 40)
    assert not [c for c in calls if c[0] == "on_message_inline" and not c[1]], calls

    # A joined request's decode leg, taken inline, makes a Work: that list is still offloaded (the join runs
    # off the loop) and its result is the join's.
    from streamproc.catalog import worker_for
    from streamproc.client.publisher import ChunkPublisher
    from streamproc.client.results import follow
    from streamproc.nats.processor import Processor
    from streamproc.sim import traffic
    from streamproc.wire import Verdict

    from durable_helpers import durable_settings
    from helpers import wait_until

    calls.clear()
    settings = durable_settings(nats_url)
    worker = worker_for(settings.format)
    truth = traffic.make_truth(5, request_id="offload-join", prompt_len=9, output_len=4)
    async with Processor(settings) as p:
        publisher = ChunkPublisher(client, settings.subjects)
        async with follow(client, settings.subjects, "offload-join", timeout=10) as results:
            await publisher.publish_leg("offload-join", "prefill", worker.prefill(truth, stream=False))
            # the request known (its first chunk took the lookup path): the decode leg comes inline
            await wait_until(lambda: p.snapshot()["chunks"] >= 1, 10, "the prefill leg decided")
            await publisher.publish_leg("offload-join", "decode", worker.decode(truth, stream=False))
            (final,) = await results.collect()
    assert final.verdict is Verdict.JOINED and worker.expert_view(final.body)[0] == truth.experts
    assert ("on_message_inline", True) in calls, calls
