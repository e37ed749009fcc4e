"""A migrated request's seal list (one result seq per migration) is charged to the byte budget.

``_Request.seals`` grew by one entry per migrate (up to ``--max-migrations``, at most 1,000,000) and
a take-over held whatever a seal record carried, both outside ``max_buffered_bytes`` and
``max_total_bytes``: 10,000 requests in flight at max_migrations 1,000,000 could hold ~360 GB of
lists of ints (36 bytes a seal). Now each seal costs ``SEAL_BYTES`` (an ``array('q')`` item),
charged as the request's migration progress state; a migrate whose seal would pass a budget is
refused before anything is sealed, and a record read back holds at most ``wire.max_seals``."""

from __future__ import annotations

import tracemalloc

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from toy_codec import MigratingToyCodec, feed

from streamproc.core import defaults
from streamproc.core.wire import decode_seal_record, encode_seal_record, max_seals
from streamproc.correlator import Correlator, CorrelatorConfig
from streamproc.testing.harness import Run, leg
from streamproc.wire import MigrateErrorCode, Role, Sealed, SealRecord

SEAL = defaults.SEAL_BYTES


def make(**config) -> tuple[Correlator, Run]:
    codec = MigratingToyCodec()
    c = Correlator(lambda name: codec, codec.name, CorrelatorConfig(**config))
    return c, Run(c)


def migrate(run: Run, rid: str, **kwargs):
    reply, decisions = run.correlator.migrate(rid, 0.0, **kwargs)
    run.absorb(decisions)
    return reply


def record(seals: list[int]) -> bytes:
    return encode_seal_record(SealRecord(seals, Sealed("r", len(seals), 2, [1, 2], 1, "toy", {}), "id-1"))


@settings(max_examples=60, deadline=None)
@given(tokens=st.integers(1, 20), migrations=st.integers(1, 300), ids=st.booleans())
def test_the_accounted_bytes_include_every_seal(tokens, migrations, ids):
    """The toy session's progress state is 8 bytes a token id emitted: what is charged beyond it (and
    beyond the last seal's reply kept for a retry) is the seal list, SEAL_BYTES a migration."""
    c, run = make(max_migrations=1_000_000)
    feed(run, leg("m", Role.AGG, [" ".join(map(str, range(tokens))).encode(), b"x"])[:1])
    last = b""
    for n in range(migrations):
        reply = migrate(run, "m", id=f"seal-{n}" if ids else None)
        assert isinstance(reply, Sealed) and reply.attempt == n + 1
        last = msgspec.json.encode(reply) if ids else b""
    kept = len(last)  # the reply's encoding, as migrate keeps it (encode_control is msgspec JSON)
    assert c.charged_bytes == 8 * tokens + migrations * SEAL + kept
    c.tick(10_000.0)  # the request times out: every byte it held is released
    assert c.charged_bytes == 0 and c.inflight == 0


def test_a_request_migrated_many_times_hits_the_per_request_budget_with_a_clear_refusal():
    """max_migrations allows a million; the byte budget ends the request first, before the seal that
    would pass it: the frontend's migrate is refused and the client gets one final error."""
    room = 5
    c, run = make(max_migrations=1_000_000, max_buffered_bytes=8 * 2 + room * SEAL)
    feed(run, leg("m", Role.AGG, [b"1 2", b"3"])[:1])
    assert [migrate(run, "m").attempt for _ in range(room)] == list(range(1, room + 1))
    assert c.charged_bytes == 8 * 2 + room * SEAL  # exactly at the bound
    reply = migrate(run, "m")
    assert reply.code is MigrateErrorCode.REFUSED and reply.attempt == room
    assert "per-request bound of 56 bytes (max_buffered_bytes)" in reply.message
    assert f"{room} seals" in reply.message
    err = run.of("m")[-1]
    assert (err.error, err.final, err.seq) == ("migration_refused", True, 1)
    assert b"max_buffered_bytes" in err.body
    assert (c.stats.migrations, c.stats.migrations_refused, c.stats.over_budget) == (room, 1, 1)
    assert c.charged_bytes == 0 and c.is_finished("m")


def test_seals_count_against_the_global_budget_and_the_biggest_holder_is_ended_to_make_room():
    """Many requests migrated many times each fit their per-request bound and together passed the
    processor's: the seal that passes max_total_bytes ends the biggest holder (as a chunk would)."""
    c, run = make(max_migrations=1_000_000, max_total_bytes=8 + 10 * SEAL + 8)
    for rid in ("big", "small"):
        feed(run, leg(rid, Role.AGG, [b"1", b"2"])[:1])
    for _ in range(10):
        migrate(run, "big")
    assert c.charged_bytes == 8 + 10 * SEAL
    reply = migrate(run, "small")  # its progress (8) fills the budget, its seal needs 8 more
    assert isinstance(reply, Sealed) and reply.attempt == 1
    [end] = [r for r in run.of("big") if r.error]
    assert end.error == "overloaded" and b"ended to make room" in end.body
    assert c.is_finished("big") and c.charged_bytes == 8 + SEAL <= c.config.max_total_bytes
    assert c.stats.over_budget == 1


