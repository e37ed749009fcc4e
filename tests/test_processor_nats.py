"""The processor over a real nats-server, both in-process and as the `streamproc run` subprocess.

Every test that takes ``kind`` runs twice: once against :class:`Processor` in the test's event
loop, once against the CLI in its own process, so the shell, the CLI wiring and the settings
path are all exercised on the wire. Tests that take ``mode`` run in core mode (plain
subscription) and in durable mode (JetStream consumers); durable-only behaviour is pinned in
``test_durable*.py``.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import random
import time
import traceback

import anyio
import msgspec
import pytest

from streamproc.sim import traffic
from streamproc.catalog import Catalog, codec_names, worker_for
from streamproc.core.codec import CodecOptions
from streamproc.core.errors import UnknownFormat
from streamproc.config import load
from streamproc.nats import processor as processor_module
from streamproc.nats.core_input import CoreInput
from streamproc.nats.durable.input import DurableInput
from streamproc.nats.input import Input
from streamproc.nats.processor import Processor, StartupError
from streamproc.client.publisher import ChunkPublisher
from streamproc.client.results import ResultCollector, follow
from streamproc.wire import (
    ATTEMPT,
    ERROR,
    FINAL,
    JOIN,
    MSG_ID,
    SEQ,
    TRACEPARENT,
    Result,
    Verdict,
    result_headers,
)

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(30)]

FORMAT = "sglang"


@pytest.fixture(params=["in-process", "subprocess"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=["core", "durable"])
def mode(request: pytest.FixtureRequest) -> str:
    return request.param


def processor_log(rp, caplog: pytest.LogCaptureFixture) -> str:
    return rp.log() if rp.kind == "subprocess" else caplog.text


async def barrier(client, subjects, publisher: ChunkPublisher) -> None:
    """Returns once the processor has handled everything published before it (it handles in order)."""
    rid = f"barrier-{random.getrandbits(32):x}"
    async with follow(client, subjects, rid, timeout=10) as results:
        await publisher.publish(rid, "agg", 0, b"barrier", final=True)
        assert [r.body for r in await results.collect()] == [b"barrier"]


# --------------------------------------------------------------------- passthrough

async def test_aggregated_chunks_pass_through_byte_for_byte_opaque_and_non_json_included(
        kind, mode, client, start_processor):
    worker = worker_for(FORMAT)
    rng = random.Random(5)
    legs: dict[str, list[bytes]] = {}
    for i in range(6):
        truth = traffic.make_truth(100 + i)
        stream = i % 2 == 0
        legs[f"agg-native-{i}"] = worker.agg(truth, stream=stream)
        legs[f"agg-opaque-{i}"] = worker.opaque_agg(truth, stream=stream, rng=rng)
    legs["agg-raw-stream"] = [b"", b"\x00\xff\xfe not json", b"data: {\"truncated\": ", b"[1, 2, 3]", b"\r\n\r\n"]
    legs["agg-raw-unary"] = [b"\xff" * 3 + bytes(range(256))]
    assert any(not _is_json(b) for bodies in legs.values() for b in bodies)

    async with start_processor(kind, format=FORMAT, mode=mode) as rp:
        publisher = ChunkPublisher(client, rp.subjects)
        async with ResultCollector(client, rp.subjects) as collector:
            for rid, bodies in legs.items():
                await publisher.publish_leg(rid, "agg", bodies)
            results = await collector.wait_for(legs, timeout=15)

    for rid, bodies in legs.items():
        got = results[rid]
        assert [r.body for r in got] == bodies, rid
        assert [r.seq for r in got] == list(range(len(bodies)))
        assert [r.final for r in got] == [False] * (len(bodies) - 1) + [True]
        assert all(r.verdict is Verdict.PASSTHROUGH and r.error is None for r in got)


def _is_json(body: bytes) -> bool:
    try:
        msgspec.json.decode(body)
    except msgspec.DecodeError:
        return False
    return True


async def test_results_carry_seq_final_msg_id_and_the_input_traceparent(kind, mode, client, start_processor):
    worker = worker_for(FORMAT)
    bodies = worker.agg(traffic.make_truth(3, output_len=9), stream=True)
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    async with start_processor(kind, format=FORMAT, mode=mode) as rp:
        raw = []
        sub = await client.subscribe(rp.subjects.result("traced"), cb=functools.partial(_append, raw))
        async with follow(client, rp.subjects, "traced", timeout=10) as results:
            await ChunkPublisher(client, rp.subjects).publish_leg("traced", "agg", bodies, traceparent=traceparent)
            await results.collect()
        await sub.unsubscribe()
    assert len(raw) == len(bodies) > 1
    for seq, msg in enumerate(raw):
        h = msg.headers
        assert h[SEQ] == str(seq)
        assert h[MSG_ID] == f"traced.{seq}"
        assert h[JOIN] == "passthrough"
        assert h[TRACEPARENT] == traceparent
        assert ERROR not in h
        assert (h.get(FINAL) == "true") == (seq == len(bodies) - 1)
        assert msg.data == bodies[seq]


async def _append(box: list, msg) -> None:
    box.append(msg)


# ---------------------------------------------------------------------------- P/D

@pytest.mark.parametrize("prefill_first", [True, False], ids=["prefill-first", "decode-first"])
async def test_pd_join_over_the_wire_reproduces_the_truth_for_every_installed_format(
        kind, mode, client, start_processor, prefill_first):
    # The processor's default format is sglang; other requests select their codec by header.
    cases = []
    for fmt in [f for f in ("sglang", "sglang-zstd", "vllm") if f in codec_names()]:
        worker = worker_for(fmt)
        for stream in (True, False):
            rid = f"pd-{fmt}-{'s' if stream else 'u'}"
            truth = traffic.make_truth(len(cases) + 40, request_id=rid, prompt_len=9, output_len=7)
            decode = worker.decode(truth, stream=stream)
            assert worker.expert_view(decode[-1])[0] != truth.experts  # decode alone carries stale rows
            cases.append((rid, fmt, worker, truth, worker.prefill(truth, stream=stream), decode))

    async with start_processor(kind, format=FORMAT, mode=mode) as rp:
        publisher = ChunkPublisher(client, rp.subjects)
        async with ResultCollector(client, rp.subjects) as collector:
            for rid, fmt, _, _, prefill, decode in cases:
                legs = [("prefill", prefill), ("decode", decode)]
                for role, bodies in legs if prefill_first else legs[::-1]:
                    await publisher.publish_leg(rid, role, bodies, format=fmt)
            results = await collector.wait_for([c[0] for c in cases], timeout=15)

    for rid, fmt, worker, truth, _, decode in cases:
        got = results[rid]
        assert [r.seq for r in got] == list(range(len(decode))), rid
        assert all(r.error is None for r in got), [r.body for r in got if r.error]
        assert got[-1].final and got[-1].verdict is Verdict.JOINED, rid
        rows, reason = worker.expert_view(got[-1].body)
        assert rows == truth.experts, rid
        assert reason is None
        for r in got[:-1]:
            assert worker.expert_view(r.body)[0] in (None, truth.experts)


async def test_missing_prefill_leg_is_omitted_with_a_reason_after_prefill_timeout(
        kind, mode, client, start_processor, caplog):
    caplog.set_level(logging.WARNING, logger="streamproc")
    worker = worker_for(FORMAT)
    truths = {rid: traffic.make_truth(60 + i, request_id=rid, output_len=6)
              for i, rid in enumerate(["no-prefill-stream", "no-prefill-unary"])}
    async with start_processor(kind, format=FORMAT, prefill_timeout=0.5, mode=mode) as rp:
        publisher = ChunkPublisher(client, rp.subjects)
        async with ResultCollector(client, rp.subjects) as collector:
            started = time.monotonic()
            for rid, truth in truths.items():
                await publisher.publish_leg(rid, "decode", worker.decode(truth, stream=rid.endswith("stream")))
            results = await collector.wait_for(truths, timeout=10)
            elapsed = time.monotonic() - started
        log_text = processor_log(rp, caplog)

    assert elapsed >= 0.45
    for rid in truths:
        final = results[rid][-1]
        assert final.final and final.error is None
        assert final.verdict is Verdict.OMITTED
        assert worker.expert_view(final.body) == (None, "prefill_timeout")
        assert "event=prefill_timeout" in log_text and f"request_id={rid}" in log_text


# ------------------------------------------------------------------ concurrency

async def test_200_concurrent_shuffled_requests_with_duplicates_all_complete_correctly(
        kind, mode, client, start_processor):
    worker = worker_for(FORMAT)
    plans = traffic.plan(FORMAT, requests=200, mode="mixed", seed=7, id_prefix="many", worker=worker)
    messages = traffic.schedule(plans, seed=7, shuffle=True, duplicates=0.1)
    keys = [(m.request_id, m.role, m.seq) for m in messages]
    assert len(keys) - len(set(keys)) > 20  # duplicates really are published
    assert {p.kind for p in plans} == {"agg", "pd"} and {p.stream for p in plans} == {True, False}

    async with start_processor(kind, format=FORMAT, mode=mode) as rp:
        raw: list = []  # wire order, before any reordering by the results helper
        sub = await client.subscribe(rp.subjects.all_results, cb=functools.partial(_append, raw),
                                     pending_msgs_limit=-1, pending_bytes_limit=-1)
        async with ResultCollector(client, rp.subjects) as collector:
            await traffic.publish(client, rp.subjects, messages, format=FORMAT)
            results = await collector.wait_for([p.request_id for p in plans], timeout=20)
            if rp.processor is not None and mode == "core":
                assert rp.processor.stats.duplicates + rp.processor.stats.late >= len(keys) - len(set(keys))
            if rp.processor is not None and mode == "durable":
                # The chunk stream collapsed the repeats (same Nats-Msg-Id) before the processor saw them.
                assert rp.processor.stats.chunks == len(set(keys))
            if rp.processor is not None:
                assert rp.processor.correlator.inflight == 0
        await client.flush()
        await sub.unsubscribe()

    wire_order: dict[str, list[int]] = {}
    for msg in raw:
        wire_order.setdefault(rp.subjects.request_id_of_result(msg.subject), []).append(int(msg.headers[SEQ]))
    # Published strictly in seq order, each seq once, even though chunks arrived shuffled and repeated.
    assert {rid: seqs for rid, seqs in wire_order.items() if seqs != list(range(len(seqs)))} == {}
    problems = {p.request_id: traffic.verify(p, results[p.request_id], worker) for p in plans}
    assert {rid: found for rid, found in problems.items() if found} == {}
    assert sum(len(r) for r in results.values()) == sum(len(p.output) for p in plans)


# -------------------------------------------------------------- contract errors

async def test_contract_violations_end_the_request_with_a_final_error_result(kind, mode, client, start_processor,
                                                                              caplog):
    caplog.set_level(logging.WARNING, logger="streamproc")
    async with start_processor(kind, format=FORMAT, mode=mode) as rp:
        subjects = rp.subjects
        publisher = ChunkPublisher(client, subjects)
        raw: list = []
        sub = await client.subscribe(subjects.all_results, cb=functools.partial(_append, raw))
        await client.flush()
        async with ResultCollector(client, subjects) as collector:
            # (request id, subject, headers, expected result seq, words the error message must contain)
            cases = [
                ("no-seq", subjects.chunk("no-seq", "agg"), None, 0, "missing"),
                ("bad-seq", subjects.chunk("bad-seq", "agg"), {SEQ: "abc"}, 0, "non-negative integer"),
                ("neg-seq", subjects.chunk("neg-seq", "agg"), {SEQ: "-1"}, 0, "non-negative integer"),
                # str.isdigit() is true for these, int() fails on them (tests/test_wire.py)
                ("super-seq", subjects.chunk("super-seq", "agg"), {SEQ: "²"}, 0, "non-negative integer"),
                ("circled-attempt", subjects.chunk("circled-attempt", "agg"), {SEQ: "0", ATTEMPT: "①"}, 0,
                 "non-negative integer"),
                ("bad-final", subjects.chunk("bad-final", "agg"), {SEQ: "0", FINAL: "yes"}, 0, FINAL),
                ("bad-role", f"{subjects.prefix}.chunks.bad-role.summary", {SEQ: "0", FINAL: "true"}, 0, "role"),
                ("mid-stream", subjects.chunk("mid-stream", "agg"), {SEQ: "x"}, 1, "non-negative integer"),
            ]
            await publisher.publish("mid-stream", "agg", 0, b'{"text": "first"}')
            for rid, subject, headers, _, _ in cases:
                await client.publish(subject, b'{"text": "hello"}', headers=headers)
            results = await collector.wait_for([c[0] for c in cases], timeout=10)
            # A valid chunk after the error must not resurrect the request.
            for rid, *_ in cases:
                await publisher.publish(rid, "agg", 5, b"late", final=True)
            await barrier(client, subjects, publisher)
            await client.flush()
            after = {rid: list(results[rid]) for rid, *_ in cases}
        await sub.unsubscribe()
        log_text = processor_log(rp, caplog)

    for rid, _, _, seq, words in cases:
        got = after[rid]
        error = got[-1]
        assert [r.seq for r in got] == list(range(seq + 1)), rid
        assert error.final and error.seq == seq
        assert error.error == "invalid_chunk" and error.verdict is None
        envelope = json.loads(error.body)
        assert words.lower() in envelope["error"]["message"].lower(), envelope
        assert f"request_id={rid}" in log_text
        headers = next(m.headers for m in raw if m.subject == subjects.result(rid) and m.headers[SEQ] == str(seq))
        assert headers[ERROR] == "invalid_chunk" and JOIN not in headers and headers[FINAL] == "true"
    assert after["mid-stream"][0].body == b'{"text": "first"}'


async def test_unknown_format_header_passes_unary_agg_through_and_fails_other_requests(
        kind, client, start_processor):
    worker = worker_for(FORMAT)
    truth = traffic.make_truth(11, output_len=5)
    async with start_processor(kind, format=FORMAT) as rp:
        publisher = ChunkPublisher(client, rp.subjects)
        async with ResultCollector(client, rp.subjects) as collector:
            unary = worker.agg(truth, stream=False)
            await publisher.publish_leg("fmt-unary", "agg", unary, format="no-such-codec")
            await publisher.publish_leg("fmt-stream", "agg", worker.agg(truth, stream=True), format="no-such-codec")
            await publisher.publish_leg("fmt-pd", "decode", worker.decode(truth, stream=False), format="no-such-codec")
            results = await collector.wait_for(["fmt-unary", "fmt-stream", "fmt-pd"], timeout=10)

    assert [(r.body, r.verdict) for r in results["fmt-unary"]] == [(unary[0], Verdict.PASSTHROUGH)]
    for rid in ("fmt-stream", "fmt-pd"):
        (error,) = results[rid]
        assert error.final and error.error == "unknown_format"
        message = json.loads(error.body)["error"]["message"]
        assert "no-such-codec" in message and "sglang" in message and "vllm" in message


async def test_a_codec_that_fails_to_load_fails_only_the_requests_that_name_it(kind, client, start_processor):
    """``--format-option stream_routed_experts=maybe`` is the vllm codec's to refuse; with another
    default format the processor starts, and the codec is first built when a chunk names it. Its
    ValueError used to leave the pure core (``Correlator.receive``) for the shell: now that request
    ends with ``unknown_format`` saying why, and the processor answers everyone else."""
    worker = worker_for(FORMAT)
    truth = traffic.make_truth(12, output_len=4)
    async with start_processor(kind, format=FORMAT, format_option="stream_routed_experts=maybe") as rp:
        publisher = ChunkPublisher(client, rp.subjects)
        async with ResultCollector(client, rp.subjects) as collector:
            for rid in ("broken-1", "broken-2"):
                await publisher.publish_leg(rid, "decode", [b'{"choices": []}'], format="vllm")
            agg = worker.agg(truth, stream=True)
            await publisher.publish_leg("healthy", "agg", agg)
            results = await collector.wait_for(["broken-1", "broken-2", "healthy"], timeout=10)

    assert [r.body for r in results["healthy"]] == agg
    for rid in ("broken-1", "broken-2"):
        (error,) = results[rid]
        assert error.final and error.error == "unknown_format"
        message = json.loads(error.body)["error"]["message"]
        assert "codec 'vllm' failed to load" in message and "stream_routed_experts='maybe'" in message


def test_a_codec_that_failed_to_load_costs_each_request_naming_it_a_fresh_error_not_a_growing_one():
    """The failure is kept (no rebuild per chunk), but re-raising one stored exception appended each
    raise's frames to its traceback: ~1.2 KB and 3 frames more per rejected request, for the
    process's life (found by review: 6,003 frames after 2,000 requests)."""
    catalog = Catalog(CodecOptions(format_options=(("stream_routed_experts", "maybe"),)))
    raised = []
    for _ in range(50):
        with pytest.raises(UnknownFormat, match="codec 'vllm' failed to load") as info:
            catalog("vllm")
        raised.append(info.value)
    depths = {len(traceback.extract_tb(exc.__traceback__)) for exc in raised}
    assert max(depths) <= 3, depths


