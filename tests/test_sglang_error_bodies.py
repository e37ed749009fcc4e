"""SGLang 0.5.23's error bodies on a native ``/generate`` stream or unary answer, written by hand.

Nothing here uses the simulator or ``upstream.py``. Read from the SGLang 0.5.23 wheel (PyPI):

* ``entrypoints/http_server.py`` ``serve_generate_request`` (stream)::

      async def stream_results() -> AsyncIterator[bytes]:
          try:
              async for out in _global_state.tokenizer_manager.generate_request(obj, request):
                  yield b"data: " + dumps_json(out) + b"\\n\\n"
          except ValueError as e:
              if request is not None and await request.is_disconnected():
                  ...; return
              out = {"error": {"message": str(e), "type": "invalid_request_error",
                               "code": getattr(e, "status_code", 400), "retryable": False}}
              yield b"data: " + dumps_json(out) + b"\\n\\n"
          yield b"data: [DONE]\\n\\n"

  so a stream ends in that frame after the chunks already sent (``_stream_batch_responses``: one
  item's exception ends every item's stream). Unary: ``except ValueError as e: return
  _create_error_response(e)``, i.e. ``ORJSONResponse({"error": {"message": str(e)}}, status_code=400)``:
  the same failure answers the error alone, none of the output produced before it.
* ``generate_request``: ``ORJSONResponse(status_code=400, content={"error": contract_error})``, a string.
* ``@app.exception_handler(HTTPException)``: ``ErrorResponse(object="error", message=exc.detail,
  type=str(exc.status_code), code=exc.status_code).model_dump()``, raised for a unary request by
  ``TokenizerManager._handle_abort_finish_reason`` when an abort's ``status_code`` is not 400 (e.g.
  ``disaggregation/prefill.py``: ``prepare_abort(req, error_message,
  status_code=HTTPStatus.INTERNAL_SERVER_ERROR)`` when the KV transfer fails).
"""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from helpers import drive_join as join
from helpers import least_seconds
from helpers import upstream_json as dumps
from sglang_0523_bodies import TOO_LONG, stream_error_frame, unary_value_error

from streamproc.codec import CodecOptions, answer_status_of
from streamproc.wire import Verdict
from streamproc_sglang import SGLangCodec
from streamproc_sglang_zstd import SGLangZstdCodec

OPTIONS = CodecOptions(max_decompressed_bytes=1 << 20)
CODECS = [SGLangCodec, SGLangZstdCodec]
RID = "req-e"
PROMPT = 4
OUT = [301, 302, 303]
TEXT = ["A", "b", "c"]
OUTPUT_LP = [[-0.25, 301, None], [-0.5, 302, None], [-0.75, 303, None]]

# ``stream_results``' frame for ``raise ValueError("boom")``, and what the same request answers unary.
STREAM_ERROR = stream_error_frame("boom")
UNARY_ERROR = unary_value_error("boom")


def chunk(lo: int, end: int, *, cumulative: bool, index: int | None = None) -> dict[str, Any]:
    """``_handle_batch_output``: an unfinished stream chunk over ``[lo, end)`` (cumulative: from 0),
    as ``_wait_one_response`` yields it; ``_stream_batch_responses`` adds ``index`` last."""
    start = 0 if cumulative else lo
    meta = {"id": f"{RID}-{index or 0}", "finish_reason": None, "prompt_tokens": PROMPT,
            "weight_version": "default", "input_token_logprobs": [],
            "output_token_logprobs": OUTPUT_LP[start:end], "output_token_logprobs_length": end,
            "completion_tokens": end, "cached_tokens": 0}
    body = {"text": "".join(TEXT[start:end]), "output_ids": OUT[start:end], "meta_info": meta}
    if index is not None:
        body["index"] = index
    return body


def fold(codec, bodies: list[bytes]) -> bytes:
    return codec(OPTIONS).fold(bodies)


# ------------------------------------------------------------------------------ aggregated fold


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("cumulative", [False, True])
@pytest.mark.parametrize("sent", [1, 3])
def test_a_stream_that_ends_in_the_error_frame_folds_to_the_unary_error_body_not_to_a_partial_answer(
        codec, cumulative, sent):
    """The unary request that fails the same way answers the error alone (``_create_error_response``:
    ``{"error": {"message": str(e)}}``), never the tokens produced before it and not the stream's frame
    (``type``, ``code``, ``retryable`` are ``stream_results``' own). The fold used to return the partial
    output with an ``error`` key beside it, then (until 2026-12-06) the frame as sent."""
    bodies = [dumps(chunk(k, k + 1, cumulative=cumulative)) for k in range(sent)] + [dumps(STREAM_ERROR)]
    assert fold(codec, bodies) == dumps(UNARY_ERROR)


@pytest.mark.parametrize("codec", CODECS)
def test_a_streamed_batch_whose_stream_ends_in_the_error_frame_folds_to_the_unary_error_body(codec):
    """``_stream_batch_responses``: one item's exception ends the whole stream after the other items'
    chunks; unary, ``_collect_batch_responses``' ``asyncio.gather`` raises it and the batch answers
    ``_create_error_response`` alone (no list). The fold used to refuse the untagged frame (the edge's
    500), then answered the frame as sent."""
    bodies = [dumps(chunk(0, 1, cumulative=False, index=0)), dumps(chunk(0, 1, cumulative=False, index=1)),
              dumps(STREAM_ERROR)]
    assert fold(codec, bodies) == dumps(UNARY_ERROR)


