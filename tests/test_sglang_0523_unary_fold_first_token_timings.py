"""A folded SGLang 0.5.23 stream never answers a unary client with a first-token timing measured the stream's way.

Written by hand from the SGLang 0.5.23 PyPI wheel, not from the simulator. With ``--enable-metrics`` a
finished body carries ``first_token_latency`` and ``decode_throughput``
(``observability/req_time_stats.py``, ``APIServerReqTimeStats.convert_to_output_meta_info``)::

    if self.created_time > 0.0 and self.first_token_time > self.created_time:
        meta_info["first_token_latency"] = self.get_first_token_latency()   # first_token_time - created_time
    ...
    decode_throughput = self.get_decode_throughput(completion_tokens)       # 1 / ((finished - first) / (n - 1))

Both count from ``first_token_time``, which ``TokenizerManager._handle_batch_output`` sets once, on the first
output batch, to ``self._get_scheduler_first_token_time(state, recv_obj, i) or first_output_time``::

    # Non-streaming outputs are batched; use the scheduler's first-token time.
    if getattr(state.obj, "stream", False) or recv_obj.time_stats is None:
        return None
    ts = recv_obj.time_stats[i].prefill_finished_time

A stream takes the tokenizer's receipt of its first output; the same request unary takes the scheduler's
``prefill_finished_time`` (or, without one, its first output batch: every ``DEFAULT_FORCE_STREAM_INTERVAL``
tokens or the finish). No chunk carries the unary value (the chunks' ``prefill_finished_time`` and
``request_received_ts`` are wall-clock stamps from two processes' own offsets), so the folded answer replaces
each field in place with ``<field>_unavailable_reason: not_streamed``; every other timing (``e2e_latency``,
``request_finished_ts``, ...) is measured the same way in both modes and folds to the finished body's value.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from helpers import upstream_json as dumps
from sglang_0523_bodies import add_counts

from streamproc.codec import CodecOptions
from streamproc_sglang import SGLangCodec

RID = "7d1c9e0a4b3f45a8b2e6c0d9f1a2b3c4"
OUT = [301, 302, 303, 304]
TEXTS = {1: "a", 2: "ab", 4: "abcd"}
RECEIVED = 1765000100.0
PREFILL_DONE = 0.180  # the scheduler's prefill_finished_time - created_time (the unary first token)
STREAM_FIRST = 0.183  # the tokenizer's receipt of a stream's first output batch
E2E = 0.5
FIN = {"type": "length", "length": 4}


def meta(n: int, finish: dict | None, *, first: float, sent: float | None) -> dict[str, Any]:
    """``_handle_batch_output``'s ``meta_info`` with ``--enable-metrics``; ``first``: ``first_token_time -
    created_time``; ``sent``: ``response_sent_to_client_time`` when it was built (``None``: not yet)."""
    m: dict[str, Any] = {"id": RID, "finish_reason": finish, "prompt_tokens": 3, "weight_version": "default",
                         "num_retractions": 0}
    # SchedulerReqTimeStats.convert_to_output_meta_info, every body
    m.update({"forward_entry_time": RECEIVED + 0.01, "prefill_finished_time": RECEIVED + PREFILL_DONE,
              "queue_time": 0.004})
    add_counts(m, n, finished=finish is not None)
    if finish is not None:
        m["e2e_latency"] = E2E
        # APIServerReqTimeStats.convert_to_output_meta_info, finished bodies
        m["request_received_ts"] = RECEIVED
        m["first_token_latency"] = first
        m["api_server_dispatch_finish_ts"] = RECEIVED + 0.002
        if sent is not None:
            m["response_sent_to_client_ts"] = sent
        m["request_finished_ts"] = RECEIVED + E2E
        m["decode_throughput"] = (n - 1) / (E2E - first)
    return m


def body(n: int, finish: dict | None, *, first: float, sent: float | None = None,
         stamp: float | None = None) -> dict:
    doc = {"text": TEXTS[n], "output_ids": OUT[:n], "meta_info": meta(n, finish, first=first, sent=sent)}
    if stamp is not None:  # _stream_one_response: the first body yielded
        doc["meta_info"]["response_sent_to_client_ts"] = stamp
    return doc


def unary() -> dict:
    """The same request unary: first_token_time from the scheduler's prefill_finished_time."""
    return body(4, FIN, first=PREFILL_DONE, stamp=RECEIVED + E2E + 0.001)


