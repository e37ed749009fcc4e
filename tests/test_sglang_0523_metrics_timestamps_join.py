"""P/D bodies with SGLang 0.5.23's conditional ``meta_info`` keys join to the aggregated key order (timings: decode's).

Independent differential check written by hand from the SGLang 0.5.23 PyPI wheel
(``sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl``, paths relative to ``sglang/srt/``), not from the
simulator, ``streamproc_sglang.upstream`` or another test's fixtures. The server runs ``--enable-metrics``
and speculative decoding with ``--dp-size 2``; the request asks ``{"stream": true, "return_logprob": true,
"top_logprobs_num": 1, "token_ids_logprob": [7, 9], "return_routed_experts": true, "sampling_params": {"stream_interval": 2,
"max_new_tokens": 5}}``.

Where each conditional key is written, in order (``managers/tokenizer_manager.py``
``TokenizerManager._handle_batch_output``)::

    meta_info = {"id": rid, "finish_reason": ..., "prompt_tokens": ..., "weight_version": ...,
                 "num_retractions": recv_obj.retraction_counts[i]}
    if self.enable_metrics:
        if recv_obj.time_stats is not None:
            meta_info.update(scheduler_time_stats.convert_to_output_meta_info())   # every body
    ... convert_logprob_style ...  reasoning_tokens, completion_tokens, cached_tokens
    ... add_weight_versions_to_meta_info (finished) ... cached_tokens_details ... customized info ...
    ... image/audio/video_tokens ... hidden_states ... routed_experts ... indexer_topk
    if getattr(recv_obj, "dp_ranks", None):
        meta_info["dp_rank"] = recv_obj.dp_ranks[i]
    if state.finished:
        meta_info["e2e_latency"] = state.time_stats.get_e2e_latency()
        if get_spec().speculative_algorithm:
            self._calculate_spec_decoding_metrics(meta_info, recv_obj, i)   # spec_accept_rate, ...
        if self.enable_metrics:
            meta_info.update(state.time_stats.convert_to_output_meta_info(scheduler_time_stats,
                                                                          completion_tokens))

``observability/req_time_stats.py`` ``SchedulerReqTimeStats.convert_to_output_meta_info``: the storage waits
(once measured), ``forward_entry_time`` and ``prefill_finished_time`` when set (``> 0.0``), then
``queue_time``; a P/D decode never sets ``prefill_finished_time`` (its prebuilt batch sets
``decode_prebuilt_finish_time``). ``APIServerReqTimeStats.convert_to_output_meta_info``:
``request_received_ts``, ``first_token_latency``, ``api_server_dispatch_finish_ts``,
``response_sent_to_client_ts`` (only ``if self.response_sent_to_client_time > 0.0``), ``request_finished_ts``,
``decode_throughput`` (more than one token).

``TokenizerManager._stream_one_response`` (what ``_wait_one_response`` returns) stamps the first body it
yields, streamed or not, by appending the key last::

    if finished:
        if not state.time_stats.response_sent_to_client_time:
            state.time_stats.set_response_sent_to_client_time()
            out["meta_info"]["response_sent_to_client_ts"] = (
                state.time_stats.get_response_sent_to_client_realtime())
    ...
    if is_stream:
        if not state.time_stats.response_sent_to_client_time:
            ...same...

So a stream's first chunk ends with it, its finished body has it (first send's value) inside the
``--enable-metrics`` block, and a unary answer ends with it. With ``--incremental-streaming-output`` the chunks
queued behind the reader are merged first (``_coalesce_streaming_chunks``): ``output_ids`` and ``text``
concatenated, every ``_INCREMENTAL_STREAMING_META_INFO_KEYS`` list (``output_token_logprobs``,
``output_top_logprobs``, ``output_token_ids_logprobs``, the sampling-mask lists) concatenated over the
chunks' slices, every other key the last chunk's (``dict(meta_info_list[-1])``).

What the join must do (docs/codecs.md, "Timings"): the timings are decode's own measurements, passed through
unchanged (no aggregated engine ran the request); prefill's never reach a joined body; every key keeps the
aggregated engine's place, also where the join inserts ``routed_experts`` into a one-token decode body that
dropped it (SGLang #39146), which must land before ``dp_rank``/``e2e_latency``/the spec and metrics keys.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from helpers import assert_same_body
from helpers import drive_join as join
from helpers import upstream_json as dumps
from sglang_0523_bodies import add_counts, coalesced, pd_rows, rows_b64

from streamproc.codec import CodecOptions
from streamproc.wire import Verdict
from streamproc_sglang import SGLangCodec

CUMULATIVE = CodecOptions(max_decompressed_bytes=1 << 20, format_options=(("streaming", "cumulative"),))
INCREMENTAL = CodecOptions(max_decompressed_bytes=1 << 20)
RID = "5d0c2a7e9f3b41c6a8e2d4f6b1c3e5a7"
PROMPT = [11, 12, 13, 14]
OUT = [201, 202, 203, 204, 205]
TEXTS = {0: "", 1: "H", 3: "Hel", 4: "Hell", 5: "Hello"}
DRAFT_TOKENS = 4  # --speculative-num-draft-tokens

# Each worker's clock (``convert_time_to_realtime``: its own perf_counter offset). Values a test can tell apart.
CLOCKS = {
    "agg": {"base": 1765000000.0, "queue": 0.0125, "e2e": 0.75, "first": 0.25},
    "decode": {"base": 1765000100.0, "queue": 0.0039, "e2e": 0.8125, "first": 0.3125},
    "prefill": {"base": 1765000200.0, "queue": 0.0625, "e2e": 0.1875, "first": 0.1875},
}


def clock_values(side: str) -> set[float]:
    c = CLOCKS[side]
    return {c["base"] + d for d in (0.0, 0.001, 0.002, 0.003, 0.004, 0.5)} | {c["queue"], c["e2e"], c["first"]}


def entry(pos: int) -> list:
    return [-0.0625 * (pos + 1), OUT[pos], None]  # detokenize_logprob_tokens, decode_to_text False


def ids_row(pos: int, off: float) -> list:
    return [[-4.0 - pos - off, 7, None], [-6.0 - pos - off, 9, None]]  # token_ids_logprob [7, 9]


def rows(stale: bool) -> np.ndarray:
    return pd_rows(len(PROMPT), len(OUT), stale=stale)


def b64(r: np.ndarray, n: int) -> str:
    return rows_b64(r[:len(PROMPT) + n - 1])


def meta(n: int, finish: dict | None, *, side: str, clock: str, experts: str | None, sent: bool,
         lo: int = 0, verify: int = 0) -> dict[str, Any]:
    """``_handle_batch_output``'s ``meta_info`` after ``n`` tokens on ``side`` (``agg``, ``decode``,
    ``prefill``) measured on ``clock``'s worker; ``sent``: a body had been yielded before this one was built
    (its ``response_sent_to_client_time`` is set); ``lo``: the incremental slice start; ``verify``: the
    request's ``spec_verify_ct``."""
    c = CLOCKS[clock]
    decode = side == "decode"
    m: dict[str, Any] = {"id": RID, "finish_reason": finish, "prompt_tokens": len(PROMPT),
                         "weight_version": "default", "num_retractions": 0}
    # SchedulerReqTimeStats.convert_to_output_meta_info (every body)
    m["forward_entry_time"] = c["base"] + 0.001
    if not decode:
        m["prefill_finished_time"] = c["base"] + 0.002
    m["queue_time"] = c["queue"]
    # add_logprob_to_meta_info: pairs, the output ones sliced in incremental mode
    m["input_token_logprobs"] = [] if decode else [[None, PROMPT[0], None]] + [
        [-0.5 * p, t, None] for p, t in enumerate(PROMPT) if p]
    m["output_token_logprobs"] = [entry(p) for p in range(n)][lo:]
    m["output_token_logprobs_length"] = n
    m["input_top_logprobs"] = [] if decode else [None] + [[[-0.5 * p, PROMPT[p], None]] for p in range(1, 4)]
    m["output_top_logprobs"] = [[entry(p)] for p in range(n)][lo:]
    m["input_token_ids_logprobs"] = [] if decode else [None] + [ids_row(p, 0.5) for p in range(1, 4)]
    # DecodeTransferQueue._commit_transfer_to_req: "Prefill omits these scores; reserve a row for the
    # streaming offset." -> detokenize_top_logprobs_tokens sends the empty row as None.
    m["output_token_ids_logprobs"] = [None if decode and p == 0 else ids_row(p, 0.25) for p in range(n)][lo:]
    add_counts(m, n, finished=finish is not None, cached=2, cached_details={"device": 2, "host": 0})
    if experts is not None:
        m["routed_experts"] = experts
    m["dp_rank"] = 1
    if finish is not None:
        m["e2e_latency"] = c["e2e"]
        if verify:  # _calculate_spec_decoding_metrics
            proposed = verify * (DRAFT_TOKENS - 1)
            correct = n - 1 - verify  # each verify step accepts its bonus token plus its correct drafts
            m.update({"spec_accept_rate": correct / proposed, "spec_accept_length": n / verify,
                      "spec_num_correct_drafts": correct, "spec_num_proposed_drafts": proposed,
                      "spec_verify_ct": verify, "spec_correct_drafts_histogram": [0, verify, 0, 0]})
        # APIServerReqTimeStats.convert_to_output_meta_info
        m["request_received_ts"] = c["base"]
        m["first_token_latency"] = c["first"]
        m["api_server_dispatch_finish_ts"] = c["base"] + 0.003
        if sent:
            m["response_sent_to_client_ts"] = c["base"] + 0.004
        m["request_finished_ts"] = c["base"] + c["e2e"]
        if n > 1:
            m["decode_throughput"] = (n - 1) / (c["e2e"] - c["first"])
    return m


