"""Input settlement rules the durable input relies on, pinned on the pure correlator (toy codec).

A JetStream redelivery of a chunk that is still held is the *same stored message*: acknowledging
the copy would release the original before the result it feeds is stored. ``abandon`` hands a
partition's requests to another instance without publishing anything for them any more.
"""

from __future__ import annotations

from toy_codec import bodies, feed, make

from streamproc.testing.harness import leg
from streamproc.wire import Chunk, Role


def redelivery(chunk: Chunk) -> Chunk:
    """The same stored message delivered again: same content, a new ack handle."""
    return Chunk(chunk.request_id, chunk.role, chunk.seq, chunk.body, chunk.final, chunk.attempt, chunk.format,
                 chunk.traceparent, token=("again", *chunk.token))


def test_a_redelivered_held_prefill_chunk_is_settled_with_the_final_result_not_before():
    c, run = make()
    pre = leg("p", Role.PREFILL, [b"P"])
    dec = leg("p", Role.DECODE, [b"need:0", b"need:1"])
    feed(run, pre + [redelivery(pre[0])])
    assert run.settled == []  # neither copy: the prefill data is still needed
    feed(run, dec)
    assert bodies(run.results) == [b"need:0|P", b"need:1|P"]
    assert set(run.results[-1].settles) == {pre[0].token, redelivery(pre[0]).token, dec[1].token}


def test_a_redelivered_buffered_output_chunk_is_settled_with_its_result_not_before_nor_after():
    """Not after either: from its result on the repeat delivers nothing new, and held on to the
    request's final result it counted towards the durable partition's held chunks (shedding)."""
    c, run = make()
    out = leg("o", Role.AGG, [b"0", b"1", b"2"])
    feed(run, [out[1], redelivery(out[1])])  # seq 1 waits for seq 0
    assert run.settled == [] and run.results == []
    feed(run, [out[0]])
    assert bodies(run.results) == [b"0", b"1"]
    assert [r.settles for r in run.results] == [(out[0].token,), (out[1].token, redelivery(out[1]).token)]
    assert list(c.unsettled()) == []
    feed(run, [out[2]])
    assert run.results[-1].settles == (out[2].token,)


def test_a_repeat_of_an_already_published_chunk_is_settled_at_once():
    c, run = make()
    out = leg("r", Role.AGG, [b"0", b"1"])
    feed(run, [out[0], redelivery(out[0])])
    assert run.settled == [out[0].token, redelivery(out[0]).token]


def test_abandon_returns_every_held_token_and_nothing_is_published_for_those_requests_later():
    c, run = make(prefill_timeout=1.0, request_timeout=2.0)
    feed(run, leg("moving", Role.PREFILL, [b"P0", b"P1"])[:1] + leg("moving", Role.DECODE, [b"need:0", b"x"]))
    feed(run, leg("staying", Role.AGG, [b"s0", b"s1"])[:1])
    tokens = c.abandon(lambda rid: rid == "moving")
    assert set(tokens) == {("moving", "prefill", 0, 0), ("moving", "decode", 0, 0), ("moving", "decode", 0, 1)}
    assert not c.knows("moving") and c.knows("staying")
    run.absorb(c.tick(10.0))  # timeouts fire for what stayed, never for what moved
    assert {r.request_id for r in run.results} == {"staying"}


def test_a_resumed_request_keeps_the_codec_its_chunks_name():
    c, run = make()
    c.resume("fmt", 2, False, 0.0, "other")
    feed(run, leg("fmt", Role.AGG, [b"0", b"1", b"2"], format="other")[2:])
    assert [(r.seq, r.body, r.error) for r in run.results] == [(2, b"2", None)]


def test_abandon_forgets_finished_requests_whose_final_result_was_not_stored():
    c, run = make()
    feed(run, leg("done-unstored", Role.AGG, [b"0", b"1"]) + leg("done-stored", Role.AGG, [b"0"]))
    assert c.is_finished("done-unstored") and c.is_finished("done-stored")
    c.abandon(lambda rid: True, unstored=["done-unstored"])
    # Redelivered chunks of it must be recovered from the stored results, not dropped as late.
    assert not c.knows("done-unstored") and c.knows("done-stored")


def test_repeats_without_a_token_as_core_mode_delivers_them_are_never_held():
    """Core mode acknowledges nothing and gives its chunks no token: a repeat of a held chunk (a
    prefill leg waiting for its decode leg, an output chunk buffered behind a missing seq) is a
    duplicate, counted and dropped, whatever its number; held, each would stay until the request
    ended (durable mode holds a repeat with its original only because its ack could release it)."""
    c, run = make()
    pre = Chunk("p", Role.PREFILL, 0, b"P", final=True)
    out = Chunk("o", Role.AGG, 1, b"1", final=True)
    feed(run, [pre, out])
    held = c.held_tokens(lambda rid: 0)
    feed(run, [pre, out] * 500)
    assert c.stats.duplicates == 1000 and run.results == []
    assert c.held_tokens(lambda rid: 0) == held and list(c.unsettled()) == []
    feed(run, [Chunk("p", Role.DECODE, 0, b"need:0", final=True), Chunk("o", Role.AGG, 0, b"0")])
    assert [(r.request_id, r.seq, r.settles) for r in run.results] == [
        ("p", 0, (None,)), ("o", 0, (None,)), ("o", 1, (None,))]
    assert c.inflight == 0
