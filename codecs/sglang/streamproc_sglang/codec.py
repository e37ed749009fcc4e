"""The ``sglang`` codec: SGLang's native ``/generate`` bodies.

Subclasses change one field's wire encoding by overriding one entry of :attr:`SGLangCodec.sequence_codecs`
and inherit the join, folding and error envelope unchanged (``sglang-zstd`` is the worked example).
"""

from __future__ import annotations

import re
from http import HTTPStatus
from typing import ClassVar, Mapping, Sequence

from streamproc.codec import (ANSWER_MEDIA_TYPE, DEFAULT_MAX_DECOMPRESSED_BYTES, Codec, CodecOptions, Emitted,
                              ErrorKind, JoinSession, MigrationSession, RoutedExperts, SequenceCodec, final_error_body,
                              is_error_status, trailing_int)
from streamproc.wire import Verdict

from . import experts, migration, native
from .fold import abort_answer, fold, fold_items
from .join import SGLangJoinSession
from .sequence import Base64Int32Rows

STREAMING_OPTION = "streaming"  # --format-option streaming=cumulative|incremental
INDEX_KEY = b'"%s"' % native.INDEX.encode()  # a streamed batch item's tag, as JSON writes the key
# Where a streamed batch item's tag stands: ``_stream_batch_responses`` sets ``result["index"] = ...`` on
# the item's finished dict (``text``, ``output_ids``, ``meta_info``, ``prompt_token_ids``), so it is the
# last key (``"index":<int>}``, plus trailing whitespace); joins edit bodies in place (key order kept).
INDEX_TAIL = 64
# Where an abort's finish reason stands: ``_handle_abort_req`` and ``_handle_batch_output`` write
# ``meta_info`` with ``id`` then ``finish_reason`` first, behind ``text`` and ``output_ids`` and in front
# of the rest of ``meta_info`` (counts, latencies, and with the request's options logprobs, hidden
# states, routed experts) and ``prompt_token_ids``: anywhere in a long body, with megabytes on both
# sides of it when a long generation with logprobs is aborted with a status (``Scheduler.abort_request``
# on a running request with a message: ``FINISH_ABORT(message, HTTPStatus.SERVICE_UNAVAILABLE)``).
# Inside a JSON string a quote is escaped, so ``"finish_reason"`` followed by ``:`` is a key, and a body
# SGLang writes has one such key, ``meta_info``'s; a string ending in ``\"finish_reason`` (a text, a
# rid, a logprob's token) matches without being one. So the key is searched for from both ends at once,
# in chunks that double from ``FINISH_STEP``: the search stops at the key, having read about twice the
# bytes on its nearer side (a text-only answer's few hundred bytes of ``meta_info``, or the text and
# ids in front of a long ``routed_experts``), and a body without it is read once. After
# ``FINISH_CANDIDATES`` matches that are no key (nothing SGLang writes) ``fold`` decides.
FINISH_KEY = b'"%s"' % native.FINISH_REASON.encode()
FINISH_CANDIDATES = 16
FINISH_STEP = 4096
_WS = rb"[ \t\r\n]*"  # JSON's whitespace
IS_KEY = re.compile(_WS + b":")
# The finish reason of an abort with a status, matched at its key (``re.match``, no search):
# ``FINISH_ABORT.to_json()`` (``type, message, status_code, err_type``) and the scheduler's own dicts
# (``type, status_code, message``) write ``type`` first and flat members after it (strings, ``null``,
# integers); a status is an integer (``HTTPStatus``) or ``null``: here a number in ``[400, 600)``, not
# the start of a longer one. Possessive (``++``, ``*+``): no backtracking. The match reads at most
# ``FINISH_SPAN`` bytes from the key (the regex costs 10-17 ms per MiB on escapes or many members, ~40x
# ``bytes.find``): a finish reason is a few hundred bytes, but a message may quote the request (a
# grammar timeout names its ``grammar_key``, the client's JSON schema, in ``grammar_manager.py``), and
# an abort whose members run past the span without a status among them goes to ``fold``, which decides.
FINISH_SPAN = 4096
_STRING = rb'"(?:[^"\\]++|\\.)*+"'
_STATUS = b'"%s"' % native.STATUS_CODE.encode()
_ERROR_STATUS = b"".join((_STATUS, _WS, b":", _WS, rb"[45][0-9][0-9](?![0-9.eE])"))
_MEMBER = b"".join((_WS, b",", _WS, rb"(?!", _ERROR_STATUS, rb")", _STRING, _WS, b":", _WS,
                    rb"(?:", _STRING, rb"|[-+.0-9A-Za-z]++)"))  # any flat member but an error status