def out(n: int, finish: dict | None, *, side: str, clock: str, experts: str | None = None, first: bool,
        lo: int | None = None, verify: int = 0) -> dict[str, Any]:
    """One yielded body; ``first``: ``_stream_one_response`` stamps it (appended last); ``lo``: incremental."""
    m = meta(n, finish, side=side, clock=clock, experts=experts, sent=not first, lo=lo or 0, verify=verify)
    if lo is None:
        body = {"text": TEXTS[n], "output_ids": OUT[:n], "meta_info": m}
    else:
        body = {"text": TEXTS[n][len(TEXTS[lo]):], "output_ids": OUT[lo:n], "meta_info": m}
    if first:
        m["response_sent_to_client_ts"] = CLOCKS[clock]["base"] + 0.004
    return body


def prefill_leg() -> list[bytes]:
    """``process_batch_result_disagg_prefill``: one finished body for token 0 (``FINISH_LENGTH(0)``), the
    prompt's rows, prefill's own clock; its stream's first (so stamped) body."""
    return [dumps(out(1, {"type": "length", "length": 0}, side="prefill", clock="prefill",
                      experts=b64(rows(False)[:len(PROMPT)], 1), first=True))]


def assert_no_prefill_clock(bodies: list[bytes]) -> None:
    leaked = clock_values("prefill")
    for body in bodies:
        meta = json.loads(body)["meta_info"]
        assert not leaked & {v for v in meta.values() if isinstance(v, float)}


