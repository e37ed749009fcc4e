"""The vLLM ``/inference/v1/generate`` body as plain JSON objects: parsing, field names, token labels.

Bodies stay ``dict``s rather than typed structs on purpose: the join must republish every key a
worker sent, including ones this codec has never heard of, and only touch the fields it owns.
"""

from __future__ import annotations

import enum
import json
import math
import re
from typing import Any

import msgspec

ROUTED_EXPERTS = "routed_experts"
FINISH_REASON = "finish_reason"  # set on a choice's finishing chunk only (a usage-only chunk may follow)
ABORT = "abort"  # ``str(FinishReason.ABORT)``: a request aborted by the frontend or a pause(mode="abort")
PROMPT_LOGPROBS = "prompt_logprobs"
# ``SamplingParams.prompt_logprob_token_ids`` (vLLM PR #56984): the prompt's scores for fixed candidate
# ids, Base64 ``.npy`` (``ServingTokens._build_full_response``: ``numpy2base64``); unary bodies only.
PROMPT_TOKEN_ID_LOGPROBS = "prompt_token_id_logprobs"
# Top-level fields only the leg that scores the prompt has: the join takes them from prefill alike.
PROMPT_SIDE_FIELDS = (PROMPT_LOGPROBS, PROMPT_TOKEN_ID_LOGPROBS)
# Of those, the ones a decode leg sends only when it computed them itself, so that its own value is the
# aggregated one when prefill has none: vLLM 0.33.0/0.34.0's V2 runner (the only one that computes the
# scores, ``InputProcessor``: "prompt_logprob_token_ids requires the V2 model runner") drops a request
# whose prefill starts past its first scored row (``PromptLogprobsWorker.compute_prompt_token_id_logprobs``:
# ``if chunk_start > start: self.token_id_scores.pop(req_id, None)``) rather than emit unwritten rows.
# Not ``prompt_logprobs``: a decode that loaded the prompt's KV sends ``[None]`` (V2 runner) or
# ``LogprobsTensors.empty_cpu`` rows never written (V1 ``GPUModelRunner._get_prompt_logprobs_dict``).
DECODE_SELF_SCORED_FIELDS = (PROMPT_TOKEN_ID_LOGPROBS,)
PROMPT_TOKENS = "prompt_tokens"  # usage counts
# 0.34.0 ``return_token_ids``: the prompt's ids (and a multimodal prompt's placeholder ranges) on the
# first stream chunk only (``serve_tokens_stream_generator``: ``chunk.prompt_token_ids =
# prompt_token_ids`` and ``chunk.mm_placeholders = ...``, then ``prompt_token_ids = None``; both
# excluded from the dump when ``None``).
PROMPT_TOKEN_IDS = "prompt_token_ids"
MM_PLACEHOLDERS = "mm_placeholders"
FIRST_CHUNK_FIELDS = (PROMPT_TOKEN_IDS, MM_PLACEHOLDERS)
# 0.34.0 choices: ``[{"version", "start", "end"}]`` over the request's output tokens, on the finishing
# output only (``RequestState._new_completion_output``: ``self._weight_version_spans() if finished``).
WEIGHT_VERSIONS = "weight_versions"
# 0.34.0 choices: the token ids the sampler could pick, one list per output token. A stream chunk's covers its
# own new tokens only (``RequestState._new_completion_output`` clears ``sampling_mask_chunks`` per delta).
SAMPLING_MASK = "sampling_mask"
# 0.34.0 ``output_mode="text"`` choices: a stream chunk's is the text since the previous chunk
# (``BaseIncrementalDetokenizer.get_next_output_text`` with ``delta``), the unary body's the whole output.
CHOICE_TEXT = "text"
# 0.34.0 ``output_mode="derender"`` choices: a stream chunk's ``delta`` (``DeltaMessage``, dumped without
# its nulls) is what ``ChatStreamProcessor.step`` parsed since the previous chunk; the unary body has one
# ``message`` (``ChatMessage``) in that place instead.
CHOICE_DELTA, CHOICE_MESSAGE = "delta", "message"
# 0.34.0 ``PerRequestMetrics`` (``generate/base/protocol.py``) on a finished response (the unary body;
# a stream's usage-only chunk): ``speculative_decoding=build_spec_decoding_metrics(final_res)``, the
# engine ``Request``'s own ``RequestSpecDecodeMetrics`` (``observe`` per verify step), and the timing
# fields the other endpoints fill; all of them the finishing attempt's.
METRICS = "metrics"
# 0.34.0 ``GenerateResponseBase.created`` (the unary body only): ``created_time = int(time.time())`` as
# ``serve_tokens_full_generator`` starts, on the worker that answers.
CREATED = "created"
# ``usage.prompt_tokens_details`` (``--enable-prompt-tokens-details``): ``{"cached_tokens": n}``, the
# engine's ``num_cached_tokens``, which on a P/D decode leg counts the prompt KV its connector loaded.
PROMPT_TOKENS_DETAILS = "prompt_tokens_details"
CACHED_TOKENS = "cached_tokens"  # the count in it (``PromptTokenUsageInfo.cached_tokens``)
KV_TRANSFER_PARAMS = "kv_transfer_params"
# vLLM 0.34.0: a finished P/D prefill's cached-token count in its ``kv_transfer_params``
# (``Scheduler.update_from_output``), which the decode engine reports as its own.
REMOTE_PREFILL_CACHED_TOKENS = "remote_prefill_cached_tokens"
COMPLETION_TOKENS = "completion_tokens"
UNAVAILABLE_SUFFIX = "_unavailable_reason"
TOKEN_LABEL_PREFIX = "token_id:"
TOKEN_ID = "token_id"  # tokens-mode logprob entries name their token by id (no "token" label)
CLAMPED_LOGPROB = -9999.0  # vLLM's stand-in for a non-finite logprob
# Keys only a unary ``GenerateResponse`` has (``JSONResponse`` keeps them when null); a
# ``GenerateStreamResponse`` chunk has neither (serve/disagg/protocol.py @ 06408932, 343bacaf,
# furionw/vllm 9cdf7782; scale_out/token_in_token_out/protocol.py @ 006ebac2).
UNARY_ONLY_KEYS = (PROMPT_LOGPROBS, KV_TRANSFER_PARAMS)
CHOICES = "choices"  # every generation body has it (a stream's usage-only chunk: ``[]``)
ERROR = "error"  # ``ErrorResponse.error``
OUTPUT_MODE = "output_mode"  # 0.34.0 bodies only (``serve/disagg`` bodies have none)
EC_TRANSFER_PARAMS = "ec_transfer_params"
# 0.34.0 ``GenerateResponseBase``'s fields, then ``Generate{Tokens,Text,Derender}Response``'s ``output_mode`` and
# ``choices``: a unary body writes every one, in this order (``api_router.generate``: ``JSONResponse(content=
# generator.model_dump())``, no ``exclude_none``); a stream chunk only ``request_id``, ``usage``, the set ones of
# ``prompt_token_ids`` / ``mm_placeholders`` / ``metrics``, ``output_mode`` and ``choices``.
# 0.34.0 models a stream's usage chunk dumps ``exclude_none=True`` and the unary body whole (``model_dump()``):
# (declared fields in order, fields left out when ``None`` all the same (``exclude_if``), nested models).
# ``UsageInfo`` / ``PromptTokenUsageInfo`` (``serve/engine/protocol.py``); ``PerRequestMetrics`` /
# ``SpeculativeDecodingMetrics`` (``generate/base/protocol.py``).
ModelFields = tuple[tuple[str, ...], tuple[str, ...], dict[str, "ModelFields"]]
PROMPT_TOKENS_DETAILS_034: ModelFields = ((CACHED_TOKENS, "created_cache_tokens", "multimodal_tokens"), (), {})
USAGE_034: ModelFields = (("prompt_tokens", "total_tokens", COMPLETION_TOKENS, PROMPT_TOKENS_DETAILS,
                           "completion_tokens_details"), (PROMPT_TOKENS_DETAILS,),
                          {PROMPT_TOKENS_DETAILS: PROMPT_TOKENS_DETAILS_034})
