"""The ``sglang`` codec and its simulated worker: native shapes, the P/D join, folding, errors."""

from __future__ import annotations

import base64
import random
import struct

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamproc.catalog import codec_class, worker_for
from streamproc.codec import CodecOptions, CorruptPayload, ErrorKind
from streamproc.decompress import TOO_LARGE
from streamproc.simulation import Damage, make_truth
from streamproc.testing.harness import leg, run_pipeline
from streamproc.testing.strategies import truths
from streamproc.wire import Role, Verdict
from streamproc_sglang import SGLangCodec, SGLangWorker
from streamproc_sglang.sequence import Base64Int32Rows

LIMIT = 64 * 1024
OPTIONS = CodecOptions(max_decompressed_bytes=LIMIT)
worker = SGLangWorker(OPTIONS)
codec = SGLangCodec(OPTIONS)


def meta(body: bytes) -> dict:
    return msgspec.json.decode(body)["meta_info"]


def edit(body: bytes, **changes) -> bytes:
    """The same body with some meta_info keys replaced (``None`` value: key removed)."""
    doc = msgspec.json.decode(body)
    for key, value in changes.items():
        if value is None:
            doc["meta_info"].pop(key, None)
        else:
            doc["meta_info"][key] = value
    return msgspec.json.encode(doc)


def join_leg(decode_bodies, prefill_bodies=None, *, unavailable: str = "prefill_timeout", codec=codec):
    """Drive one session as the correlator does: prefill settled first, decode chunks in order."""
    session = codec.open_session()
    if prefill_bodies is None:
        session.prefill_unavailable(unavailable)
    else:
        session.absorb_prefill(prefill_bodies)
    last = len(decode_bodies) - 1
    return [session.join(body, i == last) for i, body in enumerate(decode_bodies)]


def pd(truth, *, stream, prefill_damage=None, decode_damage=None):
    return join_leg(worker.decode(truth, stream=stream, damage=decode_damage),
                    worker.prefill(truth, stream=stream, damage=prefill_damage))


def truth_of(seed=7, **kw):
    kw.setdefault("prompt_len", 5)
    kw.setdefault("output_len", 6)
    return make_truth(seed, **kw)


# ---------------------------------------------------------------- worker shapes


def test_agg_unary_body_has_the_native_keys_in_native_order():
    truth = truth_of()
    doc = msgspec.json.decode(worker.agg(truth, stream=False)[0])
    assert list(doc) == ["text", "output_ids", "meta_info"]
    assert doc["output_ids"] == truth.output_ids
    assert doc["text"] == "".join(truth.token_text(t) for t in truth.output_ids)
    m = doc["meta_info"]
    assert list(m) == ["id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
                       "input_token_logprobs", "output_token_logprobs", "output_token_logprobs_length",
                       "routed_experts"]
    assert m["finish_reason"] == {"type": "length", "length": truth.output_len}
    assert m["input_token_logprobs"][0] == [None, truth.prompt_ids[0], None]
    assert m["input_token_logprobs"][1] == [truth.prompt_logprobs[1], truth.prompt_ids[1], None]
    assert base64.b64decode(m["routed_experts"]) == truth.experts


def test_agg_stream_has_one_chunk_per_chunk_size_with_deltas_and_cumulative_counts():
    truth = truth_of(output_len=9)
    bodies = worker.agg(truth, stream=True)
    assert len(bodies) == len(truth.chunk_sizes)
    for body, (start, end) in zip(bodies, truth.chunk_spans()):
        doc = msgspec.json.decode(body)
        m = doc["meta_info"]
        assert doc["output_ids"] == truth.output_ids[start:end]
        assert m["completion_tokens"] == m["output_token_logprobs_length"] == end
        assert [e[1] for e in m["output_token_logprobs"]] == truth.output_ids[start:end]
        assert len(m["input_token_logprobs"]) == truth.prompt_len  # re-emitted on every chunk
        assert ("routed_experts" in m) == (end == truth.output_len)
        assert (m["finish_reason"] is None) == (end != truth.output_len)