def marked(doc: dict) -> dict:
    """``doc`` with each first-token timing and the send stamp replaced where it stands by its reason."""
    reasons = {"first_token_latency", "decode_throughput", "response_sent_to_client_ts"}
    meta = doc["meta_info"]
    doc["meta_info"] = {(f"{key}_unavailable_reason" if key in reasons else key):
                        ("not_streamed" if key in reasons else value) for key, value in meta.items()}
    return doc


@pytest.mark.parametrize("streaming", ["cumulative", "incremental"])
def test_a_folded_metrics_stream_marks_first_token_timings_not_streamed(streaming):
    """The folded answer is the unary one with ``first_token_latency`` and ``decode_throughput`` replaced in
    place by their ``not_streamed`` reasons: never the stream's tokenizer-side values, which a unary
    answer of the same request does not carry."""
    first_sent = RECEIVED + STREAM_FIRST + 0.001
    if streaming == "cumulative":
        chunks = [body(1, None, first=STREAM_FIRST, stamp=first_sent),
                  body(2, None, first=STREAM_FIRST, sent=first_sent),
                  body(4, FIN, first=STREAM_FIRST, sent=first_sent)]
    else:  # --incremental-streaming-output: text and output_ids are deltas
        chunks = [body(1, None, first=STREAM_FIRST, stamp=first_sent),
                  {**body(2, None, first=STREAM_FIRST, sent=first_sent), "text": "b", "output_ids": OUT[1:2]},
                  {**body(4, FIN, first=STREAM_FIRST, sent=first_sent), "text": "cd", "output_ids": OUT[2:4]}]
    options = CodecOptions(max_decompressed_bytes=1 << 20, format_options=(("streaming", streaming),))
    folded = json.loads(SGLangCodec(options).fold([dumps(chunk) for chunk in chunks]))
    want = marked(unary())
    assert folded == want
    assert list(folded["meta_info"]) == list(want["meta_info"])


def test_a_streamed_batch_item_of_one_body_marks_its_first_token_timings_too():
    """An item whose only streamed body is its finished one still took ``first_token_time`` at the
    tokenizer (``state.obj.stream`` is the batch's): its timings are marked; its send stamp is the unary
    one and stays (``_stream_one_response`` stamped that finished body as it was sent)."""
    stamp = RECEIVED + E2E + 0.001
    item = body(4, FIN, first=E2E - 0.001, stamp=stamp)
    folded = json.loads(SGLangCodec(CodecOptions(max_decompressed_bytes=1 << 20)).fold(
        [dumps({**item, "index": 0})]))
    assert len(folded) == 1
    meta = folded[0]["meta_info"]
    assert meta["first_token_latency_unavailable_reason"] == "not_streamed"
    assert meta["decode_throughput_unavailable_reason"] == "not_streamed"
    assert "first_token_latency" not in meta and "decode_throughput" not in meta
    assert meta["response_sent_to_client_ts"] == stamp


def test_a_folded_stream_without_metrics_has_no_first_token_timing_reason():
    """Without ``--enable-metrics`` neither field is written, unary or streamed: no reason is added."""
    chunks = [{"text": "a", "output_ids": OUT[:1], "meta_info": {"id": RID, "finish_reason": None,
                                                                  "completion_tokens": 1}},
              {"text": "abcd", "output_ids": OUT, "meta_info": {"id": RID, "finish_reason": FIN,
                                                                 "completion_tokens": 4, "e2e_latency": E2E}}]
    folded = json.loads(SGLangCodec(CodecOptions(max_decompressed_bytes=1 << 20)).fold(
        [dumps(chunk) for chunk in chunks]))
    assert not any(key.endswith("_unavailable_reason") for key in folded["meta_info"])
    assert folded["meta_info"]["e2e_latency"] == E2E
