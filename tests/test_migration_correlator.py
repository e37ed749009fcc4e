"""The correlator's migration rules (seal-then-resume), driven with the migrating toy codec
(tests/toy_codec.py) so every rule shows in bytes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from toy_codec import MigratingToyCodec, ToyCodec, feed

from streamproc.codec import Codec
from streamproc.correlator import Correlator, CorrelatorConfig
from streamproc.testing.harness import Run, leg
from streamproc.wire import Chunk, MigrateError, MigrateErrorCode, Role, Sealed, Verdict, encode_control


class NoMigration(ToyCodec):
    """The toy join under another name, without migration support."""

    name = "plain"


def make(codec: Codec | None = None, **config) -> tuple[Correlator, Run, Codec]:
    codec = codec or MigratingToyCodec()
    c = Correlator(lambda name: codec, codec.name, CorrelatorConfig(**config))
    return c, Run(c), codec


def migrate(run: Run, rid: str, now: float = 0.0, **kwargs):
    reply, decisions = run.correlator.migrate(rid, now, **kwargs)
    run.absorb(decisions)
    return reply


def view(run: Run, rid: str) -> list[tuple[int, bytes, bool, Verdict | None]]:
    return [(r.seq, r.body, r.final, r.verdict) for r in run.of(rid)]


# ------------------------------------------------------------------------ sealing

def test_migrate_replies_with_exactly_the_tokens_of_the_published_results():
    c, run, _ = make()
    chunks = leg("m", Role.AGG, [b"1 2", b"3", b"4 5", b"6"])
    feed(run, [chunks[0], chunks[1], chunks[3]])  # seq 3 waits in the reorder buffer: not sent
    reply = migrate(run, "m")
    assert reply == Sealed("m", attempt=1, emitted_tokens=3, emitted_token_ids=[1, 2, 3], result_seq=2,
                           format="toy", state={"bodies": 2})
    assert chunks[3].token in run.settled  # dropped with the seal, settled at once
    assert [n.event for n in run.notices] == ["migrated"]
    assert c.stats.migrations == 1 and c.inflight == 1


def test_resumed_attempt_continues_the_result_seqs_with_stitched_bodies():
    c, run, _ = make()
    feed(run, leg("m", Role.AGG, [b"1 2", b"3", b"4 5"])[:2])
    migrate(run, "m")
    feed(run, leg("m", Role.AGG, [b"4 5", b"6"], attempt=1))
    assert view(run, "m") == [
        (0, b"1 2", False, Verdict.PASSTHROUGH),
        (1, b"3", False, Verdict.PASSTHROUGH),
        (2, b"4 5|+3", False, Verdict.STITCHED),
        (3, b"6|+3", True, Verdict.STITCHED),
    ]
    assert c.inflight == 0 and c.stats.stitched == 2


def test_resumed_attempt_chunks_out_of_order_and_duplicated_still_give_contiguous_seqs():
    c, run, _ = make()
    feed(run, leg("m", Role.AGG, [b"1", b"2", b"3"])[:1])
    migrate(run, "m")
    resumed = leg("m", Role.AGG, [b"2", b"3", b"4"], attempt=1)
    feed(run, [resumed[2], resumed[1], resumed[2], resumed[0], resumed[1]])
    assert [(s, b) for s, b, _, _ in view(run, "m")] == [(0, b"1"), (1, b"2|+1"), (2, b"3|+1"), (3, b"4|+1")]
    assert (c.stats.duplicates, c.stats.late) == (1, 1)  # the last repeat comes after the final


def test_chunks_of_a_sealed_attempt_are_dropped_counted_and_settled():
    c, run, _ = make()
    old = leg("m", Role.AGG, [b"1", b"2", b"3"])
    feed(run, old[:1])
    migrate(run, "m")
    feed(run, old[1:])  # the "dead" worker was only slow
    assert view(run, "m") == [(0, b"1", False, Verdict.PASSTHROUGH)]
    assert c.stats.sealed == 2 and {old[1].token, old[2].token} <= set(run.settled)
    assert [n.event for n in run.notices].count("sealed_chunk") == 2
    feed(run, leg("m", Role.AGG, [b"2", b"3"], attempt=1))
    assert [b for _, b, _, _ in view(run, "m")] == [b"1", b"2|+1", b"3|+1"]


def test_late_chunks_of_a_sealed_attempt_after_the_request_finished_are_late():
    c, run, _ = make()
    old = leg("m", Role.AGG, [b"1", b"2"])
    feed(run, old[:1])
    migrate(run, "m")
    feed(run, leg("m", Role.AGG, [b"2"], attempt=1))
    feed(run, old[1:])
    assert c.stats.late == 1 and old[1].token in run.settled


def test_a_chunk_of_an_attempt_never_granted_ends_the_request():
    c, run, _ = make()
    feed(run, leg("m", Role.AGG, [b"1", b"2"])[:1])
    feed(run, [Chunk("m", Role.AGG, 0, b"2", attempt=1, token="bad")])
    err = run.of("m")[-1]
    assert (err.seq, err.final, err.error) == (1, True, "invalid_chunk")
    assert b"attempt 1 was never granted" in err.body and "bad" in err.settles


def test_an_attempt_above_zero_for_an_unknown_request_is_rejected():
    c, run, _ = make()
    feed(run, [Chunk("x", Role.AGG, 0, b"1", final=True, attempt=2)])
    [err] = run.of("x")
    assert err.error == "invalid_chunk" and b"only follow a migration" in err.body


# ------------------------------------------------------------------------- errors

def test_migrate_for_an_unknown_request_gets_an_error_reply_and_changes_nothing():
    c, run, _ = make()
    reply = migrate(run, "nobody")
    assert isinstance(reply, MigrateError) and reply.code is MigrateErrorCode.UNKNOWN_REQUEST
    assert run.results == [] and run.notices == [] and c.inflight == 0


def test_migrate_for_a_finished_request_gets_an_error_reply():
    c, run, _ = make()
    feed(run, leg("u", Role.AGG, [b"1 2"]))  # unary aggregated: no state kept, only the finished id
    feed(run, leg("s", Role.AGG, [b"1", b"2"]))
    for rid in ("u", "s"):
        reply = migrate(run, rid)
        assert isinstance(reply, MigrateError) and reply.code is MigrateErrorCode.FINISHED
    assert len(run.results) == 3


def test_a_stale_expected_attempt_leaves_the_request_untouched():
    c, run, _ = make()
    feed(run, leg("m", Role.AGG, [b"1", b"2"])[:1])
    assert isinstance(migrate(run, "m", expected_attempt=0), Sealed)
    reply = migrate(run, "m", expected_attempt=0)  # a second migrator, racing with the first
    assert (reply.code, reply.attempt) == (MigrateErrorCode.ATTEMPT_MISMATCH, 1)
    feed(run, leg("m", Role.AGG, [b"2"], attempt=1))
    assert [b for _, b, _, _ in view(run, "m")] == [b"1", b"2|+1"]


def test_a_body_the_codec_cannot_read_refuses_the_migration_and_ends_the_request():
    c, run, _ = make()
    feed(run, leg("r", Role.AGG, [b"!opaque", b"2", b"3"])[:2])
    reply = migrate(run, "r")
    assert isinstance(reply, MigrateError) and reply.code is MigrateErrorCode.REFUSED
    assert reply.message == "toy: this body cannot move" and reply.attempt == 0
    err = run.of("r")[-1]
    assert (err.seq, err.final, err.error) == (2, True, "migration_refused")
    assert c.inflight == 0 and c.stats.migrations_refused == 1


def test_a_refusal_from_the_caller_ends_the_request_with_an_error_result():
    c, run, _ = make()
    feed(run, leg("g", Role.AGG, [b"1", b"2"])[:1])
    reply = migrate(run, "g", refuse="guided decoding (json_schema)")
    assert reply.code is MigrateErrorCode.REFUSED
    err = run.of("g")[-1]
    assert err.error == "migration_refused" and b"guided decoding" in err.body and err.final


def test_a_request_migrated_max_migrations_times_is_refused_and_ended_at_the_next_migrate():
    """Each migrate seals and sends back every token sent so far: a frontend repeating them on one
    request cost the processor work in proportion to the request, without end (docs/security.md)."""
    c, run, _ = make(max_migrations=3)
    feed(run, leg("r", Role.AGG, [b"1 2", b"3"])[:1])
    assert [migrate(run, "r").attempt for _ in range(3)] == [1, 2, 3]
    reply = migrate(run, "r")
    assert reply.code is MigrateErrorCode.REFUSED and "migrated 3 times already" in reply.message
    err = run.of("r")[-1]
    assert err.error == "migration_refused" and err.final and b"max_migrations 3" in err.body
    assert c.stats.migrations == 3 and c.stats.migrations_refused == 1


def test_a_format_without_migration_support_is_refused():
    c, run, _ = make(NoMigration())
    feed(run, leg("n", Role.AGG, [b"1", b"2"])[:1])
    reply = migrate(run, "n")
    assert reply.code is MigrateErrorCode.REFUSED and "does not support migration" in reply.message


def test_a_request_adopted_from_another_instance_migrates_once_its_published_bodies_are_read_back():
    c, run, _ = make()
    c.resume("adopted", 2, False, 0.0)  # results 0..1 were published by a dead instance
    assert c.missing("adopted") == 2
    unread = migrate(run, "adopted")
    assert unread.code is MigrateErrorCode.UNAVAILABLE and run.of("adopted") == []  # nothing moved
    feed(run, leg("adopted", Role.AGG, [b"1", b"2 3", b"4", b"5"])[2:3])  # seq 2 published here
    assert not c.restore("adopted", [b"1"])  # not what it misses: refused, nothing changes
    assert c.restore("adopted", [b"1", b"2 3"]) and c.missing("adopted") == 0
    reply = migrate(run, "adopted")
    assert (reply.emitted_token_ids, reply.result_seq, reply.attempt) == ([1, 2, 3, 4], 3, 1)


def test_a_request_adopted_mid_resumed_attempt_is_stitched_as_its_first_instance_would_have():
    bodies = [b"1 2", b"3", b"4", b"5 6", b"7"]
    whole, run, _ = make()  # one instance throughout: two migrations, at result 2 and 3
    feed(run, leg("w", Role.AGG, bodies)[:2])
    migrate(run, "w")
    feed(run, leg("w", Role.AGG, [b"4", b"5 6"], attempt=1)[:1])
    migrate(run, "w")
    feed(run, leg("w", Role.AGG, [b"5 6", b"7"], attempt=2)[:1])
    published = [r.body for r in run.of("w")]
    # A second instance adopts it from the stored bodies and the seal points, then sees the rest.
    c, other, _ = make()
    c.resume("w", len(published), False, 0.0, seals=[2, 3], history=published)
    feed(other, leg("w", Role.AGG, [b"5 6", b"7"], attempt=2))
    feed(run, leg("w", Role.AGG, [b"5 6", b"7"], attempt=2)[1:])
    assert [r.body for r in other.of("w")] == [r.body for r in run.of("w")][len(published):] == [b"7|+4"]
    assert c.stats.duplicates == 1  # attempt 2's seq 0 was already published by the dead instance


def test_an_adopted_migrated_request_seals_again_with_the_same_emitted_tokens():
    c, run, _ = make()
    c.resume("twice", 3, False, 0.0, seals=[2], history=[b"1 2", b"3", b"4|+3"])
    reply = migrate(run, "twice", expected_attempt=1)
    assert (reply.attempt, reply.emitted_token_ids, reply.result_seq) == (2, [1, 2, 3, 4], 3)
    feed(run, leg("twice", Role.AGG, [b"1"], attempt=1))
    assert c.stats.sealed == 1 and run.of("twice") == []  # the previous attempt's chunks are sealed


def test_a_migrated_request_whose_bodies_cannot_be_read_back_ends_at_once_at_its_next_seq():
    """Durable take-over of a migrated request whose stored bodies pass the read's bound (HistoryOverBound):
    its session cannot be rebuilt, so it ends with one migration_refused error at next_seq, and the
    chunk that looked it up (and any later one) is settled as late, never taken for a new request."""
    c, run, _ = make()
    run.absorb(c.end_adopted("big", 5, 1, 0.0, "its stored output is past the take-over's bound"))
    [end] = run.of("big")
    assert (end.seq, end.final, end.error) == (5, True, "migration_refused")
    assert b"past the take-over's bound" in end.body
    assert c.is_finished("big") and not c.knows("other") and c.stats.migrations_refused == 1
    feed(run, leg("big", Role.AGG, [b"1"], attempt=1))
    assert run.of("big") == [end] and c.stats.late == 1
    assert c.end_adopted("big", 5, 1, 0.0, "again") == []  # known here: nothing twice


def test_a_request_sealed_before_any_result_resumes_at_its_attempt_with_nothing_published():
    c, run, _ = make()
    c.resume("early", 0, False, 0.0, seals=[0], history=[])
    feed(run, leg("early", Role.AGG, [b"1"]))  # attempt 0: sealed
    feed(run, leg("early", Role.AGG, [b"1", b"2"], attempt=1))
    assert [(r.seq, r.body) for r in run.of("early")] == [(0, b"1"), (1, b"2")]
    assert c.stats.sealed == 1


def test_a_retried_seal_with_the_same_id_gets_the_same_reply_and_seals_nothing_more():
    c, run, _ = make()
    feed(run, leg("again", Role.AGG, [b"1", b"2", b"3"])[:2])
    first = migrate(run, "again", expected_attempt=0, id="m-1")
    retry = migrate(run, "again", expected_attempt=0, id="m-1")
    other = migrate(run, "again", expected_attempt=0, id="m-2")
    assert retry == first and first.attempt == 1 and c.stats.migrations == 1
    assert other.code is MigrateErrorCode.ATTEMPT_MISMATCH



def test_a_seal_id_reused_after_the_resumed_attempt_published_more_is_a_new_migrate_not_a_retry():
    """A retry finds the request where its seal left it; once the resumed attempt has published a
    result, the same id (with no expected_attempt to tell them apart) is another migrate: it seals
    again, rather than answering with the stale seal (whose tokens the client is already past)."""
    c, run, _ = make()
    feed(run, leg("again", Role.AGG, [b"1", b"2", b"3"])[:1])
    first = migrate(run, "again", id="m-1")
    feed(run, leg("again", Role.AGG, [b"2", b"3"], attempt=1)[:1])  # result seq 1 published
    second = migrate(run, "again", id="m-1")
    assert (first.attempt, first.result_seq) == (1, 1)
    assert (second.attempt, second.result_seq, second.emitted_token_ids) == (2, 2, [1, 2])
    assert c.stats.migrations == 2


def test_a_seal_whose_reply_is_exactly_max_seal_bytes_fits_and_one_byte_less_is_refused():
    """max_seal_bytes is the most the encoded reply may take: exactly that much is one message."""
    sizes = []
    for limit in (None, "exact", "less"):
        c, run, _ = make()
        feed(run, leg("big", Role.AGG, [b"1 2 3", b"4 5", b"6"])[:2])
        bound = None if limit is None else sizes[0] if limit == "exact" else sizes[0] - 1
        reply = migrate(run, "big", max_seal_bytes=bound)
        if limit is None:
            sizes.append(len(encode_control(reply)))
        elif limit == "exact":
            assert isinstance(reply, Sealed) and reply.attempt == 1
        else:
            assert reply.code is MigrateErrorCode.REFUSED and "does not fit one NATS message" in reply.message
            assert run.of("big")[-1].error == "migration_refused"


def test_a_refused_migrate_naming_an_attempt_this_processor_never_saw_ends_nothing():
    """With no state for the request, a refusal ends it (its one result) only when it names no
    attempt or attempt 0: one expecting a later attempt is about a request served elsewhere, and
    gets ``unknown_request`` with nothing published or remembered here."""
    c, run, _ = make()
    reply = migrate(run, "ghost", refuse="guided decoding", expected_attempt=2)
    assert reply.code is MigrateErrorCode.UNKNOWN_REQUEST
    assert run.results == [] and not c.knows("ghost") and c.stats.migrations_refused == 0
    reply = migrate(run, "lost", refuse="guided decoding", expected_attempt=0)
    assert reply.code is MigrateErrorCode.REFUSED and run.of("lost")[0].error == "migration_refused"


def test_resuming_a_request_with_nothing_stored_adopts_nothing():
    """``next_seq`` 0 and no seal: nothing was published, so there is nothing to adopt; its chunk
    starts it as a new request. Adopted, it would hold state with a request timeout running for a
    request no chunk of which has arrived."""
    c, run, _ = make(request_timeout=5.0)
    c.resume("fresh", 0, False, 0.0)
    assert not c.knows("fresh") and c.attempt_of("fresh") is None and c.next_deadline() is None
    run.absorb(c.tick(100.0))
    assert run.results == []


def test_a_sealed_request_no_longer_waits_for_prefill_so_others_prefill_timeouts_still_fire():
    """A seal drops the chunks waiting for the prefill leg: the request leaves the prefill wait
    line too, else it would stay at its head with no wait to time out and hold up every request
    behind it."""
    c, run, _ = make(prefill_timeout=5.0)
    feed(run, leg("sealed", Role.DECODE, [b"need:0", b"1"])[:1], now=0.0)
    feed(run, leg("other", Role.DECODE, [b"need:0", b"1"]), now=1.0)
    assert migrate(run, "sealed", 2.0).attempt == 1
    assert c.next_deadline() == 6.0
    run.absorb(c.tick(6.0))
    assert [b for _, b, _, _ in view(run, "other")] == [b"need:0|omitted:prefill_timeout", b"1"]

# ---------------------------------------------------------------------- P/D and mixes

def test_decode_chunks_waiting_for_prefill_are_dropped_and_the_next_attempt_has_its_own_prefill():
    c, run, _ = make()
    feed(run, leg("p", Role.DECODE, [b"need:1", b"2"]))  # prefill never comes: nothing is sent
    assert run.of("p") == []
    reply = migrate(run, "p")
    assert (reply.emitted_tokens, reply.result_seq) == (0, 0)
    assert list(c.unsettled()) == []  # the waiting decode chunks were settled with the seal
    feed(run, leg("p", Role.PREFILL, [b"P0"]))  # the old prefill turns up after the seal
    feed(run, leg("p", Role.PREFILL, [b"P1"], attempt=1) + leg("p", Role.DECODE, [b"need:1", b"2"], attempt=1))
    assert [b for _, b, _, _ in view(run, "p")] == [b"need:1|P1", b"2"]  # k = 0: nothing to stitch
    assert c.stats.sealed == 1


def test_a_pd_request_can_resume_aggregated_and_the_other_way_round():
    c, run, _ = make()
    feed(run, leg("x", Role.PREFILL, [b"P"]) + leg("x", Role.DECODE, [b"need:1", b"2", b"3"])[:2])
    migrate(run, "x")
    feed(run, leg("x", Role.AGG, [b"3", b"4", b"5"], attempt=1)[:1])
    migrate(run, "x")
    feed(run, leg("x", Role.PREFILL, [b"Q"], attempt=2) + leg("x", Role.DECODE, [b"need:4", b"5"], attempt=2))
    assert [b for _, b, _, _ in view(run, "x")] == [b"need:1|P", b"2", b"3|+2", b"need:4|Q|+3", b"5|+3"]
    assert [v for *_, v in view(run, "x")][2:] == [Verdict.STITCHED] * 3


def test_two_migrations_in_a_row_grant_two_attempts_with_the_same_progress():
    c, run, _ = make()
    feed(run, leg("t", Role.AGG, [b"1", b"2"])[:1])
    first, second = migrate(run, "t"), migrate(run, "t")
    assert (first.attempt, second.attempt) == (1, 2)
    assert first.emitted_token_ids == second.emitted_token_ids == [1]
    assert first.result_seq == second.result_seq == 1
    feed(run, leg("t", Role.AGG, [b"2"], attempt=1))  # the attempt that was skipped is sealed too
    assert c.stats.sealed == 1
    feed(run, leg("t", Role.AGG, [b"2"], attempt=2))
    assert [b for _, b, _, _ in view(run, "t")] == [b"1", b"2|+1"]


# ------------------------------------------------------------------ retention, timeouts

def test_the_codec_receives_the_published_bodies_themselves_and_only_at_migrate():
    c, run, codec = make()
    chunks = leg("r", Role.AGG, [b"1", b"2", b"3"])
    feed(run, chunks[:2])
    assert codec.sessions == []  # nothing parsed on the hot path
    migrate(run, "r")
    [absorbed] = codec.sessions[0].absorbed
    assert [id(b) for b in absorbed] == [id(chunks[0].body), id(chunks[1].body)]  # references, no copies


def test_past_the_retention_bound_bodies_are_folded_as_they_are_published():
    c, run, codec = make(max_retained_bytes=3)
    feed(run, leg("r", Role.AGG, [b"1 2", b"3 4", b"5", b"6"])[:3])
    assert codec.sessions[0].absorbed == [[b"1 2", b"3 4"]]  # 7 bytes > 3: folded, then released
    assert migrate(run, "r").emitted_token_ids == [1, 2, 3, 4, 5]


def test_a_folded_progress_state_may_reach_max_buffered_bytes_exactly_and_one_token_more_ends_it():
    """The toy's progress state is 8 bytes per emitted token: 2 tokens fill a 16-byte bound exactly."""
    c, run, _ = make(max_retained_bytes=0, max_buffered_bytes=16)
    chunks = leg("p", Role.AGG, [b"1 2", b"3", b"4"])
    feed(run, chunks[:1])
    assert [(r.seq, r.error) for r in run.of("p")] == [(0, None)] and c.inflight == 1
    feed(run, chunks[1:2])
    assert [(r.seq, r.error) for r in run.of("p")] == [(0, None), (1, None), (2, "overloaded")]
    assert c.stats.over_budget == 1


