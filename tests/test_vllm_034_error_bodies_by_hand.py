"""vLLM 0.34.0's error bodies on a native ``/inference/v1/generate`` stream or unary answer, written by hand.

Nothing here uses the simulator or ``streamproc_vllm.upstream``. Read from the vLLM 0.34.0 wheel (PyPI):

* Every error body is ``ErrorResponse(error=ErrorInfo(message, type, param, code))``
  (``entrypoints/serve/engine/protocol.py``), built by ``create_error_response``
  (``serve/exception_handling/error_response.py``): ``GenerationError`` -> ``InternalServerError``/500
  (``ServiceUnavailableError``/503 for ``RetryableRequestError``), ``EngineDeadError`` ->
  ``InternalServerError``/500 with ``CLIENT_MESSAGE``, any other ``VLLMServerError`` (``EngineGenerateError()``,
  whose ``str`` is ``""``) -> ``InternalServerError``/500, ``VLLMValidationError`` -> ``BadRequestError``/400 with
  ``param = exc.parameter``, ``GracefulHTTPError`` -> ``HTTPStatus(...).phrase``. No 0.34.0 path renders the
  flat ``{"object": "error", ...}`` of vLLM <= 0.10.0 (``grep`` of ``vllm/entrypoints``).
* Stream (``scale_out/token_in_token_out/serving.py`` ``serve_tokens_stream_generator``)::

      except GenerationError as e:
          yield f"data: {self._convert_generation_error_to_streaming_response(e)}\\n\\n"
      except Exception as e:
          ...
          data = self.create_streaming_error_response(e)
          yield f"data: {data}\\n\\n"
      yield "data: [DONE]\\n\\n"

  ``create_streaming_error_response`` is ``json.dumps(self.create_error_response(...).model_dump())``:
  default separators, ASCII escapes. ``_raise_if_error`` raises ``GenerationError("Internal server
  error")`` for an output whose ``finish_reason`` is ``"error"`` before that output is rendered, so no
  body carries ``finish_reason: "error"``: the frame ends the stream behind the chunks already sent (with
  ``n > 1``, a sibling's finished choice included). An exception of ``AsyncLLM.generate`` (a
  ``VLLMValidationError`` from ``SamplingParams.verify``, e.g. ``prompt_logprobs`` above the server's
  ``--max-logprobs``; ``EngineDeadError``; ``EngineGenerateError``) arrives the same way, before the first
  chunk or after some.
* Unary (``api_router.generate``): an ``ErrorResponse`` returned by ``serve_tokens`` is
  ``JSONResponse(content=generator.model_dump(), status_code=generator.error.code)``; what
  ``serve_tokens_full_generator`` raises (``_raise_if_error``; ``generate``'s exceptions; ``_preflight``'s
  ``dead_error`` and ``check_admission``, for stream requests too) reaches the app's handlers
  (``vllm_error_handler`` -> ``engine_error_handler`` / ``generation_error_handler`` / ``exception_handler``):
  ``JSONResponse(err.model_dump(), status_code=err.error.code)``, compact. The same failure answers the
  error alone, none of the output produced before it.
"""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from helpers import drive_join as join
from helpers import upstream_json as unary_error
from streamproc_vllm import VLLMCodec

from streamproc.codec import CodecOptions
from streamproc.testing.harness import leg, run_pipeline
from streamproc.wire import Verdict

OPTIONS = CodecOptions(max_decompressed_bytes=1 << 20)
RID = "generate-tokens-e1"
PROMPT = 6
OUT = [71, 72, 73]


