"""The edge's cheap reads of nats-py subscriptions (edge/pending.py) and its cached results-stream
lookup (edge/lookup.py), on a real nats-server."""

from __future__ import annotations

import time

import nats.errors
import pytest
from helpers import connection, rid
from nats.js.api import StreamConfig

from streamproc.edge import pending
from streamproc.edge.lookup import StreamLookup, subject_matches
from streamproc.wire import Subjects

pytestmark = [pytest.mark.nats]


def test_subject_matching_follows_nats_wildcards():
    def m(pattern: str, subject: str) -> bool:
        return subject_matches(pattern.split("."), subject.split("."))

    assert m("P.results.>", "P.results.a") and m("P.results.>", "P.results.a.b")
    assert not m("P.results.>", "P.results") and not m("P.results.>", "P.chunks.a")
    assert m("P.results.*", "P.results.a") and not m("P.results.*", "P.results.a.b")
    assert m("P.results.a", "P.results.a") and not m("P.results.a", "P.results.b")


@pytest.mark.anyio
async def test_wait_times_out_then_take_hands_out_messages_in_order_with_nats_py_accounting(server):
    async with connection(server.url) as nc:
        subject = f"pend.{rid('order')}"
        sub = await nc.subscribe(subject)
        await nc.flush()
        started = time.monotonic()
        assert await pending.wait(sub, 0.2) is False
        assert 0.15 < time.monotonic() - started < 2
        assert pending.take(sub) is None
        for i in range(3):
            await nc.publish(subject, b"x" * (i + 1))
        await nc.flush()
        assert await pending.wait(sub, 5) is True
        assert [pending.take(sub).data for _ in range(3)] == [b"x", b"xx", b"xxx"]
        assert pending.take(sub) is None
        assert sub._pending_size == 0 and not sub._pending_queue._getters
        await sub.unsubscribe()


@pytest.mark.anyio
async def test_waits_that_time_out_leave_no_getter_in_the_queue(server):
    """An idle stream waits again and again (keep-alives): a getter left behind by each timeout
    would pile up in the subscription's queue for as long as no message comes."""
    async with connection(server.url) as nc:
        sub = await nc.subscribe(f"pend.{rid('idle')}")
        await nc.flush()
        for _ in range(3):
            assert await pending.wait(sub, 0.02) is False
        assert not sub._pending_queue._getters
        await sub.unsubscribe()


@pytest.mark.anyio
async def test_drop_frees_the_messages_an_unsubscribed_subscription_still_queues(server):
    async with connection(server.url) as nc:
        subject = f"pend.{rid('drop')}"
        sub = await nc.subscribe(subject)
        await nc.flush()
        for _ in range(3):
            await nc.publish(subject, b"r" * 1000)
        await nc.flush()
        await sub.unsubscribe()
        assert sub._pending_queue.qsize() == 3  # nats-py leaves them there (pending.drop's docstring)
        pending.drop(sub)
        assert sub._pending_queue.empty()


@pytest.mark.anyio
async def test_a_waiting_reader_learns_that_the_connection_closed(server):
    import anyio

    nc = await nats.connect(server.url)
    sub = await nc.subscribe(f"pend.{rid('closed')}")
    await nc.flush()
    raised: list[Exception] = []

    async def reader() -> None:
        try:
            await pending.wait(sub, 30)
        except nats.errors.ConnectionClosedError as exc:
            raised.append(exc)

    with anyio.fail_after(10):  # before the 30 s wait would end by itself
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            await anyio.sleep(0.1)
            await nc.close()
    assert raised
    with pytest.raises(nats.errors.ConnectionClosedError):
        pending.take(sub)


@pytest.mark.anyio
async def test_the_stream_lookup_sees_a_stream_created_later_once_its_ttl_passed(server):
    subjects = Subjects(f"look{rid('p').replace('-', '')}")
    async with connection(server.url) as nc:
        js = nc.jetstream()
        lookup = StreamLookup(subjects, ttl=0.3)
        subject = subjects.result(rid("r"))
        assert await lookup.find(js, subject) is None
        name = f"RESULTS_{subjects.prefix}".upper().replace(".", "_")
        await js.add_stream(StreamConfig(name=name, subjects=[subjects.all_results]))
        try:
            assert await lookup.find(js, subject) is None  # cached: no stream, for up to ttl
            time.sleep(0.35)
            assert await lookup.find(js, subject) == name
            assert await lookup.find(js, subjects.result(rid("other"))) == name  # matched locally
        finally:
            await js.delete_stream(name)
        lookup.forget()
        assert await lookup.find(js, subject) is None