FIN = {"type": "length", "length": 5}


def stream(side: str, clock: str) -> list[bytes]:
    stale = side == "decode"
    return [dumps(out(1, None, side=side, clock=clock, first=True)),
            dumps(out(3, None, side=side, clock=clock, first=False)),
            dumps(out(5, FIN, side=side, clock=clock, experts=b64(rows(stale), 5), first=False, verify=2))]


def test_a_metrics_stream_joins_to_the_aggregated_key_order_with_decodes_own_timings():
    agg = stream("agg", "agg")
    dec = stream("decode", "decode")
    want = [json.loads(b) for b in stream("agg", "decode")]
    for body in want:
        del body["meta_info"]["prefill_finished_time"]
    out_ = join(SGLangCodec(CUMULATIVE), dec, prefill_leg())
    assert [v for _, v in out_] == [Verdict.JOINED] * 3
    for (got, _), w in zip(out_, want):
        assert_same_body(got, dumps(w))
        assert got == dumps(w)
    first = json.loads(out_[0][0])["meta_info"]
    assert list(first)[-1] == "response_sent_to_client_ts"  # still last on the first chunk
    assert first["response_sent_to_client_ts"] == CLOCKS["decode"]["base"] + 0.004
    assert_no_prefill_clock([b for b, _ in out_])
    # Apart from the timings, the joined stream is the aggregated one.
    for (got, _), a in zip(out_, agg):
        g, w = json.loads(got)["meta_info"], json.loads(a)["meta_info"]
        assert {k: v for k, v in g.items() if k not in TIMINGS} == {k: v for k, v in w.items() if k not in TIMINGS}


TIMINGS = {"forward_entry_time", "prefill_finished_time", "queue_time", "e2e_latency", "request_received_ts",
           "first_token_latency", "api_server_dispatch_finish_ts", "response_sent_to_client_ts",
           "request_finished_ts", "decode_throughput"}