SPEC_DECODING_034: ModelFields = (("mean_acceptance_length", "draft_acceptance_rate", "acceptance_histogram",
                                   "num_spec_steps", "num_accepted_draft_tokens", "num_draft_tokens",
                                   "num_spec_tokens", "per_step_accepted", "per_step_drafted"), (), {})
METRICS_034: ModelFields = (("time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms",
                             "tokens_per_second", "speculative_decoding"), (),
                            {"speculative_decoding": SPEC_DECODING_034})
# Of those, the ones no 0.34.0 stream chunk carries (``serve_tokens_stream_generator`` builds a chunk as
# ``response_cls(request_id=..., choices=[choice])`` and sets only ``prompt_token_ids`` / ``mm_placeholders`` /
# ``usage`` / ``metrics``), while ``_build_response_fields`` fills them for the unary body (``model`` and
# ``created`` always): a fold cannot say their unary value. ``usage`` and ``metrics`` are carried by the usage
# chunk only (``stream_options.include_usage``).
NEVER_STREAMED_034 = ("model", CREATED, PROMPT_LOGPROBS, PROMPT_TOKEN_ID_LOGPROBS, KV_TRANSFER_PARAMS, EC_TRANSFER_PARAMS)
USAGE_CHUNK_FIELDS_034 = ("usage", METRICS)
UNARY_KEYS_034 = ("request_id", "model", CREATED, "usage", PROMPT_LOGPROBS, PROMPT_TOKEN_ID_LOGPROBS, PROMPT_TOKEN_IDS,
                  MM_PLACEHOLDERS, METRICS, KV_TRANSFER_PARAMS, EC_TRANSFER_PARAMS, OUTPUT_MODE, CHOICES)