def test_the_result_published_before_a_progress_overrun_names_its_format():
    """Result 1 below is published as the request ends ``overloaded`` behind it: should the outbox give
    it up as unpublishable (durable mode), the request has finished and keeps no codec, so the error in
    its place takes its shape from the result's ``format``, as every other result of the request has."""
    c, run, _ = make(max_retained_bytes=0, max_buffered_bytes=16)
    feed(run, leg("p", Role.AGG, [b"1 2", b"3", b"4"])[:2])
    assert [(r.seq, r.error, r.format) for r in run.of("p")] == [(0, None, "toy"), (1, None, "toy"),
                                                                (2, "overloaded", None)]


def test_a_refusal_found_while_folding_is_the_answer_to_a_later_migrate():
    c, run, _ = make(max_retained_bytes=0)
    feed(run, leg("r", Role.AGG, [b"!x", b"2", b"3"])[:2])
    assert migrate(run, "r").message == "toy: this body cannot move"


def test_a_migrate_counts_as_progress_for_the_request_timeout():
    c, run, _ = make(request_timeout=10.0)
    feed(run, leg("slow", Role.AGG, [b"1", b"2"])[:1], now=0.0)
    migrate(run, "slow", now=8.0)
    run.absorb(c.tick(12.0))
    assert c.inflight == 1
    run.absorb(c.tick(18.0))
    assert run.of("slow")[-1].error == "timeout"