def test_stop_finish_names_the_last_output_token():
    truth = truth_of(finish="stop")
    assert meta(worker.agg(truth, stream=False)[0])["finish_reason"] == {
        "type": "stop", "matched": truth.output_ids[-1]}


@pytest.mark.parametrize("stream", [False, True])
def test_prefill_leg_is_always_one_body_with_the_first_token_and_prompt_rows(stream):
    truth = truth_of(output_len=8)
    bodies = worker.prefill(truth, stream=stream)
    assert len(bodies) == 1
    doc = msgspec.json.decode(bodies[0])
    m = doc["meta_info"]
    assert doc["output_ids"] == truth.output_ids[:1]
    assert m["completion_tokens"] == m["output_token_logprobs_length"] == 1
    assert m["finish_reason"] == {"type": "length", "length": 1}
    assert m["output_token_logprobs"] == [[truth.output_logprobs[0], truth.output_ids[0], None]]
    assert len(m["input_token_logprobs"]) == truth.prompt_len
    assert base64.b64decode(m["routed_experts"]) == truth.expert_rows(0, truth.prompt_len)


@pytest.mark.parametrize("stale", ["garbage", "zeros"])
def test_decode_leg_has_stale_prompt_rows_and_lacks_prompt_logprobs(stale):
    truth = truth_of(stale=stale)
    bodies = worker.decode(truth, stream=True)
    assert all("input_token_logprobs" not in meta(b) for b in bodies)
    first = meta(bodies[0])["output_token_logprobs"][0]
    assert first == [None, truth.output_ids[0], None]
    rows = base64.b64decode(meta(bodies[-1])["routed_experts"])
    prompt_bytes = truth.prompt_len * truth.row_bytes
    assert len(rows) == len(truth.experts)
    assert rows[prompt_bytes:] == truth.experts[prompt_bytes:]
    stale_values = struct.unpack(f"<{prompt_bytes // 4}i", rows[:prompt_bytes])
    true_values = struct.unpack(f"<{prompt_bytes // 4}i", truth.experts[:prompt_bytes])
    if stale == "zeros":
        assert set(stale_values) == {0}
    else:
        assert all(s != t for s, t in zip(stale_values, true_values))
        assert rows == base64.b64decode(meta(worker.decode(truth, stream=True)[-1])["routed_experts"])


def test_one_token_decode_may_omit_routed_experts():
    truth = truth_of(output_len=1, decode_omits_one_token_experts=True)
    assert "routed_experts" not in meta(worker.decode(truth, stream=False)[0])
    truth = truth_of(output_len=1)
    assert "routed_experts" in meta(worker.decode(truth, stream=False)[0])


# --------------------------------------------------------------- needs_prefill


def test_needs_prefill_for_logprob_chunks_rows_and_the_final_chunk_only():
    with_lp = truth_of(output_len=9)
    without_lp = truth_of(output_len=9, return_logprob=False)
    session = codec.open_session()
    first = worker.decode(with_lp, stream=True)[0]
    assert session.needs_prefill(first, False)
    plain = worker.decode(without_lp, stream=True)
    assert len(plain) > 1
    assert not session.needs_prefill(plain[0], False)
    # The final chunk always waits: only prefill tells whether a missing field was requested.
    assert session.needs_prefill(edit(plain[-1], routed_experts=None), True)
    assert not session.needs_prefill(edit(plain[-1], routed_experts=None), False)
    assert session.needs_prefill(edit(plain[0], routed_experts="AAAA"), False)


def test_unparseable_or_non_native_decode_chunks_pass_through_untouched():
    session = codec.open_session()
    for body in [b"\xffnot json", b"[1, 2]", b'{"error": {"message": "boom"}}', b'{"meta_info": 3}']:
        assert not session.needs_prefill(body, True)
        assert session.join(body, True) == (body, Verdict.PASSTHROUGH)


def test_chunk_that_needs_nothing_passes_through_before_prefill_is_known():
    truth = truth_of(output_len=9, return_logprob=False)
    body = worker.decode(truth, stream=True)[0]
    session = codec.open_session()
    assert session.join(body, False) == (body, Verdict.PASSTHROUGH)


