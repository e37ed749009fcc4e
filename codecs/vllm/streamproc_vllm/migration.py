"""vLLM request migration: read what the client has seen, rebuild the request, stitch the stream.

Reference notes §6.2 and §7. The resumed request is the original with ``token_ids = prompt +
emitted`` and ``max_tokens - k``; vLLM reports it in its own terms, which
:class:`VLLMMigrationSession.stitch` restates in the original request's:

===============================  ================================================================
field                            stitched value
===============================  ================================================================
``choices[0].token_ids``,        unchanged (deltas; nothing is replayed)
``logprobs``
``request_id``                   the id the client saw first
``usage.prompt_tokens``          the original prompt's (attempt's value − k)
``usage.completion_tokens``      + k; ``total_tokens`` is then unchanged
``usage.prompt_tokens_details``  the attempt's ``cached_tokens``, at most the original prompt's
                                 length (the attempt counts cache hits over prompt + emitted tokens)
``prompt_logprobs``              sent once, on the stream's first result: removed from a resumed
                                 attempt once the client has results; otherwise the attempt's
                                 list without its last k entries
``prompt_token_ids``,            0.34.0 ``return_token_ids``: on the stream's first chunk only;
``mm_placeholders``              removed from a resumed attempt once the client has results (its
                                 copy holds the emitted tokens too)
``choices[0].routed_experts``    the attempt's array covers every position; rows an earlier
                                 attempt already published replace its leading rows
``finish_reason``                the final attempt's
``choices[0].weight_versions``,  0.34.0, finished outputs only: ``None`` with
``metrics``                      ``<field>_unavailable_reason: stitch_incomplete`` when tokens were
                                 emitted before the seal (``ATTEMPT_FIELDS``: values over the
                                 finishing attempt's own work; the lost attempt never published its
                                 share: weight spans from its token 0, speculative-decoding counters)
``created``                      ``None`` with ``created_unavailable_reason: stitch_incomplete`` on
                                 every resumed body (``TIMING_FIELDS``): the answering worker's clock
===============================  ================================================================

P/D attempts are joined within their attempt first, then stitched. From bodies alone the processor
refuses: a body that is not a JSON object, a choice other than index 0 (``n > 1``), and
non-integer ``token_ids``, and a published ``finish_reason`` (only the usage chunk was lost). Guided
decoding (``structured_outputs``) and ``n > 1`` are refused from the request by :func:`check_request`;
``output_mode`` ``derender`` and ``text`` with stop strings it holds text back for by
:func:`resume_request`, once the seal says tokens were emitted (with none, nothing is lost).
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Any, Sequence

import msgspec
import numpy as np

from streamproc.codec import CorruptPayload, Emitted, MigrationRefused, MigrationSession
from streamproc.codec import OmissionReason as Omit
from streamproc.codec import check_resumed_prompt, check_sampling_params, keep_emitted, restated_prompt, resumed_budget
from streamproc.core.errors import shown
from streamproc.wire import Verdict

from .native import FIRST_CHUNK_FIELDS, PROMPT_LOGPROBS, PROMPT_TOKENS_DETAILS, ROUTED_EXPERTS, dump, is_int
from .native import (CACHED_TOKENS, CREATED, FINISH_REASON, METRICS, UNAVAILABLE_SUFFIX, WEIGHT_VERSIONS, parse_object,
                     unavailable_key)

if TYPE_CHECKING:
    from .codec import VLLMCodec

TOKEN_IDS = "token_ids"
SAMPLING_PARAMS = "sampling_params"
SAMPLES = "n"  # parallel samples per request (SamplingParams.n)
MAX_TOKENS = "max_tokens"
MIN_TOKENS = "min_tokens"
# Grammar-constrained decoding (and its older spellings): the grammar state is not transferable.
GUIDED_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                 "guided_decoding")
STATE_PROMPT_TOKENS = "prompt_tokens"
OUTPUT_MODE = "output_mode"  # GenerateRequest: "tokens" (default), "text", "derender"
TEXT, DERENDER = "text", "derender"
STOP = "stop"  # SamplingParams.stop: str | list[str] | None
INCLUDE_STOP = "include_stop_str_in_output"
# A finished response's values over the finishing attempt's own work, not the request's (top level,
# and per choice): with tokens emitted before the seal no exact whole-request value exists, so each is
# ``None`` with ``<field>_unavailable_reason: stitch_incomplete``.
ATTEMPT_FIELDS = (METRICS,)
ATTEMPT_CHOICE_FIELDS = (WEIGHT_VERSIONS,)
# Timings, read from the answering worker's clock (0.34.0 /inference/v1/generate: ``created``; the
# ``PerRequestMetrics`` timings stay ``None`` there, ``build_per_request_timing_metrics`` being called by
# the chat-completions server only). The request's clock started on the lost worker, so a resumed
# attempt's value is not the request's even with nothing emitted before the seal: ``None`` with
# ``<field>_unavailable_reason: stitch_incomplete`` on every stitched body.
TIMING_FIELDS = (CREATED,)


class _Base(msgspec.Struct):
    """What the stitch adds back, frozen when an attempt is sealed."""

    emitted: int = 0
    published: int = 0
    prompt: int | None = None  # the original prompt's count, as the client was sent it (None: unknown)
    request_id: Any = None
    rows: Any = None  # encoded routed_experts an earlier attempt published


class VLLMMigrationSession(MigrationSession):
    def __init__(self, codec: VLLMCodec) -> None:
        self._experts = codec.sequences[ROUTED_EXPERTS]
        self._ids = array("q")
        self._published = 0
        self._request_id: Any = None
        self._prompt_tokens: int | None = None
        self._rows: Any = None
        self._rows_bytes = 0  # size of the body routed_experts was kept from
        self._base = _Base()

    def absorb(self, bodies: Sequence[bytes]) -> None:
        for body in bodies:
            obj = parse_object(body)
            if obj is None:
                raise MigrationRefused("a published body is not a JSON object, so the emitted tokens are unknown")
            choices = obj.get("choices")
            if not isinstance(choices, list):
                raise MigrationRefused("a published body has no choices, so the emitted tokens are unknown")
            if len(choices) > 1 or any(not isinstance(c, dict) or c.get("index", 0) != 0 for c in choices):
                raise MigrationRefused("several choices (n > 1) cannot be resumed as one request")
            for choice in choices:
                ids = choice.get(TOKEN_IDS)
                if not isinstance(ids, list) or not all(is_int(t) for t in ids):
                    raise MigrationRefused("a published choice has no integer token_ids, so the emitted "
                                           "tokens are unknown")
                keep_emitted(self._ids, ids)
                if choice.get(FINISH_REASON) is not None:
                    # 0.34.0 ``serve_tokens_stream_generator``: the finishing output is a token chunk and
                    # the usage chunk (``choices=[]``, after the engine's loop) follows it. A worker lost
                    # between the two left nothing to generate: resumed, the request (``max_tokens`` - k
                    # left) went on past the finish the client had read.
                    raise MigrationRefused(f"the stream already finished (finish_reason {shown(str(choice[FINISH_REASON]))} "
                                           "was sent): only what follows it, the usage chunk, was lost; a resumed "
                                           "request would generate past the end")
                if choice.get(ROUTED_EXPERTS) is not None:
                    self._rows = choice[ROUTED_EXPERTS]
                    self._rows_bytes = len(body)
            if self._request_id is None and obj.get("request_id") is not None:
                self._request_id = obj["request_id"]
            usage = obj.get("usage")
            if isinstance(usage, dict) and is_int(usage.get("prompt_tokens")):
                self._prompt_tokens = usage["prompt_tokens"]
            self._published += 1

    def seal(self) -> Emitted:
        self._base = _Base(len(self._ids), self._published, self._prompt_tokens, self._request_id, self._rows)
        state = {STATE_PROMPT_TOKENS: self._prompt_tokens} if self._prompt_tokens is not None else {}
        return Emitted(self._ids.tolist(), state)

    def progress_bytes(self) -> int:
        """8 bytes a token id, plus the body the kept routed_experts came from (the sealed base
        shares it); ids, counts and the request id are bounded by one body."""
        return self._ids.itemsize * len(self._ids) + self._rows_bytes

    def stitch(self, body: bytes, final: bool) -> tuple[bytes, Verdict] | None:
        base = self._base
        obj = parse_object(body)
        if obj is None:
            return None  # not vLLM-shaped: nothing in it can be restated
        changed = False
        verdict = Verdict.STITCHED
        k = base.emitted
        if base.request_id is not None and obj.get("request_id") not in (None, base.request_id):
            obj["request_id"] = base.request_id
            changed = True
        usage = obj.get("usage")
        if isinstance(usage, dict) and k:
            if is_int(usage.get("prompt_tokens")):
                usage["prompt_tokens"] = restated_prompt(usage["prompt_tokens"], k, base.prompt)
                changed = True
            if is_int(usage.get("completion_tokens")):
                usage["completion_tokens"] += k
                changed = True
            changed = _cap_cached_tokens(usage) or changed
        if base.published:
            for key in (PROMPT_LOGPROBS, unavailable_key(PROMPT_LOGPROBS), *FIRST_CHUNK_FIELDS):
                if key in obj:
                    del obj[key]
                    changed = True
        elif k and isinstance(obj.get(PROMPT_LOGPROBS), list):
            obj[PROMPT_LOGPROBS] = obj[PROMPT_LOGPROBS][:max(0, len(obj[PROMPT_LOGPROBS]) - k)]
            changed = True
        choices = obj.get("choices")
        targets = [(obj, TIMING_FIELDS)]
        if k:
            targets += [(obj, ATTEMPT_FIELDS)]
            targets += [(c, ATTEMPT_CHOICE_FIELDS) for c in choices if isinstance(c, dict)] if isinstance(choices, list) else []
        for target, fields in targets:
            for field in fields:
                if target.get(field) is not None:
                    target[field] = None
                    target[unavailable_key(field)] = Omit.STITCH_INCOMPLETE.value
                    verdict = Verdict.OMITTED
                    changed = True
        if base.rows is not None and isinstance(choices, list):
            for choice in choices:
                if isinstance(choice, dict) and choice.get(ROUTED_EXPERTS) is not None:
                    outcome = self._stitch_rows(choice, base.rows)
                    if outcome is not None:
                        verdict = Verdict.OMITTED if Verdict.OMITTED in (verdict, outcome) else outcome
                        changed = True
        if not changed:
            return None  # the joined body as it is, with the join's verdict
        # The verdict is the body's: a marker left, the join's included (the stitch drops a prompt
        # logprobs one the client was answered before), makes it ``omitted`` (docs/protocol.md). The
        # join puts them in the body, its choices and ``usage`` (``prompt_tokens_details``).
        targets = [obj, *(c for c in choices if isinstance(c, dict))] if isinstance(choices, list) else [obj]
        if isinstance(usage, dict):
            targets.append(usage)
        if any(key.endswith(UNAVAILABLE_SUFFIX) for target in targets for key in target):
            verdict = Verdict.OMITTED
        return dump(obj), verdict

    def _stitch_rows(self, choice: dict, earlier_value: Any) -> Verdict | None:
        """Rows an earlier attempt published come from the passes that sampled those tokens: they win."""
        try:
            earlier = self._experts.decode(earlier_value)
            current = self._experts.decode(choice[ROUTED_EXPERTS])
        except CorruptPayload:
            return _omit(choice, Omit.STITCH_CORRUPT)
        if (earlier.dtype != current.dtype or earlier.shape[1:] != current.shape[1:]
                or current.shape[0] < earlier.shape[0]):
            return _omit(choice, Omit.LENGTH_MISMATCH)
        if np.array_equal(current[:earlier.shape[0]], earlier):
            return None
        choice[ROUTED_EXPERTS] = self._experts.encode(np.concatenate([earlier, current[earlier.shape[0]:]]))
        return Verdict.STITCHED


def _cap_cached_tokens(usage: dict) -> bool:
    """A resumed attempt's ``cached_tokens`` counts hits over its whole prompt, the emitted tokens
    included; restated against the original prompt, hits beyond it are not prompt cache hits."""
    details = usage.get(PROMPT_TOKENS_DETAILS)
    prompt = usage.get("prompt_tokens")
    if not isinstance(details, dict) or not is_int(prompt):
        return False
    cached = details.get(CACHED_TOKENS)
    if not is_int(cached) or cached <= max(prompt, 0):
        return False
    usage[PROMPT_TOKENS_DETAILS] = {**details, CACHED_TOKENS: max(prompt, 0)}
    return True


def _omit(choice: dict, reason: str) -> Verdict:
    choice[ROUTED_EXPERTS] = None
    choice[unavailable_key(ROUTED_EXPERTS)] = reason
    return Verdict.OMITTED


# --------------------------------------------------------------------- requests

def check_request(body: bytes) -> dict:
    """The parsed request, or :class:`MigrationRefused` if it cannot be resumed on another worker."""
    obj = parse_object(body)
    if obj is None:
        raise MigrationRefused("the request is not a JSON object")
    ids = obj.get(TOKEN_IDS)
    if not isinstance(ids, list) or not ids or not all(is_int(t) for t in ids):
        raise MigrationRefused("the request has no token_ids to extend")
    check_sampling_params(obj.get(SAMPLING_PARAMS), guided=GUIDED_FIELDS, samples=SAMPLES)
    return obj


def _check_detokenizer_state(mode: object, params: dict, emitted: int) -> None:
    """Refuse the output modes whose stream depends on worker state a resumed request does not have,
    when ``emitted`` tokens reached the client before the seal.

    ``tokens`` (the default) carries token ids only, and they continue exactly. ``derender``: 0.34.0
    ``serve_tokens_stream_generator`` sends ``delta.role = "assistant"`` on each request's first chunk
    (``role_sent``) and parses with a fresh ``ChatStreamProcessor``, blind to the lost attempt's
    reasoning and tool-call progress. ``text`` with stop strings: ``BaseIncrementalDetokenizer``
    holds back ``stop_buffer_length = max(len(s) for s in self.stop) - 1`` characters (unless
    ``include_stop_str_in_output``) until the request finishes (``get_next_output_text``); what the
    lost worker held back is text of tokens the client already has, and the resumed worker decodes
    only its own output, so those characters would be missing from the stitched text.

    With nothing emitted there is neither: the generator publishes a chunk only for an output with
    token ids, a finish, text or a parser that has seen tokens (``if not (delta_token_ids or
    finish_reason is not None or (text_mode and output.text) or (processors is not None and
    processors[i].num_output_tokens)): continue``), and text comes from tokens, so a body published
    before any token was emitted is a finished one, which the session refuses (only the usage chunk
    was lost). The resumed attempt's first chunk then says the role, its parser and detokenizer see
    the whole output, as the uninterrupted run's did; a unary request (``serve_tokens_full_generator``
    parses the final output in one go) always migrates with none.
    """
    if emitted == 0:
        return
    if mode == DERENDER:
        raise MigrationRefused(f"output_mode derender with {emitted} tokens emitted: the chat parser's state (the "
                               "role sent once, reasoning and tool-call progress) cannot be carried over; "
                               "derender tokens-mode output instead")
    if mode != TEXT or params.get(INCLUDE_STOP) is True:
        return
    stop = params.get(STOP)
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    if any(isinstance(s, str) and len(s) > 1 for s in stops):
        raise MigrationRefused(f"output_mode text with stop strings and {emitted} tokens emitted: the text the lost "
                               "worker held back for stop-string matching is lost with it (set "
                               "include_stop_str_in_output, or use output_mode tokens)")


def resume_request(body: bytes, emitted: Emitted) -> bytes:
    """The request that continues ``body`` after ``emitted``: prompt + emitted tokens, budget − k.

    ``routed_experts_prompt_start`` is an absolute position and stays; ``kv_transfer_params`` belonged
    to the lost P/D pair and is dropped (the serving layer sets the new pair's).
    """
    obj = check_request(body)
    _check_detokenizer_state(obj.get(OUTPUT_MODE), obj.get(SAMPLING_PARAMS) or {}, len(emitted.token_ids))
    ids = obj[TOKEN_IDS]
    check_resumed_prompt(len(ids), emitted, STATE_PROMPT_TOKENS)
    # max_tokens None: bounded by the model's context only, which the longer prompt accounts for
    obj[SAMPLING_PARAMS] = resumed_budget(obj.get(SAMPLING_PARAMS) or {}, len(emitted.token_ids),
                                          max_key=MAX_TOKENS, min_key=MIN_TOKENS, default=None)
    obj[TOKEN_IDS] = ids + list(emitted.token_ids)
    obj.pop("kv_transfer_params", None)
    return dump(obj)