STREAM_ROUTED_EXPERTS_OPTION = "stream_routed_experts"  # --format-option stream_routed_experts=unknown|yes|no


class StreamExperts(enum.StrEnum):
    """Whether the deployment's stream choices have a ``routed_experts`` field: a fact of its vLLM
    version that no body shows (a finishing stream chunk without the key reads the same either way).

    * ``no``: ``GenerateResponseStreamChoice(index, logprobs, finish_reason, token_ids)`` while the
      unary ``GenerateResponseChoice`` has ``routed_experts``: ``serve/disagg/protocol.py`` and
      ``serving.py`` of the fork furionw/vllm @ 9cdf7782f6aef4de62cb51a2740169d4555ee483 (protocol.py
      also moreh-dev/vllm @ 46791a7519dd9fecf5c354a3d1217f393ef6ecd8; the same protocol.py is in
      vllm-project/vllm's stored history, index id 52130986979, no commit named). Its aggregated
      stream never carries the key.
    * ``yes``: stream choices have it (vllm-project/vllm @ 00a80787a504467c1bcd76d5405a50b2aaa00d5a
      ``scale_out/token_in_token_out/serving.py`` passes ``routed_experts=`` to
      ``GenerateResponseStreamChoice``; @ 006ebac240f34ddcd36383832b28c25840d2ea80 protocol.py
      ``GenerateStreamChoiceBase.routed_experts``). A finishing chunk without it lost decode's rows.
    * ``unknown`` (the default): not said, so read as ``yes``, the reading that never hides a loss.
    """

    UNKNOWN = "unknown"
    YES = "yes"
    NO = "no"


_decoder = msgspec.json.Decoder()


def unavailable_key(field: str) -> str:
    return field + UNAVAILABLE_SUFFIX


def token_label(token_id: int) -> str:
    """vLLM's TITO placeholder for a token that was not detokenised."""
    return f"{TOKEN_LABEL_PREFIX}{token_id}"


def parse(body: bytes) -> Any:
    """Strict JSON first; Python-style ``NaN``/``Infinity`` as a fallback.

    Python workers that serialise with the stdlib emit non-finite logprobs as bare ``NaN`` or
    ``-Infinity``; vLLM's rule is to clamp those, which needs the body parsed first.
    Raises ``ValueError`` when the body is not JSON at all.
    """
    try:
        return _decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass
    except RecursionError as exc:  # nesting deeper than the stack: no body vLLM writes
        raise ValueError(f"body is not JSON: {exc}") from None
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"body is not JSON: {exc}") from None


def parse_object(body: bytes) -> dict | None:
    """The body as a JSON object, or None when it is anything else."""
    try:
        obj = parse(body)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def dump(obj: Any) -> bytes:
    return msgspec.json.encode(obj)


def choices_of(obj: dict) -> list[dict]:
    choices = obj.get(CHOICES)
    if not isinstance(choices, list):
        return []
    return [c for c in choices if isinstance(c, dict)]


