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
from helpers import upstream_json as dumps

from streamproc.codec import CodecOptions
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

# ``stream_results``' frame for ``raise ValueError("...")`` (no ``status_code`` attribute: 400).
STREAM_ERROR = {"error": {"message": "boom", "type": "invalid_request_error", "code": 400, "retryable": False}}


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
def test_a_stream_that_ends_in_the_error_frame_folds_to_that_frame_not_to_a_partial_answer(codec, cumulative, sent):
    """The unary request that fails the same way answers the error alone (``_create_error_response``),
    never the tokens produced before it; the fold used to return the partial output with an ``error``
    key beside it, which the edge served as a 200 answer."""
    frame = dumps(STREAM_ERROR)
    bodies = [dumps(chunk(k, k + 1, cumulative=cumulative)) for k in range(sent)] + [frame]
    assert fold(codec, bodies) == frame


@pytest.mark.parametrize("codec", CODECS)
def test_a_streamed_batch_whose_stream_ends_in_the_error_frame_folds_to_that_frame(codec):
    """``_stream_batch_responses``: one item's exception ends the whole stream after the other items'
    chunks; unary, ``_collect_batch_responses``' ``asyncio.gather`` raises it and the batch answers the
    error alone (no list). The fold used to refuse the untagged frame (the edge's 500)."""
    frame = dumps(STREAM_ERROR)
    bodies = [dumps(chunk(0, 1, cumulative=False, index=0)), dumps(chunk(0, 1, cumulative=False, index=1)), frame]
    assert fold(codec, bodies) == frame


@pytest.mark.parametrize("codec", CODECS)
def test_chunks_after_the_error_frame_are_refused_by_the_fold(codec):
    """``stream_results`` sends nothing but ``[DONE]`` after its error frame: output after it is no
    stream SGLang writes, and folding it would present that output as the answer."""
    bodies = [dumps(chunk(0, 1, cumulative=False)), dumps(STREAM_ERROR), dumps(chunk(1, 2, cumulative=False))]
    with pytest.raises(ValueError, match="error body"):
        fold(codec, bodies)


@pytest.mark.parametrize("codec", CODECS)
def test_a_stream_that_is_only_the_error_frame_is_answered_as_sent(codec):
    """A ``ValueError`` before the first chunk (``_validate_one_request``, a duplicate rid, ...)."""
    frame = dumps(STREAM_ERROR)
    assert fold(codec, [frame]) == frame


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
def test_a_pd_decode_stream_ending_in_the_error_frame_publishes_it_as_sent_and_folds_to_it(codec, cumulative, sent):
    """The decode worker's frame is its answer, as the aggregated worker's would be: published byte for
    byte (passthrough) behind the joined chunks, and the folded stream is the frame."""
    frame = dumps(STREAM_ERROR)
    decode = [dumps(chunk(k, k + 1, cumulative=cumulative)) for k in range(sent)] + [frame]
    joined = join(codec(OPTIONS), decode, [dumps(prefill_leg())])
    assert joined[-1] == (frame, Verdict.PASSTHROUGH)
    assert fold(codec, [body for body, _ in joined]) == frame


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
def test_a_pd_streamed_batch_ending_in_the_error_frame_publishes_it_as_sent_and_folds_to_it(codec):
    """The decode's streamed batch (items tagged ``index``) ends in ``stream_results``' frame: the
    items' chunks are joined with prefill's chunks of the same index, the frame (no index, no
    ``meta_info``) is published byte for byte, and the fold is the frame."""
    frame = dumps(STREAM_ERROR)
    prefill = [dumps({**prefill_leg(), "index": k}) for k in range(2)]
    decode = [dumps(chunk(0, 1, cumulative=False, index=k)) for k in range(2)] + [frame]
    joined = join(codec(OPTIONS), decode, prefill)
    assert [verdict for _, verdict in joined] == [Verdict.JOINED, Verdict.JOINED, Verdict.PASSTHROUGH]
    assert joined[-1][0] == frame
    assert fold(codec, [body for body, _ in joined]) == frame