@pytest.mark.parametrize("codec", CODECS)
def test_chunks_after_the_error_frame_are_refused_by_the_fold(codec):
    """``stream_results`` sends nothing but ``[DONE]`` after its error frame: output after it is no
    stream SGLang writes, and folding it would present that output as the answer."""
    bodies = [dumps(chunk(0, 1, cumulative=False)), dumps(STREAM_ERROR), dumps(chunk(1, 2, cumulative=False))]
    with pytest.raises(ValueError, match="error body"):
        fold(codec, bodies)


@pytest.mark.parametrize("codec", CODECS)
def test_a_stream_that_is_only_the_error_frame_folds_alone_to_the_unary_error_body(codec):
    """A ``ValueError`` before the first chunk (``_validate_one_request``: a prompt plus ``max_new_tokens``
    over the context length, ...), the common case: the edge serves a one-result stream verbatim unless
    ``folds_alone`` says otherwise, so it used to answer the frame. Unary, the same request answers
    ``{"error": {"message": ...}}`` byte for byte (orjson: compact, raw UTF-8)."""
    frame = dumps(stream_error_frame(TOO_LONG))
    assert codec(OPTIONS).folds_alone(frame)
    assert codec(OPTIONS).folds_alone(frame + b"\n")
    assert fold(codec, [frame]) == dumps(unary_value_error(TOO_LONG))
    assert fold(codec, [frame]) == b'{"error":{"message":"' + TOO_LONG.encode() + b'"}}'  # raw UTF-8


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("body", [
    unary_value_error("boom"),  # _create_error_response: already the unary answer
    {"error": "sampling_params: expected an object"},  # generate_request's contract check (unary only)
    {"object": "error", "message": "x", "type": "503", "param": None, "code": 503},  # HTTPException handler
    {"error": {"message": "not \"retryable\"", "type": "invalid_request_error"}},  # no frame of stream_results
])
def test_an_error_body_that_is_not_the_stream_frame_is_answered_as_sent(codec, body):
    """Only ``stream_results``' frame differs from its unary answer; SGLang's unary error bodies are
    already the answer (the edge serves one verbatim: ``folds_alone`` is False), and a shape SGLang does
    not write is not rewritten."""
    sent = dumps(body)
    assert not codec(OPTIONS).folds_alone(sent)
    assert fold(codec, [sent]) == sent
    assert fold(codec, [dumps(chunk(0, 1, cumulative=False)), sent]) == sent


# ------------------------------------------------------------------------------------------- P/D


def prefill_leg() -> dict[str, Any]:
    """The P/D prefill's body (0.5.23, ``return_routed_experts`` and ``return_logprob``): prompt rows,
    the first token, ``{"type": "length", "length": 0}``."""
    rows = bytes(range(1, 1 + PROMPT * 4 * 4))  # 4 prompt rows of 4 distinct int32 ids
    meta = {"id": RID, "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": PROMPT,
            "weight_version": "default", "input_token_logprobs": [[None, 101, None]] * PROMPT,
            "output_token_logprobs": OUTPUT_LP[:1], "output_token_logprobs_length": 1,
            "completion_tokens": 1, "cached_tokens": 0, "routed_experts": base64.b64encode(rows).decode()}
    return {"text": TEXT[0], "output_ids": OUT[:1], "meta_info": meta}


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("cumulative", [False, True])
@pytest.mark.parametrize("sent", [0, 2])
def test_a_pd_decode_stream_ending_in_the_error_frame_publishes_it_as_sent_and_folds_to_the_unary_error(
        codec, cumulative, sent):
    """The decode worker's frame is its answer, as the aggregated worker's would be: published byte for
    byte (passthrough) behind the joined chunks; the folded stream is the unary error body."""
    frame = dumps(STREAM_ERROR)
    decode = [dumps(chunk(k, k + 1, cumulative=cumulative)) for k in range(sent)] + [frame]
    joined = join(codec(OPTIONS), decode, [dumps(prefill_leg())])
    assert joined[-1] == (frame, Verdict.PASSTHROUGH)
    assert fold(codec, [body for body, _ in joined]) == dumps(UNARY_ERROR)


def decode_answer() -> dict[str, Any]:
    """The P/D decode's unary answer (``_handle_batch_output``, finished): its own copy of the prompt
    rows (stale) then its generated rows, no prompt logprobs (``[]``)."""
    rows = bytes(PROMPT * 16) + bytes(range(100, 100 + 2 * 16))
    meta = {"id": RID, "finish_reason": {"type": "length", "length": 3}, "prompt_tokens": PROMPT,
            "weight_version": "default", "input_token_logprobs": [], "output_token_logprobs": OUTPUT_LP,
            "output_token_logprobs_length": 3, "completion_tokens": 3, "cached_tokens": 0,
            "routed_experts": base64.b64encode(rows).decode()}
    return {"text": "".join(TEXT), "output_ids": OUT, "meta_info": meta}


