"""A failed P/D ``/inference/v1/generate`` request joins and folds to what the aggregated engine answers (vLLM 0.34.0).

Independent differential check of the failure paths, written by hand from ``vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl``
(paths relative to ``vllm/``), not from the simulator, ``streamproc_vllm.upstream`` or another test's fixtures.
The request is ``{"output_mode": "text", "stream": true, "stream_options": {"include_usage": true},
"sampling_params": {"max_tokens": 4, "logprobs": 1}}`` with routed-expert capture on.

**Aborted mid-stream** (``v1/engine/output_processor.py`` ``OutputProcessor.abort_requests``)::

    request_output := req_state.make_request_output(new_token_ids=[], ..., finish_reason=FinishReason.ABORT,
                                                    stop_reason=None, kv_transfer_params=None, ...)

``make_request_output`` concatenates the rows received on a finish (``if finished and
self.routed_experts_chunks: routed_experts = np.concatenate(...)``) and slices the delta logprobs to none
(``logprobs[:0]``). ``entrypoints/scale_out/token_in_token_out/serving.py``
``ServingTokens.serve_tokens_stream_generator`` emits a terminal output without tokens ("Terminal outputs
are always emitted so the client sees the finish reason, e.g. an abort, which has no new tokens"), then the
usage chunk: an abort is no exception there.

**An engine error** (``finish_reason == "error"``: e.g. ``kv_load_failure_policy="fail"`` on a decode whose
KV load from the prefill worker failed, ``v1/core/sched/scheduler.py``: ``error_req_ids,
RequestStatus.FINISHED_ERROR``; ``v1/request.py`` maps it to ``FinishReason.ERROR``)::

    def _raise_if_error(self, finish_reason, request_id):
        if finish_reason == "error":
            raise GenerationError("Internal server error")
    ...
    except GenerationError as e:
        yield (f"data: {self._convert_generation_error_to_streaming_response(e)}\\n\\n")
    ...
    yield "data: [DONE]\\n\\n"

``entrypoints/generate/base/serving.py`` ``create_streaming_error_response``: ``json.dumps(self.create_error_response(
message=message, ...).model_dump())`` (default separators, ASCII); ``entrypoints/serve/exception_handling/
error_response.py`` ``create_error_response`` for a ``GenerationError``: ``err_type = "InternalServerError"``
(``"ServiceUnavailableError"`` for a ``RetryableRequestError``), ``status_code = exc.status_code``, ``param =
None``; ``ErrorResponse(error=ErrorInfo(message=sanitize_message(message), type, code, param))``, fields
``message, type, param, code``. Unary, ``serve_tokens_full_generator`` raises the same ``GenerationError``
(``for output in final_res.outputs: self._raise_if_error(...)``) and the app's ``vllm_error_handler`` answers
``JSONResponse(err.model_dump(), status_code=err.error.code)``; an ``ErrorResponse`` returned by
``serve_tokens`` (a validation failure) is answered by ``api_router.generate``:
``JSONResponse(content=generator.model_dump(), status_code=generator.error.code)`` (starlette: compact,
``ensure_ascii=False``).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import drive_join as join
from helpers import upstream_json as dumps
from vllm_034_bodies import npy_b64, pd_rows

from streamproc.codec import CodecOptions
from streamproc.wire import Verdict
from streamproc_vllm import VLLMCodec

OPTIONS = CodecOptions(max_decompressed_bytes=1 << 20)
RID = "cmpl-5e1f0a9c-0"
PROMPT = [101, 102, 103, 104, 105]
OUT = [72, 101, 108, 108]
TEXT = ["H", "e", "l", "l"]


def rows(stale: bool) -> np.ndarray:
    return pd_rows(len(PROMPT), len(OUT), stale=stale)


def content(pos: int) -> dict:
    tok = TEXT[pos]
    lp = -0.25 * (pos + 1)
    entry = {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8", errors="replace"))}
    return {**entry, "top_logprobs": [dict(entry)]}


def chunk(choice: dict, first: bool) -> bytes:
    doc: dict = {"request_id": RID, "usage": None}
    if first:
        doc["prompt_token_ids"] = PROMPT  # return_token_ids: the first chunk only
    doc.update({"output_mode": "text", "choices": [choice]})
    return dumps(doc)


def choice(pos: int | None, finish: str | None, experts: str | None) -> dict:
    """``GenerateTextStreamChoice`` (``index, finish_reason, stop_reason, token_ids, routed_experts,
    sampling_mask, weight_versions``, then ``text, logprobs``); ``pos`` None: the abort output, no token."""
    return {"index": 0, "finish_reason": finish, "stop_reason": None,
            "token_ids": [] if pos is None else [OUT[pos]], "routed_experts": experts, "sampling_mask": None,
            "weight_versions": None, "text": "" if pos is None else TEXT[pos],
            "logprobs": {"content": [] if pos is None else [content(pos)]}}


def usage(completion: int) -> bytes:
    return dumps({"request_id": RID, "usage": {"prompt_tokens": len(PROMPT),
                                               "total_tokens": len(PROMPT) + completion,
                                               "completion_tokens": completion},
                  "output_mode": "text", "choices": []})


def aborted_after(n: int, stale: bool) -> list[bytes]:
    """``n`` token chunks, the abort chunk (rows over ``[0, prompt + n - 1)``), the usage chunk."""
    out = [chunk(choice(p, None, None), p == 0) for p in range(n)]
    out.append(chunk(choice(None, "abort", npy_b64(rows(stale)[:len(PROMPT) + n - 1])), n == 0))
    out.append(usage(n))
    return out


def prefill_leg() -> list[bytes]:
    """``serve_tokens_full_generator``'s ``GenerateTextResponse`` for ``max_tokens=1`` with the NIXL
    connector's ``kv_transfer_params`` for decode; rows ``[0, prompt)``."""
    body = {"request_id": RID, "model": "m", "created": 1764979200,
            "usage": {"prompt_tokens": len(PROMPT), "total_tokens": len(PROMPT) + 1, "completion_tokens": 1,
                      "completion_tokens_details": None},
            "prompt_logprobs": None, "prompt_token_id_logprobs": None, "prompt_token_ids": PROMPT,
            "mm_placeholders": None, "metrics": None,
            "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[3]],
                                   "remote_engine_id": "e0", "remote_request_id": RID, "remote_host": "10.0.0.2",
                                   "remote_port": 5600, "tp_size": 1},
            "ec_transfer_params": None, "output_mode": "text",
            "choices": [{"index": 0, "finish_reason": "length", "stop_reason": None, "token_ids": [OUT[0]],
                         "routed_experts": npy_b64(rows(False)[:len(PROMPT)]), "sampling_mask": None,
                         "weight_versions": None, "text": TEXT[0], "logprobs": {"content": [content(0)]}}]}
    return [dumps(body)]