def info(message: str, type_: str, code: int, param: str | None = None) -> dict:
    """``ErrorResponse(error=ErrorInfo(message=..., type=..., code=..., param=...)).model_dump()``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# ``_raise_if_error``: ``GenerationError("Internal server error")``.
GENERATION = info("Internal server error", "InternalServerError", 500)
# ``EngineDeadError``: ``message = exc.CLIENT_MESSAGE``.
ENGINE_DEAD = info("The server had an error while processing your request.", "InternalServerError", 500)
# ``AsyncLLM.generate``: ``raise EngineGenerateError() from e`` (no message).
ENGINE_GENERATE = info("", "InternalServerError", 500)
# ``SamplingParams._validate_logprobs`` on a server with ``--max-logprobs 20``; ``VLLMValidationError.__str__``
# appends ``(parameter=..., value=...)``.
TOO_MANY_PROMPT_LOGPROBS = info("Requested prompt logprobs of 21, which is greater than max allowed: 20 "
                                "(parameter=prompt_logprobs, value=21)", "BadRequestError", 400, "prompt_logprobs")
# ``AsyncLLM.check_admission`` (``_preflight``): ``QueueOverflowError``, a ``GracefulHTTPError``.
QUEUE_FULL = info("The engine is currently busy and cannot accept new requests. Please try again later or on a "
                  "different instance.", "Service Unavailable", 503)

STREAM_ERRORS = {"generation": GENERATION, "engine_dead": ENGINE_DEAD, "engine_generate": ENGINE_GENERATE,
                 "too_many_prompt_logprobs": TOO_MANY_PROMPT_LOGPROBS}


def frame(doc: dict) -> bytes:
    """``create_streaming_error_response``: ``json.dumps(...model_dump())``, spaces and all."""
    return json.dumps(doc).encode()


def npy_b64(arr: np.ndarray) -> str:
    """``numpy2base64``: ``np.save(buffer, array, allow_pickle=False)``, then Base64."""
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def expert_rows(start: int, end: int) -> str:
    """Rows of positions [start, end), 2 layers, top-2, distinct ids within each (position, layer)."""
    ids = [[[(p * 3 + layer * 5) % 60 + k * 64 for k in range(2)] for layer in range(2)] for p in range(start, end)]
    return npy_b64(np.asarray(ids, dtype=np.uint8))


def choice(index: int, out: list[int], finish: str | None, experts: str | None) -> dict:
    """``GenerateTokensChoice`` / ``GenerateTokensStreamChoice`` (``GenerateChoiceBase`` fields, ``logprobs``)."""
    return {"index": index, "finish_reason": finish, "stop_reason": None, "token_ids": out,
            "routed_experts": experts, "sampling_mask": None, "weight_versions": None, "logprobs": None}


def usage(completion: int, cached: int, *, exclude_none: bool) -> dict:
    """``UsageInfo`` with ``PromptTokenUsageInfo(cached_tokens=...)`` (``--enable-prompt-tokens-details``)."""
    details = {"cached_tokens": cached}
    if not exclude_none:
        details |= {"created_cache_tokens": None, "multimodal_tokens": None}
    body = {"prompt_tokens": PROMPT, "total_tokens": PROMPT + completion, "completion_tokens": completion,
            "prompt_tokens_details": details}
    return body if exclude_none else body | {"completion_tokens_details": None}


def prompt_logprobs() -> list:
    """``prompt_logprobs=1``: ``None`` for position 0, then ``{token: Logprob}`` per position."""
    return [None, *({str(300 + p): {"logprob": -0.5 - p, "rank": 1, "decoded_token": None}}
                    for p in range(1, PROMPT))]


def unary(choices: list[dict], *, completion: int, cached: int, kv: dict | None = None) -> bytes:
    """``serve_tokens_full_generator`` -> ``GenerateTokensResponse``, ``JSONResponse(model_dump())``."""
    return unary_error({"request_id": RID, "model": "m", "created": 1700000000,
                        "usage": usage(completion, cached, exclude_none=False), "prompt_logprobs": prompt_logprobs(),
                        "prompt_token_id_logprobs": None, "prompt_token_ids": None, "mm_placeholders": None,
                        "metrics": None, "kv_transfer_params": kv, "ec_transfer_params": None,
                        "output_mode": "tokens", "choices": choices})


def chunk(choices: list[dict]) -> bytes:
    """A token chunk of ``serve_tokens_stream_generator``: ``model_dump_json(exclude={...None fields})``."""
    return unary_error({"request_id": RID, "usage": None, "output_mode": "tokens", "choices": choices})


def usage_chunk(completion: int, cached: int) -> bytes:
    """The ``choices: []`` chunk after the engine's loop (``include_usage``), ``exclude_none=True``."""
    return unary_error({"request_id": RID, "usage": usage(completion, cached, exclude_none=True),
                        "output_mode": "tokens", "choices": []})