def test_join_before_prefill_is_settled_is_a_caller_bug():
    body = worker.decode(truth_of(), stream=False)[0]
    with pytest.raises(RuntimeError):
        codec.open_session().join(body, True)


# -------------------------------------------------------------------- the join


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_pd_join_reproduces_the_aggregated_bodies_byte_for_byte(seed, stream):
    truth = make_truth(seed)
    joined = pd(truth, stream=stream)
    assert [body for body, _ in joined] == worker.agg(truth, stream=stream)
    assert {verdict for _, verdict in joined} <= {Verdict.JOINED, Verdict.PASSTHROUGH}
    assert joined[-1][1] is Verdict.JOINED


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(truth=truths(), stream=st.booleans())
def test_pd_join_equals_agg_bytes_for_any_truth(truth, stream):
    assert [body for body, _ in pd(truth, stream=stream)] == worker.agg(truth, stream=stream)


def test_decode_stale_prompt_rows_are_replaced_by_prefill_rows():
    truth = truth_of(stale="garbage")
    (body, verdict), = pd(truth, stream=False)
    assert verdict is Verdict.JOINED
    assert worker.expert_view(body) == (truth.experts, None)


def test_input_logprobs_are_inserted_where_the_aggregated_body_has_them():
    truth = truth_of(output_len=9)
    joined = pd(truth, stream=True)
    for (body, _), agg_body in zip(joined, worker.agg(truth, stream=True)):
        assert list(meta(body)) == list(meta(agg_body))
        assert meta(body)["input_token_logprobs"] == meta(agg_body)["input_token_logprobs"]


def test_first_token_logprob_comes_from_prefill_only_on_the_chunk_covering_position_zero():
    truth = truth_of(output_len=9, return_experts=False)
    joined = pd(truth, stream=True)
    first = meta(joined[0][0])["output_token_logprobs"][0]
    assert first == [truth.output_logprobs[0], truth.output_ids[0], None]
    later = meta(joined[1][0])["output_token_logprobs"]
    assert all(entry[0] is not None for entry in later)


def test_first_token_logprob_of_a_different_token_is_not_copied():
    truth = truth_of(return_experts=False)
    prefill = worker.prefill(truth, stream=False)[0]
    wrong = meta(prefill)["output_token_logprobs"]
    wrong[0][1] += 1
    (body, _), = join_leg(worker.decode(truth, stream=False), [edit(prefill, output_token_logprobs=wrong)])
    assert meta(body)["output_token_logprobs"][0] == [None, truth.output_ids[0], None]


def test_top_logprobs_are_copied_with_their_fields():
    truth = truth_of(return_experts=False)
    top0 = [[-0.1, truth.output_ids[0], None], [-2.5, 42, None]]
    prefill = edit(worker.prefill(truth, stream=False)[0], input_top_logprobs=[None] * truth.prompt_len,
                   output_top_logprobs=[top0])
    decode = worker.decode(truth, stream=False)[0]
    decode = edit(decode, output_top_logprobs=[None] + [[]] * (truth.output_len - 1))
    (body, verdict), = join_leg([decode], [prefill])
    m = meta(body)
    assert verdict is Verdict.JOINED
    assert m["input_top_logprobs"] == [None] * truth.prompt_len
    assert m["output_top_logprobs"][0] == top0


def test_missing_prefill_input_logprobs_are_marked_unavailable():
    truth = truth_of(output_len=9, return_experts=False)
    prefill = edit(worker.prefill(truth, stream=False)[0], input_token_logprobs=None)
    for body, verdict in join_leg(worker.decode(truth, stream=True), [prefill]):
        m = meta(body)
        assert verdict is Verdict.OMITTED
        assert m["input_logprobs_unavailable_reason"] == "prefill_missing"
        assert "input_token_logprobs" not in m


def test_prefill_timeout_marks_every_field_that_needed_prefill():
    truth = truth_of(output_len=9)
    results = join_leg(worker.decode(truth, stream=True), None, unavailable="prefill_timeout")
    for body, verdict in results:
        assert verdict is Verdict.OMITTED
        assert meta(body)["input_logprobs_unavailable_reason"] == "prefill_timeout"
    final = meta(results[-1][0])
    assert "routed_experts" not in final
    assert final["routed_experts_unavailable_reason"] == "prefill_timeout"