def test_a_seal_the_global_budget_has_no_room_for_refuses_the_migrate_of_its_biggest_holder():
    c, run = make(max_migrations=1_000_000, max_total_bytes=8 + 3 * SEAL)
    feed(run, leg("m", Role.AGG, [b"1", b"2"])[:1])
    assert [migrate(run, "m").attempt for _ in range(3)] == [1, 2, 3]
    reply = migrate(run, "m")
    assert reply.code is MigrateErrorCode.REFUSED and "processor byte budget exhausted" in reply.message
    assert run.of("m")[-1].error == "migration_refused" and c.charged_bytes == 0


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 400))
def test_a_resumed_request_is_charged_for_its_seal_record(n):
    history = [b"1 2", b"3"]
    c, run = make(max_migrations=1_000_000)
    c.resume("r", 2, False, 0.0, seals=[2] * n, history=history)
    assert c.attempt_of("r") == n
    assert c.charged_bytes == 8 * 3 + n * SEAL


def test_a_seal_record_past_the_per_request_budget_is_never_held():
    c, run = make(max_migrations=1_000_000, max_buffered_bytes=100 * SEAL)
    c.resume("ok", 1, False, 0.0, seals=[1] * 100, history=[b"1"])  # exactly at the bound
    with pytest.raises(ValueError, match="101 seals .* passes the per-request bound"):
        c.resume("r", 1, False, 0.0, seals=[1] * 101, history=[b"1"])
    assert not c.knows("r") and c.attempt_of("ok") == 100


@settings(max_examples=200, deadline=None)
@given(seals=st.lists(st.integers(0, 2**40), max_size=60), limit=st.integers(0, 60))
def test_decode_seal_record_counts_the_seals_before_building_them(seals, limit):
    body = record(seals)
    if len(seals) > limit:
        with pytest.raises(msgspec.ValidationError, match=f"{len(seals)} seals, more than the {limit}"):
            decode_seal_record(body, limit)
    else:
        assert decode_seal_record(body, limit).seals == seals
    assert decode_seal_record(body).seals == seals  # no bound: as before


def test_decode_seal_record_counts_with_whitespace_and_refuses_without_building_the_list():
    spaced = b'{"id": null, "seals" : [ 1 ,\n 2 , 3 ] , "sealed": ' + msgspec.json.encode(
        Sealed("r", 3, 2, [1, 2], 1, "toy", {})) + b"}"
    assert decode_seal_record(spaced, 3).seals == [1, 2, 3]
    with pytest.raises(msgspec.ValidationError):
        decode_seal_record(spaced, 2)
    assert decode_seal_record(record([]), 0).seals == []
    # A forger's 4,000,000 seals (8 MB of JSON): refused at about the body's size, where decoding
    # the list first peaked at ~35 MB.
    huge = record([7] * 4_000_000)
    tracemalloc.start()
    try:
        with pytest.raises(msgspec.ValidationError):
            decode_seal_record(huge, max_seals(defaults.MAX_BUFFERED_BYTES))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1.5 * len(huge), (peak, len(huge))


def test_max_seals_is_what_decoding_them_costs_within_the_per_request_budget():
    assert max_seals(defaults.MAX_BUFFERED_BYTES) == 932_067
    # an honest record at the budget is held for less than it: SEAL_BYTES a seal once adopted
    assert max_seals(defaults.MAX_BUFFERED_BYTES) * SEAL <= defaults.MAX_BUFFERED_BYTES


def test_a_durable_seal_past_what_a_take_over_reads_back_is_refused():
    """Durable mode (a record limit given): the record must stay readable by the heir (wire.max_seals),
    so the seal past it is refused here, never written for a take-over to find unreadable."""
    budget = 36 * 4  # max_seals 4: a take-over reads back at most 4 seals
    c, run = make(max_migrations=1_000_000, max_buffered_bytes=budget)
    feed(run, leg("m", Role.AGG, [b"1", b"2"])[:1])
    assert [migrate(run, "m", max_record_bytes=1 << 20).attempt for _ in range(4)] == [1, 2, 3, 4]
    reply = migrate(run, "m", max_record_bytes=1 << 20)
    assert reply.code is MigrateErrorCode.REFUSED
    assert "5 seals, more than another instance reads back" in reply.message
    assert c.stats.over_budget == 1
    c2, run2 = make(max_migrations=1_000_000, max_buffered_bytes=budget)  # core mode: only the bytes count
    feed(run2, leg("m", Role.AGG, [b"1", b"2"])[:1])
    assert migrate(run2, "m", max_record_bytes=None).attempt == 1
    assert [migrate(run2, "m").attempt for _ in range(4)] == [2, 3, 4, 5]


def test_a_record_naming_seals_twice_builds_no_earlier_list():
    """msgspec reads a key given twice with its last value: the count looked only at the last ``seals``
    while the whole record's decode built every earlier one, so 4,000,000 seals ahead of ``"seals":[7]``
    (8 MB, what a forger with write access to the bucket can put there) peaked at ~35 MB and passed. Now the
    earlier ones are skipped without being built, and the record reads as msgspec reads it."""
    honest = record([7])
    assert honest.startswith(b'{"seals":[7],')
    body = b'{"seals":[' + b"0," * 3_999_999 + b'0],' + honest[1:]
    tracemalloc.start()
    try:
        read = decode_seal_record(body, max_seals(defaults.MAX_BUFFERED_BYTES))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert read.seals == [7] and read == decode_seal_record(honest)
    assert peak < 1.5 * len(body), (peak, len(body))