def prefill_answer(n: int = 1) -> bytes:
    """A P/D prefill leg (``max_tokens=1``): its prompt rows [0, P) per choice, its own cache hit."""
    return unary([choice(i, [OUT[0]], "length", expert_rows(0, PROMPT)) for i in range(n)], completion=n, cached=0,
                 kv={"do_remote_prefill": True, "remote_prefill_cached_tokens": 0})


def decode_answer(n: int = 1) -> bytes:
    """The P/D decode's unary answer: rows [0, P + O - 1) (stale prompt rows), its KV load counted as cached."""
    return unary([choice(i, OUT, "stop", expert_rows(0, PROMPT + len(OUT) - 1)) for i in range(n)],
                 completion=n * len(OUT), cached=PROMPT - 1)


def partial_stream(n: int = 1) -> list[bytes]:
    """Token chunks sent before a failure: with ``n > 1`` choice 0 finished (rows on its finishing chunk)
    while choice 1 was still running."""
    bodies = [chunk([choice(0, OUT[:1], None, None)]), chunk([choice(0, OUT[1:], "stop", expert_rows(0, 8))])]
    if n > 1:
        bodies.insert(1, chunk([choice(1, OUT[:1], None, None)]))
    return bodies


def fold(bodies: list[bytes]) -> bytes:
    return VLLMCodec(OPTIONS).fold(bodies)


# ------------------------------------------------------------------------------ aggregated stream and fold


# A message with non-ASCII text (``json.dumps`` escapes it in the frame, ``JSONResponse`` writes it raw).
NON_ASCII = info("Requested prompt logprobs of 21, which is greater than max allowed: 20 « é » 😀",
                 "BadRequestError", 400, "prompt_logprobs")
FOLDED_ERRORS = {**STREAM_ERRORS, "non_ascii": NON_ASCII}


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("kind", sorted(FOLDED_ERRORS))
def test_a_stream_ending_in_the_error_frame_folds_to_the_unary_error_body_not_a_partial_answer(kind, n):
    """Unary, the same failure answers ``ErrorResponse`` alone, rendered by ``JSONResponse`` (compact, raw
    UTF-8); the fold merged the frame into the output sent before it (an ``error`` key beside a partial
    answer), then (until 2026-12-06) answered the frame as ``json.dumps`` wrote it, spaces and escapes."""
    assert fold([*partial_stream(n), frame(FOLDED_ERRORS[kind])]) == unary_error(FOLDED_ERRORS[kind])


@pytest.mark.parametrize("kind", sorted(FOLDED_ERRORS))
def test_a_stream_that_failed_before_its_first_chunk_folds_alone_to_the_unary_error_body(kind):
    """``AsyncLLM.generate`` raised at once (``add_request``: ``SamplingParams.verify``, a dead engine):
    the stream is the frame and ``[DONE]``. The edge serves a one-result stream verbatim unless
    ``folds_alone`` says otherwise; the unary request answers ``JSONResponse(err.model_dump())``. Before,
    the fold made a body with ``choices: []`` and ``null`` fields, then the edge served the frame."""
    error = frame(FOLDED_ERRORS[kind])
    assert VLLMCodec(OPTIONS).folds_alone(error)
    assert fold([error]) == unary_error(FOLDED_ERRORS[kind])


@pytest.mark.parametrize("doc", [QUEUE_FULL, ENGINE_DEAD, NON_ASCII])
def test_a_unary_error_body_is_answered_as_sent(doc):
    """``JSONResponse``'s rendering (``serve_tokens``' ``ErrorResponse``, ``_preflight``'s for a stream
    request too) already is the unary answer: ``folds_alone`` leaves it to the edge, and ``fold`` keeps it."""
    body = unary_error(doc)
    assert not VLLMCodec(OPTIONS).folds_alone(body)
    assert fold([body]) == body
    assert fold([*partial_stream(), body]) == body