def test_prefill_timeout_through_the_correlator_omits_stale_rows():
    truth = truth_of(return_logprob=False)
    chunks = leg(truth.request_id, Role.DECODE, worker.decode(truth, stream=False))
    run = run_pipeline(chunks, format="sglang", options=OPTIONS, settle_at=1000.0)
    (result,) = run.of(truth.request_id)
    assert result.verdict is Verdict.OMITTED
    assert worker.expert_view(result.body) == (None, "prefill_timeout")


@pytest.mark.parametrize(
    ("target", "damage", "reason"),
    [
        ("prefill", Damage.DROP, "prefill_missing"),
        ("prefill", Damage.GARBAGE, "prefill_corrupt"),
        ("prefill", Damage.TRUNCATE, "prefill_corrupt"),
        ("prefill", Damage.WRONG_TYPE, "prefill_corrupt"),
        ("prefill", Damage.BOMB, "too_large"),
        ("decode", Damage.DROP, "decode_missing"),
        ("decode", Damage.GARBAGE, "decode_corrupt"),
        ("decode", Damage.TRUNCATE, "decode_corrupt"),
        ("decode", Damage.WRONG_TYPE, "decode_corrupt"),
        ("decode", Damage.BOMB, "too_large"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("logprobs", [False, True])
def test_damaged_sequence_payload_is_omitted_with_its_reason(target, damage, reason, stream, logprobs):
    truth = truth_of(stale="zeros", return_logprob=logprobs)
    results = pd(truth, stream=stream, **{f"{target}_damage": damage})
    body, verdict = results[-1]
    assert verdict is Verdict.OMITTED
    assert worker.expert_view(body) == (None, reason)
    for body, _ in results[:-1]:
        assert "routed_experts_unavailable_reason" not in meta(body)  # only the final chunk had rows


def test_plain_base64_bomb_is_rejected_by_its_length_alone():
    bomb = worker.bomb(truth_of(), "decode")
    assert len(bomb) > 4 * -(-LIMIT // 3)
    with pytest.raises(CorruptPayload) as info:
        Base64Int32Rows(OPTIONS).decode("!" + bomb[1:])  # invalid text: only a length check says too_large
    assert info.value.reason == TOO_LARGE


def test_decode_rows_inconsistent_with_the_token_count_are_a_length_mismatch():
    truth = truth_of()
    decode = worker.decode(truth, stream=False)[0]
    (body, verdict), = join_leg([edit(decode, completion_tokens=truth.output_len + 1)],
                                worker.prefill(truth, stream=False))
    assert verdict is Verdict.OMITTED
    assert worker.expert_view(body) == (None, "length_mismatch")


def test_legs_disagreeing_about_the_prompt_length_are_a_length_mismatch():
    truth = truth_of()
    prefill = worker.prefill(truth, stream=False)[0]
    wrong = edit(prefill, prompt_tokens=truth.prompt_len + 1)
    (body, _), = join_leg(worker.decode(truth, stream=False), [wrong])
    assert worker.expert_view(body) == (None, "length_mismatch")


def test_prefill_rows_that_fit_no_row_layout_are_corrupt():
    truth = truth_of()
    prefill = worker.prefill(truth, stream=False)[0]
    rows = base64.b64decode(meta(prefill)["routed_experts"])
    for wrong in (rows[:-2], b""):  # not whole ids; no rows for a prompt that starts at 0
        bad = edit(prefill, routed_experts=base64.b64encode(wrong).decode(), routed_experts_start_len=0)
        (body, _), = join_leg(worker.decode(truth, stream=False), [bad])
        assert worker.expert_view(body) == (None, "prefill_corrupt")


@pytest.mark.parametrize("finish", [{"type": "abort", "message": "cancelled"}, {"type": "error"}])
def test_prefill_that_aborted_counts_as_unavailable(finish):
    truth = truth_of()
    prefill = edit(worker.prefill(truth, stream=False)[0], finish_reason=finish)
    (body, verdict), = join_leg(worker.decode(truth, stream=False), [prefill])
    assert verdict is Verdict.OMITTED
    assert meta(body)["input_logprobs_unavailable_reason"] == "prefill_error"
    assert worker.expert_view(body) == (None, "prefill_error")


def test_unparseable_prefill_is_corrupt():
    truth = truth_of(return_logprob=False)
    (body, _), = join_leg(worker.decode(truth, stream=False), [b"\x00garbage"])
    assert worker.expert_view(body) == (None, "prefill_corrupt")


@pytest.mark.parametrize("omits", [False, True])
def test_one_token_decode_yields_exactly_the_prefill_rows(omits):
    truth = truth_of(output_len=1, decode_omits_one_token_experts=omits)
    prefill = worker.prefill(truth, stream=False)
    (body, verdict), = join_leg(worker.decode(truth, stream=False), prefill)
    assert verdict is Verdict.JOINED
    assert worker.expert_view(body) == (truth.experts, None)
    assert meta(body)["routed_experts"] == meta(prefill[0])["routed_experts"]
    assert body == worker.agg(truth, stream=False)[0]


def test_one_token_request_without_experts_gets_no_marker():
    truth = truth_of(output_len=1, return_experts=False, return_logprob=False)
    decode = worker.decode(truth, stream=False)
    assert join_leg(decode, worker.prefill(truth, stream=False)) == [(decode[0], Verdict.PASSTHROUGH)]


def test_decode_that_already_has_correct_rows_passes_through_unchanged():
    truth = truth_of()
    agg_body = worker.agg(truth, stream=False)[0]  # what a fixed decode worker would send
    assert join_leg([agg_body], worker.prefill(truth, stream=False)) == [(agg_body, Verdict.PASSTHROUGH)]


def test_unknown_keys_and_key_order_survive_a_join():
    truth = truth_of(return_logprob=False)
    doc = msgspec.json.decode(worker.decode(truth, stream=False)[0])
    doc = {"zeta": [1, {"b": 2}], **doc, "extra": "é"}
    doc["meta_info"] = {"weight_version": "v9", **doc["meta_info"], "e2e_latency": 0.25}
    (body, verdict), = join_leg([msgspec.json.encode(doc)], worker.prefill(truth, stream=False))
    joined = msgspec.json.decode(body)
    assert verdict is Verdict.JOINED
    assert list(joined) == list(doc)
    assert list(joined["meta_info"]) == list(doc["meta_info"])
    assert joined["zeta"] == doc["zeta"] and joined["meta_info"]["e2e_latency"] == 0.25


def test_prefill_rows_are_decoded_once_per_session():
    calls = []

    class CountingRows(Base64Int32Rows):
        def decode(self, value):
            calls.append(value)
            return super().decode(value)

    class CountingCodec(SGLangCodec):
        sequence_codecs = {"routed_experts": CountingRows}

    truth = truth_of(output_len=9, return_logprob=False)
    prefill = worker.prefill(truth, stream=False)
    prefill_value = meta(prefill[0])["routed_experts"]
    decode = worker.decode(truth, stream=True)
    # A non-native early chunk carrying rows is joined too (never published stale).
    decode[0] = edit(decode[0], routed_experts=base64.b64encode(
        truth.expert_rows(0, truth.prompt_len + truth.chunk_sizes[0] - 1)).decode())
    results = join_leg(decode, prefill, codec=CountingCodec(OPTIONS))
    assert calls.count(prefill_value) == 1
    assert results[-1][1] is Verdict.JOINED


# ---------------------------------------------------------------- fold, errors


@pytest.mark.parametrize("seed", [1, 5, 9])
def test_folding_the_agg_stream_equals_the_unary_response(seed):
    truth = make_truth(seed, output_len=10)
    folded = msgspec.json.decode(codec.fold(worker.agg(truth, stream=True)))
    assert folded == msgspec.json.decode(worker.agg(truth, stream=False)[0])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(truth=truths())
def test_folding_the_joined_stream_equals_the_joined_unary_response(truth):
    streamed = [body for body, _ in pd(truth, stream=True)]
    (unary, _), = pd(truth, stream=False)
    assert msgspec.json.decode(codec.fold(streamed)) == msgspec.json.decode(unary)


def test_fold_refuses_a_non_json_chunk_in_a_stream_of_several():
    chunk = msgspec.json.encode({"text": "a", "output_ids": [1], "meta_info": {"id": "r"}})
    with pytest.raises(ValueError):
        codec.fold([chunk, b"not json"])


@pytest.mark.parametrize("body", [
    b'{"text":"Hi","output_ids":[211],"meta_info":{"id":"r"},"index":0',  # cut short after the tag
    b"\xff\xfe" + b'"index":0}',  # not UTF-8
    b"[" * 100_000 + b'"index":0',  # nested past the parser's stack (msgspec raised RecursionError)
    b"not json",
], ids=["cut-short", "not-utf8", "nested-deep", "opaque"])
def test_a_lone_body_that_is_no_json_object_folds_to_itself(body):
    """``folds_alone`` looks at a bounded part of the bytes only (an ``"index"`` near the end), so it
    sends bodies the fold cannot parse; the edge serves any other lone body as sent, so the fold gives
    it back rather than raising (the edge's unary answer was a 500 ``cannot fold 1 results``)."""
    for name in ("sglang", "sglang-zstd"):
        assert codec_class(name)(OPTIONS).fold([body]) == body


def test_a_prefill_leg_whose_later_chunk_adds_many_keys_is_absorbed_in_linear_time():
    """Folding a multi-chunk leg places the keys a later chunk adds where that chunk has them
    (``_place_new_keys``); it did so with a list ``index`` and ``insert`` per key. A prefill leg whose
    second chunk adds 40,000 ``meta_info`` keys (430 KB) took 7 s of CPU in ``absorb_prefill``, which
    the correlator runs on the event loop: every other request waited."""
    import time

    first = msgspec.json.encode({"text": "a", "output_ids": [1], "meta_info": {"id": "p", "z": 0}})
    added = {f"k{i}": 0 for i in range(40_000)}
    second = msgspec.json.encode({"text": "", "output_ids": [], "meta_info": {**added, "id": "p"}})
    session = codec.open_session()
    started = time.process_time()
    session.absorb_prefill([first, second])
    assert time.process_time() - started < 1.0
    folded = msgspec.json.decode(codec.fold([first, second]))
    assert list(folded["meta_info"]) == [*added, "id", "z"]  # where the later chunk has them


@pytest.mark.parametrize(
    ("kind", "native_type"),
    [(ErrorKind.TIMEOUT, "timeout"), (ErrorKind.OVERLOADED, "overloaded"),
     (ErrorKind.INVALID_CHUNK, "invalid_request_error"), (ErrorKind.UNKNOWN_FORMAT, "invalid_request_error"),
     (ErrorKind.INTERNAL, "internal_error"), (ErrorKind.MIGRATION_REFUSED, "service_unavailable"),
     (ErrorKind.UNAVAILABLE, "service_unavailable")],
)
def test_error_body_is_the_native_envelope(kind, native_type):
    body = codec.error_body('bad "thing" ☃', kind)
    assert msgspec.json.decode(body) == {"error": {"message": 'bad "thing" ☃', "type": native_type}}


# ------------------------------------------------------------------ catalog, views


def test_catalog_finds_the_builtin_codec_and_worker():
    assert codec_class("sglang") is SGLangCodec
    assert isinstance(worker_for("sglang"), SGLangWorker)


def test_expert_view_raises_on_a_present_but_undecodable_value():
    body = edit(worker.agg(truth_of(), stream=False)[0], routed_experts="!!")
    with pytest.raises(ValueError):
        worker.expert_view(body)


def test_opaque_agg_bodies_vary_and_are_deterministic_per_seed():
    truth = truth_of(output_len=9)
    runs = [worker.opaque_agg(truth, stream=True, rng=random.Random(s)) for s in range(40)]
    assert worker.opaque_agg(truth, stream=True, rng=random.Random(3)) == runs[3]
    finals = {r[-1] for r in runs}
    assert len(finals) > 10
    assert any(not b.startswith(b"{") for r in runs for b in r)  # some bodies are not JSON at all
