"""A folded SGLang 0.5.23 stream never answers a unary client with the first chunk's ``response_sent_to_client_ts``.

Written by hand from the SGLang 0.5.23 PyPI wheel (``managers/tokenizer_manager.py``), not from the simulator.
``TokenizerManager._stream_one_response`` stamps the first body it yields, appending the key last::

    if finished:
        # Record response sent time right before we log finished results and metrics.
        if not state.time_stats.response_sent_to_client_time:
            state.time_stats.set_response_sent_to_client_time()
            out["meta_info"]["response_sent_to_client_ts"] = (
                state.time_stats.get_response_sent_to_client_realtime())
        ...
    if is_stream:
        # Record response sent time right before we send response.
        if not state.time_stats.response_sent_to_client_time:
            ...same...
        yield out

A unary request yields its finished body only (``_handle_batch_output``: ``out_dict = None`` until
``state.finished``), so its answer ends with the time that answer was sent. A stream's first chunk has the
stamp of *its* send; with ``--enable-metrics`` the finished body repeats that first-send time inside
``APIServerReqTimeStats.convert_to_output_meta_info`` (``if self.response_sent_to_client_time > 0.0``), and
without it no later chunk has the key. No chunk of a stream of two or more bodies carries the time a unary
answer would have been sent: the folded answer replaces the key with
``response_sent_to_client_ts_unavailable_reason: not_streamed`` (docs/codecs.md, "Timings") rather than restate
the first chunk's time as the answer's or leave it out unmarked. A stream of one body (its first body is the finished one) has
exactly the unary stamp, and keeps it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from helpers import upstream_json as dumps
from sglang_0523_bodies import add_counts

from streamproc.codec import CodecOptions
from streamproc_sglang import SGLangCodec

OPTIONS = CodecOptions(max_decompressed_bytes=1 << 20, format_options=(("streaming", "cumulative"),))
RID = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"
OUT = [201, 202, 203, 204, 205]
TEXTS = {1: "H", 3: "Hel", 5: "Hello"}
RECEIVED = 1765000000.0
FIRST_SENT = RECEIVED + 0.25  # the stream's first chunk
UNARY_SENT = RECEIVED + 0.75  # the unary answer, sent once finished
E2E = 0.75
FIN = {"type": "length", "length": 5}
FIRST_TOKEN = ("first_token_latency", "decode_throughput")


def meta(n: int, finish: dict | None, *, metrics: bool, sent: float | None) -> dict[str, Any]:
    """``_handle_batch_output``'s ``meta_info``; ``sent``: ``response_sent_to_client_time`` when it was
    built (``None``: not yet)."""
    m: dict[str, Any] = {"id": RID, "finish_reason": finish, "prompt_tokens": 4, "weight_version": "default",
                         "num_retractions": 0}
    if metrics:  # SchedulerReqTimeStats.convert_to_output_meta_info
        m.update({"forward_entry_time": RECEIVED + 0.01, "prefill_finished_time": RECEIVED + 0.2,
                  "queue_time": 0.005})
    add_counts(m, n, finished=finish is not None)
    if finish is not None:
        m["e2e_latency"] = E2E
        if metrics:  # APIServerReqTimeStats.convert_to_output_meta_info
            m["request_received_ts"] = RECEIVED
            m["first_token_latency"] = 0.25
            m["api_server_dispatch_finish_ts"] = RECEIVED + 0.001
            if sent is not None:
                m["response_sent_to_client_ts"] = sent
            m["request_finished_ts"] = RECEIVED + E2E
            m["decode_throughput"] = (n - 1) / 0.5
    return m


def body(n: int, finish: dict | None, *, metrics: bool, sent: float | None, stamp: float | None = None) -> dict:
    doc = {"text": TEXTS[n], "output_ids": OUT[:n], "meta_info": meta(n, finish, metrics=metrics, sent=sent)}
    if stamp is not None:  # the first body yielded
        doc["meta_info"]["response_sent_to_client_ts"] = stamp
    return doc


def stream(metrics: bool) -> list[bytes]:
    return [dumps(body(1, None, metrics=metrics, sent=None, stamp=FIRST_SENT)),
            dumps(body(3, None, metrics=metrics, sent=FIRST_SENT)),
            dumps(body(5, FIN, metrics=metrics, sent=FIRST_SENT))]


def unary(metrics: bool) -> dict:
    return body(5, FIN, metrics=metrics, sent=None, stamp=UNARY_SENT)


@pytest.mark.parametrize("metrics", [False, True], ids=["plain", "enable-metrics"])
def test_a_folded_stream_marks_the_send_stamp_a_unary_answer_would_carry_not_streamed(metrics):
    """The folded answer is the unary one with ``response_sent_to_client_ts`` replaced where the unary body
    has it (last: ``_stream_one_response`` appends it after ``_handle_batch_output`` built the rest) by
    ``response_sent_to_client_ts_unavailable_reason: not_streamed`` (the omission policy): never the first
    chunk's send time, which would claim the answer left at first-token time, and never a bare absence a
    client cannot tell from a server that writes no stamp."""
    folded = json.loads(SGLangCodec(OPTIONS).fold(stream(metrics)))
    want = unary(metrics)
    assert "response_sent_to_client_ts" not in folded["meta_info"]
    del want["meta_info"]["response_sent_to_client_ts"]
    want["meta_info"]["response_sent_to_client_ts_unavailable_reason"] = "not_streamed"
    # --enable-metrics: the first-token timings are measured differently unary (scheduler's prefill), so
    # they are replaced in place too (test_sglang_0523_unary_fold_first_token_timings.py)
    want["meta_info"] = {(f"{key}_unavailable_reason" if key in FIRST_TOKEN else key):
                         ("not_streamed" if key in FIRST_TOKEN else value)
                         for key, value in want["meta_info"].items()}
    assert folded == want
    assert list(folded["meta_info"]) == list(want["meta_info"])


def test_a_folded_streamed_batch_item_of_several_chunks_marks_its_send_stamp_not_streamed():
    """Each item of a streamed batch is stamped on its own first body (``_handle_batch_request``: one
    ``_wait_one_response`` per item); an item of several chunks folds with the reason, an item of one keeps
    its stamp (its first body is its finished one, as unary)."""
    long_item = [body(1, None, metrics=False, sent=None, stamp=FIRST_SENT), body(5, FIN, metrics=False, sent=None)]
    short_item = body(5, FIN, metrics=False, sent=None, stamp=UNARY_SENT)
    chunks = [dumps({**long_item[0], "index": 0}), dumps({**short_item, "index": 1}),
              dumps({**long_item[1], "index": 0})]
    folded = json.loads(SGLangCodec(OPTIONS).fold(chunks))
    assert folded[0]["meta_info"]["response_sent_to_client_ts_unavailable_reason"] == "not_streamed"
    assert "response_sent_to_client_ts" not in folded[0]["meta_info"]
    assert folded[1] == short_item


def test_a_reason_a_stitched_chunk_already_gives_the_send_stamp_is_kept():
    """A migrated stream's stitched bodies carry ``response_sent_to_client_ts_unavailable_reason:
    stitch_incomplete`` (migration.py ``TIMING_FIELDS``); the fold keeps that reason, not a second one."""
    first = body(1, None, metrics=False, sent=None)
    first["meta_info"]["response_sent_to_client_ts_unavailable_reason"] = "stitch_incomplete"
    last = body(5, FIN, metrics=False, sent=None)
    folded = json.loads(SGLangCodec(OPTIONS).fold([dumps(first), dumps(last)]))
    assert folded["meta_info"]["response_sent_to_client_ts_unavailable_reason"] == "stitch_incomplete"
    assert "response_sent_to_client_ts" not in folded["meta_info"]


def test_a_stream_of_one_finished_body_keeps_its_stamp_the_unary_one():
    """Its first yielded body is the finished one: stamped at the end with the time the whole answer was
    sent, as the same request unary."""
    only = dumps(body(5, FIN, metrics=True, sent=None, stamp=UNARY_SENT))
    codec = SGLangCodec(OPTIONS)
    assert codec.fold([only]) == only
    assert json.loads(codec.fold([only]))["meta_info"] == unary(True)["meta_info"]


def test_a_streamed_batch_of_one_body_items_folds_to_the_unary_list_with_each_items_stamp():
    """``_stream_batch_responses`` tags each item's chunk ``result["index"]``; an item whose first yielded body
    is its finished one carries the stamp the same item has unary (``_handle_batch_request``: each item's
    ``_wait_one_response``), so the folded list keeps it, item by item."""
    items = [body(5, FIN, metrics=False, sent=None, stamp=UNARY_SENT + k) for k in range(2)]
    chunks = [dumps({**item, "index": k}) for k, item in enumerate(items)]
    assert json.loads(SGLangCodec(OPTIONS).fold(chunks)) == items