ABORT_OPENING = re.compile(b"".join((
    _WS, b":", _WS, rb"\{", _WS, rb'"type"', _WS, b":", _WS, b'"%s"' % native.ABORT.encode(), rb"(?:", _MEMBER,
    rb")*+")))
STATUS_NEXT = re.compile(b"".join((_WS, b",", _WS, _ERROR_STATUS)))
# An abort without a status closed and followed by ``weight_version``: ``_handle_abort_req``'s body (SGLang
# 0.5.23 ``meta_info = {"id", "finish_reason", "weight_version", "e2e_latency", ...}``; every
# ``_handle_batch_output`` body has ``prompt_tokens`` there). Alone, an incremental stream's may be queued
# deltas coalesced with it (``_coalesce_streaming_chunks``: text doubled, last id repeated): ``fold`` reads it.
META_KEY = b'"%s"' % native.META.encode()
ABORT_REQ_NEXT = re.compile(b"".join((_WS, rb"\}", _WS, b",", _WS, b'"%s"' % native.WEIGHT_VERSION.encode())))
# The two last ids of a list that ends where the search ends (``\Z`` at the search's ``endpos``): integers
# (token ids), each after ``[`` or ``,``. ``IDS_TAIL`` bytes hold them with room for whitespace.
IDS_TAIL = 64
LAST_TWO_IDS = re.compile(b"".join((rb"[\[,]", _WS, rb"(-?[0-9]++)", _WS, b",", _WS, rb"(-?[0-9]++)", _WS, rb"\Z")))
# What is left of a flat member cut by the span (the key or its string value unterminated): the
# finish reason is undecided there, and ``fold`` decides.
_OPEN_STRING = rb'"(?:[^"\\]++|\\.)*+\\?'
MEMBER_CUT = re.compile(b"".join((
    _WS, rb"(?:,", _WS, rb"(?:", _OPEN_STRING, rb"|", _STRING, _WS, rb"(?::", _WS, rb"(?:", _OPEN_STRING,
    rb"|[-+.0-9A-Za-z]*+))?)?)?")))
# ``stream_results``' error frame (``native.unary_error_of_frame``) opens with its only key, ``error``, and
# ends with ``"retryable":false}}`` (orjson, compact), whatever the message's length in between.
ERROR_OPENING = b'{"%s"' % native.ERROR.encode()
RETRYABLE_KEY = b'"%s"' % native.RETRYABLE.encode()
FRAME_TAIL = 32

