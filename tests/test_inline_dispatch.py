"""FastClient.deliver_inline, the one way a handler runs in the client's read loop (core mode's fused
path, the durable input's chunks and PubAcks): messages handled inline keep their order with the ones
a handler declines (those go through the subscription's own callback task), and a handler that raises
loses its message, not the read loop, over a real server."""

from __future__ import annotations

import asyncio

import anyio
import pytest

from streamproc.nats.subscription import handled_all

from helpers import wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(60)]


async def test_declined_messages_and_the_ones_behind_them_are_handled_in_publish_order(client, fast_client):
    order: list[tuple[str, int]] = []

    async def queued(msg) -> None:  # the callback task: slow, as a recovery lookup is
        await anyio.sleep(0.02)
        order.append(("queued", int(msg.data)))

    def inline(subject: str, reply: str, headers, data: bytes) -> bool:
        n = int(data)
        if n % 10 == 3:  # declined: the callback task takes it, and everything behind it until it caught up
            return False
        order.append(("inline", n))
        return True

    sub = await fast_client.subscribe("inline.test", cb=queued)
    fast_client.deliver_inline(sub, inline)
    await fast_client.flush()
    for n in range(40):
        await client.publish("inline.test", str(n).encode())
        if n % 10 == 9:
            await client.flush()
            await wait_until(lambda: len(order) == n + 1, 10, "the group handled")
            await handled_all(sub, lambda: True)  # the queue drained: inline dispatch resumes
    assert [n for _, n in order] == list(range(40))
    assert {n for how, n in order if how == "queued"} >= {3, 13, 23, 33}
    # 0-2 of each group at least went inline, 4-9 waited behind 3 while its callback ran
    assert {n for how, n in order if how == "inline"} >= {g + i for g in (0, 10, 20, 30) for i in range(3)}
    await sub.unsubscribe()


async def test_a_handler_that_raises_drops_the_message_and_the_subscription_goes_on(client, fast_client):
    seen: list[int] = []

    async def queued(msg) -> None:
        seen.append(-int(msg.data))

    def inline(subject: str, reply: str, headers, data: bytes) -> bool:
        n = int(data)
        if n == 2:
            raise RuntimeError("bug")
        seen.append(n)
        return True

    sub = await fast_client.subscribe("inline.raise", cb=queued)
    fast_client.deliver_inline(sub, inline)
    await fast_client.flush()
    for n in range(5):
        await client.publish("inline.raise", str(n).encode())
    await client.flush()
    await wait_until(lambda: len(seen) == 4, 10, "the other messages handled")
    assert seen == [0, 1, 3, 4]
    await client.publish("inline.raise", b"7")  # the read loop survived
    await wait_until(lambda: seen[-1] == 7, 10, "a later message handled")
    assert fast_client.is_connected and fast_client.stats["in_msgs"] == 6
    await sub.unsubscribe()


async def test_read_done_runs_after_every_frame_of_a_read_and_before_the_next_loop_pass(client, fast_client):
    """The edge writes a read's direct SSE frames in ``read_done`` (edge/direct.py WriteBatch): they
    must all have been handed over by then, and it must not wait for a later loop pass."""
    events: list[str] = []
    loop = asyncio.get_running_loop()

    def inline(subject: str, reply: str, headers, data: bytes) -> bool:
        events.append(f"msg {int(data)}")
        loop.call_soon(events.append, "next pass")
        return True

    sub = await fast_client.subscribe("inline.done")
    fast_client.deliver_inline(sub, inline)
    fast_client.read_done = lambda: events.append("read done")
    try:
        await fast_client.flush()
        for n in range(20):
            await client.publish("inline.done", str(n).encode())
        await client.flush()
        await wait_until(lambda: events.count("next pass") == 20, 10, "every message handled")
    finally:
        fast_client.read_done = None
    assert [e for e in events if e.startswith("msg")] == [f"msg {n}" for n in range(20)]
    # Each read's messages, then its read_done, and only then the passes its handlers scheduled.
    since_done = 0
    for event in events:
        if event.startswith("msg"):
            since_done += 1
        elif event == "read done":
            since_done = 0
        else:
            assert since_done == 0, events
    assert events[-1] == "next pass" and "read done" in events
    await sub.unsubscribe()


async def test_an_ordered_consumer_is_handled_inline_and_stays_so_after_a_reset(client, fast_client):
    """The edge's results stream is read by one ordered consumer (edge/fanout.py). nats-py gives it a
    new sid each time it remakes the consumer (``_JSI.reset_ordered_consumer``); the handler must
    follow, or every result after the first reset takes the ``Msg`` and queue path again."""
    from nats.js.api import StreamConfig

    await client.jetstream().add_stream(StreamConfig(name="INL", subjects=["inl.>"]))
    inline_seen: list[int] = []

    def inline(subject: str, reply: str, headers, data: bytes) -> bool:
        assert reply.startswith("$JS.ACK.INL.")  # the stream sequence's carrier (Fanout.on_overflow)
        inline_seen.append(int(data))
        return True

    psub = await fast_client.jetstream().subscribe("inl.>", ordered_consumer=True)
    sub = psub._sub
    fast_client.deliver_inline(sub, inline)

    async def publish(numbers: range) -> None:
        for n in numbers:
            await client.jetstream().publish(f"inl.{n % 3}", str(n).encode())

    await publish(range(20))
    await wait_until(lambda: len(inline_seen) == 20, 10, "the first 20 handled inline")
    sid = sub._id
    sub._jsi._dseq += 3  # as if a delivery were lost: nats-py remakes the consumer after _sseq
    await publish(range(20, 40))
    await wait_until(lambda: len(inline_seen) == 40, 10, "the rest handled inline too")
    assert sub._id != sid  # it was reset
    assert inline_seen == list(range(40))
    assert sub._pending_queue.qsize() == 0
    fast_client.stop_inline(sub)
    await publish(range(40, 41))
    got = await asyncio.wait_for(psub.next_msg(), 10)  # stopped: the queue path again
    assert got.data == b"40" and inline_seen == list(range(40))
    await psub.unsubscribe()