def is_error_response(obj: dict) -> bool:
    """Whether a body is vLLM's ``ErrorResponse`` rather than a generation body. vLLM 0.34.0 renders every
    error of ``/inference/v1/generate`` as ``{"error": {"message", "type", "param", "code"}}``
    (``create_error_response``, ``serve/exception_handling/error_response.py``): unary,
    ``JSONResponse(err.model_dump(), status_code=err.error.code)``; streamed, a last frame behind the chunks
    already sent (``serve_tokens_stream_generator``: ``create_streaming_error_response``, ``json.dumps`` of
    the same dump, for a ``GenerationError`` that ``_raise_if_error`` raises for ``finish_reason == "error"``
    or any exception of ``AsyncLLM.generate``). No generation body lacks ``choices``."""
    return ERROR in obj and CHOICES not in obj


def error_response_prefix(body: bytes) -> bool:
    """Whether a body's bytes open as an ``ErrorResponse`` does, without parsing it: its only key,
    ``error``, comes first in both renderings (``json.dumps``: ``{"error": {``; ``JSONResponse``:
    ``{"error":{``). A generation body opens with ``request_id``. Confirm with :func:`is_error_response`."""
    return body[:32].lstrip().startswith(b'{"error"')


# How ``create_streaming_error_response`` opens its frame (``json.dumps`` with the default separators);
# ``JSONResponse``, the unary rendering of the same ``ErrorResponse``, writes ``{"error":{``.
STREAM_ERROR_OPENING = b'{"error": {'


def stream_error_frame(body: bytes) -> bool:
    """Whether a body opens as ``serve_tokens_stream_generator``'s error frame, not the unary rendering of
    the same ``ErrorResponse``: a bounded look at its first bytes (``Codec.folds_alone`` runs on the event
    loop); ``fold`` parses it."""
    return body[:32].lstrip().startswith(STREAM_ERROR_OPENING)


# How ``serve_tokens_stream_generator`` opens a chunk (``model_dump_json``: ``request_id``, then ``usage``;
# a unary ``GenerateResponseBase`` writes ``model`` next), the request id matched possessively (linear in it).
STREAM_CHUNK_OPENING = re.compile(rb'\s*\{"request_id":"(?:[^"\\]++|\\.)*+","usage":')


def stream_chunk(body: bytes) -> bool:
    """Whether a body opens as a stream chunk, not the unary body, whatever its ``output_mode``: a bounded
    look (``Codec.folds_alone`` runs on the event loop); ``fold`` parses the body."""
    return STREAM_CHUNK_OPENING.match(body) is not None


def is_unary(obj: dict) -> bool:
    """Whether a body is a unary ``GenerateResponse`` rather than a stream chunk."""
    return any(key in obj for key in UNARY_ONLY_KEYS)


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def usage_count(obj: dict | None, key: str) -> int | None:
    if obj is None:
        return None
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        return None
    value = usage.get(key)
    return value if is_int(value) else None


def logprob_entries(choice: dict) -> list | None:
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, dict):
        return None
    content = logprobs.get("content")
    return content if isinstance(content, list) else None


def label_and_clamp(choice: dict) -> bool:
    """Give each sampled-token logprob entry its ``token_id:<id>`` label and a finite logprob.

    P/D decode workers leave the label out (§7 "native token labels"); the id is the choice's
    token at the same position. An entry that names its token by ``token_id`` is left unlabelled:
    that is vLLM's tokens-mode shape (``GenerateLogProbsContent``: token_id, logprob, rank,
    top_logprobs; ``ServingTokens._create_tokens_logprobs``, vLLM 0.34.0), which has no ``token``
    key on any leg, so adding one would make the P/D body differ from the aggregated one.
    Returns whether anything changed.
    """
    entries = logprob_entries(choice)
    if not entries:
        return False
    token_ids = choice.get("token_ids")
    token_ids = token_ids if isinstance(token_ids, list) else []
    changed = False
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            continue
        new = entry
        if "token" not in entry and TOKEN_ID not in entry and i < len(token_ids) and is_int(token_ids[i]):
            new = {"token": token_label(token_ids[i]), **entry}
        logprob = new.get("logprob")
        if isinstance(logprob, float) and not math.isfinite(logprob):
            new = dict(new) if new is entry else new
            new["logprob"] = CLAMPED_LOGPROB
        if new is not entry:
            entries[i] = new
            changed = True
    return changed
