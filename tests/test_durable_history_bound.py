"""A huge stored output against a durable take-over: a vLLM P/D request taken over without a seal
record reads its stored result bodies ``[0, next_seq)`` back (``MigrationLedger.history``), one request
at a time (``Recovery._history_reads``). Until 2026-12-07 nothing bounded that read: 128 MiB stored
under one request id (a hostile or buggy worker streaming large chunks, or anyone who may publish on
results subjects) were all held at once by the heir, and every other take-over of the partition that
reads bodies waited behind it. The live session never holds them (it counts token_ids and folds what it
retains past ``max_retained_bytes``), so the heir reads at most ``defaults.MAX_HISTORY_BYTES`` and
``MAX_HISTORY_RESULTS`` and, past them, takes the bodies as lost (``published_results_lost``: the
count-dependent rows omitted with a reason, never joined on part). Real nats-server, ``streamproc run``
as a subprocess."""

from __future__ import annotations

import time

import pytest
from durable_helpers import vllm_heir, wait_for_finals
from helpers import rid, status_kib

from streamproc.core import defaults
from streamproc.core.recovery import history_over_bound
from streamproc.core.wire import SEQ, Subjects, chunk_headers

SUBJECTS = Subjects()
BODY = 960 * 1024  # under nats-server's default max_payload (1 MiB) with the headers
STORED = 136  # ~128 MiB under the victim's id
GROWTH_BOUND = 2 * defaults.MAX_HISTORY_BYTES  # the heir's peak RSS over its idle RSS
ANSWER_BOUND = 15.0  # seconds from the bystander's chunks to its stored final result


def test_the_bound_is_a_pure_decision():
    assert history_over_bound(10, 10 * 1024, 100, 1 << 20) is None
    assert history_over_bound(101, 0, 100, 1 << 20) is not None  # results, before anything is read
    assert history_over_bound(10, (1 << 20) + 1, 100, 1 << 20) is not None  # bytes received
    assert "results" in history_over_bound(101, 0, 100, 1 << 20)


def vllm_body(request_id: str, token: int, finish: str | None, pad: int = 0) -> bytes:
    """One vLLM choice with one token (stream chunk shape, usage null), ``pad`` bytes of text."""
    reason = "null" if finish is None else f'"{finish}"'
    return (b'{"request_id":"%s","choices":[{"index":0,"text":"%s","token_ids":[%d],"finish_reason":%s}],'
            b'"usage":null}' % (request_id.encode(), b"x" * pad, token, reason.encode()))


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(240)
async def test_a_huge_stored_output_costs_the_heir_a_bounded_read_and_the_bystander_no_wait():
    victim, bystander = rid("huge"), rid("bystander")
    async with vllm_heir("--request-timeout", "20") as heir:
        js = heir.js
        for seq in range(STORED):  # what a processor would have stored: results 0..STORED-1
            await js.publish(SUBJECTS.result(victim), vllm_body(victim, seq, None, BODY),
                             headers={SEQ: str(seq)})
        await js.publish(SUBJECTS.result(bystander), vllm_body(bystander, 1, None),
                         headers={SEQ: "0"})
        baseline = status_kib(heir.proc.pid, "VmRSS") * 1024
        # Both taken over: their next decode chunk (the final) and their prefill leg.
        for r, seq in ((victim, STORED), (bystander, 1)):
            await js.publish(SUBJECTS.chunk(r, "decode"), vllm_body(r, 8, "stop"),
                             headers=chunk_headers(r, "decode", seq, final=True, format="vllm"))
            await js.publish(SUBJECTS.chunk(r, "prefill"), vllm_body(r, 7, "length"),
                             headers=chunk_headers(r, "prefill", 0, final=True, format="vllm"))
            if r == victim:
                sent = time.monotonic()
        stored = await wait_for_finals(js, SUBJECTS, [bystander], 60)
        waited = time.monotonic() - sent
        stored = await wait_for_finals(js, SUBJECTS, [bystander, victim], 60)
        peak = status_kib(heir.proc.pid, "VmHWM") * 1024
    log = heir.log
    grew = peak - baseline
    print(f"\n{STORED} stored bodies of {BODY >> 10} KiB: VmRSS before {baseline >> 20} MiB, "
          f"VmHWM {peak >> 20} MiB, bystander answered {waited:.2f} s after the victim's chunks")
    assert [r.seq for r in stored[bystander] if r.final] == [1]
    final = [r for r in stored[victim] if r.final]
    assert [r.seq for r in final] == [STORED], stored[victim][-3:]
    assert log.count("event=published_results_lost") == 1, log[-3000:]
    assert "MAX_HISTORY" not in log and "past the take-over's bound" in log, log[-3000:]
    assert grew < GROWTH_BOUND, f"the heir grew by {grew >> 20} MiB through the take-over"
    assert waited < ANSWER_BOUND, f"the bystander waited {waited:.1f} s"

