"""``Codec.answer_status``: the HTTP status the aggregated engine answers a unary error body with, read from
the body's own bytes, written by hand from the engines' code (no simulator, no ``upstream.py`` builders).

SGLang 0.5.23 ``/generate`` (``entrypoints/http_server.py``): ``_create_error_response`` answers a ``ValueError``
``ORJSONResponse({"error": {"message": str(e)}}, status_code=getattr(e, "status_code", HTTPStatus.BAD_REQUEST))``
(400: no ``ValueError`` on the path has a ``status_code``); ``generate_request``'s contract check answers
``ORJSONResponse(status_code=400, content={"error": contract_error})``; an abort whose ``status_code`` is in
``[400, 600)`` and not 400 raises ``fastapi.HTTPException(status_code, detail=message)``
(``TokenizerManager._handle_abort_finish_reason``), answered ``ORJSONResponse(content=ErrorResponse(
object="error", message=exc.detail, type=str(exc.status_code), code=exc.status_code).model_dump(),
status_code=exc.status_code)``.

vLLM 0.34.0 ``/inference/v1/generate`` (``scale_out/token_in_token_out/api_router.py``): ``JSONResponse(
content=generator.model_dump(), status_code=generator.error.code)``, and the app's handlers
``JSONResponse(err.model_dump(), status_code=err.error.code)``: ``{"error": {"message", "type", "param",
"code"}}``, compact, with the status in ``code``.
"""

from __future__ import annotations

import json
from http import HTTPStatus

import pytest
from helpers import upstream_json
from sglang_0523_bodies import TOO_LONG, stream_error_frame, unary_value_error
from streamproc_sglang import SGLangCodec
from streamproc_sglang_zstd import SGLangZstdCodec
from streamproc_vllm import VLLMCodec

from streamproc.codec import (ANSWER_MEDIA_TYPE, Codec, ErrorKind, answer_media_type_of, answer_status_of,
                              trailing_int)

SGLANG = [SGLangCodec(), SGLangZstdCodec()]


def sglang_error_response(message: str, status: object) -> bytes:
    """``validation_exception_handler`` (HTTPException) on ``/generate``: ``ErrorResponse`` fields in order."""
    return upstream_json({"object": "error", "message": message, "type": str(status), "param": None,
                          "code": status})


def vllm_error_response(message: str, error_type: str, status: object, param: str | None = None) -> bytes:
    """``JSONResponse(err.model_dump(), status_code=err.error.code)``: ``ErrorResponse{error: ErrorInfo}``."""
    return upstream_json({"error": {"message": message, "type": error_type, "param": param, "code": status}})


RETRACTED = "Retracted under decode memory pressure without a KV backup. Retry later."
# A generation body (``_handle_batch_output``), unary: answered with 200.
SGLANG_OK = upstream_json({"text": "Hi", "output_ids": [211], "meta_info": {
    "id": "r", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 4, "completion_tokens": 1}})
# An abort with a status whose body ``folds_alone`` sends to ``fold``: the body itself is no unary answer,
# and on its own answers 200 (it is served only when ``fold`` is not asked, as sent).
SGLANG_ABORT = upstream_json({"text": "", "output_ids": [], "meta_info": {
    "id": "r", "finish_reason": {"type": "abort", "message": RETRACTED, "status_code": 503, "err_type": None},
    "prompt_tokens": 4, "completion_tokens": 0}})