# Every body a failed SGLang 0.5.23 prefill leg answers with instead of a generation body.
PREFILL_ERRORS = {
    "stream_frame": STREAM_ERROR,  # stream_results, a ValueError
    "value_error": {"error": {"message": "boom"}},  # _create_error_response
    "contract": {"error": "sampling_params: expected an object"},  # generate_request's contract check
    # validation_exception_handler (HTTPException): _handle_abort_finish_reason for an abort whose
    # status_code is not 400, e.g. prefill.py's KV transfer failure (INTERNAL_SERVER_ERROR).
    "http_exception": {"object": "error", "message": "KV transfer failed", "type": "500", "param": None,
                       "code": 500},
}


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("shape", sorted(PREFILL_ERRORS))
def test_a_prefill_leg_that_answered_an_error_body_is_prefill_error_never_corrupt(codec, shape):
    """No prefill value exists: decode's stale prompt rows and empty prompt logprobs are removed, each
    with ``prefill_error`` (the leg failed), not ``prefill_corrupt`` (an unreadable leg), which
    SGLang's HTTPException body (``{"object": "error", ...}``, no ``error`` key) used to read as."""
    [(joined, verdict)] = join(codec(OPTIONS), [dumps(decode_answer())], [dumps(PREFILL_ERRORS[shape])])
    meta = json.loads(joined)["meta_info"]
    assert verdict is Verdict.OMITTED
    assert "routed_experts" not in meta and "input_token_logprobs" not in meta
    assert meta["routed_experts_unavailable_reason"] == "prefill_error"
    assert meta["input_logprobs_unavailable_reason"] == "prefill_error"


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("shape", sorted(PREFILL_ERRORS))
def test_a_pd_decode_that_answered_an_error_body_publishes_it_as_sent(codec, shape):
    """The decode worker's unary error (e.g. its own KV transfer failure, ``prepare_abort(...,
    status_code=HTTPStatus.INTERNAL_SERVER_ERROR)`` in ``disaggregation/decode.py``) is what the
    aggregated worker would answer for the same failure: byte for byte, whatever prefill sent."""
    body = dumps(PREFILL_ERRORS[shape])
    for prefill in ([dumps(prefill_leg())], [body], None):
        assert join(codec(OPTIONS), [body], prefill) == [(body, Verdict.PASSTHROUGH)]


@pytest.mark.parametrize("codec", CODECS)
def test_a_unary_batch_against_a_failed_prefill_batch_omits_each_items_rows_as_prefill_error(codec):
    """A P/D batch (mini_lb sends it to both servers) whose prefill answered one error body for the
    whole batch (``_collect_batch_responses``: ``asyncio.gather`` raises the first item's
    exception): each decode item has no prefill value."""
    batch = dumps([decode_answer(), decode_answer()])
    [(joined, verdict)] = join(codec(OPTIONS), [batch], [dumps(PREFILL_ERRORS["http_exception"])])
    assert verdict is Verdict.OMITTED
    for item in json.loads(joined):
        assert "routed_experts" not in item["meta_info"]
        assert item["meta_info"]["routed_experts_unavailable_reason"] == "prefill_error"


@pytest.mark.parametrize("codec", CODECS)
def test_a_pd_streamed_batch_ending_in_the_error_frame_publishes_it_as_sent_and_folds_to_the_unary_error(codec):
    """The decode's streamed batch (items tagged ``index``) ends in ``stream_results``' frame: the
    items' chunks are joined with prefill's chunks of the same index, the frame (no index, no
    ``meta_info``) is published byte for byte, and the fold is the unary error body."""
    frame = dumps(STREAM_ERROR)
    prefill = [dumps({**prefill_leg(), "index": k}) for k in range(2)]
    decode = [dumps(chunk(0, 1, cumulative=False, index=k)) for k in range(2)] + [frame]
    joined = join(codec(OPTIONS), decode, prefill)
    assert [verdict for _, verdict in joined] == [Verdict.JOINED, Verdict.JOINED, Verdict.PASSTHROUGH]
    assert joined[-1][0] == frame
    assert fold(codec, [body for body, _ in joined]) == dumps(UNARY_ERROR)


# ------------------------------------------------------------------ aborts that carry an HTTP status
#
# SGLang 0.5.23, ``tokenizer_manager.py`` ``TokenizerManager._handle_abort_finish_reason``, called by
# ``_stream_one_response`` on a finished body whose ``finish_reason`` is a dict::
#
#     status_code = finish_reason.get("status_code")
#     if (finish_reason.get("type") != "abort" or status_code is None
#             or not HTTPStatus.BAD_REQUEST <= status_code < 600):
#         return None                       # the body is yielded as any other
#     ...
#     if not is_stream:
#         if status_code == HTTPStatus.BAD_REQUEST:
#             raise ValueError(finish_reason["message"])
#         raise fastapi.HTTPException(status_code=status_code, detail=finish_reason["message"])
#     return out                            # a stream yields the abort body, then stops
#
# The ValueError is answered by ``serve_generate_request``' ``_create_error_response(e)``
# (``ORJSONResponse({"error": {"message": str(e)}}, ...)``), the HTTPException by
# ``@app.exception_handler(HTTPException)``: ``ORJSONResponse(content=ErrorResponse(object="error",
# message=exc.detail, type=str(exc.status_code), code=exc.status_code).model_dump())``
# (``ErrorResponse`` fields ``object, message, type, param = None, code``). fastapi's
# ``ORJSONResponse.render`` is ``orjson.dumps(content, option=OPT_NON_STR_KEYS | OPT_SERIALIZE_NUMPY)``:
# compact, raw UTF-8. A batch (``_collect_batch_responses``: ``asyncio.gather``) answers the first
# item's exception. The expected bodies below are written out by hand.
#
# The aborts (``FINISH_ABORT.to_json()`` is ``{"type", "message", "status_code", "err_type"}``; the
# scheduler's own dicts are ``{"type", "status_code", "message"}``):
RETRACTED = {"type": "abort",  # schedule_batch.py retract_decode, no KV backup
             "message": "Retracted under decode memory pressure without a KV backup. Retry later.",
             "status_code": 503, "err_type": None}
