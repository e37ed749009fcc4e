"""The built-in ``vllm`` codec: vLLM's native ``/inference/v1/generate`` response format.

Field rules are documented in ``docs/formats-vllm.md``. Sequence fields are looked up in the
``sequence_codecs`` registry, so a derived format that ships ``routed_experts`` differently only
replaces that one entry and inherits the join, fold and error envelope.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import ClassVar, Mapping, Sequence

from streamproc.codec import (DEFAULT_MAX_DECOMPRESSED_BYTES, Codec, CodecOptions, Emitted, ErrorKind, JoinSession,
                              MigrationSession, RoutedExperts, SequenceCodec, final_error_body, is_error_status,
                              trailing_int)
from streamproc.wire import Verdict

from . import experts, migration
from .native import (ROUTED_EXPERTS, STREAM_ROUTED_EXPERTS_OPTION, StreamExperts, dump, error_response_prefix,
                     is_error_response, parse, parse_object, stream_chunk, stream_error_frame)
from .fold import fold_objects
from .join import VLLMJoinSession
from .sequence import Base64Npy

# ``ErrorResponse.error.type`` for each HTTP status (``ErrorKind.http_status``, the one table the
# edge answers with, so the envelope's ``code`` always equals the status line). vLLM's
# ``OpenAIServing.create_error_response`` names 400/500/503 ``BadRequestError``,
# ``InternalServerError`` and ``ServiceUnavailableError``; for 502/504 the names are those KServe's
# OpenAI proxy uses over the same ErrorResponse model (``BadGateway``, ``GatewayTimeout``).
ERROR_TYPES: Mapping[int, str] = {
    400: "BadRequestError",
    500: "InternalServerError",
    502: "BadGateway",
    503: "ServiceUnavailableError",
    504: "GatewayTimeout",
}

# The status of vLLM 0.34.0's unary error answer on ``/inference/v1/generate``
# (``scale_out/token_in_token_out/api_router.py``, ``generate``)::
#
#     generator = await handler.serve_tokens(request, raw_request)
#     if isinstance(generator, ErrorResponse):
#         return JSONResponse(content=generator.model_dump(), status_code=generator.error.code)
#
# and every exception the app's handlers answer (``serve/exception_handling/handlers``: ``exception_handler``,
# ``engine_error_handler``, ``generation_error_handler``: ``err = create_error_response(exc); return
# JSONResponse(err.model_dump(), status_code=err.error.code)``; ``http_exception_handler``: ``ErrorInfo(...,
# code=exc.status_code)`` with ``status_code=exc.status_code``; ``validation_exception_handler``: ``code=400``,
# status 400): the status is always ``ErrorResponse.error.code``. ``ErrorInfo``'s fields are ``message, type,
# param, code``, and ``model_dump`` keeps that order: ``JSONResponse`` (compact) ends the body ``"code":503}}``,
# which ``fold`` writes too. A ``code`` outside ``[400, 600)`` is nothing vLLM writes: 200.
# No plain-text answer (SGLang's Starlette ``Internal Server Error``, ``streamproc_sglang.codec.SERVER_ERROR``)
# has an equivalent here: ``init_exception_handler`` (``serve/exception_handling/register.py``) registers
# ``app.exception_handler(Exception)(exception_handler)``, which Starlette installs as
# ``ServerErrorMiddleware``'s handler, so an unhandled exception is answered ``create_error_response(exc)``
# (``InternalServerError``, 500) as JSON too: the default ``answer_media_type`` (``application/json``) holds.
CODE_KEY = b'"code"'  # ErrorInfo.code
ANSWER_TAIL = 64


# The engine's API-key middleware (``--api-key``), vLLM 0.34.0
# ``entrypoints/serve/middleware/authenticate.py`` ``AuthenticationMiddleware.__call__``: a request under
# ``/inference`` (the format's ``/inference/v1/generate``) without the key is answered
# ``JSONResponse(content={"error": "Unauthorized"}, status_code=401)``. It refused the *worker's* request
# to its engine: a deployment fault, not the edge client's, so the edge answers 502 (Bad Gateway, as for
# a worker's invalid chunk) and never 401, which at the edge says the client's own token was refused.
AUTH_REFUSAL = b'{"error":"Unauthorized"}'


class VLLMCodec(Codec):
    name = "vllm"
    description = "vLLM native generate: routed_experts as Base64 .npy, prompt logprobs from prefill"
    sequence_codecs: ClassVar[Mapping[str, type[SequenceCodec]]] = {ROUTED_EXPERTS: Base64Npy}
    option_keys: ClassVar[frozenset[str] | None] = frozenset({STREAM_ROUTED_EXPERTS_OPTION})
    # The session counts token_ids across chunks (VLLMJoinSession.published): a take-over's heir
    # reads back the bodies published before it, or decides the final chunk's rows on part of them.
    needs_published: ClassVar[bool] = True

    def __init__(self, options: CodecOptions | None = None) -> None:
        super().__init__(options)
        # Whether the workers' stream choices have routed_experts (their vLLM version): the join
        # cannot read it from a finishing chunk that lacks the key (native.StreamExperts).
        text = self.options.option(STREAM_ROUTED_EXPERTS_OPTION, StreamExperts.UNKNOWN)
        try:
            self.stream_experts = StreamExperts(text)
        except ValueError:
            raise ValueError(f"format option {STREAM_ROUTED_EXPERTS_OPTION}={text!r}: expected "
                             f"{StreamExperts.UNKNOWN}, {StreamExperts.YES} or {StreamExperts.NO}") from None

    def open_session(self) -> JoinSession:
        return VLLMJoinSession(self)

    def fold(self, bodies: Sequence[bytes]) -> bytes:
        """The unary equivalent of a stream's bodies. A lone body that is no JSON object is answered as
        sent: ``folds_alone`` sent it here on its opening alone, and the edge serves any other lone body
        as sent (a 500 ``cannot fold`` would make a worker's broken chunk the edge's failure)."""
        chunks = []
        for seq, body in enumerate(bodies):
            obj = parse_object(body)
            if obj is None:
                if len(bodies) == 1:
                    return bytes(body)
                parse(body)  # the parser's own complaint, when the body is no JSON at all
                raise ValueError(f"chunk {seq} is not a JSON object")
            chunks.append(obj)
        # The same request unary answers the error alone (``api_router.generate``: the exception reaches
        # the app's handlers, ``JSONResponse(err.model_dump())``); ``serve_tokens_stream_generator`` sends
        # only ``[DONE]`` after its frame, ``json.dumps`` of the same ``ErrorResponse`` (spaces, ASCII
        # escapes). ``dump`` writes it as starlette's ``JSONResponse.render`` does (``json.dumps(...,
        # ensure_ascii=False, separators=(",", ":"))``): the unary answer byte for byte.
        error_body = final_error_body(bodies, chunks, is_error_response, "vLLM")
        if error_body is not None:
            return dump(chunks[-1])
        return dump(fold_objects(chunks))

    def folds_alone(self, body: bytes) -> bool:
        """A stream's only chunk that is ``serve_tokens_stream_generator``'s error frame (``AsyncLLM.generate``
        raised before any output): unary, the same request answers ``JSONResponse(err.model_dump())``, which
        :meth:`fold` writes. A bounded look at the first bytes (:func:`~.native.stream_error_frame`).

        Also any stream's only chunk (one engine step: ``max_tokens=1``, an EOS at once;
        :func:`~.native.stream_chunk`): it lacks the unary body's ``model``, ``created`` and prompt-side keys,
        which the fold of a longer stream writes, and a derender chunk has ``delta`` where the unary answer
        has ``message``."""
        return stream_error_frame(body) or stream_chunk(body)

    def answer_status(self, body: bytes) -> int:
        """``ErrorResponse.error.code`` for a body that opens ``{"error"`` (:func:`~.native.error_response_prefix`)
        and ends with it, the last member of ``error`` (``CODE_KEY`` above), when it is in ``[400, 600)``; 502
        for the engine's API-key refusal (``AUTH_REFUSAL``); else 200. Reads the first 32 and the last
        ``ANSWER_TAIL`` (64) bytes only."""
        if body == AUTH_REFUSAL:  # (bytes equality tests the lengths first)
            return HTTPStatus.BAD_GATEWAY
        if not error_response_prefix(body):
            return 200
        status = trailing_int(body, CODE_KEY, 2, ANSWER_TAIL)
        return status if status is not None and is_error_status(status) else 200

    def error_body(self, message: str, kind: ErrorKind) -> bytes:
        code = ErrorKind(kind).http_status
        error_type = ERROR_TYPES.get(code, "InternalServerError")
        # ErrorResponse{error: ErrorInfo{message, type, param, code}}
        return dump({"error": {"message": message, "type": error_type, "param": None, "code": code}})

    # The edge's routed-experts view (``experts.py``), decoded with this instance's sequence codecs.
    experts_field = ROUTED_EXPERTS

    def routed_experts(self, body: bytes, *, verdict: Verdict | None = None,
                       limit: int = DEFAULT_MAX_DECOMPRESSED_BYTES) -> RoutedExperts:
        return experts.routed_experts(self, body, verdict, limit)

    # Migration (``migration.py``): the stitch reuses this instance's sequence codecs.

    def open_migration(self) -> MigrationSession:
        return migration.VLLMMigrationSession(self)

    def check_migratable(self, request: bytes) -> None:
        migration.check_request(request)

    def resume_request(self, request: bytes, emitted: Emitted) -> bytes:
        return migration.resume_request(request, emitted)
