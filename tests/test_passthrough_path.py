"""The fused passthrough path (core/passthrough.py) decides exactly what the general path decides.

Random message sequences (in-order, duplicate, out-of-order, unary, migrated attempts, format and
traceparent headers, broken seqs) go through two processors' worth of state: one takes every
message on the general path (ChunkParser -> Correlator.receive -> result_headers -> nats-py's
header encoding), the other tries the fused path first, as CoreInput does. Published results
(subject, body, header bytes), counters and the state left behind must be identical.
"""

from __future__ import annotations

import types

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from streamproc.catalog import Catalog
from streamproc.core.correlator import Correlator, CorrelatorConfig
from streamproc.core.passthrough import PassthroughPath
from streamproc.core.wire import (ATTEMPT, FINAL, FORMAT, SEQ, TRACEPARENT, ContractError, Result, Subjects,
                                  result_headers, valid_request_id)
from streamproc.nats.fast_client import encode_header_block
from streamproc.nats.input import Pipeline

SUBJECTS = Subjects("p")
UNSAMPLED = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"  # flags 00: the worker did not sample


def _pipeline() -> Pipeline:
    config = CorrelatorConfig(max_inflight=2, max_retained_bytes=40, max_finished=3)
    return Pipeline(Correlator(Catalog(), "sglang", config), SUBJECTS, clock=lambda: 0.0)


def _general(pipeline: Pipeline, subject: str, headers, body: bytes, now: float) -> list:
    msg = types.SimpleNamespace(subject=subject, headers=headers)  # what a nats-py Msg carries
    try:
        chunk = pipeline.parse(subject, headers, body, msg)
    except ContractError as exc:
        decisions = pipeline.contract_error(exc, msg, acknowledged=False)
    else:
        decisions = pipeline.correlator.receive(chunk, now)
    return [(SUBJECTS.result(d.request_id), d.body, encode_header_block(result_headers(d)))
            for d in decisions if d.__class__ is Result]


# Repeats weight the common (fused-eligible) values; the rest exercise every way out of the fused path.
_MESSAGES = st.lists(st.tuples(
    # The fused path repeats valid_request_id's rule inline (a call costs ~27 ns of its ~4 µs per
    # message): every way out of the rule is compared here. Seqs: ASCII decimal digits only.
    st.sampled_from(["r0", "r1", "r2", "r3", "r4", "r5"] * 3 + ["bad id", "r.x", "*", ">", "a*", "b>", "v\x0bt", "f\x0cf",
                     "t\tb", "é", "\x7f", "L" * 256, "M" * 257]),
    st.sampled_from(["agg"] * 5 + ["decode"]),
    st.sampled_from(["0"] * 4 + ["1", "2", "3"] * 2 + ["007", "x", None, "²", "٠", "１", "-1", "1" * 19]),
    st.sampled_from([None, None, "true", "true", "false", "yes"]),
    st.sampled_from([None, None, "0", "0", "1"]),
    st.sampled_from([None] * 5 + ["", "sglang", "other"]),
    st.sampled_from([None] * 5 + ["", "00-abc-01", " x", "a\rb", "tp\x1c", UNSAMPLED, UNSAMPLED, "x-00", "-00\r"]),
    st.binary(max_size=12),
), max_size=60)


def _state(pipeline: Pipeline) -> object:
    c = pipeline.correlator
    return (msgspec.structs.asdict(c.stats), c.inflight, list(c._finished.items()),
            [(rid, r.next_seq, r.final_seq, len(r.retained), r.budget, r.last, r.kind, r.traceparent, r.format,
              type(r.codec), len(r.pending)) for rid, r in c._active.items()])