WAITING_TIMEOUT = {"type": "abort", "status_code": 503,  # scheduler.py _poll_timeout_aborts
                   "message": "Request waiting timeout reached."}
HANDSHAKE = {"type": "abort",  # disaggregation/decode.py, KVPoll.Failed (prepare_abort, 500)
             "message": "Decode handshake failed for request rank=0 decode_req.req.rid='req-e' "
                        "decode_req.req.bootstrap_room=7",
             "status_code": 500, "err_type": None}
REJECTED = {"type": "abort",  # disaggregation/decode.py, preallocation refused (prepare_abort, 400)
            "message": "Request req-e requires too many SWA KV tokens for decode preallocation: 9 > 8",
            "status_code": 400, "err_type": None}
QUOTED = {"type": "abort", "message": 'bad "x" \\ é\n', "status_code": 503, "err_type": None}

RETRACTED_UNARY = (b'{"object":"error","message":"Retracted under decode memory pressure without a KV '
                   b'backup. Retry later.","type":"503","param":null,"code":503}')
WAITING_TIMEOUT_UNARY = (b'{"object":"error","message":"Request waiting timeout reached.","type":"503",'
                         b'"param":null,"code":503}')
HANDSHAKE_UNARY = (b'{"object":"error","message":"Decode handshake failed for request rank=0 '
                   b"decode_req.req.rid='req-e' decode_req.req.bootstrap_room=7\",\"type\":\"500\","
                   b'"param":null,"code":500}')
REJECTED_UNARY = (b'{"error":{"message":"Request req-e requires too many SWA KV tokens for decode '
                  b'preallocation: 9 > 8"}}')
QUOTED_UNARY = (b'{"object":"error","message":"bad \\"x\\" \\\\ \xc3\xa9\\n","type":"503","param":null,'
                b'"code":503}')
UNARY_ERRORS = {
    "retracted": (RETRACTED, RETRACTED_UNARY),
    "waiting_timeout": (WAITING_TIMEOUT, WAITING_TIMEOUT_UNARY),
    "handshake": (HANDSHAKE, HANDSHAKE_UNARY),
    "rejected": (REJECTED, REJECTED_UNARY),
    "quoted": (QUOTED, QUOTED_UNARY),
}

# Aborts a unary request answers with the abort body (``_handle_abort_finish_reason`` returns None).
BODY_ABORTS = {
    "waiting_queue": {"type": "abort", "message": "Abort in waiting queue"},  # _handle_abort_req's own
    "abort_request": {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None},
    "status_399": {"type": "abort", "message": "x", "status_code": 399, "err_type": None},
    "status_600": {"type": "abort", "message": "x", "status_code": 600, "err_type": None},
}


def abort_req_body(seen: int, finish: dict[str, Any], *, index: int | None = None) -> dict[str, Any]:
    """``_handle_abort_req`` (stream, incremental) once the tokenizer holds ``seen`` tokens: the whole
    text and lists, the last id again, no ``prompt_tokens``."""
    meta = {"id": f"{RID}-{index or 0}", "finish_reason": finish, "weight_version": "default",
            "e2e_latency": 0.5, "input_token_logprobs": [], "output_token_logprobs": OUTPUT_LP[:seen],
            "output_token_logprobs_length": seen, "completion_tokens": seen}
    body = {"text": "".join(TEXT[:seen]), "output_ids": OUT[seen - 1:seen] if seen else [], "meta_info": meta}
    if index is not None:
        body["index"] = index
    return body


def finished_chunk(lo: int, end: int, finish: dict[str, Any], *, index: int | None = None) -> dict[str, Any]:
    """``_handle_batch_output``'s last chunk of a request aborted through ``to_finish``/``prepare_abort``."""
    body = chunk(lo, end, cumulative=False, index=index)
    body["meta_info"]["finish_reason"] = finish
    return body


