"""Copies of stored results against the durable take-over's history bound (follow-up of
tests/test_durable_history_bound.py). A result re-published after JetStream's duplicate window (or under
another ``Nats-Msg-Id``) is stored again with the same ``Streamproc-Seq``; the heir's read
(``MigrationLedger.history``) keeps the first copy of each seq. Until 2026-12-07 every copy counted toward
``MAX_HISTORY_BYTES``, so an honest request whose results were all stored twice passed the bound at about
half of it (16 MiB of real output) and its counts were lost on take-over (``published_results_lost``).
Now the bound counts what is kept (distinct seqs), and every copy received counts toward a bound
``MAX_HISTORY_COPIES`` times larger, so a hostile store of endless copies of one seq still ends the read
within a bounded time and memory, as lost. Real nats-server, ``streamproc run`` as a subprocess."""

from __future__ import annotations

import json
import struct
import time

import pytest
from durable_helpers import vllm_heir, wait_for_finals
from helpers import rid, status_kib

from streamproc.catalog import Catalog
from streamproc.codec import CodecOptions
from streamproc.core import defaults
from streamproc.core.correlator import Correlator, CorrelatorConfig
from streamproc.core.recovery import history_over_bound
from streamproc.core.wire import MSG_ID, SEQ, Subjects, chunk_headers
from streamproc.sim.simulation import Truth
from streamproc.testing.harness import Run, leg
from streamproc.wire import Chunk, Result, Role, Verdict, result_headers
from streamproc_vllm import VLLMWorker

SUBJECTS = Subjects()
BODY = 960 * 1024  # under nats-server's default max_payload (1 MiB) with the headers
DISTINCT = 24  # ~22.5 MiB of distinct results: under MAX_HISTORY_BYTES; stored twice, ~45 MiB over it
GROWTH_BOUND = 2 * defaults.MAX_HISTORY_BYTES  # kept bodies + the subscription's queue, each under the bound
ANSWER_BOUND = 30.0  # seconds from the victim's chunks to its stored final result
COPIES = 140  # copies of one seq: ~131 MiB, past MAX_HISTORY_COPIES x MAX_HISTORY_BYTES (128 MiB) by bytes


def test_the_bound_counts_kept_bodies_and_every_copy_against_a_larger_bound():
    mib = 1 << 20
    assert history_over_bound(10, 10 * 1024, 100, mib) is None
    assert history_over_bound(101, 0, 100, mib) is not None  # results asked for, before anything is read
    assert history_over_bound(10, mib + 1, 100, mib) is not None  # bytes kept
    # Every result stored twice: twice the bytes received, the kept ones under the bound.
    assert history_over_bound(10, mib, 100, mib, received=20, received_bytes=2 * mib, max_copies=4) is None
    assert history_over_bound(100, mib, 100, mib, received=400, received_bytes=4 * mib, max_copies=4) is None
    # Copies past max_copies times either bound: the read ends whatever it kept.
    over_bytes = history_over_bound(2, 1024, 100, mib, received=5, received_bytes=4 * mib + 1, max_copies=4)
    over_count = history_over_bound(2, 1024, 100, mib, received=401, received_bytes=1024, max_copies=4)
    for why in (over_bytes, over_count):
        assert why is not None and "past the take-over's bound" in why and "copies" in why, why
    # Without max_copies, copies have no slack: what was received is the bound (the old reading).
    assert history_over_bound(2, 1024, 100, mib, received=2, received_bytes=mib + 1) is not None
    assert defaults.MAX_HISTORY_COPIES >= 2  # a request stored twice over reads whole
    # the hostile store below passes the copies bound
    assert COPIES * BODY > defaults.MAX_HISTORY_COPIES * defaults.MAX_HISTORY_BYTES


def vllm_body(request_id: str, token: int, finish: str | None, pad: int = 0) -> bytes:
    """One vLLM choice with one token (stream chunk shape, usage null), ``pad`` bytes of text."""
    reason = "null" if finish is None else f'"{finish}"'
    return (b'{"request_id":"%s","choices":[{"index":0,"text":"%s","token_ids":[%d],"finish_reason":%s}],'
            b'"usage":null}' % (request_id.encode(), b"x" * pad, token, reason.encode()))


async def take_over(js, victim: str, next_seq: int) -> None:
    """The victim's next decode chunk (its final) and its prefill leg, to a processor that never saw it."""
    await js.publish(SUBJECTS.chunk(victim, "decode"), vllm_body(victim, 8, "stop"),
                     headers=chunk_headers(victim, "decode", next_seq, final=True, format="vllm"))
    await js.publish(SUBJECTS.chunk(victim, "prefill"), vllm_body(victim, 7, "length"),
                     headers=chunk_headers(victim, "prefill", 0, final=True, format="vllm"))


