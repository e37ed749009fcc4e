"""A partition's hand-over NAKs (:mod:`streamproc.core.handback`), pure."""

from __future__ import annotations

from durable_helpers import outbox_settings
from hypothesis import given
from hypothesis import strategies as st

from streamproc.core.handback import UNKNOWN, HandBack, in_stream_order, stream_sequence


class Token:
    def __init__(self, reply: str | None) -> None:
        self.reply = reply

    def __repr__(self) -> str:
        return f"Token({self.reply!r})"


def ack(seq: int, delivered: int = 1, v2: bool = False) -> str:
    if v2:
        return f"$JS.ACK.hub.ACCHASH.STREAMPROC_CHUNKS.streamproc-p0.{delivered}.{seq}.{seq}.1733300000000000000.0.r1"
    return f"$JS.ACK.STREAMPROC_CHUNKS.streamproc-p0.{delivered}.{seq}.{seq}.1733300000000000000.0"


def reply_of(t: Token) -> str | None:
    return t.reply


def test_the_stream_sequence_is_read_from_both_ack_subject_forms():
    assert stream_sequence(ack(42)) == 42
    assert stream_sequence(ack(42, delivered=3, v2=True)) == 42
    assert stream_sequence(None) == stream_sequence("") == stream_sequence("_INBOX.x") == UNKNOWN
    assert stream_sequence("$JS.ACK.S.C.1.notanumber.1.1.0") == UNKNOWN


def test_nothing_is_nacked_until_the_release_which_gives_everything_in_stream_order():
    hb: HandBack[Token] = HandBack(reply_of)
    late = [Token(ack(70)), Token(ack(71))]  # arrived while the subscription drained: NAKed at once before
    held = [Token(ack(s)) for s in (16, 17, 18)]  # decided earlier, given back by the hand-over
    assert hb.hold(late) == [] and len(hb) == 2
    out = hb.release(held)
    assert [stream_sequence(t.reply) for t in out] == [16, 17, 18, 70, 71]
    assert len(hb) == 0 and hb.released


def test_what_arrives_after_the_release_passes_straight_through():
    hb: HandBack[Token] = HandBack(reply_of)
    hb.release()
    t = Token(ack(5))
    assert hb.hold([t]) == [t]
    assert hb.release() == []


def test_tokens_without_a_stream_sequence_go_last_in_the_order_given():
    a, b = Token(None), Token("nonsense")
    assert in_stream_order([a, Token(ack(9)), b, Token(ack(3))], reply_of)[2:] == [a, b]


@outbox_settings
@given(st.lists(st.tuples(st.integers(1, 200), st.booleans(), st.booleans()), max_size=60),
       st.integers(0, 60))
def test_every_token_is_nacked_once_and_what_was_held_in_stream_order(events, release_at):
    """Whatever is held before the release comes out of it exactly once, sorted by stream sequence
    (stable); after it each token passes through at once, once."""
    hb: HandBack[Token] = HandBack(reply_of)
    nacked: list[Token] = []
    given_tokens: list[Token] = []
    release_at = min(release_at, len(events))
    at_release: list[Token] = []
    for i, (seq, v2, with_release) in enumerate(events):
        t = Token(ack(seq, v2=v2))
        given_tokens.append(t)
        if i == release_at:
            extra = [t] if with_release else []
            if not with_release:
                nacked.extend(hb.hold([t]))
            at_release = hb.release(extra)
            nacked.extend(at_release)
        else:
            nacked.extend(hb.hold([t]))
    if release_at == len(events):
        at_release = hb.release()
        nacked.extend(at_release)
    assert sorted(map(id, nacked)) == sorted(map(id, given_tokens))
    seqs = [stream_sequence(t.reply) for t in at_release]
    assert seqs == sorted(seqs)
    assert len(at_release) == min(release_at + 1, len(events))