def test_every_chunk_is_settled_across_attempts():
    c, run, _ = make()
    a0 = leg("s", Role.PREFILL, [b"P"]) + leg("s", Role.DECODE, [b"need:1", b"2", b"3"])
    a1 = leg("s", Role.AGG, [b"2", b"3"], attempt=1)
    feed(run, [a0[0], a0[1], a0[3]])  # decode seq 2 buffered (seq 1 missing)
    migrate(run, "s")
    feed(run, [a0[2]] + a1)
    assert set(run.settled) == {ch.token for ch in a0 + a1}
    assert c.inflight == 0


# ------------------------------------------------------------ a seal overtaken while its results are stored

def test_a_seal_holds_after_its_wait_only_while_the_request_is_held_at_the_granted_attempt():
    """Durable mode answers a seal only once the results it counts as published are stored; the wait
    ends when nothing of the request is queued, which is also how a result given up leaves. One that
    can never be published is replaced by an error result that ends the request (finished: answered
    ``finished``), one the stream kept refusing is dropped with its request (answered ``unavailable``);
    the seal held, it would say a result was sent that is not stored, or whose place an error took."""
    from streamproc.core.recovery import seal_overtaken

    for outcome in ("held", "replaced", "dropped", "resumed"):
        c, run, _ = make()
        feed(run, leg("m", Role.AGG, [b"1 2", b"3", b"4"])[:2])
        sealed = migrate(run, "m")
        assert isinstance(sealed, Sealed) and sealed.attempt == 1
        if outcome == "replaced":  # result 1, sealed as published, could not be sent
            run.absorb(c.unpublishable("m", 1, "larger than max_payload", 0.1))
        elif outcome == "dropped":  # given up, its chunks NAKed: the request is forgotten here
            c.abandon(lambda r: r == "m", ("m",))
        elif outcome == "resumed":  # the resumed attempt's chunk in already: the seal still holds
            feed(run, leg("m", Role.AGG, [b"4", b"5"], attempt=1)[:1])
        overtaken = seal_overtaken(c, sealed)
        if outcome in ("held", "resumed"):
            assert overtaken is None, outcome
        elif outcome == "replaced":
            assert overtaken is not None and overtaken[0] is MigrateErrorCode.FINISHED
            assert run.of("m")[-1].error == "internal" and run.of("m")[-1].seq == 1
        else:
            assert overtaken is not None and overtaken[0] is MigrateErrorCode.UNAVAILABLE


