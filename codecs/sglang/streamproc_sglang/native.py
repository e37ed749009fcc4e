"""SGLang's native ``/generate`` body: field names, tolerant parsing, the two streaming modes.

Bodies are ``{"text", "output_ids", "meta_info"}``. SGLang streams in one of two modes
(``tokenizer_manager._handle_batch_output``, server flag ``--incremental-streaming-output``):

- cumulative (the default): every chunk restates ``text``, ``output_ids`` and the ``output_*logprobs``
  lists from output position 0;
- incremental: ``text``/``output_ids`` and the ``output_*logprobs`` lists are per-chunk deltas.

Every other ``meta_info`` key is cumulative or terminal in both modes. Which mode a chunk is in is
read from the chunk itself (:func:`restates`), so no setting has to match the workers.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import msgspec

# HTTPStatus.BAD_REQUEST <= status_code < 600: the statuses _handle_abort_finish_reason answers a
# unary request with an error (abort_status); the core's one test of that range
from streamproc.codec import is_error_status

TEXT = "text"
OUTPUT_IDS = "output_ids"
# Token ids a P/D handoff can carry: ``MetadataBuffers.output_ids`` (disaggregation/utils.py) is int32.
TOKEN_ID_LIMIT = 1 << 31
META = "meta_info"
ERROR = "error"

FINISH_REASON = "finish_reason"
PROMPT_TOKENS = "prompt_tokens"
COMPLETION_TOKENS = "completion_tokens"
REASONING_TOKENS = "reasoning_tokens"  # requests with require_reasoning (SGLang 0.5.23 writes it)
# SGLang 0.5.23, a finished body only: ``[{"version", "start", "end"}]`` over the output tokens, and
# ``weight_version`` set to the last span's version (``utils/weight_versions.py``
# ``add_weight_versions_to_meta_info``; an unfinished body's ``weight_version`` is the server's current).
WEIGHT_VERSIONS = "weight_versions"
WEIGHT_VERSION = "weight_version"
ROUTED_EXPERTS = "routed_experts"
# SGLang 0.5.23 ``TokenizerManager._stream_one_response``: the time the FIRST body yielded was sent, appended
# last to that body (and, with ``--enable-metrics``, repeated in a stream's finished body). A unary answer's
# is the time that answer was sent, which no body of a longer stream carries (fold.py).
RESPONSE_SENT_TS = "response_sent_to_client_ts"
# SGLang 0.5.23 with ``--enable-metrics``, finished bodies (``APIServerReqTimeStats.convert_to_output_meta_info``):
# counted from ``first_token_time``, which ``TokenizerManager._handle_batch_output`` takes at the tokenizer's
# receipt of a stream's first output but from the scheduler's ``prefill_finished_time`` for a unary request
# (``_get_scheduler_first_token_time``). No chunk carries the unary values (fold.py).
FIRST_TOKEN_TIMINGS = ("first_token_latency", "decode_throughput")
# SGLANG_ROUTED_EXPERTS_DTYPE on the worker, advertised per body (int32 when absent).
ROUTED_EXPERTS_DTYPE = "routed_experts_dtype"
# GenerateReqInput.routed_experts_start_len: rows cover [start, seqlen - 1). Read from meta_info when
# a worker echoes it; otherwise the join infers it from the byte counts.
ROUTED_EXPERTS_START_LEN = "routed_experts_start_len"
CUMULATIVE = "cumulative"
INCREMENTAL = "incremental"
EXPERT_DTYPE_SIZES = {"int32": 4, "uint16": 2, "uint8": 1}
DEFAULT_EXPERT_DTYPE = "int32"

INPUT_TOKEN_LOGPROBS = "input_token_logprobs"
OUTPUT_TOKEN_LOGPROBS = "output_token_logprobs"
OUTPUT_TOP_LOGPROBS = "output_top_logprobs"
OUTPUT_TOKEN_LOGPROBS_LENGTH = "output_token_logprobs_length"
# A streamed batch or n > 1 request's chunks are per-item objects tagged with the item's position
# (TokenizerManager._stream_batch_responses: result["index"] = rid_to_index[...]).
INDEX = "index"
OUTPUT_TOKEN_IDS_LOGPROBS = "output_token_ids_logprobs"  # the request's token_ids_logprob, per position
# Prompt-side logprob fields only a prefill worker computes; copied together.
INPUT_LOGPROB_FIELDS = (INPUT_TOKEN_LOGPROBS, "input_top_logprobs", "input_token_ids_logprobs")
# ``return_flat_raw_top_logprobs`` (SGLang 0.5.23, ``tokenizer_manager._build_flat_top_logprobs_fields``
# and ``_build_flat_top_logprobs_fields_from_arrays``): the prompt's top logprobs as flat arrays plus
# shape metadata ([rows, k]), in place of ``input_top_logprobs``; ``_b64`` forms hold float32/int32.
INPUT_TOP_SHAPE = "input_top_logprobs_shape"
INPUT_TOP_NULL_PREFIX = "input_top_logprobs_null_prefix"  # leading null positions before the flat rows
INPUT_TOP_FLAT_FIELDS = (
    "input_top_logprobs_val_flat", "input_top_logprobs_idx_flat",
    "input_top_logprobs_val_flat_b64", "input_top_logprobs_idx_flat_b64",
    "input_top_logprobs_val_flat_b64_dtype", "input_top_logprobs_idx_flat_b64_dtype",
    INPUT_TOP_SHAPE, INPUT_TOP_NULL_PREFIX,
)
# ``return_flat_raw_output_top_logprobs`` (unary only): the output's top logprobs in the same form, in
# place of ``output_top_logprobs`` on the finished body.
OUTPUT_TOP_SHAPE = "output_top_logprobs_shape"
OUTPUT_TOP_NULL_PREFIX = "output_top_logprobs_null_prefix"
OUTPUT_TOP_FLAT_LISTS = ("output_top_logprobs_val_flat", "output_top_logprobs_idx_flat")
OUTPUT_TOP_FLAT_B64 = ("output_top_logprobs_val_flat_b64", "output_top_logprobs_idx_flat_b64")  # + "_dtype"
# ``return_sampling_mask``: per output token, the ids the sampler could pick and the sampled token's
# log-probability over them (``output_token_sampling_mask_length`` is their running count).
OUTPUT_SAMPLING_FIELDS = ("output_token_sampling_mask", "output_token_sampling_logprobs")
# Fields SGLang slices to each chunk's span in incremental streaming; folding concatenates them
# (``tokenizer_manager._INCREMENTAL_STREAMING_META_INFO_KEYS``). A request's ``customized_info`` keys
# are sliced too; their names are the deployment's own, so they are not known here (docs/codecs.md).
OUTPUT_DELTA_FIELDS = frozenset({OUTPUT_TOKEN_LOGPROBS, OUTPUT_TOP_LOGPROBS, OUTPUT_TOKEN_IDS_LOGPROBS,
                                 *OUTPUT_SAMPLING_FIELDS})

# Omission markers (Dynamo's ``input_logprobs_unavailable_reason`` convention, §2.3).
INPUT_LOGPROBS_UNAVAILABLE = "input_logprobs_unavailable_reason"
ROUTED_EXPERTS_UNAVAILABLE = "routed_experts_unavailable_reason"
OUTPUT_TOKEN_IDS_LOGPROBS_UNAVAILABLE = "output_token_ids_logprobs_unavailable_reason"
# Token 0's logprob entries only (the list stays, position 0 nulled): see join._omit_first_token.
OUTPUT_TOKEN_LOGPROBS_UNAVAILABLE = "output_token_logprobs_unavailable_reason"
# Token 0's top logprobs row only (the list stays, row 0 nulled): see join._check_first_top.
OUTPUT_TOP_LOGPROBS_UNAVAILABLE = "output_top_logprobs_unavailable_reason"

# finish_reason types that mean the leg did not complete (sidecar ``terminal_failure``).
ABORT = "abort"  # a finish reason's type (also a status abort's: abort_status)
FAILED_FINISH_TYPES = frozenset({ABORT, "error"})

_decode = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


def decode(body: bytes) -> Any:
    """The body's JSON value, or None when it is not JSON. A body nested deeper than the parser's stack
    raises ``RecursionError``: the join ends such a request ``invalid_chunk`` (no body SGLang writes)."""
    try:
        return _decode.decode(body)
    except msgspec.DecodeError:
        return None


def parse(body: bytes) -> dict[str, Any] | None:
    """The body as a dict, or None when it is not a JSON object (such bodies are never rewritten)."""
    doc = decode(body)
    return doc if isinstance(doc, dict) else None


def items_of(doc: Any) -> list[dict[str, Any]] | None:
    """A batch body's items, or None. A non-stream batch or ``n > 1`` request answers with a JSON list
    of its requests' bodies (``TokenizerManager._handle_batch_request``: ``outputs = await
    asyncio.gather(...)``, ``yield outputs``); mini_lb sends such batches to P/D pairs too."""
    return doc if isinstance(doc, list) and doc and all(isinstance(item, dict) for item in doc) else None


def meta_of(doc: dict[str, Any]) -> dict[str, Any] | None:
    meta = doc.get(META)
    return meta if isinstance(meta, dict) else None


def encode(doc: object) -> bytes:
    """Compact JSON; dicts keep insertion order, so an edited body keeps its key order."""
    return _encoder.encode(doc)


def http_error(doc: dict[str, Any]) -> bool:
    """Whether a body is one of SGLang's HTTP-layer error bodies rather than a generation body (SGLang
    0.5.23, ``entrypoints/http_server.py``): the stream's last frame ``{"error": {"message", "type",
    "code", "retryable"}}`` (``serve_generate_request``' ``stream_results``, for a ``ValueError``), the
    unary ``{"error": {"message"}}`` (``_create_error_response``) or ``{"error": "<text>"}`` (the
    contract check in ``generate_request``), and the unary ``ErrorResponse`` (``{"object": "error",
    "message", "type", "param", "code"}``, ``validation_exception_handler`` for an ``HTTPException``:
    ``TokenizerManager._handle_abort_finish_reason`` raises one for an abort whose ``status_code`` is
    not 400, e.g. a P/D leg's failed KV transfer); none has ``meta_info``."""
    return (ERROR in doc or doc.get(ERROR_OBJECT_KEY) == ERROR) and META not in doc


ERROR_OBJECT_KEY = "object"  # ErrorResponse.object, "error"
# The keys of ``stream_results``' error frame (``serve_generate_request``, SGLang 0.5.23), which no unary
# error body has: ``{"error": {"message", "type", "code", "retryable"}}``.
STREAM_ERROR_KEYS = frozenset({"message", "type", "code", "retryable"})
RETRYABLE = "retryable"


def unary_error_of_frame(doc: dict[str, Any]) -> dict[str, Any] | None:
    """What the same request answers unary when its stream ended in ``stream_results``' error frame, or
    None for any other body. SGLang 0.5.23, ``serve_generate_request``: streamed, ``except ValueError as
    e`` yields ``{"error": {"message": str(e), "type": "invalid_request_error", "code":
    getattr(e, "status_code", 400), "retryable": False}}``; unary, the same ``ValueError`` is answered
    ``_create_error_response(e)``, ``ORJSONResponse({"error": {"message": str(e)}},
    status_code=getattr(e, "status_code", HTTPStatus.BAD_REQUEST))``: the message alone. The frame's
    other fields are constants of the stream (no ``ValueError`` SGLang raises on this path has a
    ``status_code``: ``code`` is 400) and its ``code`` is the unary answer's status line, the 400 the
    codec's ``answer_status`` gives the unary body (docs/codecs.md)."""
    error = doc.get(ERROR)
    if (len(doc) != 1 or not isinstance(error, dict) or error.keys() != STREAM_ERROR_KEYS
            or type(error[MESSAGE]) is not str):
        return None
    return {ERROR: {MESSAGE: error[MESSAGE]}}


# An abort's HTTP status (``FINISH_ABORT.to_json()``, the scheduler's ``finished_reason`` dicts).
STATUS_CODE = "status_code"
MESSAGE = "message"


def abort_status(finish: Any) -> int | None:
    """The HTTP status of a finish reason that makes a unary request answer an error, else None.

    SGLang 0.5.23, ``TokenizerManager._handle_abort_finish_reason``::

        status_code = finish_reason.get("status_code")
        if (finish_reason.get("type") != "abort" or status_code is None
                or not HTTPStatus.BAD_REQUEST <= status_code < 600):
            return None

    A stream yields the abort body as any other (``return out``); a unary request raises instead. An
    SGLang body's status is an integer (``HTTPStatus``); anything else is taken as no status."""
    if not isinstance(finish, dict) or finish.get("type") != ABORT:
        return None
    status = finish.get(STATUS_CODE)
    return status if type(status) is int and is_error_status(status) else None


def abort_error(finish: dict[str, Any]) -> dict[str, Any]:
    """The body a unary request answers for an abort with :func:`abort_status`. SGLang 0.5.23,
    ``_handle_abort_finish_reason`` for a non-stream request::

        if status_code == HTTPStatus.BAD_REQUEST:
            raise ValueError(finish_reason["message"])
        raise fastapi.HTTPException(status_code=status_code, detail=finish_reason["message"])

    ``serve_generate_request`` answers the ``ValueError`` with ``_create_error_response(e)``
    (``ORJSONResponse({"error": {"message": str(e)}}, status_code=400)``), and the
    ``HTTPException`` reaches ``@app.exception_handler(HTTPException)``, which answers a ``/generate``
    request ``ORJSONResponse(content=ErrorResponse(object="error", message=exc.detail,
    type=str(exc.status_code), code=exc.status_code).model_dump(), ...)`` (fields ``object, message,
    type, param, code``; ``param`` None). :func:`encode` writes them as orjson does. A message that is
    no string is nothing SGLang writes (``FINISH_ABORT`` defaults it to "Aborted"): ValueError."""
    message = finish.get(MESSAGE)
    if type(message) is not str:
        raise ValueError(f"an abort with status {finish.get(STATUS_CODE)} has no string message: no body "
                         "SGLang writes; it cannot be folded")
    status = finish[STATUS_CODE]
    if status == 400:
        return {ERROR: {MESSAGE: message}}
    return {ERROR_OBJECT_KEY: ERROR, MESSAGE: message, "type": str(status), "param": None, "code": status}


def failed(doc: dict[str, Any]) -> bool:
    """Whether a (folded) leg ended in an error or abort rather than a normal finish."""
    if ERROR in doc or http_error(doc):
        return True
    meta = meta_of(doc)
    return meta is not None and failed_finish(meta)


def failed_finish(meta: dict[str, Any]) -> bool:
    """Whether ``meta_info`` names an error or abort finish."""
    finish = meta.get(FINISH_REASON)
    kind = finish.get("type") if isinstance(finish, dict) else None
    return isinstance(kind, str) and (kind in FAILED_FINISH_TYPES or kind.startswith(ABORT))


# ``Req.retraction_count`` on every body (``_handle_batch_output``): ``num_retractions`` since SGLang
# 0.5.23, ``total_retractions`` before.
RETRACTION_COUNTS = ("num_retractions", "total_retractions")


def retracted(meta: dict[str, Any]) -> bool:
    """Whether the worker retracted the request at least once (``Req.reset_for_retract`` counts it).

    A P/D decode resumes with its KV copied back into new slots (``backup_kv_cache`` /
    ``restore_kv_cache``) or recomputed by the prefill and transferred (``dsv4_needs_rebootstrap``),
    never by a forward of its own, while ``BaseTopkCapturer.get_topk`` reads routed experts at the
    request's current slots: the rows of the tokens before the retraction are whatever request last
    ran a forward there. The aggregated engine prefills a retracted request again (rows right)."""
    return any(type(count := meta.get(key)) is int and count > 0 for key in RETRACTION_COUNTS)


def from_abort_req(meta: dict[str, Any]) -> bool:
    """Whether a body's ``meta_info`` is ``TokenizerManager._handle_abort_req``'s: an abort finish and
    no ``prompt_tokens`` (every ``_handle_batch_output`` body has them)."""
    return PROMPT_TOKENS not in meta and failed_finish(meta)


def abort_restates_ids(doc: dict[str, Any]) -> bool:
    """Whether a ``_handle_abort_req`` body carries every output id of its engine, as its text and
    lists are whole: SGLang 0.5.23 cuts them to the last (``[output_ids[-1]]``) only with
    ``--incremental-streaming-output``, older trees in both modes. Read from the counts: as many ids
    as ``completion_tokens`` (with one token, ``[last]`` is every id in either form)."""
    meta = meta_of(doc)
    ids = doc.get(OUTPUT_IDS)
    count = meta.get(COMPLETION_TOKENS) if meta is not None else None
    return isinstance(ids, list) and type(count) is int and len(ids) == count


# What ``TokenizerManager._handle_abort_req`` restates in full in a stream's abort body (it calls
# ``add_logprob_to_meta_info`` and never slices): the text and these lists.
ABORT_RESTATED_FIELDS = frozenset({OUTPUT_TOKEN_LOGPROBS, OUTPUT_TOP_LOGPROBS, OUTPUT_TOKEN_IDS_LOGPROBS})


class AbortRestatement(NamedTuple):
    ids: list[Any]  # the ids the body adds to those already seen
    doubled: bool  # chunks coalesced in front of it: its text and lists are theirs, then the whole again


def abort_restatement(doc: dict[str, Any], seen: Sequence[Any]) -> AbortRestatement | None:
    """How a stream's abort body from ``TokenizerManager._handle_abort_req`` extends ``seen``, or None
    for any other body.

    That body (the scheduler aborted a queued or retracted request) restates the whole text and output
    logprob lists, carries ``output_ids = [output_ids[-1]]`` and ``completion_tokens`` = every token, in
    both streaming modes; it alone has an abort finish and no ``prompt_tokens``. With ``m`` tokens not
    yet seen, its ids are read from the counts: ``m + 1`` ids ending in a repeat are incremental
    chunks coalesced with it (``_coalesce_streaming_chunks``: their ids, then the last again); one id
    with ``m == 1`` is the token a cumulative stream never sent. With ``m > 1`` and one id, the
    missing ids cannot be placed: none is added.
    """
    meta = meta_of(doc)
    ids = doc.get(OUTPUT_IDS)
    if meta is None or not from_abort_req(meta) or not isinstance(ids, list):
        return None
    count = meta.get(COMPLETION_TOKENS)
    missing = count - len(seen) if type(count) is int else -1
    if missing < 0:
        return None
    if ids and len(ids) == missing + 1 and len(ids) + len(seen) > 1:
        before = ids[-2] if len(ids) > 1 else seen[-1]
        if ids[-1] == before:
            return AbortRestatement(ids[:-1], missing > 0)
    if len(ids) <= 1:
        return AbortRestatement(ids if missing == 1 else [], False)
    return None


def restated(value: Any, size: int, tail: Callable[[int], Any], doubled: bool,
             added: int | None = None) -> tuple[Any, Any]:
    """How the whole text or list an abort body restates meets what the fold accumulated before it
    (``size`` long, its last ``k`` items ``tail(k)``): ``(whole, None)`` replaces it, ``(None, more)``
    keeps it and appends ``more``. Never reads more of it than the body is long (a worker's stream
    of such bodies costs what it sends).

    The body holds ``whole`` (the text or list of every token its worker produced), or, when queued
    chunks were coalesced in front of it, ``queued + whole`` with ``whole = accumulated + queued``
    (``added`` entries queued: a list has one per token; a text's length is read from the halves).
    After a migration the resumed attempt's ``whole`` covers its own tokens only when
    ``migration.py`` could not put the client's in front (chunks coalesced with it): it is then a
    tail of ``accumulated + queued``, which is the answer. Anything else is taken as it is.
    """
    length = len(value)
    if doubled:
        cut = (length - size) // 2 if added is None else added
        if 0 <= cut <= length:
            queued, whole = value[:cut], value[cut:]
            before = len(whole) - cut  # how much of ``whole`` precedes ``queued`` (accumulated's tail)
            if before <= 0:
                if queued[cut - len(whole):] == whole:
                    return None, queued
            elif before <= size and whole[before:] == queued and tail(before) == whole[:before]:
                return None, queued
        return value, None
    if length >= size and value[:size] == tail(size):
        return value, None  # the whole again, or also the one token a cumulative stream did not send
    if length <= size and tail(length) == value:
        return None, value[:0]  # a resumed attempt's own output, which the client has already
    return value, None


def restates(doc: dict[str, Any], seen: Sequence[Any]) -> bool:
    """Whether ``doc`` is a cumulative-mode chunk that restates the ``seen`` output ids.

    Decided from counts, not guessed: a chunk's ``completion_tokens`` is cumulative in both modes, so
    after any earlier token an incremental chunk has fewer ids than that count and a cumulative
    chunk exactly as many, starting with what was already seen. Before the first token both modes
    send the same thing, so False is then also the right answer.
    """
    if not seen:
        return False
    ids = doc.get(OUTPUT_IDS)
    meta = meta_of(doc)
    count = meta.get(COMPLETION_TOKENS) if meta is not None else None
    if type(count) is not int and meta is not None:
        count = meta.get(OUTPUT_TOKEN_LOGPROBS_LENGTH)
    if not (isinstance(ids, list) and type(count) is int and len(ids) == count >= len(seen)):
        return False
    return ids[:len(seen)] == (seen if isinstance(seen, list) else list(seen))


def expert_dtype(meta: dict[str, Any]) -> str | None:
    """The body's routed-experts wire dtype name; None when it names none SGLang ships. The value is
    the worker's: checked to be a string before the lookup (a JSON object or list is unhashable)."""
    dtype = meta.get(ROUTED_EXPERTS_DTYPE, DEFAULT_EXPERT_DTYPE)
    return dtype if isinstance(dtype, str) and dtype in EXPERT_DTYPE_SIZES else None