def aborted_stream(shape: str, sent: int, finish: dict[str, Any]) -> list[bytes]:
    chunks = [chunk(k, k + 1, cumulative=False) for k in range(sent)]
    last = abort_req_body(sent, finish) if shape == "abort_req" else finished_chunk(sent, sent, finish)
    return [dumps(c) for c in [*chunks, last]]


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("shape", ["abort_req", "batch_output"])
@pytest.mark.parametrize("sent", [0, 2])
@pytest.mark.parametrize("abort", sorted(UNARY_ERRORS))
def test_a_stream_aborted_with_an_http_status_folds_to_the_error_the_unary_request_answers(codec, shape, sent,
                                                                                           abort):
    """Not the output produced before the abort with the abort's finish reason, which is what the fold
    answered: the unary request never sees that output."""
    finish, want = UNARY_ERRORS[abort]
    assert fold(codec, aborted_stream(shape, sent, finish)) == want


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("abort", sorted(UNARY_ERRORS))
def test_a_stream_that_is_only_an_abort_with_an_http_status_asks_to_be_folded(codec, abort):
    """An abort before any token (a waiting timeout, a failed handshake, an intake rejection) is the
    stream's only chunk: the edge serves such a result verbatim unless ``folds_alone`` says the fold
    decides."""
    [body] = aborted_stream("abort_req", 0, UNARY_ERRORS[abort][0])
    assert codec(OPTIONS).folds_alone(body)
    assert fold(codec, [body]) == UNARY_ERRORS[abort][1]


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("shape", ["abort_req", "batch_output"])
@pytest.mark.parametrize("abort", sorted(BODY_ABORTS))
def test_a_stream_aborted_without_an_http_status_still_folds_to_the_partial_answer(codec, shape, abort):
    """``_handle_abort_finish_reason`` returns None: the unary request answers the abort body, the
    tokens so far with the abort's finish reason."""
    finish = BODY_ABORTS[abort]
    got = json.loads(fold(codec, aborted_stream(shape, 2, finish)))
    assert got["output_ids"] == OUT[:2] and got["text"] == "".join(TEXT[:2])
    assert got["meta_info"]["finish_reason"] == finish
    [alone] = aborted_stream("abort_req", 0, finish)
    assert fold(codec, [alone]) == alone  # a stream of one such chunk: the body as sent


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("aborted", [0, 1])
def test_a_streamed_batch_with_an_item_aborted_with_an_http_status_folds_to_that_error(codec, aborted):
    """Unary, ``asyncio.gather`` raises the item's exception and the batch answers it alone (no list),
    whatever the other items produced."""
    finish, want = UNARY_ERRORS["retracted"]
    other = 1 - aborted
    bodies = [chunk(0, 1, cumulative=False, index=0), chunk(0, 1, cumulative=False, index=1),
              finished_chunk(1, 2, finish, index=aborted),
              finished_chunk(1, 3, {"type": "length", "length": 3}, index=other)]
    assert fold(codec, [dumps(b) for b in bodies]) == want


@pytest.mark.parametrize("codec", CODECS)
def test_a_streamed_batch_with_two_items_aborted_with_a_status_folds_to_the_first_one_sent(codec):
    """``asyncio.gather`` raises the exception raised first; ``_stream_batch_responses`` sends each
    item's chunks as they come, so the first such abort in the stream."""
    bodies = [abort_req_body(0, REJECTED, index=1), abort_req_body(0, RETRACTED, index=0)]
    assert fold(codec, [dumps(b) for b in bodies]) == UNARY_ERRORS["rejected"][1]


@pytest.mark.parametrize("codec", CODECS)
def test_a_streamed_batch_with_an_item_aborted_without_a_status_folds_to_the_list(codec):
    finish = BODY_ABORTS["waiting_queue"]
    bodies = [chunk(0, 1, cumulative=False, index=0), abort_req_body(0, finish, index=1),
              finished_chunk(1, 2, {"type": "length", "length": 2}, index=0)]
    got = json.loads(fold(codec, [dumps(b) for b in bodies]))
    assert [item["meta_info"]["finish_reason"] for item in got] == [{"type": "length", "length": 2}, finish]


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("index", [None, 1])
def test_a_chunk_after_its_items_abort_with_a_status_is_refused_by_the_fold(codec, index):
    """``_stream_one_response`` stops after the abort body (``yield abort_out; break``)."""
    bodies = [abort_req_body(0, RETRACTED, index=index), chunk(0, 1, cumulative=False, index=index)]
    with pytest.raises(ValueError, match="follows its item's abort"):
        fold(codec, [dumps(b) for b in bodies])


@pytest.mark.parametrize("codec", CODECS)
def test_an_abort_with_a_status_and_no_string_message_is_refused_by_the_fold(codec):
    """SGLang always writes one (``FINISH_ABORT``: ``message or "Aborted"``); without it there is no
    error body to answer."""
    body = abort_req_body(0, {"type": "abort", "message": None, "status_code": 503})
    with pytest.raises(ValueError, match="no string message"):
        fold(codec, [dumps(body)])


@pytest.mark.parametrize("codec", CODECS)
def test_a_pd_stream_whose_decode_handshake_failed_folds_to_the_unary_error(codec):
    """P/D decode's failed KV handshake (``prepare_abort(..., status_code=500)``, body from
    ``_handle_batch_output``, before token 0): joined with prefill's leg, published and folded to the
    error the decode server answers a unary request with."""
    decode = [dumps(finished_chunk(0, 0, HANDSHAKE))]
    joined = join(codec(OPTIONS), decode, [dumps(prefill_leg())])
    assert fold(codec, [body for body, _ in joined]) == UNARY_ERRORS["handshake"][1]


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("abort", sorted(BODY_ABORTS))
def test_a_stream_that_is_only_an_abort_without_an_http_status_is_not_sent_to_the_fold(codec, abort):
    """Its unary answer is the body as sent, so the edge needs no ``fold`` for it; ``fold`` parses the
    whole body (a 64 MiB one with ``routed_experts``: ~75 ms holding the GIL, the edge's event loop
    with it, for the bytes it had). Every abort names ``"type":"abort"`` near the front, the client's
    and the tokenizer's own among them, so ``"abort"`` alone does not ask for the fold."""
    [body] = aborted_stream("abort_req", 0, BODY_ABORTS[abort])
    assert not codec(OPTIONS).folds_alone(body)
    rows = base64.b64encode(bytes(3 << 20)).decode()  # the prompt's rows behind the finish reason
    doc = abort_req_body(0, BODY_ABORTS[abort])
    doc["meta_info"]["routed_experts"] = rows
    assert not codec(OPTIONS).folds_alone(dumps(doc))


