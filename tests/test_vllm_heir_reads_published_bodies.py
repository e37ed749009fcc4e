"""A vLLM P/D request taken over without a seal record (``Adoption.RESUME``): the heir reads back the
bodies already published, because its join session counts their token_ids (upstream stream chunks carry
no usage: ``GenerateStreamResponse(request_id=..., choices=[...])``), and a codec whose sessions count
nothing costs the take-over no read. Before (2026-12-07) only the seal-record path handed the bodies to
``JoinSession.published``; the plain resume decided the final chunk's rows on part of the output."""

from __future__ import annotations

import contextlib
import json
from typing import NamedTuple

import pytest

from streamproc.catalog import Catalog
from streamproc.codec import CodecOptions
from streamproc.core.correlator import Correlator, CorrelatorConfig
from streamproc.sim.simulation import Truth
from streamproc.testing.harness import Run, leg
from streamproc.wire import Role
from streamproc_vllm import VLLMWorker

ROWS = b"\x02\x00\x00\x00\x04\x00\x00\x00\x01\x00\x00\x00\x02\x00\x00\x00"  # 2 positions, 1 layer, top 2


def _correlator(format: str = "vllm") -> Correlator:
    return Correlator(Catalog(CodecOptions()), format, CorrelatorConfig())


ROWS3 = ROWS + b"\x03\x00\x00\x00\x05\x00\x00\x00"  # 3 positions (prompt 1, output 3)


def _legs(rid: str, coverage: str = "full", *, decode_rows: bool = True, three: bool = False):
    if three:
        truth = Truth(rid, [24936], [14729, 15475, 16000], [1, 1, 1], 1, 2, 8, ROWS3, [-5.2],
                      [-6.3, -0.75, -1.5], return_logprob=False, decode_coverage=coverage)
    else:
        truth = Truth(rid, [24936], [14729, 15475], [1, 1], 1, 2, 8, ROWS, [-5.2], [-6.3, -0.75],
                      return_logprob=False, decode_coverage=coverage)
    w = VLLMWorker()
    prefill = leg(rid, Role.PREFILL, w.prefill(truth, stream=True))
    bodies = w.decode(truth, stream=True)
    if not decode_rows:  # a decode whose capture lost its rows: the aggregated answer cannot be rebuilt
        last = json.loads(bodies[-1])
        del last["choices"][0]["routed_experts"]
        bodies = [*bodies[:-1], json.dumps(last, separators=(",", ":")).encode()]
    decode = leg(rid, Role.DECODE, bodies)
    # the shape under test: stream chunks without usage
    assert len(decode) == (3 if three else 2) and all(b'"usage":null' in c.body for c in decode)
    return prefill, decode


def _live(rid: str, prefill, decode) -> list:
    live = Run(_correlator())
    for chunk in [*prefill, *decode]:
        live.absorb(live.correlator.receive(chunk, 0.0))
    return live.of(rid)


def _take_over(rid: str, prefill, decode, stored: list[bytes] | None, *, ask: bool = True) -> list:
    """The durable shell's steps (recovery.py ``Recovery.adopt``, ``Adoption.RESUME``): ask the
    correlator whether the bodies are wanted, read them (``stored``: None when they are gone), resume,
    feed the chunks not yet answered."""
    heir = Run(_correlator())
    history = None
    if ask and heir.correlator.needs_published(rid, 1, False, "vllm"):
        history = stored
    heir.correlator.resume(rid, 1, False, 0.0, "vllm", history=history)
    for chunk in [*prefill, decode[1]]:
        heir.absorb(heir.correlator.receive(chunk, 0.0))
    return heir.of(rid)


@pytest.mark.parametrize("coverage", ["full", "suffix"])
def test_a_heir_without_a_seal_record_reads_the_published_bodies_and_joins_as_the_live_one(coverage):
    prefill, decode = _legs("r1", coverage)
    results = _live("r1", prefill, decode)
    assert [r.verdict.value for r in results] == ["passthrough", "joined"]
    heir = _take_over("r1", prefill, decode, [results[0].body])
    assert [(r.seq, r.verdict, r.body) for r in heir] == [(1, results[1].verdict, results[1].body)]


def test_only_a_codec_that_counts_across_chunks_wants_the_bodies_and_only_when_something_is_left():
    vllm, sglang = _correlator("vllm"), _correlator("sglang")
    assert vllm.needs_published("r", 3, False) and vllm.needs_published("r", 3, False, "vllm")
    assert not sglang.needs_published("r", 3, False)  # SGLang's chunks carry their counts: no read
    assert not vllm.needs_published("r", 3, False, "sglang")  # the chunk's format decides
    assert not vllm.needs_published("r", 3, True)  # finished: nothing is joined again
    assert not vllm.needs_published("r", 0, False)  # nothing published yet
    vllm.resume("r", 3, False, 0.0)
    assert not vllm.needs_published("r", 3, False)  # held here already


