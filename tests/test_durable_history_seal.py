"""Stored bodies past the take-over's bound where a retry can never help (follow-up of
tests/test_durable_history_bound.py). Real nats-server, ``streamproc run --mode durable`` as a subprocess.

(a) A migrated request (a seal record) taken over by a new owner must rebuild its migration session
from its stored bodies ``[0, next_seq)``. Past ``MAX_HISTORY_RESULTS`` / ``MAX_HISTORY_BYTES`` the read
raises ``HistoryOverBound``; until 2026-12-07 that failed the recovery lookup, so the chunk was NAKed
and redelivered (each delivery reading up to 32 MiB again) until ``--max-deliver``, then poison. Now
the request ends at once with one ``migration_refused`` error result saying the stored output passes
the bound, and the chunk is acknowledged.
(b) A migrate of a request taken over without its bodies (a plain take-over) reads them before the
seal; past the bound it answered ``unavailable`` (retry) every time. Now ``refused``, with the request
ended by its ``migration_refused`` error result, as any refused migrate.

The bound is hit by count: one stored result whose ``Streamproc-Seq`` is ``MAX_HISTORY_RESULTS`` says
``next_seq`` is one past it, and the ledger refuses before reading a body (a forged or a huge output
are the same to the reader)."""

from __future__ import annotations

import pytest
from durable_helpers import stored_results, vllm_heir, wait_for_finals
from helpers import free_port, rid, scrape
from migration_helpers import ask_migrate

from streamproc.core import defaults
from streamproc.core.events import MigrateError, MigrateErrorCode, Sealed, SealRecord
from streamproc.core.wire import SEQ, Subjects, chunk_headers, encode_seal_record
from streamproc.nats.durable.migrations import record_key
from streamproc.nats.streams import CHUNKS_STREAM

SUBJECTS = Subjects()
LAST = defaults.MAX_HISTORY_RESULTS  # the last stored result's seq: next_seq is one past the bound


def vllm_body(request_id: str, token: int, finish: str | None) -> bytes:
    reason = "null" if finish is None else f'"{finish}"'
    return (b'{"request_id":"%s","choices":[{"index":0,"text":"x","token_ids":[%d],"finish_reason":%s}],'
            b'"usage":null}' % (request_id.encode(), token, reason.encode()))


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(180)
async def test_stored_output_past_the_bound_ends_a_migrated_request_and_refuses_a_migrate():
    sealed, plain, bystander = rid("sealed"), rid("plain"), rid("bystander")
    port = free_port()
    async with vllm_heir("--http-port", str(port)) as heir:
        js = heir.js
        for r in (sealed, plain):
            await js.publish(SUBJECTS.result(r), vllm_body(r, 1, None), headers={SEQ: str(LAST)})
        await js.publish(SUBJECTS.result(bystander), vllm_body(bystander, 1, None), headers={SEQ: "0"})
        # The sealed one migrated elsewhere at its next result: attempt 1 starts at LAST + 1.
        seal = Sealed(sealed, 1, 1, [1], LAST + 1, "vllm", {})
        kv = await js.key_value(f"{CHUNKS_STREAM}_MIGRATIONS")
        await kv.create(record_key(sealed), encode_seal_record(SealRecord([LAST + 1], seal, "m-1")))
        await js.publish(SUBJECTS.chunk(sealed, "decode"), vllm_body(sealed, 8, "stop"),
                         headers=chunk_headers(sealed, "decode", 0, final=True, attempt=1, format="vllm"))
        await js.publish(SUBJECTS.chunk(plain, "decode"), vllm_body(plain, 8, None),
                         headers=chunk_headers(plain, "decode", LAST + 1, format="vllm"))
        await js.publish(SUBJECTS.chunk(bystander, "decode"), vllm_body(bystander, 8, "stop"),
                         headers=chunk_headers(bystander, "decode", 1, final=True, format="vllm"))
        await js.publish(SUBJECTS.chunk(bystander, "prefill"), vllm_body(bystander, 7, "length"),
                         headers=chunk_headers(bystander, "prefill", 0, final=True, format="vllm"))
        stored = await wait_for_finals(js, SUBJECTS, [bystander, sealed], 60)
        metrics = scrape(port)  # before the migrate: (a) alone
        replies = [await ask_migrate(heir.nc, SUBJECTS, plain, expected_attempt=0) for _ in range(2)]
        stored = await stored_results(js, SUBJECTS)
    log = heir.log
    print(f"\nreplies {replies}; redelivered {metrics['streamproc_durable_redelivered_total']:.0f}, "
          f"poisoned {metrics['streamproc_durable_poisoned_total']:.0f}")
    assert [r.seq for r in stored[bystander] if r.final] == [1]
    # (a) one clear error, at the sealed attempt's first result seq, and the chunk acknowledged at once.
    ends = [r for r in stored[sealed] if r.seq > LAST]
    assert len(ends) == 1, stored[sealed]
    end = ends[0]
    assert end.final and end.seq == LAST + 1 and end.error == "migration_refused", end
    assert b"past the take-over's bound" in end.body and b"stored output" in end.body, end.body
    assert metrics["streamproc_durable_redelivered_total"] == 0, log[-3000:]
    assert metrics["streamproc_durable_poisoned_total"] == 0
    assert "event=recovery_lookup_failed" not in log, log[-3000:]
    # (b) a definite refusal, the same to a retry; the request ended with its error result.
    first = replies[0]
    assert isinstance(first, MigrateError) and first.code is MigrateErrorCode.REFUSED, replies
    assert "past the take-over's bound" in first.message, first
    assert isinstance(replies[1], MigrateError) and replies[1].code is not MigrateErrorCode.UNAVAILABLE, replies
    [final] = [r for r in stored.get(plain, []) if r.final]
    assert final.error == "migration_refused" and b"past the take-over's bound" in final.body, final
