"""What the edge remembers of its STREAM.MSG.GET permission (``edge/msg_get.py``), without NATS.

The end-to-end behaviour (a real nats-server whose edge user lacks the grant, the re-probe after a
configuration reload) is in test_trust_model.py; here the rules that decide it: which error text
is a refusal, one open per re-probe interval, one notice per change.
"""

from __future__ import annotations

import asyncio

import pytest

from streamproc.edge.msg_get import ApiPermission, Refused

pytestmark = pytest.mark.anyio

# What nats-py 2.16 hands the error callback for nats-server's -ERR (its parser lower-cases it).
VIOLATION = 'nats: permissions violation for publish to "$js.api.stream.msg.get.streamproc_results"'


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def access_with_clock() -> tuple[ApiPermission, Clock, list[tuple[str, str]]]:
    clock, changes = Clock(), []
    access = ApiPermission("$JS.API", "STREAMPROC_RESULTS", lambda state, reason: changes.append((state, reason)),
                          reprobe=60.0, clock=clock)
    return access, clock, changes


def test_only_a_refused_msg_get_on_its_own_stream_counts_as_a_refusal():
    access, _, _ = access_with_clock()
    assert access.note_error(VIOLATION)
    assert not access.note_error(VIOLATION.replace("streamproc_results", "other"))
    assert not access.note_error(VIOLATION.replace("msg.get", "info"))
    assert not access.note_error('nats: permissions violation for subscription to "streamproc.chunks.>"')


def test_after_a_refusal_one_open_per_interval_tries_again_and_each_change_is_told_once():
    access, clock, changes = access_with_clock()
    assert access.usable() and not access.confirmed
    access.refused(VIOLATION)
    access.refused(VIOLATION)  # every open that finds out: still one notice
    assert changes == [("refused", VIOLATION)]
    assert not access.usable()
    clock.now += 59.9
    assert not access.usable()
    clock.now += 0.1
    assert access.usable()  # the re-probe
    assert not access.usable()  # the others wait for its answer, or for the next interval
    clock.now += 60.0
    assert access.usable()  # the re-probing open went away unanswered: another one tries
    access.allowed()
    access.allowed()
    assert changes == [("refused", VIOLATION), ("allowed", "")]
    assert access.usable() and access.confirmed


async def test_a_guarded_request_ends_at_the_refusal_instead_of_its_timeout():
    access, _, _ = access_with_clock()
    never = asyncio.get_running_loop().create_future()

    async def request() -> bytes:
        await never  # nats-server never answers a refused publish
        return b""

    waiting = asyncio.ensure_future(access.guard(request()))
    await asyncio.sleep(0)
    assert access.note_error(VIOLATION)
    with pytest.raises(Refused) as refused:
        await asyncio.wait_for(waiting, 1.0)
    assert refused.value.denied and "msg.get" in str(refused.value)

    async def answered() -> bytes:
        return b"{}"

    assert await access.guard(answered()) == b"{}"  # a later request is not refused by the old error