def test_a_heir_whose_published_bodies_are_gone_omits_the_rows_rather_than_splice_prefills():
    """Decode lost its rows: the live session omits them (``decode_missing``). A heir counting only the
    final chunk's token (generated 0) would publish prefill's prompt rows as the whole answer; without
    the published bodies it knows no count and omits them too."""
    prefill, decode = _legs("r3", decode_rows=False)
    results = _live("r3", prefill, decode)
    final = json.loads(results[1].body)["choices"][0]
    assert final["routed_experts"] is None and final["routed_experts_unavailable_reason"] == "decode_missing"
    heir = _take_over("r3", prefill, decode, None)
    assert [(r.seq, r.verdict.value) for r in heir] == [(1, "omitted")]
    choice = json.loads(heir[0].body)["choices"][0]
    assert choice["routed_experts"] is None
    assert choice["routed_experts_unavailable_reason"] == "length_mismatch"


class Heir(NamedTuple):
    """A durable processor that never saw the request, and a client of its nats-server."""

    processor: object
    nc: object
    js: object
    subjects: object
    publisher: object
    reads: list[tuple[str, int]]  # (request id, count) of every MigrationLedger.history call


@contextlib.asynccontextmanager
async def durable_heir():
    """A real nats-server with a durable vLLM processor on it (the heir of a dead instance whose results
    the test stores), its reads of stored bodies counted, and a connection publishing chunks durably."""
    from durable_helpers import connect, durable_settings

    from streamproc.client.publisher import ChunkPublisher
    from streamproc.nats.processor import Processor
    from streamproc.sim.embedded import EmbeddedNats

    with EmbeddedNats() as server:
        settings = durable_settings(server.url, format="vllm")
        async with Processor(settings) as p:
            ledger = p.input.recovery.ledger  # type: ignore[union-attr,attr-defined]
            assert ledger is not None
            reads: list[tuple[str, int]] = []
            history = ledger.history

            async def counted(rid: str, count: int) -> list[bytes]:
                reads.append((rid, count))
                return await history(rid, count)

            ledger.history = counted  # type: ignore[method-assign]
            nc = await connect(server.url)
            try:
                yield Heir(p, nc, nc.jetstream(), settings.subjects,
                           ChunkPublisher(nc, settings.subjects, durable=True), reads)
            finally:
                await nc.close()


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(90)
async def test_a_durable_heir_reads_the_published_bodies_for_vllm_and_nothing_for_sglang():
    """Against a real nats-server and a durable processor that never saw the requests: what a dead
    instance stored (result 0, its chunk settled) is in the results stream, the rest of the chunks
    come. The vLLM request is answered as the live processor answered it; the SGLang one costs no read
    of its stored bodies (``MigrationLedger.history`` calls counted)."""
    from durable_helpers import wait_for_finals

    from streamproc.wire import Result, Verdict, result_headers

    prefill, decode = _legs("v1", "suffix")
    live = _live("v1", prefill, decode)
    agg = [b'{"text":"Hello","meta_info":{"id":"s1"}}', b'{"text":" world","meta_info":{"id":"s1"}}']
    async with durable_heir() as heir:
        js, subjects, pub = heir.js, heir.subjects, heir.publisher
        for rid, body in (("v1", live[0].body), ("s1", agg[0])):
            await js.publish(subjects.result(rid), body,
                             headers=result_headers(Result(rid, 0, body, False, Verdict.PASSTHROUGH)))
        for chunk in prefill:
            await pub.publish("v1", "prefill", chunk.seq, chunk.body, final=chunk.final, format="vllm")
        await pub.publish("v1", "decode", 1, decode[1].body, final=True, format="vllm")
        await pub.publish("s1", "agg", 1, agg[1], final=True, format="sglang")
        stored = await wait_for_finals(js, subjects, ["v1", "s1"], 30)
    assert [(r.seq, r.verdict, r.body) for r in stored["v1"]] == [(0, live[0].verdict, live[0].body),
                                                                  (1, live[1].verdict, live[1].body)]
    assert [(r.seq, r.body) for r in stored["s1"]] == [(0, agg[0]), (1, agg[1])]
    assert heir.reads == [("v1", 1)]


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(90)
async def test_a_durable_heir_whose_published_bodies_are_gone_omits_rather_than_splice_prefills(caplog):
    """Result 0 of three is gone from the results stream (expired, purged; results 1 stored): the heir
    cannot count the tokens before it. Decode lost its rows, so the live processor omitted them
    (``decode_missing``); an heir counting only the final chunk's token took prefill's prompt rows for
    the whole answer (``joined``). Now it omits them (``length_mismatch``) and says so in the log."""
    from durable_helpers import wait_for_finals

    from streamproc.wire import Result, Verdict, result_headers

    prefill, decode = _legs("v2", three=True, decode_rows=False)
    live = _live("v2", prefill, decode)
    assert json.loads(live[2].body)["choices"][0]["routed_experts_unavailable_reason"] == "decode_missing"
    async with durable_heir() as heir:
        js, subjects, pub = heir.js, heir.subjects, heir.publisher
        acks = [await js.publish(subjects.result("v2"), r.body,
                                 headers=result_headers(Result("v2", r.seq, r.body, False, r.verdict)))
                for r in live[:2]]
        results_stream = heir.processor.input.recovery.results_stream  # type: ignore[attr-defined]
        await heir.nc.jsm().delete_msg(results_stream, acks[0].seq)
        for chunk in prefill:
            await pub.publish("v2", "prefill", chunk.seq, chunk.body, final=chunk.final, format="vllm")
        await pub.publish("v2", "decode", 2, decode[2].body, final=True, format="vllm")
        stored = await wait_for_finals(js, subjects, ["v2"], 30)
    assert [r.seq for r in stored["v2"]] == [1, 2]
    final = stored["v2"][-1]
    assert final.verdict is Verdict.OMITTED, final
    choice = json.loads(final.body)["choices"][0]
    assert choice["routed_experts"] is None
    assert choice["routed_experts_unavailable_reason"] == "length_mismatch"
    assert any("published_results_lost" in r.getMessage() and "v2" in r.getMessage() for r in caplog.records)


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(90)
async def test_a_read_past_the_bound_counts_as_lost_never_as_part():
    """Bodies past the take-over's bound (``MAX_HISTORY_BYTES``) are not usable, as gone ones are: the
    heir's session is told they are lost (``JoinSession.published_lost``) and omits the count-dependent
    rows (``length_mismatch``), where the bodies read back give the live processor's answer
    (``decode_missing``). The ledger's bound is lowered to one body here so that two stored results
    pass it."""
    from durable_helpers import wait_for_finals

    from streamproc.wire import Result, Verdict, result_headers

    prefill, decode = _legs("v3", three=True, decode_rows=False)
    live = _live("v3", prefill, decode)
    assert json.loads(live[2].body)["choices"][0]["routed_experts_unavailable_reason"] == "decode_missing"
    async with durable_heir() as heir:
        ledger = heir.processor.input.recovery.ledger  # type: ignore[attr-defined]
        ledger.max_history_bytes = len(live[0].body)
        js, subjects, pub = heir.js, heir.subjects, heir.publisher
        for r in live[:2]:
            await js.publish(subjects.result("v3"), r.body,
                             headers=result_headers(Result("v3", r.seq, r.body, False, r.verdict)))
        for chunk in prefill:
            await pub.publish("v3", "prefill", chunk.seq, chunk.body, final=chunk.final, format="vllm")
        await pub.publish("v3", "decode", 2, decode[2].body, final=True, format="vllm")
        stored = await wait_for_finals(js, subjects, ["v3"], 30)
    assert heir.reads == [("v3", 2)]
    final = stored["v3"][-1]
    assert (final.seq, final.verdict) == (2, Verdict.OMITTED), final
    choice = json.loads(final.body)["choices"][0]
    assert choice["routed_experts"] is None
    assert choice["routed_experts_unavailable_reason"] == "length_mismatch"


