"""Independent format-fidelity review: SGLang 0.5.23 ``meta_info.weight_versions`` in P/D.

Source: the PyPI wheel ``sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl`` (paths relative to
``sglang/srt/``). Bodies are written by hand from the upstream functions quoted below: nothing comes
from the simulator, the simulated workers or ``streamproc_sglang.upstream``.

``weight_versions`` says which weights produced which output tokens (RL trainers read it to find
off-policy tokens). 0.5.23 builds it for a finished request only
(``scheduler_components/output_streamer.py`` ``_GenerationStreamAccumulator.accept``)::

    if req.finished():
        self.weight_versions.append(compute_weight_version_spans(
            req.weight_version_events, current_version=self.current_weight_version,
            num_output_tokens=len(output_ids_)))

from the events ``Scheduler.record_weight_version_change`` records on an update for the requests
that hold output tokens (``record_weight_version_events``: ``WeightVersionEvent(old_version,
num_output_tokens=len(req.output_ids))``), and ``TokenizerManager._handle_batch_output`` writes it
with ``add_weight_versions_to_meta_info`` (``utils/weight_versions.py``), which also sets
``weight_version`` to the last visible span's version.

Output token 0 is sampled by the prefill worker's weights. The P/D prefill reports that:
``process_disagg_prefill_inflight_queue`` finishes it (``FINISH_LENGTH(length=0)``) and streams it
through the same ``OutputStreamer``, so its body carries ``[{version: <prefill's>, start: 0, end: 1}]``.
The decode worker appends token 0 from the metadata buffer (``DecodeTransferQueue._commit_transfer_to_req``:
``decode_req.req.output_ids.append(committed_output_id)``), which carries no version, so decode's spans
attribute token 0 to decode's own weights, which never ran it. When the two servers were on different
versions (an update reaches them at different moments), decode's value is not the aggregated one.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from helpers import assert_same_body as assert_same
from helpers import drive_join as join
from helpers import upstream_json as dumps

from streamproc.codec import CodecOptions
from streamproc.wire import Verdict
from streamproc_sglang import SGLangCodec

OPTIONS = CodecOptions(max_decompressed_bytes=1 << 20)
RID = "req-wv"
PROMPT = 4
OUT = [201, 202, 203]


# utils/weight_versions.py (0.5.23), verbatim but for the msgspec Struct (a dict here):
#
#     def compute_weight_version_spans(events, current_version, num_output_tokens):
#         changes = [(event.old_version, event.num_output_tokens) for event in events]
#         changes.append((current_version, num_output_tokens))
#         spans = []
#         for version, end in changes:
#             end = min(end, num_output_tokens)
#             if spans and end <= spans[-1].end:
#                 continue
#             if spans and version == spans[-1].version:
#                 spans[-1].end = end
#                 continue
#             start = spans[-1].end if spans else 0
#             spans.append(WeightVersionSpan(version=version, start=start, end=end))
#         return spans
def compute_weight_version_spans(events: list[tuple[str, int]], current_version: str,
                                 num_output_tokens: int) -> list[dict[str, Any]]:
    changes = [*events, (current_version, num_output_tokens)]
    spans: list[dict[str, Any]] = []
    for version, end in changes:
        end = min(end, num_output_tokens)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        start = spans[-1]["end"] if spans else 0
        spans.append({"version": version, "start": start, "end": end})
    return spans


#     def add_weight_versions_to_meta_info(meta_info, spans, num_output_tokens):
#         visible = [span for span in spans if span.start < num_output_tokens or span.start == 0]
#         meta_info["weight_versions"] = [
#             {"version": span.version, "start": span.start, "end": min(span.end, num_output_tokens)}
#             for span in visible]
#         meta_info["weight_version"] = visible[-1].version
def add_weight_versions_to_meta_info(meta: dict[str, Any], spans: list[dict[str, Any]], n: int) -> None:
    visible = [span for span in spans if span["start"] < n or span["start"] == 0]
    meta["weight_versions"] = [{"version": s["version"], "start": s["start"], "end": min(s["end"], n)}
                               for s in visible]
    meta["weight_version"] = visible[-1]["version"]


def body(out: list[int], *, finish: Any, config_version: str, events: list[tuple[str, int]] | None,
         sent: slice = slice(None)) -> bytes:
    """0.5.23 ``TokenizerManager._handle_batch_output`` (BatchStrOutput, no logprobs, no experts) after
    ``len(out)`` output tokens; ``events`` None: not finished (no spans). ``sent``: the ids the body
    carries (``--incremental-streaming-output``: the chunk's delta; ``completion_tokens`` counts all)."""
    n = len(out)
    meta: dict[str, Any] = {
        "id": RID, "finish_reason": finish, "prompt_tokens": PROMPT,
        "weight_version": config_version,  # self.config_value("weight_version"): the server's current
        "num_retractions": 0,
        "reasoning_tokens": 0, "completion_tokens": n, "cached_tokens": 0,
    }
    if events is not None:
        add_weight_versions_to_meta_info(meta, compute_weight_version_spans(events, config_version, n), n)
    meta["cached_tokens_details"] = None  # OutputStreamer.get_cached_tokens_details: no cache hit
    if events is not None:
        meta["e2e_latency"] = 0.25
    ids = out[sent]
    return dumps({"text": "x" * len(ids), "output_ids": ids, "meta_info": meta})


STOP = {"type": "stop", "matched": OUT[-1]}
PREFILL_FINISH = {"type": "length", "length": 0}  # process_disagg_prefill_inflight_queue


def finish_of(n: int) -> dict[str, Any]:
    return STOP if n == len(OUT) else {"type": "length", "length": n}


def prefill_leg(version: str) -> bytes:
    """The prefill worker ran ``version``: token 0 is its, and it finishes with no event recorded."""
    return body(OUT[:1], finish=PREFILL_FINISH, config_version=version, events=[])


def legs_after_a_split_update(n: int) -> tuple[bytes, bytes, bytes]:
    """An update to ``v2`` reached the decode server before this request and the prefill server after
    it. The aggregated engine that ran the same weights per token sampled token 0 under ``v1`` and then
    moved to ``v2``: ``record_weight_version_events`` recorded ``(v1, 1)`` (the request held one token)."""
    agg = body(OUT[:n], finish=finish_of(n), config_version="v2", events=[("v1", 1)])
    decode = body(OUT[:n], finish=finish_of(n), config_version="v2", events=[])  # no event: already on v2
    return agg, prefill_leg("v1"), decode


@pytest.mark.parametrize("n", [1, 2, 3])
def test_pd_weight_versions_give_token_0_the_prefill_weights_as_the_aggregated_engine_does(n):
    agg, prefill, decode = legs_after_a_split_update(n)
    assert json.loads(decode)["meta_info"]["weight_versions"][0]["version"] == "v2"  # decode's own claim
    [(got, verdict)] = join(SGLangCodec(OPTIONS), [decode], [prefill])
    assert_same(got, agg)
    assert verdict is Verdict.JOINED


def test_pd_weight_versions_update_the_top_level_version_of_a_one_token_answer():
    """``add_weight_versions_to_meta_info`` sets ``weight_version`` to the last span's version: for one
    token, the prefill worker's."""
    _, prefill, decode = legs_after_a_split_update(1)
    [(got, _)] = join(SGLangCodec(OPTIONS), [decode], [prefill])
    meta = json.loads(got)["meta_info"]
    assert meta["weight_version"] == "v1" and meta["weight_versions"] == [{"version": "v1", "start": 0, "end": 1}]


@pytest.mark.parametrize("cumulative", [True, False])
def test_pd_stream_joins_weight_versions_on_its_finished_chunk_only(cumulative):
    """A stream's intermediate chunks carry no spans (``accept`` appends ``None`` for an unfinished
    request), and their ``weight_version`` is the sending server's current one on either engine: they
    pass through. The finished chunk's spans are joined."""
    agg = body(OUT, finish=STOP, config_version="v2", events=[("v1", 1)])
    first = body(OUT[:1], finish=None, config_version="v2", events=None)
    second = body(OUT[:2], finish=None, config_version="v2", events=None, sent=slice(0 if cumulative else 1, 2))
    last = body(OUT, finish=STOP, config_version="v2", events=[], sent=slice(0 if cumulative else 2, 3))
    results = join(SGLangCodec(OPTIONS), [first, second, last], [prefill_leg("v1")])
    assert [body for body, _ in results[:2]] == [first, second]
    got = json.loads(results[-1][0])["meta_info"]
    assert got["weight_versions"] == json.loads(agg)["meta_info"]["weight_versions"]
    assert got["weight_versions"] == [{"version": "v1", "start": 0, "end": 1}, {"version": "v2", "start": 1, "end": 3}]
    assert results[-1][1] is Verdict.JOINED


def test_pd_weight_versions_of_legs_on_the_same_weights_pass_through_byte_for_byte():
    """The common case, also with an update while decode ran (``(v1, 2)`` recorded on decode after two
    tokens): token 0's version is decode's first span's, nothing changes."""
    for events in ([], [("v1", 2)]):
        agg = body(OUT, finish=STOP, config_version="v2" if events else "v1", events=events)
        decode = agg  # decode's body is the aggregated one: same spans, same version
        [(got, verdict)] = join(SGLangCodec(OPTIONS), [decode], [prefill_leg("v1")])
        assert got == agg and verdict is Verdict.PASSTHROUGH


@pytest.mark.parametrize("n", [1, 3])
def test_pd_weight_versions_without_a_prefill_leg_are_omitted_not_decodes_claim(n):
    """Without the prefill leg nothing says which weights sampled token 0: decode's spans are removed
    (the reason in their place). ``weight_version`` names the last token's weights: decode's own from
    the second token on, and for a one-token answer unknown too."""
    _, _, decode = legs_after_a_split_update(n)
    [(got, verdict)] = join(SGLangCodec(OPTIONS), [decode], None)
    meta = json.loads(got)["meta_info"]
    assert "weight_versions" not in meta and meta["weight_versions_unavailable_reason"] == "prefill_timeout"
    keys = list(meta)
    assert keys.index("weight_versions_unavailable_reason") == keys.index("cached_tokens") + 1  # in its place
    if n == 1:
        assert "weight_version" not in meta and meta["weight_version_unavailable_reason"] == "prefill_timeout"
        assert keys.index("weight_version_unavailable_reason") == keys.index("prompt_tokens") + 1
    else:
        assert meta["weight_version"] == "v2"
    assert verdict is Verdict.OMITTED


def test_pd_weight_versions_with_a_prefill_leg_that_has_none_are_omitted():
    """A prefill body without spans (a worker before 0.5.23) cannot vouch for token 0."""
    _, _, decode = legs_after_a_split_update(3)
    prefill = json.loads(prefill_leg("v1"))
    del prefill["meta_info"]["weight_versions"]
    [(got, verdict)] = join(SGLangCodec(OPTIONS), [decode], [dumps(prefill)])
    meta = json.loads(got)["meta_info"]
    assert "weight_versions" not in meta and meta["weight_versions_unavailable_reason"] == "prefill_missing"
    assert verdict is Verdict.OMITTED


@pytest.mark.parametrize("spans", [
    "v2", [], [{"version": "v2", "start": 1, "end": 3}], [{"version": 2, "start": 0, "end": 3}],
    [{"version": "v2", "start": 0, "end": 1}, {"version": "v3", "start": 2, "end": 3}],
])
def test_pd_decode_weight_versions_that_are_no_span_list_are_decode_corrupt(spans):
    _, prefill, decode = legs_after_a_split_update(3)
    doc = json.loads(decode)
    doc["meta_info"]["weight_versions"] = spans
    [(got, verdict)] = join(SGLangCodec(OPTIONS), [dumps(doc)], [prefill])
    meta = json.loads(got)["meta_info"]
    assert "weight_versions" not in meta and meta["weight_versions_unavailable_reason"] == "decode_corrupt"
    assert verdict is Verdict.OMITTED



def test_pd_decode_aborted_before_token_0_passes_its_zero_token_span_through():
    """A decode request aborted in its queues before the KV transfer committed token 0 (client gone)
    finishes with no output token: ``_make_abort_req`` computes its spans with ``len(req.output_ids)``
    0, and ``compute_weight_version_spans`` / ``add_weight_versions_to_meta_info`` write
    ``[{version: <current>, start: 0, end: 0}]`` (``visible`` keeps ``span.start == 0``), as the
    aggregated engine does for the same abort. No token is attributed to any weights, so there is
    nothing to join: the body is upstream's, not ``decode_corrupt``."""
    abort = {"type": "abort", "message": "Abort in waiting queue"}
    decode = body([], finish=abort, config_version="v2", events=[])
    assert json.loads(decode)["meta_info"]["weight_versions"] == [{"version": "v2", "start": 0, "end": 0}]
    [(got, verdict)] = join(SGLangCodec(OPTIONS), [decode], [prefill_leg("v1")])
    assert "weight_versions_unavailable_reason" not in json.loads(got)["meta_info"]
    assert got == decode and verdict is Verdict.PASSTHROUGH