@pytest.mark.parametrize("codec", CODECS)
def test_an_honest_body_that_says_abort_is_not_sent_to_the_fold(codec):
    """A finished body whose text is the word ``abort`` (or whose ``status_code`` is nothing's)."""
    done = finished_chunk(0, 1, {"type": "stop", "matched": 2})
    done["text"] = "abort"
    assert not codec(OPTIONS).folds_alone(dumps(done))
    assert not codec(OPTIONS).folds_alone(b'{"text":"abort","meta_info":{"status_code":"503"}}')


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("separator", [b":", b": ", b" : ", b":\n  "])
def test_an_abort_with_an_http_status_asks_to_be_folded_however_its_json_is_spaced(codec, separator):
    """orjson writes ``"status_code":503``; a body re-encoded on its way (``json.dumps``: ``": "``)
    still names its status."""
    [body] = aborted_stream("abort_req", 0, RETRACTED)
    spaced = body.replace(b'"status_code":', b'"status_code"' + separator)
    assert codec(OPTIONS).folds_alone(spaced)
    assert json.loads(fold(codec, [spaced])) == json.loads(RETRACTED_UNARY)


# A client's rid is any string, and the failed handshake's message repeats it: with a 5,000-character rid
# the finish reason's status stands past the first 4 KiB (``meta_info.id`` and the message in front).
LONG_RID = "r" * 5000
LONG_HANDSHAKE = {"type": "abort", "message": f"Decode handshake failed for request rank=0 "
                  f"decode_req.req.rid='{LONG_RID}' decode_req.req.bootstrap_room=7",
                  "status_code": 500, "err_type": None}


def long_abort(front: str) -> dict[str, Any]:
    """A stream's only chunk, an abort with a status, with more than 4 KiB in front of its status:
    ``long_rid`` (the rid and the handshake message repeating it) or ``long_text`` (``_handle_abort_req``
    writes the whole text, 6,000 characters of it, behind which ``meta_info`` comes)."""
    if front == "long_rid":
        body = abort_req_body(0, LONG_HANDSHAKE)
        body["meta_info"]["id"] = LONG_RID
        return body
    body = abort_req_body(1, RETRACTED)
    body["text"] = "x" * 6000
    return body


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("front", ["long_rid", "long_text"])
def test_an_abort_with_a_status_past_the_first_4_kib_is_found_from_the_end_and_folded(codec, front):
    """Its finish reason is followed by a few hundred bytes of ``meta_info``. It was served as sent with
    200 (the status looked for in the first 4 KiB only); the same request unary answers the error."""
    doc = long_abort(front)
    body = dumps(doc)
    finish = doc["meta_info"]["finish_reason"]
    assert body.index(b'"status_code"') > 4096
    assert codec(OPTIONS).folds_alone(body)
    folded = fold(codec, [body])
    status = finish["status_code"]
    assert json.loads(folded) == {"object": "error", "message": finish["message"], "type": str(status),
                                  "param": None, "code": status}
    assert answer_status_of(codec(OPTIONS), folded) == status


# A running request aborted with a status, its generation long and its logprobs asked for. SGLang 0.5.23,
# ``Scheduler._poll_timeout_aborts`` sends ``AbortReq(rid, abort_message="Request running timeout
# reached.", ...)`` for an inflight request past its deadline; ``Scheduler.abort_request`` ("Abort method
# 3") sets ``req.to_finish = FINISH_ABORT(recv_req.abort_message, HTTPStatus.SERVICE_UNAVAILABLE)``, the
# request runs one more step and finishes with it; the output streamer writes
# ``req.finished_reason.to_json()`` (``FINISH_ABORT.to_json``: ``type, message, status_code, err_type``)
# and ``TokenizerManager._handle_batch_output`` builds ``meta_info = {"id", "finish_reason",
# "prompt_tokens", "weight_version", "num_retractions"}``, then the logprobs (``convert_logprob_style``),
# ``reasoning_tokens``, ``completion_tokens``, ``cached_tokens``; the body is ``{"text", "output_ids",
# "meta_info"}`` (cumulative: the whole text and ids) plus ``prompt_token_ids`` with
# ``return_prompt_token_ids``. A stream whose consumer fell behind gets it as its only chunk
# (``_wait_one_response`` yields ``out_list[-1]`` cumulative, ``_coalesce_streaming_chunks`` joins the
# queued ones incremental). Unary, ``_handle_abort_finish_reason`` raises ``HTTPException(503, ...)``.
RUNNING_TIMEOUT = {"type": "abort", "message": "Request running timeout reached.", "status_code": 503,
                   "err_type": None}
RUNNING_TIMEOUT_UNARY = (b'{"object":"error","message":"Request running timeout reached.","type":"503",'
                         b'"param":null,"code":503}')
