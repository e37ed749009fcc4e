"""A stream the SGLang scheduler aborts, with bodies written by hand from upstream SGLang code.

Nothing here uses the simulator or the codec's ``upstream.py`` builders. Upstream sources read
(sgl-project/sglang, stored snapshots):

* ``python/sglang/srt/managers/tokenizer_manager.py`` @ 001067ff, ``TokenizerManager._handle_abort_req``::

      meta_info = {"id": recv_obj.rid, "finish_reason": finish_reason,
                   "weight_version": ..., "e2e_latency": ...}
      if getattr(state.obj, "return_logprob", False):
          self.add_logprob_to_meta_info(meta_info, state, ...)   # the WHOLE lists, never sliced
      output_ids = state.output_ids
      meta_info["completion_tokens"] = len(output_ids)
      if is_stream:
          output_ids = [output_ids[-1]] if len(output_ids) > 0 else []
      out = {"text": state.get_text(), "output_ids": output_ids, "meta_info": meta_info}

  So in both streaming modes the abort body restates the whole text and output logprob lists,
  carries only the last token id (again) and no ``prompt_tokens`` (every ``_handle_batch_output``
  body has it). ``finish_reason`` is ``{"type": "abort", "message": ...}`` or the scheduler's
  ``FINISH_ABORT.to_json()`` (``{"type": "abort", "message", "status_code", "err_type"}``).
* same file, ``_wait_one_response``: cumulative mode yields ``out_list[-1]`` (chunks queued behind
  the abort are never sent); incremental mode coalesces queued chunks with
  ``_coalesce_streaming_chunks``: ``output_ids`` and ``text`` of every queued chunk concatenated,
  the ``_INCREMENTAL_STREAMING_META_INFO_KEYS`` lists concatenated, other keys from the last chunk.
* ``python/sglang/srt/managers/scheduler.py`` @ 0003215c, ``Scheduler.update_running_batch``: the
  requests ``retract_decode`` cannot keep get ``_make_abort_req(req, finished_reason=
  abort_reason.to_json())`` sent to the tokenizer: a running request, tokens already streamed.
  ``_abort_on_waiting_timeout`` / ``_abort_on_queued_limit`` do the same for the waiting queue,
  which holds retracted requests with their output.
"""

from __future__ import annotations

import base64
import gc
import json
import time
from typing import Any

import pytest
from helpers import assert_same_body, drive_stitch
from helpers import drive_join as join
from helpers import upstream_json as dumps
from sglang_0523_bodies import coalesced

from streamproc.codec import CodecOptions
from streamproc.wire import Verdict
from streamproc_sglang import SGLangCodec

OPTIONS = CodecOptions(max_decompressed_bytes=1 << 20)
RID = "req-1"
PROMPT_TOKENS = 4
OUT = [201, 202, 202, 203]  # a repeated token in the middle: only the counts tell a repeat from a token
TEXT = ["Hé", "llo", "llo", " 世"]
OUTPUT_LP = [[-0.125, 201, "Hé"], [-0.5, 202, "llo"], [-0.5, 202, "llo"], [-0.75, 203, " 世"]]
RETRACT_ABORT = {"type": "abort", "message": "retract: out of memory", "status_code": 503, "err_type": None}
# ``TokenizerManager._handle_abort_finish_reason`` (SGLang 0.5.23) makes a unary request whose abort has
# a ``status_code`` in [400, 600) raise (``HTTPException`` -> ``ErrorResponse``), so only an abort
# without one is answered unary with the abort body the fold must reproduce: ``_handle_abort_req``'s
# own reason when the scheduler's ``AbortReq`` carries none (``abort_request`` of a queued or retracted
# request), and ``FINISH_ABORT()`` (``abort_request`` of a running one, through ``to_finish``).
QUEUED_ABORT = {"type": "abort", "message": "Abort in waiting queue"}
RUNNING_ABORT = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
RETRACT_UNARY = b'{"object":"error","message":"retract: out of memory","type":"503","param":null,"code":503}'