# ------------------------------------------------------------- shell behaviour

async def test_request_without_progress_ends_with_a_timeout_error_result(client, nats_url):
    settings = load({}, {"nats_url": nats_url, "format": FORMAT, "request_timeout": 0.5})
    async with Processor(settings) as processor:
        async with follow(client, settings.subjects, "stalled", timeout=10) as results:
            await ChunkPublisher(client, settings.subjects).publish("stalled", "agg", 0, b'{"text": "a"}')
            started = time.monotonic()
            got = await results.collect()
            elapsed = time.monotonic() - started
        assert processor.stats.timeouts == 1 and processor.correlator.inflight == 0
    assert 0.4 <= elapsed < 5
    assert [(r.seq, r.final, r.error) for r in got] == [(0, False, None), (1, True, "timeout")]


async def test_graceful_stop_publishes_results_for_every_chunk_already_received(kind, client, start_processor):
    # Core semantics: what was received is handled before the connection closes. (In durable mode
    # the unhandled backlog stays in the stream for the next instance: test_durable.py.)
    n = 20_000  # enough that the processor still has a backlog when it is told to stop
    async with start_processor(kind, format=FORMAT, mode="core") as rp:
        subjects = rp.subjects
        collector = ResultCollector(client, subjects)
        await collector.__aenter__()
        publisher = ChunkPublisher(client, subjects)
        for i in range(n):
            await publisher.publish(f"stop-{i}", "agg", 0, b"x" * 64, final=True)
        await client.flush()  # the server has routed every chunk to the processor before it is told to stop
    try:
        results = await collector.wait_for([f"stop-{i}" for i in range(n)], timeout=10)
    finally:
        await collector.__aexit__(None, None, None)
    assert all(r[0].body == b"x" * 64 for r in results.values())