# The unary error answers of SGLang 0.5.23's ``/generate`` (``entrypoints/http_server.py``) and their HTTP
# status, as ``Codec.answer_status`` reads them from the first ``ANSWER_HEAD`` and the last ``ANSWER_TAIL``
# bytes (no parse, whatever the body's size):
#
# - ``{"error": ...}``, status 400. ``generate_request``'s contract check::
#
#       contract_error = generate_contract_error(await request.json())
#       if contract_error is not None:
#           return ORJSONResponse(status_code=400, content={"error": contract_error})
#
#   and ``serve_generate_request``' unary branch, ``except ValueError as e: return
#   _create_error_response(e)``::
#
#       def _create_error_response(e):
#           return ORJSONResponse(
#               {"error": {"message": str(e)}},
#               status_code=getattr(e, "status_code", HTTPStatus.BAD_REQUEST),
#           )
#
#   No ``ValueError`` SGLang 0.5.23 raises there has a ``status_code`` (the wheel's subclasses,
#   ``MsgpackDecodeError``, ``JsonContractError``, ``_BadOpenAIRequest``, define none), so 400; an abort
#   whose ``status_code`` is 400 raises one too (``_handle_abort_finish_reason``, below). ``stream_results``'
#   frame ``{"error": {"message", "type", "code": getattr(e, "status_code", 400), "retryable"}}`` (folded to
#   the unary ``{"error": {"message"}}``, ``native.unary_error_of_frame``) carries the same 400. No
#   generation body opens with ``error`` (``text`` comes first).
# - ``ErrorResponse``, ``{"object":"error","message":...,"type":...,"param":...,"code":N}``, status ``N``.
#   ``TokenizerManager._handle_abort_finish_reason``, for a non-stream request whose abort has a
#   ``status_code`` in ``[400, 600)``::
#
#       if status_code == HTTPStatus.BAD_REQUEST:
#           raise ValueError(finish_reason["message"])
#       raise fastapi.HTTPException(status_code=status_code, detail=finish_reason["message"])
#
#   answered by ``@app.exception_handler(HTTPException)`` on ``/generate``::
#
#       error = ErrorResponse(object="error", message=exc.detail, type=str(exc.status_code),
#                             code=exc.status_code)
#       return ORJSONResponse(content=error.model_dump(), status_code=exc.status_code)
#
#   (the ``RequestValidationError`` handler writes ``code=400`` with status 400). ``model_dump`` keeps the
#   fields' order (``object, message, type, param, code``), so ``code`` is the last member: orjson ends the
#   body ``"code":503}``. A ``code`` outside ``[400, 600)`` is nothing SGLang writes: 200.
ANSWER_HEAD = 32
ANSWER_TAIL = 64
ERROR_ANSWER = re.compile(rb'\s*\{\s*"%s"\s*:' % native.ERROR.encode())
ERROR_RESPONSE = re.compile(rb'\s*\{\s*"%s"\s*:\s*"%s"' % (native.ERROR_OBJECT_KEY.encode(), native.ERROR.encode()))
CODE_KEY = b'"code"'  # ErrorResponse.code
# The engine's API-key middleware (``--api-key``), SGLang 0.5.23 ``srt/utils/auth.py``
# ``_ApiKeyASGIMiddleware.__call__``: ``ORJSONResponse(content={"error": "Unauthorized" if
# decision.error_status_code == 401 else "Forbidden"}, status_code=decision.error_status_code)``. It
# refused the *worker's* request to its engine: a deployment fault, not the edge client's, so the edge
# answers 502 (Bad Gateway, as for a worker's invalid chunk) and never 401/403, which at the edge say
# the client's own token was refused (docs/edge.md).
AUTH_REFUSALS = frozenset({b'{"error":"Unauthorized"}', b'{"error":"Forbidden"}'})
AUTH_REFUSAL_BYTES = max(map(len, AUTH_REFUSALS))
# Any other exception in ``serve_generate_request``'s unary branch (it catches ``ValueError`` only) leaves
# the app: SGLang 0.5.23 registers no handler for ``Exception`` (``http_server.py`` has handlers for
# ``HTTPException`` and ``RequestValidationError`` alone, and ``FastAPI(...)`` is not in debug mode), so
# Starlette's ``ServerErrorMiddleware.error_response`` answers ``PlainTextResponse("Internal Server
# Error", status_code=500)``: status 500, ``text/plain; charset=utf-8`` (``Response.init_headers`` adds
# the charset to a ``text/`` type). A worker that publishes that answer publishes these bytes.
SERVER_ERROR = b"Internal Server Error"
SERVER_ERROR_MEDIA_TYPE = "text/plain; charset=utf-8"

# SGLang/OpenAI-style error ``type`` strings for the processor's own error kinds.
ERROR_TYPES: Mapping[ErrorKind, str] = {
    ErrorKind.TIMEOUT: "timeout",
    ErrorKind.OVERLOADED: "overloaded",
    ErrorKind.INVALID_CHUNK: "invalid_request_error",
    ErrorKind.UNKNOWN_FORMAT: "invalid_request_error",
    ErrorKind.INTERNAL: "internal_error",
    ErrorKind.MIGRATION_REFUSED: "service_unavailable",
    ErrorKind.UNAVAILABLE: "service_unavailable",
}