def pd_request(request_id: str) -> tuple[list[Chunk], list[Chunk], list[Result]]:
    """A vLLM P/D request of ``DISTINCT + 1`` output tokens, one a decode chunk (stream chunks without
    usage), and what a live processor stores for it: ``DISTINCT`` pass-through results, each padded to
    ``BODY`` bytes of text (a worker streaming large chunks), then the final, whose routed_experts rows
    are joined from both legs only when every token_id before it was counted (else ``length_mismatch``)."""
    n = DISTINCT + 1
    rows = b"".join(struct.pack("<2i", i % 8, (i + 1) % 8) for i in range(n))  # positions [0, 1 + n - 1)
    truth = Truth(request_id, [24936], [14000 + i for i in range(n)], [1] * n, 1, 2, 8, rows, [-5.2],
                  [-0.5] * n, return_logprob=False)
    worker = VLLMWorker()
    prefill = leg(request_id, Role.PREFILL, worker.prefill(truth, stream=True))
    decoded = worker.decode(truth, stream=True)
    text = b'"index":0,"text":"%s",' % (b"x" * BODY)
    padded = [body.replace(b'"index":0,', text, 1) for body in decoded[:-1]]
    decode = leg(request_id, Role.DECODE, [*padded, decoded[-1]])
    live = Run(Correlator(Catalog(CodecOptions()), "vllm", CorrelatorConfig()))
    for chunk in [*prefill, *decode]:
        live.absorb(live.correlator.receive(chunk, 0.0))
    results = live.of(request_id)
    assert [r.seq for r in results] == list(range(n)) and results[-1].verdict is Verdict.JOINED, results[-1]
    return prefill, decode, results


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(240)
async def test_results_stored_twice_are_read_whole_when_the_distinct_ones_fit():
    """Each result stored twice (the copy under another ``Nats-Msg-Id``, as one re-published after the
    duplicate window), interleaved: ~45 MiB received, ~22.5 MiB distinct. The heir reads them whole and
    joins the final as the live processor did (before: ``published_results_lost``, past the 32 MiB bound,
    and the rows omitted with ``length_mismatch``)."""
    victim = rid("twice")
    prefill, decode, live = pd_request(victim)
    async with vllm_heir("--request-timeout", "20") as heir:
        js = heir.js
        for result in live[:-1]:
            headers = result_headers(result)
            for msg_id in (headers[MSG_ID], headers[MSG_ID] + ".again"):
                await js.publish(SUBJECTS.result(victim), result.body,
                                 headers={**headers, MSG_ID: msg_id})
        # Taken over: its last decode chunk (the final) and its prefill leg.
        for chunk in [decode[-1], *prefill]:
            role = chunk.role.value
            headers = chunk_headers(victim, role, chunk.seq, final=chunk.final, format="vllm")
            await js.publish(SUBJECTS.chunk(victim, role), chunk.body, headers=headers)
        stored = await wait_for_finals(js, SUBJECTS, [victim], 60)
    log = heir.log
    [final] = [r for r in stored[victim] if r.final]
    sent = sum(len(r.body) for r in stored[victim] if not r.final)
    choice = json.loads(final.body)["choices"][0]
    rows = "present" if choice.get("routed_experts") else choice.get("routed_experts_unavailable_reason")
    print(f"\n{DISTINCT} results stored twice ({sent >> 20} MiB, {sent >> 21} MiB distinct): "
          f"final {final.verdict}, routed_experts {rows}")
    assert len(stored[victim]) == 2 * DISTINCT + 1
    assert sent > defaults.MAX_HISTORY_BYTES > sent // 2
    assert "event=published_results_lost" not in log, log[-3000:]
    assert (final.seq, final.verdict) == (DISTINCT, Verdict.JOINED), (final, choice)
    assert final.body == live[-1].body


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(300)
async def test_endless_copies_of_one_seq_end_the_read_in_bounded_time_and_memory():
    """A hostile store: seq 0 stored ``COPIES`` times (~131 MiB), then seq 1. Only one body is ever kept,
    so the kept bound never trips; the copies bound (``MAX_HISTORY_COPIES`` x ``MAX_HISTORY_BYTES``,
    128 MiB received) ends the read, counted as lost (``published_results_lost``), with the heir's peak
    RSS growth under ``GROWTH_BOUND`` and its answer within ``ANSWER_BOUND``."""
    copies = COPIES
    victim, bystander = rid("copies"), rid("bystander")
    async with vllm_heir("--request-timeout", "30") as heir:
        js = heir.js
        body = vllm_body(victim, 0, None, BODY)
        for n in range(copies):
            await js.publish(SUBJECTS.result(victim), body,
                             headers={SEQ: "0", MSG_ID: f"{victim}.0.{n}"})
        await js.publish(SUBJECTS.result(victim), vllm_body(victim, 1, None), headers={SEQ: "1"})
        await js.publish(SUBJECTS.result(bystander), vllm_body(bystander, 1, None),
                         headers={SEQ: "0"})
        baseline = status_kib(heir.proc.pid, "VmRSS") * 1024
        sent = time.monotonic()
        await take_over(js, victim, 2)
        await take_over(js, bystander, 1)
        stored = await wait_for_finals(js, SUBJECTS, [victim, bystander], 120)
        waited = time.monotonic() - sent
        peak = status_kib(heir.proc.pid, "VmHWM") * 1024
    log = heir.log
    grew = peak - baseline
    print(f"\n{copies} copies of one {BODY >> 10} KiB result ({copies * BODY >> 20} MiB): VmRSS before "
          f"{baseline >> 20} MiB, VmHWM {peak >> 20} MiB (+{grew >> 20} MiB, "
          f"bound {GROWTH_BOUND >> 20} MiB), "
          f"both answered {waited:.2f} s after the chunks")
    assert [r.seq for r in stored[bystander] if r.final] == [1]
    assert [r.seq for r in stored[victim] if r.final] == [2]
    lost = [line for line in log.splitlines() if "event=published_results_lost" in line]
    assert len(lost) == 1 and victim in lost[0], log[-3000:]
    assert "past the take-over's bound" in lost[0] and "copies" in lost[0], lost[0]
    assert grew < GROWTH_BOUND, f"the heir grew by {grew >> 20} MiB through the take-over"
    assert waited < ANSWER_BOUND, f"the take-over took {waited:.1f} s"