def test_a_unary_generation_body_alone_is_not_sent_to_the_fold_and_a_stream_chunk_is():
    """The unary ``GenerateTokensResponse`` (``request_id``, then ``model``) is the unary answer; a stream's
    only chunk (``request_id``, then ``usage``) lacks its top-level keys and is folded (until 2026-12-06 a
    tokens chunk was not)."""
    unary = unary_error({"request_id": RID, "model": "m", "created": 1, "usage": None, "output_mode": "tokens",
                         "choices": [choice(0, OUT, "stop", None)]})
    assert not VLLMCodec(OPTIONS).folds_alone(unary)
    assert VLLMCodec(OPTIONS).folds_alone(chunk([choice(0, OUT, "stop", None)]))
    assert not VLLMCodec(OPTIONS).folds_alone(b' {"request_id": "x", "error": {"message": "m"}}')


def test_chunks_after_the_error_frame_are_no_stream_vllm_writes_and_cannot_be_folded():
    """``serve_tokens_stream_generator`` yields only ``[DONE]`` after its frame."""
    with pytest.raises(ValueError, match="error"):
        fold([partial_stream()[0], frame(GENERATION), partial_stream()[1]])


@pytest.mark.parametrize("body", [frame(GENERATION), unary_error(QUEUE_FULL), unary_error(ENGINE_DEAD)])
def test_an_aggregated_error_body_passes_through_byte_for_byte(body):
    """The correlator publishes an aggregated leg as sent, the error frame behind the chunks included."""
    bodies = [*partial_stream(2), body]
    run = run_pipeline(leg(RID, "agg", bodies), format="vllm", options=OPTIONS)
    assert [(r.body, r.verdict) for r in run.of(RID)] == [(b, Verdict.PASSTHROUGH) for b in bodies]


# ------------------------------------------------------------------------------ P/D: the prefill leg failed


# Every leg a failed 0.34.0 prefill sends instead of a generation answer (P/D prefill requests are unary;
# a streamed one ends in the frame, behind what it sent).
PREFILL_ERRORS = {
    "unary_generation": [unary_error(GENERATION)],
    "unary_engine_dead": [unary_error(ENGINE_DEAD)],
    "unary_too_many_prompt_logprobs": [unary_error(TOO_MANY_PROMPT_LOGPROBS)],  # its --max-logprobs only
    "unary_queue_full": [unary_error(QUEUE_FULL)],
    "stream_frame_alone": [frame(TOO_MANY_PROMPT_LOGPROBS)],
    "stream_frame_after_chunks": [*partial_stream(2), frame(GENERATION)],
}


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("shape", sorted(PREFILL_ERRORS))
def test_a_prefill_leg_that_answered_an_error_body_is_prefill_error_never_missing(shape, n):
    """No prefill value exists: decode's stale prompt rows, unwritten prompt logprobs and KV-load cache count
    are removed, each with ``prefill_error`` (the leg failed); they read ``prefill_missing`` (the leg did
    not carry the field), as if a router had stripped the parameter."""
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [decode_answer(n)], PREFILL_ERRORS[shape])
    joined = json.loads(body)
    assert verdict is Verdict.OMITTED
    assert joined["prompt_logprobs"] is None
    assert joined["prompt_logprobs_unavailable_reason"] == "prefill_error"
    assert joined["usage"]["prompt_tokens_details"] is None
    assert joined["usage"]["prompt_tokens_details_unavailable_reason"] == "prefill_error"
    assert [c["routed_experts"] for c in joined["choices"]] == [None] * n
    assert [c["routed_experts_unavailable_reason"] for c in joined["choices"]] == ["prefill_error"] * n