@pytest.mark.parametrize("stream_", [True, False], ids=["stream", "unary"])
def test_a_one_token_decode_without_rows_gets_prefills_rows_before_dp_rank_and_the_finish_time_keys(stream_):
    """``max_new_tokens`` 1: decode's only body is finished and (SGLang #39146) may lack ``routed_experts``;
    the join inserts prefill's rows where the aggregated body has them, before ``dp_rank``, ``e2e_latency``,
    the ``--enable-metrics`` finish block and the ``response_sent_to_client_ts`` that
    ``_stream_one_response`` appended (the first and only body, streamed or unary)."""
    fin = {"type": "length", "length": 1}
    dec = dumps(out(1, fin, side="decode", clock="decode", experts=None, first=True))
    want = out(1, fin, side="agg", clock="decode", experts=b64(rows(False), 1), first=True)
    del want["meta_info"]["prefill_finished_time"]
    codec = SGLangCodec(CUMULATIVE)
    [(got, verdict)] = join(codec, [dec], prefill_leg())
    assert verdict is Verdict.JOINED
    assert_same_body(got, dumps(want))
    assert got == dumps(want)
    assert_no_prefill_clock([got])
    keys = list(json.loads(got)["meta_info"])
    assert keys.index("routed_experts") < keys.index("dp_rank") < keys.index("e2e_latency")
    assert keys[-1] == "response_sent_to_client_ts"


# ``Scheduler.abort_request`` on a running request: ``req.to_finish = FINISH_ABORT(abort_message, 503)``; the
# next step samples one more token and the request finishes like any finish (``_handle_batch_output``, rows
# collected by ``_maybe_collect_routed_experts``).
ABORT = {"type": "abort", "message": "Request running timeout reached.", "status_code": 503, "err_type": None}


@pytest.mark.parametrize("sent", [0, 1], ids=["nothing-sent-before", "token-0-sent-before"])
def test_an_incremental_stream_whose_abort_was_coalesced_with_queued_chunks_joins_to_the_aggregated_one(sent):
    """``--incremental-streaming-output``, a reader that fell behind: the chunks over ``[sent, 3)`` and the
    abort's finished body over ``[3, 4)`` are merged into one. Its output lists start at position ``sent``;
    with nothing sent before, they hold position 0 first (filled from prefill's leg there) and the merged
    body is the first yielded: ``_stream_one_response`` appends ``response_sent_to_client_ts`` last."""
    def leg(side: str, clock: str) -> list[bytes]:
        stale = side == "decode"
        chunks = [out(1, None, side=side, clock=clock, first=True, lo=0)] if sent else []
        queued = [out(1, None, side=side, clock=clock, first=False, lo=0)] if not sent else []
        queued += [out(3, None, side=side, clock=clock, first=False, lo=1),
                   out(4, ABORT, side=side, clock=clock, experts=b64(rows(stale), 4), first=False, lo=3,
                       verify=1)]
        merged = coalesced(queued)
        if not sent:
            # Nothing had been sent when the finished body was built (response_sent_to_client_time 0: no
            # stamp in the --enable-metrics block); the merged body is the first yielded, stamped last.
            m = merged["meta_info"]
            del m["response_sent_to_client_ts"]
            m["response_sent_to_client_ts"] = CLOCKS[clock]["base"] + 0.004
        return [dumps(b) for b in [*chunks, merged]]

    build = leg
    dec = build("decode", "decode")
    want = [json.loads(b) for b in build("agg", "decode")]
    for body in want:
        body["meta_info"].pop("prefill_finished_time", None)
    codec = SGLangCodec(INCREMENTAL)
    got = join(codec, dec, prefill_leg())
    assert got[-1][1] is Verdict.JOINED
    for (g, _), w in zip(got, want):
        assert_same_body(g, dumps(w))
        assert g == dumps(w)
    assert_no_prefill_clock([b for b, _ in got])
    last = json.loads(got[-1][0])["meta_info"]
    assert last["output_token_logprobs"][0] == entry(sent)
    assert last["output_token_ids_logprobs"][0] == ids_row(sent, 0.25)  # prefill's row at position 0
    agg = build("agg", "agg")
    assert codec.fold([b for b, _ in got]) == codec.fold([dumps(w) for w in want])
    assert json.loads(codec.fold(agg)) == {"object": "error", "message": ABORT["message"], "type": "503",
                                           "param": None, "code": 503}