@pytest.mark.parametrize("codec", SGLANG, ids=lambda c: c.name)
@pytest.mark.parametrize(("body", "status"), [
    pytest.param(upstream_json(unary_value_error(TOO_LONG)), 400, id="value_error"),
    pytest.param(upstream_json({"error": "missing field `text` or `input_ids`"}), 400, id="contract_check"),
    pytest.param(upstream_json(stream_error_frame(TOO_LONG)), 400, id="stream_frame_as_sent"),
    pytest.param(sglang_error_response(RETRACTED, 503), 503, id="abort_503"),
    pytest.param(sglang_error_response("KV transfer failed", 500), 500, id="abort_500"),
    pytest.param(sglang_error_response("x" * 100_000, 599), 599, id="long_message_599"),
    pytest.param(upstream_json({"object": "error", "message": "bad", "type": "Bad Request", "param": None,
                                "code": 400}), 400, id="request_validation"),
    pytest.param(SGLANG_OK, 200, id="generation"),
    pytest.param(SGLANG_ABORT, 200, id="abort_body_itself"),
    pytest.param(upstream_json([json.loads(SGLANG_OK)]), 200, id="unary_batch_list"),
])
def test_sglang_answers_its_unary_error_bodies_with_the_status_sglang_answers_them_with(codec, body, status):
    assert codec.answer_status(body) == status


@pytest.mark.parametrize("codec", SGLANG, ids=lambda c: c.name)
def test_sglang_answer_status_of_a_folded_stream_is_the_unary_errors(codec):
    """``fold`` writes what the same request answers unary; its status follows: the frame's message alone
    (400), an abort's ``ErrorResponse`` (its status)."""
    folded = codec.fold([upstream_json(stream_error_frame("boom"))])
    assert (folded, codec.answer_status(folded)) == (upstream_json(unary_value_error("boom")), 400)
    folded = codec.fold([SGLANG_ABORT])
    assert (folded, codec.answer_status(folded)) == (sglang_error_response(RETRACTED, 503), 503)


@pytest.mark.parametrize(("body", "status"), [
    pytest.param(vllm_error_response("Internal server error", "InternalServerError", 500), 500, id="generation_error"),
    pytest.param(vllm_error_response("Please retry", "ServiceUnavailableError", 503), 503, id="retryable"),
    pytest.param(vllm_error_response("prompt_logprobs > max", "BadRequestError", 400, "prompt_logprobs"), 400,
                 id="validation_with_param"),
    pytest.param(vllm_error_response("Not Found", "Not Found", 404), 404, id="http_exception"),
    pytest.param(vllm_error_response("é" * 50_000, "InternalServerError", 500), 500, id="long_message"),
    pytest.param(json.dumps({"error": {"message": "m", "type": "InternalServerError", "param": None,
                                       "code": 500}}).encode(), 500, id="stream_frame_spacing"),
    pytest.param(upstream_json({"request_id": "r", "choices": [{"index": 0, "token_ids": [1],
                                                                 "finish_reason": "length"}]}), 200, id="generation"),
])
def test_vllm_answers_its_error_response_with_its_code(body, status):
    assert VLLMCodec().answer_status(body) == status


def test_vllm_answer_status_of_a_folded_error_frame_is_its_code():
    frame = json.dumps({"error": {"message": "Service Unavailable", "type": "ServiceUnavailableError",
                                  "param": None, "code": 503}}).encode()
    codec = VLLMCodec()
    folded = codec.fold([frame])
    assert codec.answer_status(folded) == 503


HOSTILE = [200, 99, 999, 600, 399, 0, -500, 10**30, 10**6, "abc", "503", 503.0, True, None, [503], {"x": 503}]


@pytest.mark.parametrize("claim", HOSTILE, ids=repr)
def test_a_claimed_status_outside_400_to_599_answers_200(claim):
    """A worker's body claiming a status no engine answers an error with cannot make an invalid status line:
    vLLM's and SGLang's ``ErrorResponse`` with such a ``code`` answer 200 (the body as a result like any
    other); SGLang's ``{"error": ...}`` is 400 whatever it claims (the shape is only written with 400)."""
    assert VLLMCodec().answer_status(vllm_error_response("m", "X", claim)) == 200
    for codec in SGLANG:
        assert codec.answer_status(sglang_error_response("m", claim)) == 200
        assert codec.answer_status(upstream_json({"error": {"message": "m", "code": claim}})) == 400


