"""A forger on the results subjects against a durable take-over: the last stored result of a request
names where the heir resumes (``core.recovery.resume_point``), and since 2026-12-07 a vLLM P/D request
taken over reads its stored bodies ``[0, next_seq)`` back (``MigrationLedger.history``). A stored
``Streamproc-Seq`` of 19,999,999 made that read list the missing seqs by building
``set(range(20_000_000))`` (~1.5 GB, 10^18 would never end); one of ``'²'`` (``str.isdigit`` is true,
``int`` refuses it) failed every lookup of the request. Building that set held the event loop
~3.5 s, past the partition's lease (1.5 s here): the lease expired, the chunk came back, and the
read began again, for good (the partition served nobody). Real nats-server, ``streamproc run`` as a
subprocess: the forged request is read once (its chunks then count as published: no answer but its
request timeout's; whoever forges its results owns its answer anyway), a bystander is answered, the partition
keeps its lease, and the processor's peak RSS (VmHWM) stays within a bound."""

from __future__ import annotations

import pytest
from conftest import processor_subprocess
from durable_helpers import chunk_stream_messages, connect, durable_flags, wait_for_finals
from helpers import free_port, rid, status_kib, wait_until

from streamproc.core.recovery import resume_point
from streamproc.core.wire import FINAL, SEQ, Subjects, chunk_headers
from streamproc.sim.embedded import EmbeddedNats

SUBJECTS = Subjects()
FORGED_SEQ = 19_999_999
GROWTH_BOUND = 64 * 1024 * 1024  # the processor's peak RSS over its idle RSS through the take-over


@pytest.mark.parametrize("seq", ["²", "٣", "1" * 19, "1" * 400, "-1", "+1", " 1", "1.0", ""])
def test_a_stored_seq_that_is_no_plain_number_names_no_resume_point(seq):
    """The rule every other reader of ``Streamproc-Seq`` applies (``wire._parse_index``): ASCII digits,
    at most 18. ``'²'`` raised ``ValueError`` out of ``int`` (every lookup of the request failed),
    ``'٣'`` read as 3, and 19 digits and more named seqs past ``MAX_SEQ``."""
    assert resume_point({SEQ: seq}) is None
    assert resume_point({SEQ: "17", FINAL: "true"}) == (18, True)
    assert resume_point({SEQ: "9" * 18}) == (10**18, False)


def vllm_body(request_id: str, token: int, finish: str | None) -> bytes:
    """One vLLM choice with one token (the older stream's chunk shape, usage null)."""
    reason = "null" if finish is None else f'"{finish}"'
    return (b'{"request_id":"%s","choices":[{"index":0,"token_ids":[%d],"finish_reason":%s}],"usage":null}'
            % (request_id.encode(), token, reason.encode()))


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(120)
async def test_a_forged_huge_resume_point_costs_the_heir_no_memory_and_nobody_an_answer():
    victim, bystander = rid("forged"), rid("bystander")
    port = free_port()
    with EmbeddedNats() as server:
        with processor_subprocess(server.url, *durable_flags(partitions=1, format="vllm"),
                                  "--request-timeout", "3", "--http-port", str(port)) as (proc, log_path):
            nc = await connect(server.url)
            try:
                js = nc.jetstream()
                baseline = status_kib(proc.pid, "VmRSS") * 1024
                await js.publish(SUBJECTS.result(victim), b'{"forged":true}', headers={SEQ: str(FORGED_SEQ)})
                for role, token, finish in (("prefill", 7, "length"), ("decode", 8, "stop")):
                    await js.publish(SUBJECTS.chunk(victim, role), vllm_body(victim, token, finish),
                                     headers=chunk_headers(victim, role, 0, final=True, format="vllm"))
                await js.publish(SUBJECTS.chunk(bystander, "agg"), vllm_body(bystander, 9, "stop"),
                                 headers=chunk_headers(bystander, "agg", 0, final=True, format="vllm"))
                stored = await wait_for_finals(js, SUBJECTS, [bystander, victim], 30)

                async def drained() -> bool:
                    return await chunk_stream_messages(js) == 0

                await wait_until(drained, 15, "every chunk acknowledged")
                peak = status_kib(proc.pid, "VmHWM") * 1024
            finally:
                await nc.close()
            assert proc.poll() is None
            log = log_path.read_text(errors="replace")
    assert [(r.seq, r.final) for r in stored[bystander]] == [(0, True)]
    ended = [(r.seq, r.final, r.error) for r in stored[victim] if r.final]
    assert ended == [(FORGED_SEQ + 1, True, "timeout")], stored[victim]  # its chunks settled as published
    assert log.count("event=published_results_lost") == 1, log[-3000:]  # read once, not again and again
    assert "event=lease_expired" not in log, log[-3000:]
    grew = peak - baseline
    print(f"\nforged resume point {FORGED_SEQ}: VmRSS before {baseline >> 20} MiB, VmHWM {peak >> 20} MiB")
    assert grew < GROWTH_BOUND, f"the processor grew by {grew >> 20} MiB through the take-over"