def batch_chunk(lo: int, end: int, *, cumulative: bool) -> dict[str, Any]:
    """``_handle_batch_output`` (BatchStrOutput): one unfinished stream chunk covering ``[lo, end)``;
    cumulative chunks restate from 0 (text filled in by ``_wait_one_response``)."""
    start = 0 if cumulative else lo
    meta = {"id": RID, "finish_reason": None, "prompt_tokens": PROMPT_TOKENS, "weight_version": "default",
            "input_token_logprobs": [], "output_token_logprobs": OUTPUT_LP[start:end],
            "output_token_logprobs_length": end, "completion_tokens": end, "cached_tokens": 0}
    return {"text": "".join(TEXT[start:end]), "output_ids": OUT[start:end], "meta_info": meta}


def abort_body(seen: int, *, stream: bool, finish: dict[str, Any] = RETRACT_ABORT) -> dict[str, Any]:
    """``_handle_abort_req`` once the tokenizer holds ``seen`` tokens of the request."""
    meta = {"id": RID, "finish_reason": finish, "weight_version": "default", "e2e_latency": 0.5,
            "input_token_logprobs": [], "output_token_logprobs": OUTPUT_LP[:seen],
            "output_token_logprobs_length": seen, "completion_tokens": seen}
    ids = OUT[:seen]
    if stream:
        ids = [ids[-1]] if ids else []
    return {"text": "".join(TEXT[:seen]), "output_ids": ids, "meta_info": meta}