@pytest.mark.parametrize("body", [
    b'{"error":{"message":"m","type":"X","param":null,"code":503}}  \n',  # trailing whitespace
    b'{"error" : { "message" : "m" , "code" : 503 } }',
])
def test_whitespace_between_tokens_is_read(body):
    assert VLLMCodec().answer_status(body) == 503


def test_the_code_must_be_the_envelopes_last_member_in_the_bodys_tail():
    """``code`` anywhere else (inside the message, not last, not closing the envelope) is not read: the look
    is the last 64 bytes."""
    codec = VLLMCodec()
    assert codec.answer_status(b'{"error":{"message":"\\"code\\":503}}","type":"X"}}') == 200
    assert codec.answer_status(b'{"error":{"code":503,"message":"m"}}') == 200
    assert codec.answer_status(b'{"error":{"message":"m","code":503}}' + b" " * 64) == 200
    assert codec.answer_status(b'{"error":{"message":"m","code":503}') == 200  # one brace: not the envelope
    assert codec.answer_status(b'{"request_id":"r","error":{"code":503}}') == 200  # opens as no ErrorResponse
    for sglang in SGLANG:
        assert sglang.answer_status(b'{"object":"error","code":503,"message":"m"}') == 200
        assert sglang.answer_status(b'{"object":"other","message":"m","code":503}') == 200
        assert sglang.answer_status(b'{"text":"{\\"error\\":1}","meta_info":{}}') == 200


def test_trailing_int_reads_only_the_tail():
    assert trailing_int(b'{"a":1,"k":42}', b'"k"', 1) == 42
    assert trailing_int(b'{"a":{"k":42}}', b'"k"', 2) == 42
    assert trailing_int(b'{"a":{"k":42}}', b'"k"', 1) is None
    assert trailing_int(b'{"k":' + b"1" * 21 + b"}", b'"k"', 1) is None  # more than 20 digits
    body = b'{"k":42' + b" " * 100 + b"}"
    assert trailing_int(body, b'"k"', 1) is None
    assert trailing_int(body, b'"k"', 1, tail=200) == 42


@pytest.mark.parametrize("codec", [*SGLANG, VLLMCodec()], ids=lambda c: c.name)
def test_only_the_first_32_bytes_are_looked_at_for_an_error_opening(codec):
    """The look is a prefix and a suffix (the edge calls it on its event loop for every unary answer):
    an error envelope whose opening starts past the first 32 bytes is not seen (200), the same
    envelope with a little leading whitespace is."""
    envelope = vllm_error_response("m", "X", 503) if codec.name == "vllm" else sglang_error_response("m", 503)
    assert answer_status_of(codec, b" " * 4 + envelope) == 503
    assert answer_status_of(codec, b" " * 40 + envelope) == 200


class _Liar(Codec):
    """A codec (a third party's) whose ``answer_status`` returns whatever the body says."""

    name = "liar"

    def open_session(self):
        raise NotImplementedError

    def fold(self, bodies):
        raise NotImplementedError

    def error_body(self, message: str, kind: ErrorKind) -> bytes:
        return b"{}"

    def answer_status(self, body: bytes):
        return json.loads(body)


@pytest.mark.parametrize(("claim", "status"), [(503, 503), (400, 400), (599, 599), *((c, 200) for c in HOSTILE)])
def test_answer_status_of_takes_only_an_error_status(claim, status):
    assert answer_status_of(_Liar(), json.dumps(claim).encode()) == status


def test_the_default_codec_answers_200():
    class Plain(_Liar):
        answer_status = Codec.answer_status

    assert answer_status_of(Plain(), vllm_error_response("m", "X", 503)) == 200


class _Enum(_Liar):
    """A codec that answers with ``http.HTTPStatus`` members, as the engines' own code writes its statuses
    (SGLang's ``HTTPStatus.BAD_REQUEST``, vLLM's ``HTTPStatus.SERVICE_UNAVAILABLE``)."""

    def answer_status(self, body: bytes):
        return HTTPStatus(json.loads(body))


