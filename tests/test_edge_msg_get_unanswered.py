"""An edge whose ``STREAM.MSG.GET`` requests go unanswered (no reply, no ``-ERR``) while MSG.GET
never answered: the first open waits out one ``REPLAY_TIMEOUT`` and finds out; later opens do not.

The requests are held back by a proxy in front of a real nats-server (:mod:`proxy_helpers`), as a
server or an account import that never answers them would.
"""

from __future__ import annotations

import time

import pytest
from edge_harness import publish_result, started_source
from helpers import connection, rid, wait_until
from proxy_helpers import HoldingProxy

from streamproc.core.wire import ResultInfo
from streamproc.edge.feed import Ended
from streamproc.edge.source import REPLAY_TIMEOUT
from streamproc.nats.streams import ensure_results_stream
from streamproc.wire import Subjects

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(60)]

SUBJECTS = Subjects("msggetsilent")
MSG_GET = b"$JS.API.STREAM.MSG.GET."


async def read_all(feed, timeout: float) -> list[int]:
    seqs: list[int] = []
    while isinstance(item := await feed.next(timeout), ResultInfo):
        seqs.append(item.seq)
    assert isinstance(item, Ended), (seqs, item)
    return seqs


async def test_after_one_open_found_msg_get_unanswered_later_opens_do_not_wait_out_its_timeout_again(nats_url):
    """Until the fix each ring open made while MSG.GET had never answered asked it first, guarded, and
    a silence (not a refusal) turned that open to consumers without counting MSG.GET refused: every
    later open, also one with nothing stored, waited the whole ``REPLAY_TIMEOUT`` (5 s) before its
    first result, for as long as the edge ran. (Before 2026-12-06 the open fell back, which counted
    it refused until the re-probe; so does the replay now.)"""
    proxy = HoldingProxy(int(nats_url.rsplit(":", 1)[1]), lambda subject: subject.startswith(MSG_GET),
                         hold_at_most=120.0, every=True)
    proxy.arm()
    async with proxy.running(), connection(nats_url) as nc:
        await ensure_results_stream(nc.jetstream(), SUBJECTS)
        async with started_source(proxy.url, SUBJECTS) as source:
            assert source.msg_get is not None and source.fanout is not None
            first = rid("first")
            for seq in range(3):
                await publish_result(nc, SUBJECTS, first, seq, b'{"n":%d}' % seq, final=seq == 2, acked=True)
            await wait_until(lambda: source.fanout.delivered() >= 3, 10, "the ring read the history")
            feed = await source.open(first)
            assert await read_all(feed, REPLAY_TIMEOUT + 5) == [0, 1, 2]  # after one timeout: consumers
            await feed.close()
            assert proxy.held.is_set()  # its MSG.GET was held, unanswered
            assert source.msg_get.state == "refused", source.msg_get.state

            later = rid("later")
            feed = await source.open(later)
            started = time.monotonic()
            await publish_result(nc, SUBJECTS, later, 0, b'{"n":0}', final=True, acked=True)
            assert await read_all(feed, REPLAY_TIMEOUT + 5) == [0]
            assert time.monotonic() - started < REPLAY_TIMEOUT / 2, time.monotonic() - started
            await feed.close()
