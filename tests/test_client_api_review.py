"""A user's review of the public client API (streamproc.client): results, subscriptions, payload
limits, exports. Real nats-server processes only."""

from __future__ import annotations

import json
import urllib.request

import anyio
import nats
import pytest

import streamproc
from streamproc import ChunkPublisher, MalformedResult, Subjects, follow
from streamproc.client.results import collect
from streamproc.core.events import Result, Verdict
from streamproc.core.wire import result_headers

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(60)]


def server_subscriptions(nats_server, nc) -> int:
    """Subscriptions the server holds for ``nc``'s connection (what leaks if a helper forgets one)."""
    with urllib.request.urlopen(f"{nats_server.monitor_url}/connz?subs=1&cid={nc._client_id}", timeout=5) as r:
        conns = json.load(r)["connections"]
    return len(conns[0].get("subscriptions_list") or []) if conns else 0


async def publish_result(nc, subjects: Subjects, request_id: str, seq: int, final: bool = False) -> None:
    r = Result(request_id, seq, f"body-{seq}".encode(), final, Verdict.PASSTHROUGH)
    await nc.publish(subjects.result(request_id), r.body, headers=result_headers(r))


async def test_results_that_arrived_before_a_malformed_one_are_still_yielded(client):
    """Results 0 and 1 arrived in order, then a stray message broke the contract: the stream raised
    MalformedResult on its first ``__anext__`` and results 0 and 1 were never handed out."""
    subjects = Subjects()
    got = []
    async with follow(client, subjects, "mal", timeout=5) as results:
        await publish_result(client, subjects, "mal", 0)
        await publish_result(client, subjects, "mal", 1)
        await client.publish(subjects.result("mal"), b"junk", headers={"Streamproc-Seq": "x"})
        await publish_result(client, subjects, "mal", 2, final=True)  # after the error: not yielded
        await client.flush()
        await anyio.sleep(0.2)  # all four delivered before the reader looks
        with pytest.raises(MalformedResult, match="Streamproc-Seq must be a non-negative integer"):
            async for r in results:
                got.append(r.seq)
    assert got == [0, 1]