LONG = 2000  # output tokens: ~6 KiB of text and 10 KiB of ids in front of the finish reason


def running_timeout_abort(behind: str) -> dict[str, Any]:
    """The body above, built by hand from the functions it names (no simulator, no ``upstream.py``)."""
    out = [1000 + k for k in range(LONG)]
    meta: dict[str, Any] = {"id": RID, "finish_reason": RUNNING_TIMEOUT, "prompt_tokens": PROMPT,
                            "weight_version": "default", "num_retractions": 0}
    if behind == "logprobs":
        meta["input_token_logprobs"] = [[None, 1, None]] + [[-0.5, 2 + k, None] for k in range(PROMPT - 1)]
        meta["output_token_logprobs"] = [[-0.25, t, None] for t in out]
        meta["output_token_logprobs_length"] = LONG
    meta.update({"reasoning_tokens": 0, "completion_tokens": LONG, "cached_tokens": 0})
    body: dict[str, Any] = {"text": "word " * LONG, "output_ids": out, "meta_info": meta}
    if behind == "prompt_token_ids":
        body["prompt_token_ids"] = list(range(100000, 101500))
    return body


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("behind", ["logprobs", "prompt_token_ids"])
def test_an_abort_with_a_status_and_kilobytes_on_both_sides_of_it_is_answered_with_its_status(codec, behind):
    """More than 4 KiB of text and ids in front of the finish reason and more than 4 KiB of logprobs or
    prompt ids behind it: it was served as sent with 200 (the status looked for in the first and the
    last 4 KiB only); the same request unary answers the error, with its status."""
    body = dumps(running_timeout_abort(behind))
    at = body.index(b'"status_code"')
    assert at > 4096 and len(body) - at > 4096
    c = codec(OPTIONS)
    assert c.folds_alone(body)
    folded = fold(codec, [body])
    assert folded == RUNNING_TIMEOUT_UNARY
    assert answer_status_of(c, folded) == 503


LURES = {  # fragments a hostile worker may fill a body with
    "plain": b"A",
    "lures": b'"abort","status_code":500,',
    "escaped": b'\\"finish_reason\\":{\\"type\\":\\"abort\\",\\"status_code\\":500},',  # inside a string
    "finish_keys": b'"finish_reason":{"type":"abort","message":"',
}