async def test_unknown_default_format_fails_before_connecting_and_lists_installed_codecs():
    settings = load({}, {"nats_url": "nats://127.0.0.1:1", "format": "no-such-codec"})
    with pytest.raises(StartupError) as info:
        Processor(settings)
    message = str(info.value)
    assert "no-such-codec" in message and "sglang" in message and "vllm" in message


async def test_unreachable_nats_fails_start_up_within_connect_timeout():
    settings = load({}, {"nats_url": "nats://127.0.0.1:1", "format": FORMAT, "connect_timeout": 0.5})
    started = time.monotonic()
    with pytest.raises(StartupError, match="cannot connect to NATS"):
        async with Processor(settings):
            pass
    assert time.monotonic() - started < 5


# ----------------------------------------------------------------------- helpers

async def test_results_follow_reorders_out_of_order_results_and_drops_repeats(client):
    from streamproc.wire import Subjects

    subjects = Subjects("helpers")

    def result(seq: int, final: bool = False) -> tuple[bytes, dict]:
        r = Result("r1", seq, f"body-{seq}".encode(), final, Verdict.PASSTHROUGH)
        return r.body, result_headers(r)

    async with follow(client, subjects, "r1", timeout=5) as results:
        for seq, final in [(2, True), (0, False), (0, False), (3, False), (1, False), (2, True)]:
            body, headers = result(seq, final)
            await client.publish(subjects.result("r1"), body, headers=headers)
        got = await results.collect()
    assert [(r.seq, r.body, r.final) for r in got] == [(0, b"body-0", False), (1, b"body-1", False),
                                                       (2, b"body-2", True)]

    started = time.monotonic()
    with pytest.raises(TimeoutError, match="no final result"):
        async with follow(client, subjects, "never", timeout=0.3) as results:
            body, headers = result(0)
            await client.publish(subjects.result("never"), body, headers=headers)
            await results.collect()
    assert time.monotonic() - started < 3