def test_an_aggregated_request_wants_no_bodies_whatever_its_codec():
    """Aggregated bodies never reach a codec (byte-identical results, docs/protocol.md), so no join
    session counts them: the chunk that starts the take-over being ``agg`` costs it no read."""
    from streamproc.wire import Role as R

    vllm = _correlator("vllm")
    assert not vllm.needs_published("r", 3, False, "vllm", role=R.AGG)
    assert vllm.needs_published("r", 3, False, "vllm", role=R.DECODE)
    assert vllm.needs_published("r", 3, False, "vllm", role=R.PREFILL)
    assert vllm.needs_published("r", 3, False, "vllm")  # not known (a migrate's adoption): read


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(90)
async def test_a_durable_heir_reads_no_bodies_for_an_aggregated_vllm_request():
    """An aggregated vLLM request taken over without a seal record (real nats-server, durable processor
    that never saw it): its results are passed through byte-identical, so the heir reads none of its
    stored bodies back (until 2026-12-07 every one of them, held whole under the one-at-a-time history
    lock and parsed by a join session the request never uses)."""
    from durable_helpers import wait_for_finals

    from streamproc.wire import Result, Verdict, result_headers

    _, decode = _legs("a1")
    bodies = [c.body for c in decode]
    async with durable_heir() as heir:
        await heir.js.publish(heir.subjects.result("a1"), bodies[0],
                              headers=result_headers(Result("a1", 0, bodies[0], False, Verdict.PASSTHROUGH)))
        await heir.publisher.publish("a1", "agg", 1, bodies[1], final=True, format="vllm")
        stored = await wait_for_finals(heir.js, heir.subjects, ["a1"], 30)
    assert [(r.seq, r.body) for r in stored["a1"]] == [(0, bodies[0]), (1, bodies[1])]
    assert heir.reads == []