def hostile(size: int, filler: bytes, middle: bytes = b"") -> bytes:
    """A body of about ``size`` bytes: ``{"text":"`` and ``filler`` repeated, ``middle`` halfway."""
    half = filler * (size // 2 // len(filler))
    return b'{"text":"' + half + middle + half + b'"}'


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("filler", sorted(LURES))
def test_a_hostile_64_mib_body_costs_a_linear_look_and_is_not_sent_to_the_fold(codec, filler):
    """The look runs on the edge's event loop for every unary answer of one result: a 64 MiB body full
    of ``"abort"``, ``"status_code":500`` or ``"finish_reason"`` fragments, bare or escaped in a string,
    costs one byte search of it (~20-35 ms measured, under 2 ms a MiB asserted) and is answered as sent:
    no finish reason in it is an abort with a status."""
    c = codec(OPTIONS)
    big = hostile(64 << 20, LURES[filler])
    assert not c.folds_alone(big)
    spent = least_seconds(lambda: c.folds_alone(big))
    assert spent < 2e-3 * (len(big) >> 20), f"{spent * 1e3:.1f} ms for a {len(big) >> 20} MiB body"


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("filler", ["plain", "escaped"])
def test_an_abort_with_a_status_halfway_through_a_long_body_is_found(codec, filler):
    """No window: a finish reason that is an abort with a status is found wherever it stands, escaped
    lures around it notwithstanding."""
    middle = b'","meta_info":{"id":"r","finish_reason":{"type":"abort","message":"m","status_code":503},"x":"'
    assert codec(OPTIONS).folds_alone(hostile(8 << 20, LURES[filler], middle))
    assert not codec(OPTIONS).folds_alone(hostile(8 << 20, LURES[filler], middle.replace(b"503", b"200")))


def grammar_timeout_abort(schema_bytes: int) -> dict[str, Any]:
    """SGLang 0.5.23's grammar timeout (``GrammarManager``: ``error_msg = f"Grammar preprocessing timed out:
    {req.grammar_key=}"``, ``req.set_finish_with_abort(error_msg)``: ``FINISH_ABORT(error_msg, 400,
    "BadRequestError")``, whose ``to_json`` writes ``type, message, status_code, err_type``), built by hand:
    the message quotes the grammar key, the client's JSON schema, so a long schema puts megabytes of
    escaped quotes between the finish reason's ``"abort"`` and its status."""
    schema = json.dumps({"type": "object", "properties": {
        f"p{k}": {"type": "string"} for k in range(schema_bytes // 30)}})
    message = f"Grammar preprocessing timed out: req.grammar_key={('json', schema)!r}"
    finish = {"type": "abort", "message": message, "status_code": 400, "err_type": "BadRequestError"}
    return {"text": "", "output_ids": [7], "meta_info": {
        "id": RID, "finish_reason": finish, "prompt_tokens": 1, "weight_version": "default",
        "num_retractions": 0, "reasoning_tokens": 0, "completion_tokens": 1, "cached_tokens": 0}}


@pytest.mark.parametrize("codec", CODECS)
def test_an_abort_whose_message_quotes_a_megabytes_schema_is_looked_at_briefly_and_answered_400(codec):
    """The regex that reads a finish reason costs 10-17 ms a MiB of escapes: matched to the end of a
    4 MiB message it held the event loop ~67 ms. It reads ``FINISH_SPAN`` bytes from the key; an abort
    still undecided there goes to ``fold``, which answers the error with the engine's 400."""
    body = dumps(grammar_timeout_abort(4 << 20))
    assert len(body) > 4 << 20 and body.count(b'\\"') > 100_000
    c = codec(OPTIONS)
    assert c.folds_alone(body)
    spent = least_seconds(lambda: c.folds_alone(body))
    assert spent < 2e-3, f"{spent * 1e3:.1f} ms for a {len(body) >> 20} MiB body"
    assert answer_status_of(c, fold(codec, [body])) == 400


REGEX_LURES = {  # what follows a finish reason's key in a hostile body: each costs the regex most
    "escapes": b':{"type":"abort","message":"' + b'\\"' * (32 << 20) + b'"}',
    "members": b':{"type":"abort"' + b',"a":1' * (11 << 20) + b"}",
    "spaces": b" " * (64 << 20) + b':{"type":"abort","status_code":500}',
}


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("lure", sorted(REGEX_LURES))
def test_a_finish_reason_that_runs_for_64_mib_costs_the_look_a_bounded_read(codec, lure):
    """Matched to its end, each of these cost 0.2-1.1 s of the edge's event loop; the look reads at most
    ``FINISH_SPAN`` bytes of a finish reason (``fold`` decides one it could not) and searches the rest
    for another key at ``bytes.find``'s speed (under 2 ms a MiB asserted)."""
    body = b'{"text":"","meta_info":{"id":"r","finish_reason"' + REGEX_LURES[lure] + b"}}"
    c = codec(OPTIONS)
    spent = least_seconds(lambda: c.folds_alone(body))
    assert spent < 2e-3 * (len(body) >> 20), f"{spent * 1e3:.1f} ms for a {len(body) >> 20} MiB body"


@pytest.mark.parametrize("from_end", [False, True], ids=["from the front", "from the back"])
def test_a_finish_reason_whose_key_straddles_a_search_chunks_edge_is_found(from_end):
    """The key is searched for in chunks from both ends; one that crosses a chunk's edge (the chunks
    overlap by the key's length less one) is found wherever it stands (the review's mutations
    ``overlap = 0`` and ``rfind(..., back)`` passed every other test)."""
    from streamproc_sglang.codec import FINISH_KEY, FINISH_STEP, _abort_with_status

    inserted = FINISH_KEY + b':{"type":"abort","message":"m","status_code":503}'
    size = 40 * FINISH_STEP
    near_edges = sorted({k * FINISH_STEP + d for k in range(1, 32) for d in range(-len(FINISH_KEY), len(FINISH_KEY))})
    missed = []
    for offset in near_edges:
        at = size - offset if from_end else offset
        body = b"x" * at + inserted + b"x" * (size - at - len(inserted))
        if not _abort_with_status(body):
            missed.append(offset)
    assert missed == []


@pytest.mark.parametrize("codec", CODECS)
def test_a_body_of_finish_reason_strings_that_are_no_key_is_left_to_the_fold(codec):
    """``"finish_reason"`` that is no key (a string ending in it) more than ``FINISH_CANDIDATES`` times is
    nothing SGLang writes: after that many anchored matches the look stops and ``fold`` decides (a
    list, answered as sent)."""
    from streamproc_sglang.codec import FINISH_CANDIDATES

    c = codec(OPTIONS)
    few = dumps(["finish_reason"] * FINISH_CANDIDATES)
    assert not c.folds_alone(few)
    many = dumps(["finish_reason"] * (FINISH_CANDIDATES + 1))
    assert c.folds_alone(many)
    assert fold(codec, [many]) == many


@pytest.mark.parametrize("codec", CODECS)
def test_an_item_the_failed_prefill_stream_never_reached_is_prefill_error_not_length_mismatch(codec):
    """A streamed batch's prefill leg: item 0's chunk, then ``stream_results``' frame (an item's
    ``ValueError`` ends every item's stream, ``_stream_batch_responses``) before item 1 had one. Item 1
    has no prefill value because the prefill worker failed, as with a unary error body (``prefill_error``,
    docs/codecs.md), not because the legs' shapes differ (``length_mismatch``). Item 0 keeps its join."""
    prefill = [dumps({**prefill_leg(), "index": 0}), dumps(STREAM_ERROR)]
    decode = [dumps({**decode_answer(), "index": k}) for k in range(2)]
    joined = join(codec(OPTIONS), decode, prefill)
    assert joined[0] == join(codec(OPTIONS), decode[:1], prefill[:1])[0]  # as with its own leg alone
    assert joined[1][1] is Verdict.OMITTED
    meta = json.loads(joined[1][0])["meta_info"]
    assert meta["routed_experts_unavailable_reason"] == "prefill_error"
    assert meta["input_logprobs_unavailable_reason"] == "prefill_error"
    assert "routed_experts" not in meta and "input_token_logprobs" not in meta