def error_info(message: str, err_type: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def stream_frame(doc: dict) -> bytes:
    """``create_streaming_error_response``: ``json.dumps(...model_dump())``, default separators."""
    return json.dumps(doc).encode()


GENERATION_ERROR = error_info("Internal server error", "InternalServerError", 500)


@pytest.mark.parametrize("n", [1, 3])
def test_a_decode_aborted_mid_stream_joins_to_the_aggregated_abort_chunk(n):
    """The abort chunk carries the whole request's rows, the prompt's being stale on P/D decode: they are
    replaced with the prefill leg's, so every chunk equals the aggregated one byte for byte, and the stream
    folds to the aggregated fold (an abort is a 200 answer in vLLM)."""
    agg, dec = aborted_after(n, stale=False), aborted_after(n, stale=True)
    assert dec != agg
    codec = VLLMCodec(OPTIONS)
    out = join(codec, dec, prefill_leg())
    for (got, _), want in zip(out, agg):
        assert got == want
    assert Verdict.JOINED in [v for _, v in out]
    folded = codec.fold([b for b, _ in out])
    assert folded == codec.fold(agg)
    assert codec.answer_status(folded) == 200


def test_a_decode_aborted_before_its_first_token_keeps_its_null_rows():
    """Aborted while it waited for its KV: no rows were received, the abort chunk's ``routed_experts`` is
    ``null`` (``if finished and self.routed_experts_chunks``), as the aggregated abort's; nothing of the
    prefill leg is spliced in."""
    doc = [chunk(choice(None, "abort", None), True), usage(0)]
    out = join(VLLMCodec(OPTIONS), doc, prefill_leg())
    assert [b for b, _ in out] == doc


@pytest.mark.parametrize("prefill", ["prefill-ok", "prefill-error", "prefill-timeout"])
def test_a_decode_whose_kv_load_failed_sends_the_error_frame_as_sent_and_folds_to_the_unary_500(prefill):
    """``kv_load_failure_policy="fail"``: the decode's only output finishes ``"error"`` and its stream is the
    frame alone; the join publishes it as sent whatever the prefill leg became, and its unary answer is the
    compact ``ErrorResponse`` with status 500."""
    legs = {"prefill-ok": prefill_leg(), "prefill-timeout": None,
            "prefill-error": [dumps(error_info("Engine loop is dead", "InternalServerError", 500))]}
    frame = stream_frame(GENERATION_ERROR)
    codec = VLLMCodec(OPTIONS)
    [(got, verdict)] = join(codec, [frame], legs[prefill])
    assert got == frame and verdict is not Verdict.JOINED
    assert codec.folds_alone(got)
    unary = dumps(GENERATION_ERROR)
    assert codec.fold([got]) == unary
    assert codec.answer_status(unary) == 500
    assert codec.answer_media_type(unary) == "application/json"


def test_a_stream_that_errors_after_tokens_folds_to_the_unary_error_as_the_aggregated_one_does():
    """An ``"error"`` finish after two tokens: the chunks already sent, then the frame; the joined stream's
    chunks and fold equal the aggregated stream's."""
    agg = [chunk(choice(0, None, None), True), chunk(choice(1, None, None), False), stream_frame(GENERATION_ERROR)]
    codec = VLLMCodec(OPTIONS)
    out = join(codec, list(agg), prefill_leg())
    assert [b for b, _ in out] == agg
    assert codec.fold([b for b, _ in out]) == codec.fold(agg) == dumps(GENERATION_ERROR)


@pytest.mark.parametrize("doc, status", [
    # GenerationError (vllm_error_handler)
    (GENERATION_ERROR, 500),
    # RetryableRequestError: "ServiceUnavailableError", HTTPStatus.SERVICE_UNAVAILABLE
    (error_info("Request failed; please retry", "ServiceUnavailableError", 503), 503),
    # VLLMValidationError returned by serve_tokens: "BadRequestError", param = exc.parameter
    (error_info("logprobs must be at most 20", "BadRequestError", 400, "logprobs"), 400),
    # http_exception_handler: type=HTTPStatus(exc.status_code).phrase
    (error_info("Model m2 not found", "Not Found", 404), 404),
    # a non-ASCII message, raw UTF-8 (starlette JSONResponse, ensure_ascii=False)
    (error_info("prompt \u00e9 trop long", "BadRequestError", 400), 400),
], ids=["500", "503", "400-param", "404", "400-utf8"])
def test_unary_error_responses_join_as_sent_and_keep_the_engines_status(doc, status):
    codec = VLLMCodec(OPTIONS)
    body = dumps(doc)
    for prefill in (prefill_leg(), None):
        [(got, verdict)] = join(codec, [body], prefill)
        assert got == body and verdict is not Verdict.JOINED
    assert codec.fold([body]) == body
    assert codec.answer_status(body) == status
    assert codec.answer_media_type(body) == "application/json"


def test_a_streamed_error_frame_with_a_non_ascii_message_folds_to_raw_utf8():
    """``json.dumps`` escapes the frame's ``é`` (``\\u00e9``); ``JSONResponse`` writes it raw."""
    doc = error_info("prompt \u00e9 trop long", "BadRequestError", 400)
    frame = stream_frame(doc)
    assert b"\\u00e9" in frame
    codec = VLLMCodec(OPTIONS)
    assert codec.fold([frame]) == dumps(doc)
