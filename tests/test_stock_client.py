"""The processor on the stock nats-py path (``RobustClient``), as on a nats-py release outside
``SUPPORTED_NATS_PY``: CI runs the newest nats-py, so the path is forced with ``STOCK_NATS_PY``."""

from __future__ import annotations

import anyio
import httpx
import pytest
from edge_harness import expected_sse, publish_result, running_edge
from helpers import rid

from streamproc.catalog import worker_for
from streamproc.client.publisher import ChunkPublisher
from streamproc.client.results import follow
from streamproc.nats import fast_client
from streamproc.nats.processor import Processor
from streamproc.nats.robust import RobustClient
from streamproc.sim import traffic
from streamproc.wire import Subjects, Verdict

from durable_helpers import FORMAT, durable_settings, wait_for_finals

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(60)]


@pytest.fixture
def stock_client(monkeypatch):
    monkeypatch.setenv(fast_client.STOCK_CLIENT_ENV, "1")
    monkeypatch.setattr(fast_client, "_support", None)
    yield
    fast_client._support = None


async def test_the_stock_path_is_forced_by_its_variable_and_says_why(stock_client, caplog):
    nc = fast_client.new_client()
    assert type(nc) is RobustClient
    assert "nats_fast_path_disabled" in caplog.text and fast_client.STOCK_CLIENT_ENV in caplog.text


@pytest.mark.parametrize("mode", ["core", "durable"])
async def test_the_processor_on_the_stock_path_passes_through_joins_and_stores_results(stock_client, client,
                                                                                        nats_url, mode):
    settings = durable_settings(nats_url, mode=mode)
    worker = worker_for(FORMAT)
    truth = traffic.make_truth(5, request_id="stock-pd", prompt_len=9, output_len=4)
    bodies = [b"one", b"two", b"\xffthree"]
    async with Processor(settings) as p:
        assert type(p.nc) is RobustClient
        publisher = ChunkPublisher(client, settings.subjects)
        async with follow(client, settings.subjects, "stock-agg", timeout=10) as passed, \
                follow(client, settings.subjects, "stock-pd", timeout=10) as joined:
            await publisher.publish_leg("stock-agg", "agg", bodies)
            await publisher.publish_leg("stock-pd", "prefill", worker.prefill(truth, stream=False))
            await publisher.publish_leg("stock-pd", "decode", worker.decode(truth, stream=False))
            got = await passed.collect()
            (final,) = await joined.collect()
        assert [r.body for r in got] == bodies and [r.seq for r in got] == [0, 1, 2] and got[-1].final
        assert all(r.verdict is Verdict.PASSTHROUGH for r in got)
        assert final.verdict is Verdict.JOINED and worker.expert_view(final.body)[0] == truth.experts
        if mode == "durable":
            stored = await wait_for_finals(client.jetstream(), settings.subjects, ["stock-agg", "stock-pd"], 15)
            assert [r.body for r in stored["stock-agg"]] == bodies
            assert [r.verdict for r in stored["stock-pd"]] == [Verdict.JOINED]


async def test_the_edge_on_the_stock_path_writes_each_result_as_it_arrives(nats_url, client):
    """On the stock client nothing calls ``read_done``, so the edge's direct SSE frames are flushed
    by a ``call_soon`` of their own (edge/direct.py WriteBatch): each result reaches the client
    before the next one is published, not with the request's last."""
    subjects, request_id = Subjects("stockedge"), rid("stock-edge")
    with running_edge(nats_url, "--prefix", subjects.prefix, env={fast_client.STOCK_CLIENT_ONLY_ENV: "1"}) as edge:
        async with httpx.AsyncClient(base_url=edge.url, timeout=15) as http:
            async with http.stream("GET", f"/v1/results/{request_id}") as response:
                assert response.status_code == 200
                lines = response.aiter_lines()
                await anyio.sleep(0.3)  # the edge's subscription is live once the headers are written
                for seq in range(4):
                    await publish_result(client, subjects, request_id, seq, b'{"n":%d}' % seq, final=seq == 3)
                    await client.flush()
                    with anyio.fail_after(5):
                        while await anext(lines) != 'data: {"n":%d}' % seq:
                            pass
        metrics = edge.metrics()
        assert "nats_fast_path_disabled" in edge.log()
    # The last result ends the response through the stream's task; the others went directly.
    assert metrics["streamproc_edge_results_written_directly_total"] >= 3


async def test_direct_writes_on_the_stock_path_count_for_the_result_timeout_and_the_keep_alive(nats_url, client):
    """Direct writes stamp their stream's ``sent_at`` in ``WriteBatch.flush``, which on the stock
    client runs from its own ``call_soon``, not ``read_done``: results every 0.25 s for 2.5 s, all but
    the last written directly, keep a stream with ``--result-timeout 1`` and ``--keepalive 0.4`` from
    timing out and from keep-alives between them (as on the fast path: test_edge_sse.py)."""
    subjects, request_id = Subjects("stockclock"), rid("stock-clock")
    bodies = [b'{"n":%d}' % seq for seq in range(10)]
    with running_edge(nats_url, "--prefix", subjects.prefix, "--result-timeout", "1", "--keepalive", "0.4",
                      env={fast_client.STOCK_CLIENT_ONLY_ENV: "1"}) as edge:
        async with httpx.AsyncClient(base_url=edge.url, timeout=15) as http:
            async with http.stream("GET", f"/v1/results/{request_id}") as response:
                assert response.status_code == 200
                await anyio.sleep(0.3)  # the edge's subscription is live once the headers are written
                read: list[bytes] = []

                async def read_all() -> None:
                    read.extend([chunk async for chunk in response.aiter_bytes()])

                with anyio.fail_after(15):
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(read_all)
                        for seq, body in enumerate(bodies):
                            await publish_result(client, subjects, request_id, seq, body,
                                                 final=seq == len(bodies) - 1)
                            await client.flush()
                            await anyio.sleep(0.25)
                raw = b"".join(read)
        metrics = edge.metrics()
    assert metrics["streamproc_edge_result_timeouts_total"] == 0, raw
    assert metrics["streamproc_edge_results_written_directly_total"] >= len(bodies) - 1
    assert raw.replace(b": keep-alive\n\n", b"") == expected_sse(bodies), raw
    assert raw.count(b": keep-alive\n\n") <= 1, raw  # at most the one before the first result