def _abort_with_status(body: bytes) -> bool:
    """Whether the body's finish reason may be an abort with a ``status_code`` in ``[400, 600)``: the
    ``"finish_reason"`` key (``FINISH_KEY``; the first one found from either end) holds one
    (``ABORT_OPENING`` then ``STATUS_NEXT``, within ``FINISH_SPAN`` bytes of the key). Byte searches
    from both ends that stop at the key (a body without one is read once), at most
    ``FINISH_CANDIDATES + 1`` anchored matches of at most ``FINISH_SPAN`` bytes: linear in the body
    whatever its bytes, and for a body SGLang writes proportional to the nearer side of its finish
    reason (``Codec.folds_alone`` runs on the edge's event loop). ``fold`` parses to decide."""
    front, back, step = 0, len(body), FINISH_STEP
    overlap = len(FINISH_KEY) - 1  # a key across a chunk's edge
    misses = 0
    while front < back:
        at = body.find(FINISH_KEY, front, min(front + step, back) + overlap)
        if at < 0:
            front = min(front + step, back)
            at = body.rfind(FINISH_KEY, max(back - step, front), back + overlap)
            if at < 0:
                back = max(back - step, front)
                step *= 2
                continue
            back = at
        else:
            front = at + 1
        end = at + len(FINISH_KEY)
        span = end + FINISH_SPAN
        opening = ABORT_OPENING.match(body, end, span)
        if opening is not None:
            if STATUS_NEXT.match(body, opening.end(), span):
                return True
            if ABORT_REQ_NEXT.match(body, opening.end(), span):
                return _repeats_last_id(body, at)
            # A member cut by the span (a long message): undecided, fold decides. Else: no error status.
            return span < len(body) and MEMBER_CUT.fullmatch(body, opening.end(), span) is not None
        if IS_KEY.match(body, end, span):
            return False  # the finish reason, and not an abort
        misses += 1
        if misses > FINISH_CANDIDATES:
            return True  # nothing SGLang writes: fold decides
    return False


def _repeats_last_id(body: bytes, at: int) -> bool:
    """Whether the ``output_ids`` in front of ``meta_info`` (whose ``finish_reason`` key is at ``at``) end
    in the same id twice, as queued deltas coalesced with ``_handle_abort_req``'s ``[output_ids[-1]]`` do.
    Reads backwards from the finish reason to ``"meta_info"`` and the list's ``]`` (adjacent in a body
    SGLang writes), then the last ``IDS_TAIL`` bytes before it (``LAST_TWO_IDS``): not the whole list, so
    the cost does not grow with the ids. A cumulative body with every id once is not parsed for nothing
    unless its last token really repeats; bytes that are no such list (a string, a cut number) say no."""
    meta = body.rfind(META_KEY, 0, at)
    end = body.rfind(b"]", 0, meta) if meta >= 0 else -1
    if end < 0:
        return False
    ids = LAST_TWO_IDS.search(body, max(0, end - IDS_TAIL), end)
    return ids is not None and ids[1] == ids[2]


def _coalesced_abort(doc: dict) -> bool:
    """Whether a lone body is queued deltas coalesced with ``_handle_abort_req``'s (``ABORT_REQ_NEXT``), which
    :func:`~.fold.fold` cuts to the whole: one id more than its ``completion_tokens``, the last repeated
    (``native.abort_restatement``). Any other lone abort body is the unary answer as sent: a unary one has
    every id once, and one with ``[output_ids[-1]]`` of several tokens cannot have the others placed."""
    restatement = native.abort_restatement(doc, ())
    return restatement is not None and restatement.doubled


def _stream_error_frame(body: bytes) -> bool:
    """Whether a body may be ``stream_results``' error frame: it opens with ``{"error"`` and has
    ``"retryable"`` in its last ``FRAME_TAIL`` bytes (a key: inside a JSON string the quotes are
    escaped). Two bounded byte searches; ``fold`` parses the body to decide."""
    return (body[:16].lstrip().startswith(ERROR_OPENING)
            and body.find(RETRYABLE_KEY, max(0, len(body) - FRAME_TAIL)) >= 0)