@settings(max_examples=400, deadline=None)
@given(_MESSAGES, st.booleans())
def test_the_fused_path_publishes_and_counts_what_the_general_path_does(messages, unsampled_only):
    """``unsampled_only`` (tracing on): the general path of a chunk whose trace is unsampled records
    nothing (streamproc.tracing), so it is compared with the untraced general path here."""
    general, fused_side = _pipeline(), _pipeline()
    fused = PassthroughPath(SUBJECTS, fused_side.correlator, unsampled_only=unsampled_only)
    taken = 0
    for i, (rid, role, seq, final, attempt, fmt, traceparent, body) in enumerate(messages):
        subject = f"p.chunks.{rid}.{role}"
        headers = {k: v for k, v in ((SEQ, seq), (FINAL, final), (ATTEMPT, attempt), (FORMAT, fmt),
                                     (TRACEPARENT, traceparent)) if v is not None}
        now = float(i)
        expected = _general(general, subject, headers, body, now)
        routed = fused(subject, headers, body, now)
        if routed is None:
            got = _general(fused_side, subject, headers, body, now)
        else:
            taken += 1
            got = [(routed[0], body, routed[1])]
            assert not unsampled_only or (traceparent or "").endswith("-00"), (i, messages[i])
        assert got == expected, (i, messages[i])
        assert _state(fused_side) == _state(general), (i, messages[i])


def test_the_fused_path_takes_exactly_the_ids_valid_request_id_accepts():
    ids = ["r", "L" * 256, "M" * 257, "", "*", ">", "a*b", "a>b", "a.b", "a b", "v\x0bt", "f\x0cf", "t\tb", "n\nb",
           "\x00", "\x7f", "é", "\u00a0", "~!#$%&'()+,-/:;<=?@[]^_`{|}", *map(chr, range(0x21, 0x7f))]
    for rid in ids:
        pipeline = _pipeline()
        fused = PassthroughPath(SUBJECTS, pipeline.correlator)
        taken = fused(f"p.chunks.{rid}.agg", {SEQ: "0", FINAL: "true"}, b"x", 0.0) is not None
        assert taken == valid_request_id(rid), repr(rid)


def test_in_order_and_unary_aggregated_chunks_take_the_fused_path():
    pipeline = _pipeline()
    fused = PassthroughPath(SUBJECTS, pipeline.correlator)
    assert fused("p.chunks.u.agg", {SEQ: "0", FINAL: "true", ATTEMPT: "0"}, b"x", 0.0) is not None
    assert fused("p.chunks.s.agg", {SEQ: "0"}, b"a", 0.0) is not None  # opens the streamed request
    assert fused("p.chunks.s.agg", {SEQ: "1"}, b"b", 0.0) is not None
    assert fused("p.chunks.s.agg", {SEQ: "3"}, b"d", 0.0) is None  # a gap: buffering is the general path's
    assert fused("p.chunks.t.agg", {SEQ: "1"}, b"b", 0.0) is None  # a stream starting out of order, too
    assert fused("p.chunks.s.agg", {SEQ: "2", FORMAT: "sglang"}, b"c", 0.0) is None  # format: compared there
    assert pipeline.correlator.stats.passthrough == 3


def test_with_tracing_on_only_chunks_of_unsampled_worker_traces_take_the_fused_path():
    """Tracing on with a sampler that records nothing for unsampled parents: such chunks record no span
    on the general path either, so they may take the fused one. A chunk without traceparent starts a
    trace the sampler decides, and a sampled one is recorded: both take the general path."""
    pipeline = _pipeline()
    fused = PassthroughPath(SUBJECTS, pipeline.correlator, unsampled_only=True)
    assert fused("p.chunks.u.agg", {SEQ: "0", FINAL: "true", TRACEPARENT: UNSAMPLED}, b"x", 0.0) is not None
    assert fused("p.chunks.s.agg", {SEQ: "0", FINAL: "true", TRACEPARENT: UNSAMPLED[:-1] + "1"}, b"x", 0.0) is None
    assert fused("p.chunks.n.agg", {SEQ: "0", FINAL: "true"}, b"x", 0.0) is None
    assert fused("p.chunks.c.agg", {SEQ: "0", FINAL: "true", TRACEPARENT: "\r-00"}, b"x", 0.0) is None
    untraced = PassthroughPath(SUBJECTS, _pipeline().correlator)
    assert untraced("p.chunks.n.agg", {SEQ: "0", FINAL: "true"}, b"x", 0.0) is not None
    assert untraced("p.chunks.s.agg", {SEQ: "0", FINAL: "true", TRACEPARENT: UNSAMPLED[:-1] + "1"}, b"x", 0.0)