_AFTER_SEAL = st.lists(st.one_of(
    st.tuples(st.just("resume"), st.integers(0, 2)),  # a chunk of the resumed attempt (seq 2 is final)
    st.tuples(st.just("replace"), st.integers(0, 1)),  # a published result could not be sent: an error in place
    st.tuples(st.just("drop"), st.just(0)),  # a result given up: the request forgotten, its chunks NAKed
    st.tuples(st.just("unstorable"), st.just(0)),  # its subject full: ended without a result
    st.tuples(st.just("timeout"), st.just(0)),  # request_timeout passes
    st.tuples(st.just("shed"), st.just(0)),  # its held tokens shed: an overloaded error result
), max_size=6)


@settings(max_examples=300, deadline=None)
@given(_AFTER_SEAL)
def test_a_seal_overtaken_agrees_with_what_the_correlator_answers_a_migrate_of_the_request_next(events):
    """Whatever happens to the request while the seal waits for its results to be stored, the seal
    holds exactly while the request is held at the granted attempt; overtaken, it answers as the
    correlator would answer the migrate asked again: ``finished`` once the request ended here (an
    error result in place of a published one, a timeout, a shed, a full subject, the resumed attempt's
    final), else ``unavailable``, the request not held here any more (dropped: a retry adopts it from
    the stores)."""
    from streamproc.core.recovery import seal_overtaken

    c, run, _ = make(request_timeout=10.0)
    feed(run, leg("m", Role.AGG, [b"1 2", b"3", b"4"])[:2])
    sealed = migrate(run, "m")
    assert isinstance(sealed, Sealed) and sealed.attempt == 1
    resumed = leg("m", Role.AGG, [b"4", b"5", b"6"], attempt=1)
    now = 0.0
    for kind, arg in events:
        now += 1.0
        if kind == "resume":
            run.absorb(c.receive(resumed[arg], now))
        elif kind == "replace":
            run.absorb(c.unpublishable("m", arg, "larger than max_payload", now))
        elif kind == "drop":
            c.abandon(lambda r: r == "m", ("m",))
        elif kind == "unstorable":
            c.unstorable("m", now)
        elif kind == "timeout":
            now += 60.0
            run.absorb(c.tick(now))
        else:
            run.absorb(c.shed(lambda r: r == "m", 1, now, "held too long"))
    overtaken = seal_overtaken(c, sealed)
    held = c.attempt_of("m") == sealed.attempt
    assert (overtaken is None) == held, (events, overtaken)
    if overtaken is None:
        return
    code, why = overtaken
    again, _ = c.migrate("m", now + 1.0)  # what a retry of the migrate is told here
    if c.is_finished("m"):
        assert code is MigrateErrorCode.FINISHED and isinstance(again, MigrateError), (events, again)
        assert again.code is MigrateErrorCode.FINISHED, (events, again)
    else:
        assert code is MigrateErrorCode.UNAVAILABLE, (events, overtaken)
        assert not c.knows("m") or c.attempt_of("m") != sealed.attempt, events
    assert why