def fold(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    return json.loads(SGLangCodec(OPTIONS).fold([dumps(c) for c in chunks]))


def assert_unary(got: dict[str, Any], seen: int) -> None:
    """What the non-stream request aborted at the same point (without a status code) answers
    (``_handle_abort_req``, ``is_stream`` False): every token, the whole text and lists, the abort reason."""
    want = abort_body(seen, stream=False, finish=QUEUED_ABORT)
    assert got["output_ids"] == want["output_ids"]
    assert got["text"] == want["text"]
    for key in ("output_token_logprobs", "output_token_logprobs_length", "completion_tokens", "finish_reason"):
        assert got["meta_info"][key] == want["meta_info"][key], key


@pytest.mark.parametrize("cumulative", [False, True])
@pytest.mark.parametrize("seen", [1, 2, 3, 4])
def test_a_stream_the_scheduler_aborts_folds_to_what_the_unary_abort_answers(cumulative, seen):
    """Every chunk was sent before the abort: the abort body's id is the last one again. An abort
    with a status code (a retraction's 503) is answered unary with the error alone, not the body
    (this test pinned the partial body for it until 2026-12-05)."""
    chunks = [batch_chunk(k, k + 1, cumulative=cumulative) for k in range(seen)]
    assert_unary(fold([*chunks, abort_body(seen, stream=True, finish=QUEUED_ABORT)]), seen)
    raw = SGLangCodec(OPTIONS).fold([dumps(c) for c in [*chunks, abort_body(seen, stream=True)]])
    assert raw == RETRACT_UNARY


def test_an_abort_before_any_token_folds_to_no_tokens():
    got = fold([abort_body(0, stream=True, finish=QUEUED_ABORT)])
    assert got["output_ids"] == [] and got["text"] == ""
    assert got["meta_info"]["finish_reason"] == QUEUED_ABORT


@pytest.mark.parametrize("queued", [1, 2])
def test_an_incremental_abort_coalesced_with_queued_chunks_keeps_them_and_drops_the_repeat(queued):
    """``_wait_one_response`` coalesces the chunks queued behind the stream's last sent one with the
    abort body: their ids, then the last id again; their text, then the whole text again."""
    sent = 4 - queued
    chunks = [batch_chunk(k, k + 1, cumulative=False) for k in range(sent)]
    pending = [batch_chunk(k, k + 1, cumulative=False) for k in range(sent, 4)]
    assert_unary(fold([*chunks, coalesced([*pending, abort_body(4, stream=True, finish=QUEUED_ABORT)])]), 4)


def test_a_cumulative_abort_that_overtook_one_chunk_adds_its_token():
    """Cumulative mode yields ``out_list[-1]``: a chunk queued behind the abort is never sent, and the
    abort's one id is then the token the client has not seen."""
    chunks = [batch_chunk(0, k + 1, cumulative=True) for k in range(3)]
    assert_unary(fold([*chunks, abort_body(4, stream=True, finish=QUEUED_ABORT)]), 4)


def test_a_cumulative_abort_that_overtook_several_chunks_keeps_only_the_ids_it_can_place():
    """Two tokens were never sent as ids: the folded ids stop at what was seen (a known limit), the
    text and lists are the abort body's whole ones."""
    chunks = [batch_chunk(0, k + 1, cumulative=True) for k in range(2)]
    got = fold([*chunks, abort_body(4, stream=True, finish=QUEUED_ABORT)])
    assert got["output_ids"] == OUT[:2]
    assert got["text"] == "".join(TEXT)
    assert got["meta_info"]["output_token_logprobs"] == OUTPUT_LP


def test_an_abort_finish_in_a_batch_output_chunk_is_an_ordinary_delta():
    """A running request aborted through ``to_finish`` ends in ``_handle_batch_output`` (it has
    ``prompt_tokens``): its ids are new tokens, folded as any chunk."""
    chunks = [batch_chunk(k, k + 1, cumulative=False) for k in range(4)]
    chunks[-1]["meta_info"]["finish_reason"] = RUNNING_ABORT
    got = fold(chunks)
    assert got["output_ids"] == OUT and got["text"] == "".join(TEXT)


# ------------------------------------------------------------------------------------- P/D decode


def prefill_leg() -> dict[str, Any]:
    """The P/D prefill's body with ``return_routed_experts``: prompt rows, one token."""
    rows = bytes(range(1, 1 + PROMPT_TOKENS * 4 * 4))  # 4 prompt rows of 4 distinct int32 ids
    meta = {"id": RID, "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": PROMPT_TOKENS,
            "weight_version": "default", "input_token_logprobs": [[None, 101, None]] * PROMPT_TOKENS,
            "output_token_logprobs": OUTPUT_LP[:1], "output_token_logprobs_length": 1,
            "completion_tokens": 1, "cached_tokens": 0, "routed_experts": base64.b64encode(rows).decode()}
    return {"text": TEXT[0], "output_ids": OUT[:1], "meta_info": meta}


@pytest.mark.parametrize("prefill_aborted", [False, True])
@pytest.mark.parametrize("seen", [1, 3])
def test_a_decode_leg_the_scheduler_aborted_after_tokens_gets_no_experts_and_no_reason(seen, prefill_aborted):
    """``_handle_abort_req`` never writes ``routed_experts``, so the aggregated abort body has neither
    rows nor a marker, and so must the join: not prefill's rows (one token), nor ``decode_missing``,
    nor the ``decode_error`` (``prefill_error`` when prefill aborted too) it used to add. A running
    request aborted through ``to_finish`` (``Scheduler.abort_request``, "Abort method 3") does get
    rows, in both modes: its last step runs ``_handle_finish_state_updated_req``, which calls
    ``_maybe_collect_routed_experts`` once ``req.finished()``, and the body comes from
    ``_handle_batch_output`` with the field, joined as any. A failed decode body without the field
    comes from a path that writes none (``_handle_abort_req``; ``_handle_sampling_mask_abort``
    collects none either). (Before token 0: the next test.)"""
    body = abort_body(seen, stream=True)
    prefill = dumps(body) if prefill_aborted else dumps(prefill_leg())
    [(joined, verdict)] = join(SGLangCodec(OPTIONS), [dumps(body)], [prefill])
    meta = json.loads(joined)["meta_info"]
    assert "routed_experts" not in meta and "routed_experts_unavailable_reason" not in meta
    if not prefill_aborted:  # the prompt logprobs are prefill's; nothing else is omitted
        assert verdict is not Verdict.OMITTED
        assert {k: v for k, v in meta.items() if k != "input_token_logprobs"} == {
            k: v for k, v in body["meta_info"].items() if k != "input_token_logprobs"}


def test_a_decode_leg_aborted_through_to_finish_carries_rows_and_is_joined_as_any():
    """``Scheduler.abort_request`` on a running request sets ``req.to_finish = FINISH_ABORT()``: one
    more decode step, then ``update_finish_state`` finishes it and ``_handle_finish_state_updated_req``
    calls ``_maybe_collect_routed_experts`` (``batch_result_processor.py``), so the body
    (``_handle_batch_output``: it has ``prompt_tokens``) carries rows in both modes: prefill's prompt
    rows and decode's generated ones, as for any finish."""
    generated = bytes(range(100, 100 + 2 * 16))  # 2 rows of 4 int32 ids: output tokens 0 and 1
    body = batch_chunk(0, 3, cumulative=True)
    body["meta_info"]["finish_reason"] = RETRACT_ABORT
    body["meta_info"]["routed_experts"] = base64.b64encode(bytes(4 * 16) + generated).decode()  # prompt rows stale
    [(joined, verdict)] = join(SGLangCodec(OPTIONS), [dumps(body)], [dumps(prefill_leg())])
    meta = json.loads(joined)["meta_info"]
    prompt_rows = base64.b64decode(prefill_leg()["meta_info"]["routed_experts"])
    assert base64.b64decode(meta["routed_experts"]) == prompt_rows + generated
    assert "routed_experts_unavailable_reason" not in meta and verdict is Verdict.JOINED


@pytest.mark.parametrize("prefill_aborted", [False, True])
def test_a_decode_aborted_before_token_0_is_the_aggregated_abort_body_without_a_reason(prefill_aborted):
    """No engine has rows for a request that ended before output token 0: the scheduler collects them
    only when a request finishes after sampling a token (``BatchResultProcessor.
    _maybe_collect_routed_experts``, called in ``process_batch_result_prefill``/``_decode`` once
    ``req.finished()`` after ``output_ids.append``, and by the P/D prefill on a finished transfer),
    and ``_handle_abort_req`` writes none. So the aggregated abort before any token carries neither
    rows nor a marker, whatever the request asked, and so must the join (also when prefill aborted
    too, which used to read ``prefill_error``; a decode alone used to read ``decode_error``)."""
    body = dumps(abort_body(0, stream=True))
    prefill = body if prefill_aborted else dumps(prefill_leg())
    [(joined, verdict)] = join(SGLangCodec(OPTIONS), [body], [prefill])
    meta = json.loads(joined)["meta_info"]
    assert "routed_experts" not in meta and "routed_experts_unavailable_reason" not in meta
    assert json.loads(joined) == json.loads(body)
    assert verdict is not Verdict.OMITTED


def test_a_pd_stream_whose_decode_aborts_folds_to_the_unary_abort():
    decode = [batch_chunk(k, k + 1, cumulative=False) for k in range(3)]
    decode = [*decode, abort_body(3, stream=True, finish=QUEUED_ABORT)]
    joined = join(SGLangCodec(OPTIONS), [dumps(d) for d in decode], [dumps(prefill_leg())])
    got = json.loads(SGLangCodec(OPTIONS).fold([body for body, _ in joined]))
    assert_unary(got, 3)


# ------------------------------------------------------------------------------ after a migration
#
# ``migration.py`` stitches a resumed attempt's bodies into the original request's terms: counts + k,
# ``prompt_tokens`` - k; a cumulative stream's text, ids and lists get what the client saw in front.
# The attempt's own ``_handle_abort_req`` body restates the attempt's text and lists (its ``state``
# holds no more), so after the stitch they are the whole request's in a cumulative stream and only
# the attempt's tail in an incremental one.

K = 2  # tokens the first attempt published before its worker was lost


def attempt_chunk(lo: int, end: int, *, cumulative: bool) -> dict[str, Any]:
    """The resumed attempt's ``_handle_batch_output`` chunk over its own positions ``[lo, end)``
    (tokens ``K + lo`` .. of the request), in the attempt's terms (prompt + K, counts from 0)."""
    start = 0 if cumulative else lo
    meta = {"id": "req-2", "finish_reason": None, "prompt_tokens": PROMPT_TOKENS + K, "weight_version": "default",
            "input_token_logprobs": [], "output_token_logprobs": OUTPUT_LP[K + start:K + end],
            "output_token_logprobs_length": end, "completion_tokens": end, "cached_tokens": 0}
    return {"text": "".join(TEXT[K + start:K + end]), "output_ids": OUT[K + start:K + end], "meta_info": meta}


def attempt_abort(seen: int) -> dict[str, Any]:
    """``_handle_abort_req`` of the resumed attempt (stream) once it holds ``seen`` tokens of its own,
    aborted without a status code (the unary request answers this body)."""
    meta = {"id": "req-2", "finish_reason": QUEUED_ABORT, "weight_version": "default", "e2e_latency": 0.5,
            "input_token_logprobs": [], "output_token_logprobs": OUTPUT_LP[K:K + seen],
            "output_token_logprobs_length": seen, "completion_tokens": seen}
    ids = OUT[K:K + seen]
    return {"text": "".join(TEXT[K:K + seen]), "output_ids": ids[-1:], "meta_info": meta}


def migrated(first: list[dict[str, Any]], second: list[dict[str, Any]]) -> list[bytes]:
    """What the client was sent: the first attempt's bodies, then the resumed attempt's stitched."""
    return drive_stitch(SGLangCodec(OPTIONS), first, second)


def assert_lists_and_ids(got: dict[str, Any], seen: int) -> None:
    want = abort_body(seen, stream=False, finish=QUEUED_ABORT)
    assert got["output_ids"] == want["output_ids"]
    for key in ("output_token_logprobs", "output_token_logprobs_length", "completion_tokens"):
        assert got["meta_info"][key] == want["meta_info"][key], key


@pytest.mark.parametrize("cumulative", [False, True])
@pytest.mark.parametrize("resumed", [0, 1, 2])
def test_a_resumed_attempt_the_scheduler_aborts_folds_to_the_whole_request(cumulative, resumed):
    """The resumed attempt is aborted (in its new worker's waiting queue: ``resumed`` 0, or running)
    after every chunk was sent: the fold is the request's K + ``resumed`` tokens, text and lists, not
    the attempt's alone (incremental: the first attempt's text and lists were dropped) nor the
    client's ids again (cumulative: the stitch put them in front of the repeated last id)."""
    first = [batch_chunk(k, k + 1, cumulative=cumulative) for k in range(K)]
    second = [attempt_chunk(k, k + 1, cumulative=cumulative) for k in range(resumed)]
    got = json.loads(SGLangCodec(OPTIONS).fold(migrated(first, [*second, attempt_abort(resumed)])))
    assert_unary(got, K + resumed)


def test_a_resumed_incremental_attempt_aborted_with_chunks_coalesced_keeps_the_first_attempts_lists():
    """Coalesced chunks in front of the resumed attempt's abort body: the lists are the request's
    (the queued chunks' entries are counted by their ids)."""
    first = [batch_chunk(k, k + 1, cumulative=False) for k in range(K)]
    sent = [attempt_chunk(0, 1, cumulative=False)]
    queued = coalesced([attempt_chunk(1, 2, cumulative=False), attempt_abort(2)])
    assert_lists_and_ids(json.loads(SGLangCodec(OPTIONS).fold(migrated(first, [*sent, queued]))), K + 2)


# ---------------------------------------------------------------------------------- hostile bodies


def hostile_stream(pairs: int, *, doubled: bool) -> list[bytes]:
    """A worker's stream alternating an ordinary one-token delta with an abort-looking body that
    restates a tiny tail (``doubled``: one queued id in front of the repeat): each such body, if
    the fold copied or re-read what it accumulated, costs the whole text and lists so far."""
    bodies = []
    for i in range(pairs):
        count = 2 * i + 1
        bodies.append(dumps({"text": "word ", "output_ids": [7], "meta_info": {
            "prompt_tokens": 3, "completion_tokens": count, "output_token_logprobs": [[-0.5, 7, None]]}}))
        ids, count = ([7, 7], count + 1) if doubled else ([7], count)
        bodies.append(dumps({"text": "word " if not doubled else "w", "output_ids": ids, "meta_info": {
            "completion_tokens": count, "output_token_logprobs": [[-0.5, 7, None]],
            "finish_reason": {"type": "abort"}}}))
    return bodies


@pytest.mark.parametrize("doubled", [False, True])
def test_a_stream_of_abort_looking_bodies_folds_in_time_linear_in_its_size(doubled):
    """Folding 4x the bodies takes about 4x the time, not 16x: each abort body is compared with
    at most as much of the accumulated text and lists as it carries itself. When the fold joined
    the text or copied a list per such body, 40,000 pairs (12 MB, below --max-unary-bytes) took
    7.6 s (a tail restated) and 22 s (doubled) of the edge's CPU. Best of three each, with the
    cyclic GC off while timing: its full collections grow with the heap and made the ratio 5.8 on
    a quiet machine and 8.8 under CI's load (4.2-4.5 without them); the edge runs with collections
    made rare (cli.collect_rarely)."""
    def cost(pairs: int) -> float:
        bodies = hostile_stream(pairs, doubled=doubled)
        best = float("inf")
        for _ in range(3):
            gc.collect()
            gc.disable()
            try:
                started = time.process_time()
                SGLangCodec(OPTIONS).fold(bodies)
                best = min(best, time.process_time() - started)
            finally:
                gc.enable()
        return best

    small, large = cost(5_000), cost(20_000)
    assert large < 8 * small, (small, large)


# ------------------------------------- P/D decode, SGLang 0.5.23: an abort body coalesced with chunks
#
# SGLang 0.5.23 (PyPI wheel), read by hand:
# * ``disaggregation/decode.py`` ``DecodeTransferQueue._commit_transfer_to_req``: with
#   ``token_ids_logprob`` the decode request's ``output_token_ids_logprobs_val`` gets an empty row for
#   output token 0 ("Prefill omits these scores; reserve a row for the streaming offset"), which
#   ``TokenizerManager.detokenize_top_logprobs_tokens`` turns into ``None``.
# * ``scheduler.py`` ``Scheduler.abort_request``: a decode request in the prealloc queue's
#   ``retracted_queue`` is aborted with ``send_abort_output(_make_abort_req(decode_req), ...)``, after
#   tokens were streamed; ``_make_abort_req`` carries ``weight_versions``.
# * ``tokenizer_manager.py`` ``_handle_abort_req``: meta_info ``id``, ``finish_reason``,
#   ``weight_version``, ``e2e_latency``, then ``add_weight_versions_to_meta_info`` (``weight_versions``)
#   and ``add_logprob_to_meta_info`` (the WHOLE lists), ``completion_tokens``; incremental mode cuts
#   ``output_ids`` to ``[last]``. ``_wait_one_response`` coalesces it with the chunks still queued
#   (``_coalesce_streaming_chunks``: their slices, then the whole lists again), so output position 0
#   sits at index ``len(list) - output_token_logprobs_length`` of the coalesced lists, and also at 0
#   when nothing had been sent.
# * ``_handle_batch_output`` 0.5.23 (incremental): id, finish_reason, prompt_tokens, weight_version,
#   num_retractions, the logprob lists (output ones sliced by ``_slice_streaming_output_meta_info``),
#   reasoning_tokens, completion_tokens, cached_tokens, cached_tokens_details; the first body sent
#   gets ``response_sent_to_client_ts`` (``_stream_one_response``).

IDS_LP = [[[-3.0, 9, "x"], [-8.0, 42, "q"]], [[-1.0, 9, "x"], [-9.0, 42, "q"]],
          [[-2.0, 9, "x"], [-9.5, 42, "q"]], [[-2.5, 9, "x"], [-7.5, 42, "q"]]]
SPANS = [{"version": "default", "start": 0, "end": 1}]


def chunk_0523(lo: int, end: int, ids_lp: list[Any]) -> dict[str, Any]:
    """An unfinished incremental chunk of ``[lo, end)`` (``_handle_batch_output``, 0.5.23)."""
    meta = {"id": RID, "finish_reason": None, "prompt_tokens": PROMPT_TOKENS, "weight_version": "default",
            "num_retractions": 0, "input_token_logprobs": [], "output_token_logprobs": OUTPUT_LP[lo:end],
            "output_token_logprobs_length": end, "input_token_ids_logprobs": [],
            "output_token_ids_logprobs": ids_lp[lo:end], "reasoning_tokens": 0, "completion_tokens": end,
            "cached_tokens": 0, "cached_tokens_details": None}
    if lo == 0:
        meta["response_sent_to_client_ts"] = 1700000000.5
    return {"text": "".join(TEXT[lo:end]), "output_ids": OUT[lo:end], "meta_info": meta}


def abort_0523(seen: int, ids_lp: list[Any]) -> dict[str, Any]:
    """``_handle_abort_req`` (0.5.23, incremental stream) once the tokenizer holds ``seen`` tokens."""
    meta = {"id": RID, "finish_reason": RETRACT_ABORT, "weight_version": "default", "e2e_latency": 0.5,
            "weight_versions": [{"version": "default", "start": 0, "end": seen}],
            "input_token_logprobs": [], "output_token_logprobs": OUTPUT_LP[:seen],
            "output_token_logprobs_length": seen, "input_token_ids_logprobs": [],
            "output_token_ids_logprobs": ids_lp[:seen], "completion_tokens": seen}
    return {"text": "".join(TEXT[:seen]), "output_ids": OUT[seen - 1:seen], "meta_info": meta}


def prefill_0523() -> dict[str, Any]:
    """The P/D prefill's one body (``process_disagg_prefill_inflight_queue``: ``FINISH_LENGTH(0)``)."""
    meta = {"id": RID, "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": PROMPT_TOKENS,
            "weight_version": "default", "num_retractions": 0, "input_token_logprobs": [],
            "output_token_logprobs": OUTPUT_LP[:1], "output_token_logprobs_length": 1,
            "input_token_ids_logprobs": [], "output_token_ids_logprobs": IDS_LP[:1], "reasoning_tokens": 0,
            "completion_tokens": 1, "cached_tokens": 0, "weight_versions": SPANS,
            "cached_tokens_details": None, "e2e_latency": 0.125}
    return {"text": TEXT[0], "output_ids": OUT[:1], "meta_info": meta}


@pytest.mark.parametrize(("sent", "seen"), [(1, 2), (1, 3), (2, 4), (0, 2), (0, 1)])
def test_a_pd_abort_body_coalesced_with_queued_chunks_gets_prefills_token_ids_row_at_position_0(sent, seen):
    """The client got ``sent`` chunks of one token; the next ``seen - sent`` were queued when the abort
    arrived, and ``_wait_one_response`` coalesced them with it. Decode's restated list has its reserved
    ``null`` row where output position 0 is restated (and in the queued part too when nothing was
    sent); the aggregated engine's has the row. The joined stream must equal the aggregated one."""
    decode_ids = [None, *IDS_LP[1:]]

    def stream(ids_lp: list[Any]) -> list[dict[str, Any]]:
        chunks = [chunk_0523(k, k + 1, ids_lp) for k in range(sent)]
        queued = [chunk_0523(k, k + 1, ids_lp) for k in range(sent, seen)]
        return [*chunks, coalesced([*queued, abort_0523(seen, ids_lp)])]

    agg, decode = stream(IDS_LP), stream(decode_ids)
    results = join(SGLangCodec(OPTIONS), [dumps(d) for d in decode], [dumps(prefill_0523())])
    for (body, verdict), want in zip(results, agg):
        assert_same_body(body, dumps(want))
        assert verdict is not Verdict.OMITTED


@pytest.mark.parametrize(("sent", "seen"), [(1, 2), (2, 4), (0, 2)])
def test_a_pd_abort_body_coalesced_with_queued_chunks_gets_prefills_first_token_logprob(sent, seen):
    """Before SGLang 0.5.23 P/D decode had no logprob for output token 0 (``[null, id, text]``) and the
    join takes prefill's wherever the chunk holds position 0: in a coalesced abort body that is where
    the whole list is restated (and first too when nothing had been sent), not only at index 0."""
    def stream(first: list[Any]) -> list[dict[str, Any]]:
        chunks = [batch_chunk(k, k + 1, cumulative=False) for k in range(sent)]
        queued = [batch_chunk(k, k + 1, cumulative=False) for k in range(sent, seen)]
        bodies = [*chunks, coalesced([*queued, abort_body(seen, stream=True)])]
        for body in bodies:
            meta = body["meta_info"]
            meta["output_token_logprobs"] = [first if entry[1] == OUT[0] else entry
                                             for entry in meta["output_token_logprobs"]]
        return bodies

    agg, decode = stream(OUTPUT_LP[0]), stream([None, OUT[0], TEXT[0]])
    results = join(SGLangCodec(OPTIONS), [dumps(d) for d in decode], [dumps(prefill_leg())])
    for (body, _), want in zip(results, agg):
        got = json.loads(body)["meta_info"]
        assert got["output_token_logprobs"] == want["meta_info"]["output_token_logprobs"]
