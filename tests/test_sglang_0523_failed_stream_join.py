"""A failed P/D ``/generate`` request joins and folds to what the aggregated engine answers (SGLang 0.5.23).

Independent differential check of the failure paths, written by hand from the SGLang 0.5.23 PyPI wheel
(``sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl``, paths relative to ``sglang/srt/``), not from the
simulator, ``streamproc_sglang.upstream`` or another test's fixtures. The request asks
``{"stream": true, "return_logprob": true, "logprob_start_len": 0, "top_logprobs_num": 2,
"token_ids_logprob": [7, 9], "return_text_in_logprobs": true, "return_routed_experts": true,
"sampling_params": {"stream_interval": 2, "max_new_tokens": 5}}`` of a cumulative server (the default).

**A running request aborted** (``managers/scheduler.py`` ``Scheduler.abort_request``, "Abort method 3")::

    for req in self.collect_inflight_reqs():
        if not req.finished() and (recv_req.abort_all or req.rid.startswith(recv_req.rid)):
            if recv_req.abort_message:
                # Timeout aborts carry an SLA message + 503 for the client.
                req.to_finish = FINISH_ABORT(recv_req.abort_message, HTTPStatus.SERVICE_UNAVAILABLE)
            else:
                req.to_finish = FINISH_ABORT()

The request runs one more decode step and finishes like any finish, so its last body is
``_handle_batch_output``'s finished body with ``FINISH_ABORT.to_json()`` as its finish reason
(``managers/schedule_batch.py``)::

    def to_json(self):
        return {"type": "abort", "message": self.message, "status_code": self.status_code,
                "err_type": self.err_type}

``TokenizerManager._wait_one_response`` hands a finished body with a dict finish reason to
``_handle_abort_finish_reason``, which for a ``status_code`` in ``[400, 600)`` yields it to a stream
(``return out``) and, unary, raises::

    if status_code == HTTPStatus.BAD_REQUEST:
        raise ValueError(finish_reason["message"])
    raise fastapi.HTTPException(status_code=status_code, detail=finish_reason["message"])

answered by ``entrypoints/http_server.py`` ``validation_exception_handler`` (``HTTPException``) with
``ORJSONResponse(content=ErrorResponse(object="error", message=exc.detail, type=str(exc.status_code),
code=exc.status_code).model_dump(), status_code=exc.status_code)``, and by ``serve_generate_request``'s
``except ValueError as e: return _create_error_response(e)`` (``{"error": {"message": str(e)}}``, status
``getattr(e, "status_code", HTTPStatus.BAD_REQUEST)``). ``FINISH_ABORT()`` has no status: the body is the
request's answer, as any finish.

**A decode whose KV transfer failed** (the prefill leg aborted, errored or never sent:
``disaggregation/decode.py`` ``DecodeTransferQueue``, on ``poll == KVPoll.Failed``)::

    prepare_abort(decode_req.req, error_message, status_code=HTTPStatus.INTERNAL_SERVER_ERROR)
    self.scheduler.output_streamer.stream_output([decode_req.req], decode_req.req.return_logprob)

``disaggregation/utils.py`` ``prepare_abort`` sets ``FINISH_ABORT(error_message, status_code)`` and empties
every ``input_*`` logprob list; no token was sampled, so the body has no output, no rows
(``if getattr(recv_obj, "routed_experts", None)``: none) and ``weight_versions`` ``[{version, 0, 0}]``
(``compute_weight_version_spans`` with ``num_output_tokens`` 0). ``DecodePreallocQueue``'s failed
handshake is the same ``prepare_abort(..., HTTPStatus.INTERNAL_SERVER_ERROR)`` with another message.

**A ``ValueError`` while the stream runs** (``http_server.py`` ``stream_results``)::

    except ValueError as e:
        out = {"error": {"message": str(e), "type": "invalid_request_error",
                         "code": getattr(e, "status_code", 400), "retryable": False}}
        yield b"data: " + dumps_json(out) + b"\\n\\n"
    yield b"data: [DONE]\\n\\n"

Logprob entries with ``return_text_in_logprobs``: ``TokenizerManager.detokenize_logprob_tokens`` returns
``list(zip(token_logprobs_val, token_logprobs_idx, token_texts))``, so each entry is ``[logprob, id, text]``
(``tokenizer.batch_decode([[idx] for idx in ...])``, one text per id).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from helpers import assert_same_body
from helpers import drive_join as join
from helpers import upstream_json as dumps
from sglang_0523_bodies import add_counts, pd_rows, rows_b64

from streamproc.codec import CodecOptions
from streamproc.wire import Verdict
from streamproc_sglang import SGLangCodec
from streamproc_sglang_zstd import SGLangZstdCodec

OPTIONS = CodecOptions(max_decompressed_bytes=1 << 20, format_options=(("streaming", "cumulative"),))
RID = "9b2e7c41d0a84f6e8c35a1f2e4d6b8c0"
PROMPT = [11, 12, 13, 14]
OUT = [201, 202, 203, 204, 205]
TEXTS = {1: "H", 3: "Hel", 4: "Hell", 5: "Hello"}
IDS = [7, 9]
E2E = 0.5
VOCAB = {7: "<7>", 9: "<9>", 11: "The", 12: " cat", 13: " sat", 14: " on",
         201: "H", 202: "e", 203: "l", 204: "l", 205: "o"}
# ``Scheduler._poll_timeout_aborts`` (``SGLANG_REQ_RUNNING_TIMEOUT``): an ``AbortReq`` with this
# ``abort_message``, which ``abort_request`` turns into ``FINISH_ABORT(abort_message, 503)`` on a running request.
TIMEOUT = "Request running timeout reached."


def tok(token_id: int) -> str:
    """``tokenizer.batch_decode([[idx]])``: one text per id (this test's vocabulary)."""
    return VOCAB.get(token_id, f"<{token_id}>")


def entry(logprob: float | None, token_id: int) -> list:
    return [logprob, token_id, tok(token_id)]  # detokenize_logprob_tokens, decode_to_text


def top(pos: int, base: int) -> list:
    return [entry(-0.03125 * (pos + 1), base + pos), entry(-3.0 - pos, base + 50 + pos)]


def ids_row(pos: int, off: float) -> list:
    return [entry(-4.0 - pos - off, IDS[0]), entry(-6.0 - pos - off, IDS[1])]


def rows(stale: bool) -> np.ndarray:
    return pd_rows(len(PROMPT), len(OUT), stale=stale)


def b64(r: np.ndarray, n: int) -> str:
    return rows_b64(r[:len(PROMPT) + n - 1])


def meta(n: int, finish: dict | None, *, side: str, experts: str | None) -> dict[str, Any]:
    """``_handle_batch_output``'s cumulative ``meta_info`` after ``n`` tokens on leg ``side`` (``agg``,
    ``decode``, ``prefill``); field order as there, the logprob block in ``add_logprob_to_meta_info``'s."""
    decode = side == "decode"
    m: dict[str, Any] = {"id": RID, "finish_reason": finish, "prompt_tokens": len(PROMPT),
                         "weight_version": "default", "num_retractions": 0}
    m.update({
        # P/D decode never scores the prompt ("Decode server does not send input logprobs").
        "input_token_logprobs": [] if decode else [entry(None if p == 0 else -0.5 * p, t) for p, t in enumerate(PROMPT)],
        "output_token_logprobs": [entry(-0.0625 * (p + 1), OUT[p]) for p in range(n)],
        "output_token_logprobs_length": n,
        "input_top_logprobs": [] if decode else [None] + [top(p, 1000) for p in range(1, len(PROMPT))],
        "output_top_logprobs": [top(p, 2000) for p in range(n)],
        "input_token_ids_logprobs": [] if decode else [None] + [ids_row(p, 0.5) for p in range(1, len(PROMPT))],
        # DecodeTransferQueue._commit_transfer_to_req: "Prefill omits these scores; reserve a row for the
        # streaming offset." -> detokenize_top_logprobs_tokens sends the empty row as None.
        "output_token_ids_logprobs": [None if decode and p == 0 else ids_row(p, 0.25) for p in range(n)],
    })
    add_counts(m, n, finished=finish is not None)
    if experts is not None:
        m["routed_experts"] = experts
    if finish is not None:
        m["e2e_latency"] = E2E
    return m


def body(n: int, finish: dict | None, *, side: str, experts: str | None = None) -> bytes:
    return dumps({"text": TEXTS[n], "output_ids": OUT[:n], "meta_info": meta(n, finish, side=side, experts=experts)})


def finish_abort(message: str | None, status: int | None) -> dict:
    """``FINISH_ABORT(message, status_code).to_json()``; ``message or "Aborted"``."""
    return {"type": "abort", "message": message or "Aborted", "status_code": status, "err_type": None}


def prefill_leg() -> list[bytes]:
    """``process_batch_result_disagg_prefill``: one finished body for token 0, ``FINISH_LENGTH(0)``, the
    prompt's logprobs and rows."""
    return [body(1, {"type": "length", "length": 0}, side="prefill", experts=b64(rows(False)[:len(PROMPT)], 1))]


def stream_aborted_at(n: int, finish: dict, *, side: str) -> list[bytes]:
    """Chunks after 1 and 3 tokens (``stream_interval`` 2), then the abort's finished body after ``n``:
    ``to_finish`` takes effect on the next step, which still samples a token."""
    stale = side == "decode"
    return [body(1, None, side=side), body(3, None, side=side),
            body(n, finish, side=side, experts=b64(rows(stale), n))]


@pytest.mark.parametrize("status", [503, None], ids=["timeout-503", "client-no-status"])
def test_a_decode_aborted_mid_stream_joins_to_the_aggregated_abort_and_folds_to_its_unary_answer(status):
    finish = finish_abort(TIMEOUT if status else None, status)
    agg = stream_aborted_at(4, finish, side="agg")
    dec = stream_aborted_at(4, finish, side="decode")
    assert all(d != a for d, a in zip(dec, agg))
    codec = SGLangCodec(OPTIONS)
    out = join(codec, dec, prefill_leg())
    assert [v for _, v in out] == [Verdict.JOINED] * 3
    for (got, _), want in zip(out, agg):
        assert got == want
    joined = [b for b, _ in out]
    assert codec.fold(joined) == codec.fold(agg)
    if status is None:
        # No status: _handle_abort_finish_reason returns None and the finished body is the answer.
        assert codec.fold(joined) == agg[-1]
        assert codec.answer_status(codec.fold(joined)) == 200
    else:
        want = dumps({"object": "error", "message": TIMEOUT, "type": "503", "param": None, "code": 503})
        assert codec.fold(joined) == want
        assert codec.answer_status(want) == 503
        assert codec.answer_media_type(want) == "application/json"


def test_an_abort_with_status_400_folds_to_create_error_response():
    """``status_code == HTTPStatus.BAD_REQUEST``: ``raise ValueError(message)`` -> ``_create_error_response``."""
    finish = finish_abort("Bad sampling state.", 400)
    codec = SGLangCodec(OPTIONS)
    joined = [b for b, _ in join(codec, stream_aborted_at(4, finish, side="decode"), prefill_leg())]
    want = dumps({"error": {"message": "Bad sampling state."}})
    assert codec.fold(joined) == want
    assert codec.answer_status(want) == 400


def transfer_failed() -> bytes:
    """``DecodeTransferQueue`` on ``KVPoll.Failed``: ``prepare_abort(..., INTERNAL_SERVER_ERROR)`` then
    ``stream_output``; ``_handle_batch_output`` writes a finished body with nothing generated (a stream's
    cumulative body and the unary one are the same finished dict)."""
    message = (f"Decode transfer failed for request rank=0 decode_req.req.rid='{RID}' "
               "decode_req.req.bootstrap_room=42 with exception KV transfer failed")
    m: dict[str, Any] = {"id": RID, "finish_reason": finish_abort(message, 500), "prompt_tokens": len(PROMPT),
                         "weight_version": "default", "num_retractions": 0,
                         "input_token_logprobs": [], "output_token_logprobs": [], "output_token_logprobs_length": 0,
                         "input_top_logprobs": [], "output_top_logprobs": [],
                         "input_token_ids_logprobs": [], "output_token_ids_logprobs": [],
                         "reasoning_tokens": 0, "completion_tokens": 0, "cached_tokens": 0,
                         # add_weight_versions_to_meta_info also sets weight_version, which keeps its place
                         "weight_versions": [{"version": "default", "start": 0, "end": 0}],
                         "cached_tokens_details": None, "e2e_latency": E2E}
    return dumps({"text": "", "output_ids": [], "meta_info": m})


def prefill_aborted() -> list[bytes]:
    """The prefill leg's own transfer failure (``disaggregation/prefill.py``: ``prepare_abort(req, ...,
    status_code=HTTPStatus.INTERNAL_SERVER_ERROR)``), streamed: its finished abort body, no token."""
    m = {"id": RID, "finish_reason": finish_abort("Prefill transfer failed for request rank=0", 500),
         "prompt_tokens": len(PROMPT), "weight_version": "default", "num_retractions": 0,
         "input_token_logprobs": [], "output_token_logprobs": [], "output_token_logprobs_length": 0,
         "input_top_logprobs": [], "output_top_logprobs": [], "input_token_ids_logprobs": [],
         "output_token_ids_logprobs": [], "reasoning_tokens": 0, "completion_tokens": 0, "cached_tokens": 0,
         "weight_versions": [{"version": "default", "start": 0, "end": 0}],
         "cached_tokens_details": None, "e2e_latency": E2E}
    return [dumps({"text": "", "output_ids": [], "meta_info": m})]


PREFILL_OUTCOMES = {
    "prefill-sent-token-0": prefill_leg,  # the prefill finished; the transfer failed on the way
    "prefill-aborted": prefill_aborted,
    "prefill-timeout": lambda: None,
    "prefill-error-frame": lambda: [dumps({"error": {"message": "boom", "type": "invalid_request_error",
                                                     "code": 400, "retryable": False}})],
}


@pytest.mark.parametrize("codec_type", [SGLangCodec, SGLangZstdCodec])
@pytest.mark.parametrize("prefill", sorted(PREFILL_OUTCOMES))
def test_a_decode_whose_kv_transfer_failed_is_published_as_sent_whatever_the_prefill_leg_became(prefill, codec_type):
    """Nothing of the prefill leg is spliced into an abort that sampled no token (no engine has prompt
    logprobs, rows or a token-0 entry before token 0), and the unary answer is the 500 ``ErrorResponse``.
    The prefill leg is the same raw-int32 body for both codecs: none of it is read."""
    codec = codec_type(OPTIONS)
    dec = transfer_failed()
    [(got, verdict)] = join(codec, [dec], PREFILL_OUTCOMES[prefill]())
    assert_same_body(got, dec)
    assert got == dec
    assert verdict is not Verdict.JOINED
    assert codec.folds_alone(got)
    folded = codec.fold([got])
    message = json.loads(dec)["meta_info"]["finish_reason"]["message"]
    assert folded == dumps({"object": "error", "message": message, "type": "500", "param": None, "code": 500})
    assert codec.answer_status(folded) == 500


@pytest.mark.parametrize("status, want", [
    (503, lambda m: {"object": "error", "message": m, "type": "503", "param": None, "code": 503}),
    (500, lambda m: {"object": "error", "message": m, "type": "500", "param": None, "code": 500}),
    (400, lambda m: {"error": {"message": m}}),
])
def test_unary_error_answers_join_as_sent_and_keep_the_engines_status(status, want):
    """Unary, the decode worker's HTTP answer to an abort with a status is the error body itself
    (``_handle_abort_finish_reason`` raises before any body is built): joined with any prefill leg it is
    published as sent, and the edge answers it with the engine's status and media type."""
    codec = SGLangCodec(OPTIONS)
    error = dumps(want("Request aborted by SLA"))
    for prefill in (prefill_leg(), None):
        [(got, verdict)] = join(codec, [error], prefill)
        assert got == error and verdict is not Verdict.JOINED
        assert codec.fold([got]) == error
        assert codec.answer_status(got) == status
        assert codec.answer_media_type(got) == "application/json"


def test_starlettes_plain_text_500_is_answered_500_text_plain():
    """``serve_generate_request`` catches ``ValueError`` only; any other exception reaches Starlette's
    ``ServerErrorMiddleware``: ``PlainTextResponse("Internal Server Error", status_code=500)``."""
    codec = SGLangCodec(OPTIONS)
    assert codec.answer_status(b"Internal Server Error") == 500
    assert codec.answer_media_type(b"Internal Server Error") == "text/plain; charset=utf-8"


def frame(message: str) -> bytes:
    return dumps({"error": {"message": message, "type": "invalid_request_error", "code": 400, "retryable": False}})


@pytest.mark.parametrize("before", [0, 2], ids=["frame-alone", "frame-after-two-chunks"])
def test_stream_results_error_frame_passes_the_join_and_folds_to_the_unary_error(before):
    """A decode stream that ends in ``stream_results``' frame: the frame is published as sent (no prefill
    field spliced into it) and the stream folds to ``_create_error_response``'s body, status 400, as the
    aggregated stream with the same chunks and frame does."""
    message = "The input (9000 tokens) is longer than the model's context length (8192 tokens)."
    agg = [body(1, None, side="agg"), body(3, None, side="agg")][:before] + [frame(message)]
    dec = [body(1, None, side="decode"), body(3, None, side="decode")][:before] + [frame(message)]
    codec = SGLangCodec(OPTIONS)
    out = join(codec, dec, prefill_leg())
    assert out[-1][0] == frame(message)
    for (got, _), want in zip(out, agg):
        assert got == want
    joined = [b for b, _ in out]
    if before == 0:
        assert codec.folds_alone(joined[0])
    want = dumps({"error": {"message": message}})
    assert codec.fold(joined) == codec.fold(agg) == want
    assert codec.answer_status(want) == 400


def test_return_text_in_logprobs_rows_join_with_each_entrys_text():
    """A completed stream with text in each logprob entry: position 0 of the token-ids scores (decode's
    reserved ``None``) and the prompt lists come from the prefill leg with their texts; every chunk equals
    the aggregated one byte for byte."""
    fin = {"type": "length", "length": 5}
    agg = [body(1, None, side="agg"), body(3, None, side="agg"),
           body(5, fin, side="agg", experts=b64(rows(False), 5))]
    dec = [body(1, None, side="decode"), body(3, None, side="decode"),
           body(5, fin, side="decode", experts=b64(rows(True), 5))]
    out = join(SGLangCodec(OPTIONS), dec, prefill_leg())
    assert [v for _, v in out] == [Verdict.JOINED] * 3
    for (got, _), want in zip(out, agg):
        assert got == want
    first = json.loads(out[0][0])["meta_info"]
    assert first["output_token_ids_logprobs"][0] == ids_row(0, 0.25)
    assert first["input_token_logprobs"][1] == [-0.5, 12, " cat"]


OOM = ("Out of memory even after retracting all other requests in the decode batch. Aborting the last request.")


def abort_req_body(n: int, finish: dict, *, side: str) -> bytes:
    """``TokenizerManager._handle_abort_req`` for a stream that received ``n`` tokens (cumulative): ``meta_info``
    ``id, finish_reason, weight_version, e2e_latency``, then ``add_weight_versions_to_meta_info`` (the spans of
    ``_make_abort_req``: ``num_output_tokens=len(req.output_ids)``; ``weight_version`` keeps its place), the
    request's whole logprob lists (``add_logprob_to_meta_info(..., finished=True)`` from the state) and
    ``completion_tokens``; no ``prompt_tokens``, no rows."""
    m: dict[str, Any] = {"id": RID, "finish_reason": finish, "weight_version": "default", "e2e_latency": E2E}
    m["weight_versions"] = [{"version": "default", "start": 0, "end": n}]
    full = meta(n, None, side=side, experts=None)
    for key in ("input_token_logprobs", "output_token_logprobs", "output_token_logprobs_length",
                "input_top_logprobs", "output_top_logprobs", "input_token_ids_logprobs", "output_token_ids_logprobs"):
        m[key] = full[key]
    m["completion_tokens"] = n
    return dumps({"text": TEXTS[n], "output_ids": OUT[:n], "meta_info": m})


@pytest.mark.parametrize("finish", [
    # retract_decode: the last request that no retraction can keep; send_abort_output(_make_abort_req(req,
    # finished_reason=abort_reason.to_json()))
    finish_abort(OOM, 500),
    # abort_request on a retracted P/D decode request (retracted_queue): _make_abort_req(decode_req), no
    # finished_reason, so the tokenizer's own {"type": "abort", "message": "Abort in waiting queue"}
    {"type": "abort", "message": "Abort in waiting queue"},
    # Scheduler._poll_timeout_aborts (SGLANG_REQ_WAITING_TIMEOUT) on a retracted request back in the waiting
    # queue: abort_request pops it and sends _make_abort_req(req, finished_reason=recv_req.finished_reason),
    # the scheduler's own dict (type, status_code, message)
    {"type": "abort", "status_code": 503, "message": "Request waiting timeout reached."},
], ids=["oom-500", "retracted-no-status", "waiting-timeout-503"])
def test_a_decode_ended_by_handle_abort_req_joins_to_the_aggregated_abort_body(finish):
    """The abort body restates the request's whole logprob lists: decode's ``[]`` prompt lists and reserved
    ``None`` row are filled from the prefill leg, as the aggregated engine's abort body has them."""
    agg = [body(1, None, side="agg"), body(3, None, side="agg"), abort_req_body(3, finish, side="agg")]
    dec = [body(1, None, side="decode"), body(3, None, side="decode"), abort_req_body(3, finish, side="decode")]
    codec = SGLangCodec(OPTIONS)
    out = join(codec, dec, prefill_leg())
    for (got, _), want in zip(out, agg):
        assert got == want
    joined = [b for b, _ in out]
    assert codec.fold(joined) == codec.fold(agg)
    if "status_code" in finish:
        status = finish["status_code"]
        want = dumps({"object": "error", "message": finish["message"], "type": str(status), "param": None,
                      "code": status})
        assert codec.fold(joined) == want
        assert codec.answer_status(want) == status


def incremental(prev: int, n: int, finish: dict | None, *, side: str, experts: str | None = None) -> bytes:
    """``--incremental-streaming-output``: ``_handle_batch_output`` sends the delta text and ids and
    ``_slice_streaming_output_meta_info`` cuts the ``output_*`` lists at the previous offset
    (``output_token_logprobs_length`` and the ``input_*`` lists are not in ``_INCREMENTAL_STREAMING_META_INFO_KEYS``)."""
    m = meta(n, finish, side=side, experts=experts)
    for key in ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs"):
        m[key] = m[key][prev:]
    return dumps({"text": TEXTS[n][len(TEXTS.get(prev, "")):], "output_ids": OUT[prev:n], "meta_info": m})


def test_an_incremental_stream_ended_by_handle_abort_req_joins_to_the_aggregated_abort_body():
    """``_handle_abort_req`` in incremental mode: ``output_ids = [output_ids[-1]]`` but the text
    (``state.get_text()``) and the logprob lists (``add_logprob_to_meta_info`` from the state) are whole, so
    position 0 is restated at index 0 of the abort body's lists and is filled there."""
    fin = finish_abort(OOM, 500)

    def leg(side: str) -> list[bytes]:
        last = json.loads(abort_req_body(3, fin, side=side))
        last["output_ids"] = [OUT[2]]
        return [incremental(0, 1, None, side=side), incremental(1, 3, None, side=side), dumps(last)]

    agg, dec = leg("agg"), leg("decode")
    assert dec[-1] != agg[-1]
    codec = SGLangCodec(CodecOptions(max_decompressed_bytes=1 << 20))
    out = join(codec, dec, prefill_leg())
    for (got, _), want in zip(out, agg):
        assert got == want
    assert codec.fold([b for b, _ in out]) == codec.fold(agg)


def test_a_decode_aborted_mid_stream_without_a_prefill_leg_omits_with_reasons_and_still_folds_to_the_503():
    """The prefill leg timed out: the abort body keeps no decode prompt-side ``[]`` nor stale rows (each
    omitted with its reason), and the unary answer is still the engine's 503 ``ErrorResponse``."""
    finish = finish_abort(TIMEOUT, 503)
    codec = SGLangCodec(OPTIONS)
    out = join(codec, stream_aborted_at(4, finish, side="decode"), None)
    last = json.loads(out[-1][0])["meta_info"]
    assert out[-1][1] is Verdict.OMITTED
    assert "input_token_logprobs" not in last and "routed_experts" not in last
    assert last["input_logprobs_unavailable_reason"] == "prefill_timeout"
    assert last["routed_experts_unavailable_reason"] == "prefill_timeout"
    assert last["finish_reason"] == finish
    folded = codec.fold([b for b, _ in out])
    assert folded == dumps({"object": "error", "message": TIMEOUT, "type": "503", "param": None, "code": 503})
    assert codec.answer_status(folded) == 503