@pytest.mark.parametrize(("claim", "status"), [(503, 503), (400, 400), (500, 500), (200, 200), (302, 200), (204, 200)])
def test_an_http_status_member_is_taken_as_its_number(claim, status):
    """``HTTPStatus`` is an ``int``: ``HTTPStatus.SERVICE_UNAVAILABLE`` is 503, not a non-integer answered 200
    (until 2026-12-06 ``answer_status_of`` took only an exact ``int``); the answer is a plain ``int``."""
    answered = answer_status_of(_Enum(), json.dumps(claim).encode())
    assert (answered, type(answered)) == (status, int)


# The engines' API-key middleware, written as they write it: SGLang's ORJSONResponse and vLLM's
# JSONResponse of {"error": "Unauthorized"} (401) and, SGLang only, {"error": "Forbidden"} (403).
@pytest.mark.parametrize("codec", SGLANG, ids=lambda c: c.name)
@pytest.mark.parametrize("refusal", ["Unauthorized", "Forbidden"])
def test_sglang_api_key_refusal_of_the_worker_is_answered_as_a_bad_gateway_not_as_the_clients_401(codec, refusal):
    """The engine refused the worker's key: the worker's fault (502), never 401/403, which at the edge
    say the client's own token was refused (and were answered 400 as any ``{"error":`` body before)."""
    body = upstream_json({"error": refusal})
    assert answer_status_of(codec, body) == 502
    assert answer_status_of(codec, upstream_json({"error": refusal + "!"})) == 400  # another {"error": body


def test_vllm_api_key_refusal_of_the_worker_is_answered_as_a_bad_gateway_not_as_the_clients_401():
    """vLLM answers ``/inference`` without the key ``{"error":"Unauthorized"}`` with 401 (was answered 200)."""
    codec = VLLMCodec()
    assert answer_status_of(codec, upstream_json({"error": "Unauthorized"})) == 502
    assert answer_status_of(codec, upstream_json({"error": "Forbidden"})) == 200  # vLLM writes no such body


class Unhashable(bytes):
    """A body whose hashing fails the test: hashing reads every byte (~20 ms for 64 MiB)."""

    def __hash__(self) -> int:
        raise AssertionError("the body was hashed whole")


@pytest.mark.parametrize("codec", [*SGLANG, VLLMCodec()], ids=lambda c: c.name)
def test_the_refusal_check_does_not_hash_a_large_body(codec):
    """The refusal check tests the length first (a set lookup hashes the whole body)."""
    body = Unhashable(b'{"text":"' + b"x" * (1 << 20) + b'"}')
    assert answer_status_of(codec, body) == 200


@pytest.mark.parametrize("claim", [401, 403, 407, HTTPStatus.UNAUTHORIZED])
def test_a_claimed_client_credential_status_is_answered_as_a_worker_fault(claim):
    """401/403/407 from the edge say the client's own credentials were refused: a body claiming one
    is the worker's credentials towards its engine, answered 502."""
    assert answer_status_of(_Liar(), json.dumps(claim).encode()) == 502
    assert answer_status_of(SGLangCodec(), sglang_error_response("no", claim)) == 502
    assert answer_status_of(VLLMCodec(), vllm_error_response("no", "Unauthorized", claim)) == 502


# Starlette's ``ServerErrorMiddleware.error_response``: ``PlainTextResponse("Internal Server Error",
# status_code=500)``, what SGLang 0.5.23's unary ``/generate`` answers an exception that is no
# ``ValueError`` with (``serve_generate_request`` catches ``ValueError`` only; no ``Exception`` handler).
STARLETTE_500 = b"Internal Server Error"
PLAIN_TEXT = "text/plain; charset=utf-8"  # PlainTextResponse.media_type, with the charset init_headers adds


@pytest.mark.parametrize("codec", SGLANG, ids=lambda c: c.name)
def test_sglang_plain_text_internal_server_error_is_answered_500_as_plain_text(codec):
    """The engine answers it 500 ``text/plain; charset=utf-8``; the edge answered it 200 as JSON."""
    assert (answer_status_of(codec, STARLETTE_500), answer_media_type_of(codec, STARLETTE_500)) == (500, PLAIN_TEXT)