async def test_publisher_rejects_request_ids_that_are_not_a_single_subject_token(client):
    publisher = ChunkPublisher(client)
    for bad in ["", "a.b", "a b", "a*", "a>", "x" * 300]:
        with pytest.raises(ValueError):
            await publisher.publish(bad, "agg", 0, b"{}", final=True)
    with pytest.raises(ValueError):
        await publisher.publish("ok", "summary", 0, b"{}")
    with pytest.raises(ValueError):
        await publisher.publish("ok", "agg", -1, b"{}")
    with anyio.fail_after(5):
        await publisher.publish("ok", "agg", 0, b"{}", final=True)


def test_both_inputs_implement_every_member_of_the_input_protocol_so_the_processor_never_probes():
    """The processor calls an input's members as the ``Input`` protocol declares them; a member only
    one input has (the durable ``migrate``, its ``partitions`` count) was once read with ``getattr``,
    a seam the protocol did not show."""
    members = {name for name, value in vars(Input).items()
               if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property))}
    assert {"start", "stop", "dispatch", "caught_up", "owns", "migrate", "reading", "dropped",
            "reconnected"} <= members
    for cls in (CoreInput, DurableInput):
        assert [m for m in sorted(members) if not hasattr(cls, m)] == [], cls
    source = inspect.getsource(processor_module)
    assert "getattr(self._input" not in source and "getattr(stats" not in source