def test_a_streamed_decode_against_a_failed_prefill_omits_its_rows_and_count_as_prefill_error():
    """The finishing chunk's rows and the usage chunk's count; the token chunks carry neither."""
    decode = [chunk([choice(0, OUT[:1], None, None)]),
              chunk([choice(0, OUT[1:], "stop", expert_rows(0, PROMPT + len(OUT) - 1))]),
              usage_chunk(len(OUT), PROMPT - 1)]
    joined = join(VLLMCodec(OPTIONS), decode, [unary_error(GENERATION)])
    assert joined[0] == (decode[0], Verdict.PASSTHROUGH)
    finishing, usage_only = (json.loads(body) for body, _ in joined[1:])
    assert [verdict for _, verdict in joined[1:]] == [Verdict.OMITTED, Verdict.OMITTED]
    assert finishing["choices"][0]["routed_experts_unavailable_reason"] == "prefill_error"
    assert usage_only["usage"]["prompt_tokens_details_unavailable_reason"] == "prefill_error"


def test_the_correlator_omits_a_decode_answer_against_a_failed_prefill_as_prefill_error():
    """The same through the correlator (legs in either order), not only a join session."""
    for chunks in (leg(RID, "prefill", [unary_error(ENGINE_DEAD)]) + leg(RID, "decode", [decode_answer()]),
                   leg(RID, "decode", [decode_answer()]) + leg(RID, "prefill", [unary_error(ENGINE_DEAD)])):
        [result] = run_pipeline(chunks, format="vllm", options=OPTIONS).of(RID)
        assert result.verdict is Verdict.OMITTED
        assert json.loads(result.body)["choices"][0]["routed_experts_unavailable_reason"] == "prefill_error"


# ------------------------------------------------------------------------------ P/D: the decode leg failed


DECODE_ERRORS = {
    "unary": [unary_error(GENERATION)],
    "unary_engine_dead": [unary_error(ENGINE_DEAD)],
    "frame_alone": [frame(ENGINE_GENERATE)],
    "frame_after_tokens": [*partial_stream(), frame(ENGINE_DEAD)],
    "frame_after_tokens_n2": [*partial_stream(2), frame(GENERATION)],
}


@pytest.mark.parametrize("prefill", ["answered", "failed", "timed_out"])
@pytest.mark.parametrize("shape", sorted(DECODE_ERRORS))
def test_a_decode_error_body_is_published_as_sent_and_the_joined_stream_folds_to_it(shape, prefill):
    """The decode worker's error is what the aggregated worker answers for the same failure: byte for byte,
    whatever prefill sent; a joined stream that ends in it folds to the unary rendering of the same
    ``ErrorResponse``, as the aggregated stream does."""
    decode = DECODE_ERRORS[shape]
    legs = {"answered": [prefill_answer(2 if shape.endswith("n2") else 1)], "failed": [unary_error(GENERATION)],
            "timed_out": None}
    joined = join(VLLMCodec(OPTIONS), decode, legs[prefill])
    assert joined[-1] == (decode[-1], Verdict.PASSTHROUGH)
    assert fold([body for body, _ in joined]) == unary_error(json.loads(decode[-1]))


@pytest.mark.parametrize("body", [unary_error(ENGINE_DEAD), frame(TOO_MANY_PROMPT_LOGPROBS)])
def test_a_decode_leg_that_failed_at_once_is_published_without_waiting_for_prefill(body):
    """Its join never reads the prefill leg, so it does not wait up to ``--prefill-timeout`` for one that
    may never come (the SGLang join does not wait for its error bodies either); it waited."""
    [result] = run_pipeline(leg(RID, "decode", [body]), format="vllm", options=OPTIONS).of(RID)
    assert (result.body, result.verdict, result.final) == (body, Verdict.PASSTHROUGH, True)


def test_an_error_frame_behind_a_waiting_decode_chunk_keeps_its_place():
    """The first chunk waits for prefill (its ``prompt_logprobs``); the frame after it is not published
    ahead of it, and both go once the leg comes."""
    decode = [*partial_stream(), frame(ENGINE_DEAD)]
    run = run_pipeline(leg(RID, "decode", decode), format="vllm", options=OPTIONS)
    assert run.of(RID) == []
    run.absorb(run.correlator.receive(leg(RID, "prefill", [prefill_answer()])[0], 1.0))
    assert [r.body for r in run.of(RID)][-1] == decode[-1]
    assert [r.seq for r in run.of(RID)] == [0, 1, 2]