@pytest.mark.parametrize("codec", SGLANG, ids=lambda c: c.name)
@pytest.mark.parametrize("body", [STARLETTE_500 + b"\n", b" " + STARLETTE_500, b"Internal Server Error!",
                                  upstream_json("Internal Server Error"), upstream_json({"text": "Internal Server Error"}),
                                  SGLANG_OK, sglang_error_response(RETRACTED, 503)])
def test_sglang_answers_only_the_exact_plain_text_body_as_plain_text(codec, body):
    """Every other body is JSON (a generation body, an error envelope, a text that says it)."""
    assert answer_media_type_of(codec, body) == ANSWER_MEDIA_TYPE == "application/json"
    if body != sglang_error_response(RETRACTED, 503):
        assert answer_status_of(codec, body) == 200


def test_vllm_answers_every_body_as_json_its_unhandled_exception_too():
    """vLLM 0.34.0 registers ``exception_handler`` for ``Exception`` (``init_exception_handler``), so an
    unhandled exception is ``JSONResponse(create_error_response(exc).model_dump(), status_code=500)``:
    no plain-text answer to mirror."""
    codec = VLLMCodec()
    unhandled = vllm_error_response("boom", "InternalServerError", 500)
    assert (answer_status_of(codec, unhandled), answer_media_type_of(codec, unhandled)) == (500, ANSWER_MEDIA_TYPE)
    assert answer_media_type_of(codec, STARLETTE_500) == ANSWER_MEDIA_TYPE


class _MediaLiar(_Liar):
    """A codec whose ``answer_media_type`` returns whatever the body says."""

    def answer_media_type(self, body: bytes):
        return json.loads(body)


@pytest.mark.parametrize(("claim", "media_type"), [
    ("text/plain; charset=utf-8", "text/plain; charset=utf-8"),
    ("application/problem+json", "application/problem+json"),
    ("text/plain;charset=utf-8", "text/plain;charset=utf-8"),
    ("application/json; charset=utf-8", "application/json; charset=utf-8"),
    ("text/plain", "text/plain"),
    ("text/html", ANSWER_MEDIA_TYPE),
    ("text/html; charset=utf-8", ANSWER_MEDIA_TYPE),
    ("image/svg+xml", ANSWER_MEDIA_TYPE),
    ("application/xhtml+xml", ANSWER_MEDIA_TYPE),
    ("text/xml", ANSWER_MEDIA_TYPE),
    ("application/javascript", ANSWER_MEDIA_TYPE),
    ("text/plain; boundary=x", ANSWER_MEDIA_TYPE),
    ("application/json; charset=utf-8; a=b", ANSWER_MEDIA_TYPE),
    ("text/plain\r\nSet-Cookie: a=b", ANSWER_MEDIA_TYPE),
    ("text/plain; charset=\"utf-8\"", ANSWER_MEDIA_TYPE),
    ("t\u00e9xt/plain", ANSWER_MEDIA_TYPE),
    ("text", ANSWER_MEDIA_TYPE),
    ("", ANSWER_MEDIA_TYPE),
    ("text/" + "x" * 100, ANSWER_MEDIA_TYPE),
    (None, ANSWER_MEDIA_TYPE),
    (503, ANSWER_MEDIA_TYPE),
    (["text/plain"], ANSWER_MEDIA_TYPE),
])
def test_answer_media_type_of_takes_only_a_media_type(claim, media_type):
    """A codec names a Content-Type, never a header that splits the response or fails to encode, nor
    one a browser renders as active content: a worker's body choosing ``text/html`` or ``image/svg+xml``
    through a codec would be stored XSS at the edge's origin. JSON and plain text only."""
    assert answer_media_type_of(_MediaLiar(), json.dumps(claim).encode()) == media_type


def test_the_default_codec_answers_json():
    assert answer_media_type_of(_Liar(), STARLETTE_500) == ANSWER_MEDIA_TYPE