def _migrated(times: int) -> tuple[Run, list]:
    _, run, _ = make(max_migrations=100)
    feed(run, leg("r", Role.AGG, [b"1 2", b"3", b"4"])[:2])
    return run, [migrate(run, "r", id=f"m{i}") for i in range(times)]


def test_a_seal_is_refused_exactly_when_its_seal_record_would_not_fit():
    """Found by a review (2026-12-07): the durable seal record (reply, one result seq per seal, migrate
    id) was never measured, only the reply against max_payload less a fixed 8 KiB. Now the limit is on
    the record as ``wire.encode_seal_record`` writes it: one byte under its size refuses, at it seals."""
    from streamproc.core.events import SealRecord
    from streamproc.core.wire import encode_seal_record

    _, replies = _migrated(6)  # what the 6th seal writes
    record = len(encode_seal_record(SealRecord([r.result_seq for r in replies], replies[-1], "m5")))
    for slack, sealed in ((0, True), (-1, False)):
        run, _ = _migrated(5)
        reply = migrate(run, "r", id="m5", max_seal_bytes=1 << 20, max_record_bytes=record + slack)
        assert isinstance(reply, Sealed) is sealed, reply
        if not sealed:
            assert reply.code is MigrateErrorCode.REFUSED
            assert f"6 seals, 3 emitted tokens: {record} bytes" in reply.message, reply.message
            assert f"({record - 1} bytes: max_payload less" in reply.message, reply.message