class SGLangCodec(Codec):
    name = "sglang"
    description = "SGLang native /generate; meta_info.routed_experts = Base64(raw int32 rows)"

    sequence_codecs: ClassVar[Mapping[str, type[SequenceCodec]]] = {native.ROUTED_EXPERTS: Base64Int32Rows}
    option_keys: ClassVar[frozenset[str] | None] = frozenset({STREAMING_OPTION})

    def __init__(self, options: CodecOptions | None = None) -> None:
        super().__init__(options)
        # How the workers stream when a request shows no mode yet (one token-carrying chunk):
        # SGLang's default is cumulative, ``--incremental-streaming-output`` makes it incremental.
        self.streaming = self.options.option(STREAMING_OPTION, native.INCREMENTAL)
        self._stitch_experts: SequenceCodec | None = None
        if self.streaming not in (native.INCREMENTAL, native.CUMULATIVE):
            raise ValueError(f"format option {STREAMING_OPTION}={self.streaming!r}: expected "
                             f"{native.INCREMENTAL} or {native.CUMULATIVE}")

    def open_session(self) -> JoinSession:
        return SGLangJoinSession(self)

    def fold(self, bodies: Sequence[bytes]) -> bytes:
        """The unary equivalent of a stream's bodies. A lone body that is no JSON object is the unary
        answer as sent: ``folds_alone`` sent it here on a bounded look at its bytes (an ``"index"`` near
        its end, an abort's or error frame's opening), and the edge serves any other lone body as sent;
        a 500 ``cannot fold`` would make a worker's cut-short chunk the edge's failure."""
        docs = []
        for index, body in enumerate(bodies):
            try:
                doc = native.decode(body)
            except RecursionError:  # nested deeper than the parser goes: no JSON object here
                doc = None
            if not isinstance(doc, dict):
                if len(bodies) == 1:
                    return bytes(body)  # a unary batch's list, or no JSON at all: as sent
                raise ValueError(f"chunk {index} is not a JSON object; it cannot be folded")
            docs.append(doc)
        # The same request unary answers the error alone (``_create_error_response``: the message only,
        # not ``stream_results``' frame); ``stream_results`` sends only ``[DONE]`` after its frame.
        error_body = final_error_body(bodies, docs, native.http_error, "SGLang")
        if error_body is not None:
            unary = native.unary_error_of_frame(docs[-1])
            return error_body if unary is None else native.encode(unary)
        error = abort_answer(docs)  # an abort with an HTTP status: unary, the error alone
        if error is not None:
            return native.encode(error)
        items = fold_items(docs)  # a streamed batch or n > 1 request answers a list unary
        if items is None and len(bodies) == 1 and not _coalesced_abort(docs[0]):
            return bodies[0]  # a unary body, or a single request's only chunk: the unary answer as sent
        return native.encode(items if items is not None else fold(docs))

    def folds_alone(self, body: bytes) -> bool:
        """A streamed batch of one (``text: ["..."]``: ``GenerateReqInput._determine_batch_size`` makes
        it ``is_single = False``) whose stream is one chunk: ``_stream_batch_responses`` tagged it
        ``"index": 0``, and unary the same request answers ``yield outputs``, a list of one
        (``TokenizerManager._handle_batch_request``), which :meth:`fold` builds. The tag is the body's
        last key, so only its last ``INDEX_TAIL`` bytes are read: searching the whole body held the
        edge's event loop ~1 ms per MiB for every unary answer of one result. A key is written
        ``"index"`` (inside a JSON string the quotes are escaped); a value ``"index"`` there makes
        ``fold`` look, and give the body back as sent.

        Also a stream's only chunk that is an abort with an HTTP status (``_handle_abort_finish_reason``
        yields it to a stream; unary, the request answers an error, which :meth:`fold` builds): a
        ``"finish_reason"`` key whose abort has a ``"status_code"`` in ``[400, 600)``, wherever it stands
        (``_abort_with_status``), makes ``fold`` look. An abort without one (the client's, the
        tokenizer's own) is not sent: its unary answer is the body as sent, and sent to ``fold`` a 64 MiB
        one was parsed whole for nothing, ~75 ms holding the GIL. Except ``_handle_abort_req``'s body
        (``weight_version`` after its finish reason) whose ``output_ids`` end in the same id twice
        (``_repeats_last_id``, a bounded read): queued incremental deltas coalesced with it, its text
        doubled, which ``fold`` cuts to the unary abort body.

        Also a stream's only chunk that is ``stream_results``' error frame (a ``ValueError`` before the
        first chunk, e.g. ``_validate_one_request``'s context-length check): unary, the same request
        answers ``{"error": {"message": ...}}`` (``_create_error_response``), which :meth:`fold` builds."""
        return (body.find(INDEX_KEY, max(0, len(body) - INDEX_TAIL)) >= 0
                or _abort_with_status(body) or _stream_error_frame(body))

    def answer_status(self, body: bytes) -> int:
        """502 for the engine's API-key refusals (``AUTH_REFUSALS``), 500 for Starlette's plain-text
        ``Internal Server Error`` (``SERVER_ERROR``), 400 for a body that opens
        ``{"error":``, the ``ErrorResponse``'s ``code`` for one that opens
        ``{"object":"error"`` (200 when it is outside ``[400, 600)`` or not its last member), else 200:
        the statuses SGLang 0.5.23's ``/generate`` answers these bodies with (``ERROR_ANSWER`` above).
        Reads the first ``ANSWER_HEAD`` (32) and the last ``ANSWER_TAIL`` (64) bytes only: an abort with a
        status reaches it folded (:meth:`folds_alone`), as the ``ErrorResponse`` or ``{"error":`` body."""
        if len(body) <= AUTH_REFUSAL_BYTES and body in AUTH_REFUSALS:  # (the length first: a lookup hashes
            return HTTPStatus.BAD_GATEWAY  # the whole body)
        if body == SERVER_ERROR:  # (bytes equality tests the lengths first)
            return HTTPStatus.INTERNAL_SERVER_ERROR
        head = body[:ANSWER_HEAD]
        if ERROR_ANSWER.match(head):
            return 400
        if ERROR_RESPONSE.match(head):
            status = trailing_int(body, CODE_KEY, 1, ANSWER_TAIL)
            return status if status is not None and is_error_status(status) else 200
        return 200

    def answer_media_type(self, body: bytes) -> str:
        """``text/plain; charset=utf-8`` for Starlette's plain-text ``Internal Server Error``
        (``SERVER_ERROR``), the one non-JSON body SGLang 0.5.23's ``/generate`` answers; else JSON. One
        length-first comparison."""
        return SERVER_ERROR_MEDIA_TYPE if body == SERVER_ERROR else ANSWER_MEDIA_TYPE

    def error_body(self, message: str, kind: ErrorKind) -> bytes:
        return native.encode({"error": {"message": message, "type": ERROR_TYPES.get(kind, "internal_error")}})

    # What the live page shows: the generated text, and the edge's routed-experts view
    # (``experts.py``, decoded with this instance's sequence codecs).
    text_field = native.TEXT
    experts_field = native.ROUTED_EXPERTS

    def routed_experts(self, body: bytes, *, verdict: Verdict | None = None,
                       limit: int = DEFAULT_MAX_DECOMPRESSED_BYTES) -> RoutedExperts:
        return experts.routed_experts(self, body, verdict, limit)

    # Migration (``migration.py``). The stitch decodes with its own sequence codec instance, apart from
    # the joins': sglang-zstd's decompression context is not thread safe. The processor runs every
    # stitch in the join thread when it offloads joins (one at a time), inline otherwise; an embedder
    # that mixes the two cannot make them share a context. Created on first use, shared by every
    # migration session.

    def open_migration(self) -> MigrationSession:
        return migration.SGLangMigrationSession(self)

    def stitch_experts(self) -> SequenceCodec:
        """The ``routed_experts`` sequence codec the migration stitch uses (not the joins')."""
        if self._stitch_experts is None:
            self._stitch_experts = type(self.sequences[native.ROUTED_EXPERTS])(self.options)
        return self._stitch_experts

    def check_migratable(self, request: bytes) -> None:
        migration.check_request(request)

    def resume_request(self, request: bytes, emitted: Emitted) -> bytes:
        return migration.resume_request(request, emitted)
