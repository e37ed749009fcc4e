"""The vLLM P/D join: prompt logprobs and prompt expert rows from prefill, token labels filled.

A P/D decode worker that receives the prompt's KV cannot score the prompt (its ``prompt_logprobs``
rows are never written; one that recomputes them gives another engine's floats) and
either returns garbage for the prompt's expert rows ("full" coverage) or leaves them out ("suffix"
coverage, vLLM's capturer with ``start_tokens = num_prompt_tokens``). Which one happened is read
from the row counts, never assumed. With vLLM 0.34.0's ``routed_experts_prompt_start = S`` every
leg's rows start at ``S``; each leg's ``S`` is read from its own row count (:func:`leg_start`) and
the rows are joined only when both legs imply the same one. Anything that cannot be joined exactly
is omitted with a ``<field>_unavailable_reason`` marker: a client never sees a stale or partial array.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Sequence

import numpy as np

from streamproc.codec import CorruptPayload, JoinSession, parsed_json_bound
from streamproc.codec import OmissionReason as Omit
from streamproc.wire import Verdict

from .native import (
    ABORT,
    CACHED_TOKENS,
    COMPLETION_TOKENS,
    DECODE_SELF_SCORED_FIELDS,
    FINISH_REASON,
    KV_TRANSFER_PARAMS,
    PROMPT_LOGPROBS,
    PROMPT_SIDE_FIELDS,
    PROMPT_TOKENS_DETAILS,
    REMOTE_PREFILL_CACHED_TOKENS,
    ROUTED_EXPERTS,
    StreamExperts,
    choices_of,
    dump,
    error_response_prefix,
    is_error_response,
    is_int,
    is_unary,
    label_and_clamp,
    parse_object,
    unavailable_key,
    usage_count,
)
from .fold import fold_objects

if TYPE_CHECKING:
    from .codec import VLLMCodec

EXPERT_RANK = 3  # (rows, num_layers, top_k)


def leg_start(positions: int, rows: int) -> int | None:
    """The first position ``S`` of a leg's rows, from the positions it forwarded and the rows it
    sent; None when the rows outnumber the positions (``S < 0``: no capture does that).

    vLLM 0.34.0 ``AuxOutputSchedulerConnector.build_connector_meta`` gives a request, on its first
    schedule, the emit start::

        # A P/D prefiller may cut the prompt short of the requested start.
        scheduled_requests[request_id] = max(
            min(request.sampling_params.routed_experts_prompt_start, request.num_prompt_tokens),
            0 if request.num_output_tokens == 0 else request.num_tokens - 1,
        )

    the worker keeps it as ``_WorkerRequestState(emit_cursor=emit_start)`` and emits every row from
    there (``AuxOutputWorkerConnector._commit_output``: captured, or materialised from its store for
    KV it did not compute), and ``take_output`` stops at ``request.num_tokens - 1``. So a leg's rows
    are ``[min(S, num_prompt_tokens), positions)`` with ``positions = P + O - 1`` (prefill: ``P``).
    Its ``S`` is ``positions - rows``; the caller bounds it by ``P``.

    A decode leg's prompt rows are never partly missing: its external KV hit is all or nothing
    (``cap_external_hit``: ``return num_external`` if the hit is block-aligned and within
    ``max_cache_hit``, the blocks whose rows it holds, else ``return 0`` and it recomputes), and its
    store fails closed (``BlockObjectStoreError``) instead of returning fewer rows. A NIXL prefiller
    that backs off ``b`` prompt tokens (``_truncate_request_for_prefill``) sends ``[min(S, P - b),
    P - b)`` while ``usage.prompt_tokens`` stays ``P``: it implies ``S + b`` (or ``P``), which agrees
    with decode's ``S`` only when ``S = P``, where the joined rows are exact.
    """
    start = positions - rows
    return start if start >= 0 else None


class _Edit:
    """What a join did to one body, so the verdict and the bytes follow from it."""

    __slots__ = ("changed", "omitted")

    def __init__(self) -> None:
        self.changed = False
        self.omitted = False

    def put(self, target: dict, key: str, value: object) -> None:
        if key not in target or target[key] != value:
            target[key] = value
            self.changed = True

    def drop(self, target: dict, key: str) -> None:
        if key in target:
            del target[key]
            self.changed = True

    def provide(self, target: dict, field: str, value: object) -> None:
        self.put(target, field, value)
        self.drop(target, unavailable_key(field))

    def omit(self, target: dict, field: str, reason: str) -> None:
        self.put(target, field, None)
        self.put(target, unavailable_key(field), reason)
        self.omitted = True


def duplicate_ids(rows: np.ndarray) -> bool:
    """Whether some (position, layer) names one expert twice among its top-k: no real capture does
    (a router picks k distinct experts), a stale all-zero capture with k >= 2 always does."""
    if rows.ndim != EXPERT_RANK or rows.shape[2] < 2 or rows.shape[0] == 0:
        return False
    ordered = np.sort(rows, axis=2)
    return bool((ordered[:, :, 1:] == ordered[:, :, :-1]).any())


def _finishes(choice: dict) -> bool:
    """A choice's last chunk: vLLM puts ``routed_experts`` on it (a usage-only chunk may follow)."""
    return choice.get(FINISH_REASON) is not None


def _usage_details(obj: dict) -> bool:
    """Whether a body's usage reports ``prompt_tokens_details`` (a value, not ``null``)."""
    usage = obj.get("usage")
    return isinstance(usage, dict) and usage.get(PROMPT_TOKENS_DETAILS) is not None


class _LastChild(enum.Enum):
    """Which child's state a body's prompt-side fields and cached count are (see :func:`_last_child`)."""

    STARTED = enum.auto()  # one that produced a token: it scored the prompt, prefill's values are the aggregated ones
    UNSTARTED = enum.auto()  # one that ended before its first token: decode's unscored values are
    EITHER = enum.auto()  # an abort ended both kinds, in an order the body does not show


def _last_child(obj: dict, choices: list[dict]) -> _LastChild:
    """Which child completed the body's ``RequestOutput``: a unary body's ``prompt_logprobs``,
    ``prompt_token_id_logprobs`` and ``num_cached_tokens`` are that child's own (vLLM 0.34.0
    ``ParentRequest.get_outputs`` returns the aggregated outputs only once ``child_requests`` is empty, and
    ``RequestState._new_request_output`` reads them from the child whose output it builds), and a child that
    ended before its first token has scored nothing and counted no cache hit (``Scheduler.update_from_output``
    sends both only with an output).

    Choices with tokens that finished normally did so before any abort (``OutputProcessor.abort_requests``
    pops the aborted children's ``request_states``; ``EngineCore`` sends a ``pause(mode="abort")``'s outputs
    between steps), so when every choice without a token was aborted and none with tokens was, an unstarted
    child came last, on any engine. An abort that ended both kinds builds them in an order the body does not
    show: by index for the server's ``/inference/v1/abort_requests`` (``abort_requests`` walks
    ``external_req_ids``, the children in the order they were added), in the order of a set of child-id
    strings, which follows the process's string hashing, for a ``pause(mode="abort")``
    (``EngineCore._send_abort_outputs``: ``list(req_ids)`` of a ``set``) or a parent aborted by its internal id
    (``list(parent.child_requests)``). The aggregated engine may answer either child's values. Stream chunks
    count cache hits from their first output and carry no prompt-side fields; choices whose ``token_ids``
    are not listed tell nothing: both read as ``STARTED``."""
    if usage_count(obj, COMPLETION_TOKENS) == 0:
        return _LastChild.UNSTARTED
    if len(choices) < 2 or not is_unary(obj) or not all(isinstance(c.get("token_ids"), list) for c in choices):
        return _LastChild.STARTED
    unstarted = [c for c in choices if not c["token_ids"]]
    if not unstarted:
        return _LastChild.STARTED
    if any(c.get(FINISH_REASON) != ABORT for c in unstarted):
        return _LastChild.EITHER  # e.g. an "error" finish, sent in its own step: no order is known
    if any(c.get(FINISH_REASON) == ABORT for c in choices if c["token_ids"]):
        return _LastChild.EITHER
    return _LastChild.UNSTARTED


def _unscored(value: object) -> bool:
    """A ``prompt_logprobs`` list without a score: what a child that ended before its first token has
    (``create_prompt_logprobs`` plus a ``None`` per position before ``prompt_logprob_start``), and all a
    scored child has when nothing past that start is left to score."""
    return isinstance(value, list) and all(entry is None for entry in value)


def _choice_index(choice: dict, position: int) -> int:
    index = choice.get("index", position)
    return index if is_int(index) else position


def _ascii_rows(obj: dict) -> int:
    """Characters of the ASCII ``routed_experts`` strings (Base64 rows) in one parsed body."""
    return sum(len(value) for choice in choices_of(obj)
               if type(value := choice.get(ROUTED_EXPERTS)) is str and value.isascii())


class VLLMJoinSession(JoinSession):
    def __init__(self, codec: VLLMCodec) -> None:
        self._experts = codec.sequences[ROUTED_EXPERTS]
        self._max_bytes = codec.options.max_decompressed_bytes
        self._stream_has_no_experts = codec.stream_experts is StreamExperts.NO
        self._prefill_known = False
        self._leg_reason: str | None = None  # the whole prefill leg is unusable, and why
        self._prefill: dict | None = None  # the prefill leg folded into one object
        self._prefill_rows: dict[int, np.ndarray | str] = {}  # choice index -> rows or omission reason
        self._parsed_extra = 0  # what the parsed prefill leg holds beyond its body length (retained_bytes)
        self._joined = 0
        self._tokens_seen: dict[int, int] = {}
        self._tokens_hidden: set[int] = set()  # choice indices with a chunk whose token_ids were not a list
        self._counts_lost = False  # bodies published before a take-over could not be read back
        self._parsed: tuple[bytes, dict | None] | None = None
        self.decodes = 0  # rows payloads decoded or tried (JoinSession.decodes: max_decode_cpu)

    # ------------------------------------------------------------- prefill leg

    def needs_prefill(self, body: bytes, final: bool) -> bool:
        # The first chunk may carry prompt_logprobs (unary bodies), and a choice's finishing chunk
        # routed_experts. A middle chunk only waits if it unexpectedly carries expert rows, which
        # could be stale, or usage with prompt_tokens_details (upstream puts those on the final one).
        if final or self._joined == 0:
            # Not the worker's ErrorResponse, which is published as sent (nothing of prefill's is read).
            # The raw bytes first: a first or final body may be large, and this runs on the event loop.
            if not error_response_prefix(body):
                return True
            obj = self._parse(body)
            return obj is None or not is_error_response(obj)
        obj = self._parse(body)  # an ErrorResponse has neither usage nor choices: it does not wait
        return obj is not None and (_usage_details(obj) or any(
            _finishes(c) or c.get(ROUTED_EXPERTS) is not None for c in choices_of(obj)))

    def published(self, bodies: Sequence[bytes]) -> None:
        # Stream chunks carry no usage unless the client asked for it (serve_tokens_stream_generator
        # yields GenerateStreamResponse(request_id=..., choices=[...]): usage null), so the generated
        # count the final chunk's rows are checked against is the token_ids seen in every chunk
        # (_completion_tokens). The heir of a take-over counts the published ones as the live session
        # counted their chunks; the join leaves token_ids as the chunk sent them.
        for body in bodies:
            self._joined += 1
            obj = parse_object(body)
            if obj is not None:
                self._count_tokens(choices_of(obj))

    def published_lost(self, count: int, reason: str) -> None:
        # Their token_ids are unknown: a count without them would check the final chunk's rows against
        # part of the output (and a one-token guess could pass prefill's rows off as the whole answer).
        self._joined += count
        self._counts_lost = True

    def _count_tokens(self, choices: list[dict]) -> None:
        for position, choice in enumerate(choices):
            index = _choice_index(choice, position)
            token_ids = choice.get("token_ids")
            if isinstance(token_ids, list):
                self._tokens_seen[index] = self._tokens_seen.get(index, 0) + len(token_ids)
            else:
                self._tokens_hidden.add(index)

    def set_aside(self) -> None:
        self._parsed = None  # the waiting chunk's parsed form: parsed again when it resumes

    def absorb_prefill(self, bodies: Sequence[bytes]) -> None:
        self._prefill_known = True
        objects = [parse_object(b) for b in bodies]
        if not objects or any(o is None for o in objects):
            self._leg_reason = Omit.PREFILL_CORRUPT
            return
        if any(is_error_response(o) for o in objects):  # type: ignore[arg-type]
            # The prefill worker failed (its unary ``ErrorResponse``, or a stream's last frame): no value
            # of it exists, which is not a leg that left a field out (``prefill_missing``).
            self._leg_reason = Omit.PREFILL_ERROR
            return
        if any(c.get(FINISH_REASON) == ABORT
               for o in objects for c in choices_of(o)):  # type: ignore[arg-type]
            # Aborted before its one token (max_tokens=1: a token ends it "length" in the same step): its
            # count 0 and unscored list are no engine's answer, and no connector hands its KV over (vLLM
            # ``MooncakeConnectorScheduler.request_finished``: ``if params is None or not
            # params.get("do_remote_decode") or request.status != RequestStatus.FINISHED_LENGTH_CAPPED:
            # return False, None``), so a decode that answered scored the prompt itself.
            self._leg_reason = Omit.PREFILL_ERROR
            return
        self._prefill = fold_objects(objects)  # type: ignore[arg-type]
        for position, choice in enumerate(choices_of(self._prefill)):
            self._prefill_rows[_choice_index(choice, position)] = self._prefill_choice_rows(choice)
        # What the parsed leg holds beyond its body length (charged already, as buffered bodies):
        # parsed_json_bound of each body, its Base64 rows one byte a character.
        self._parsed_extra = sum(parsed_json_bound(body, _ascii_rows(obj)) - len(body)
                                 for body, obj in zip(bodies, objects))

    def retained_bytes(self) -> int:
        extra = self._parsed_extra if self._prefill is not None else 0
        return extra + sum(rows.nbytes for rows in self._prefill_rows.values() if isinstance(rows, np.ndarray))

    def prefill_unavailable(self, reason: str) -> None:
        self._prefill_known = True
        self._leg_reason = reason

    def _prefill_choice_rows(self, choice: dict) -> np.ndarray | str:
        value = choice.get(ROUTED_EXPERTS)
        if value is None:
            return Omit.PREFILL_MISSING
        self.decodes += 1
        try:
            rows = self._experts.decode(value)
        except CorruptPayload as exc:
            return Omit.of_leg(exc, "prefill")
        return rows if rows.ndim == EXPERT_RANK and not duplicate_ids(rows) else Omit.PREFILL_CORRUPT

    def _prefill_slot(self, index: int) -> np.ndarray | str:
        if self._leg_reason is not None:
            return self._leg_reason
        if not self._prefill_known:
            return Omit.PREFILL_MISSING
        return self._prefill_rows.get(index, Omit.PREFILL_MISSING)

    # ------------------------------------------------------------ decode chunks

    def _parse(self, body: bytes) -> dict | None:
        cached = self._parsed
        if cached is not None and cached[0] is body:
            return cached[1]
        obj = parse_object(body)
        self._parsed = (body, obj)
        return obj

    def join(self, body: bytes, final: bool) -> tuple[bytes, Verdict]:
        try:
            return self._join(body, final)
        finally:
            if final:
                # The request ends with this chunk: prefill's decoded rows are freed here, in the thread
                # that joins, not when the request is forgotten on the event loop (freeing a large
                # buffer holds the GIL, ~2 ms per 32 MiB, every other request waiting).
                self._prefill_rows.clear()
                self._prefill = None

    def _join(self, body: bytes, final: bool) -> tuple[bytes, Verdict]:
        obj = self._parse(body)
        self._parsed = None
        first = self._joined == 0
        self._joined += 1
        if obj is None:
            return body, Verdict.PASSTHROUGH  # not a vLLM object: nothing in it can be joined
        edit = _Edit()
        choices = choices_of(obj)
        self._count_tokens(choices)
        for choice in choices:
            if label_and_clamp(choice):
                edit.changed = True
        # A body whose usage counts no generated token answers a request that ended before token 0 (an
        # abort): no engine has scored its prompt or counted its cache hits by then, since
        # ``Scheduler.update_from_output`` sends prompt logprobs and prefill stats only with the first
        # output ("EngineCore returns no partial prefill outputs"). Decode's values (``create_prompt_logprobs``'s
        # ``[None]``, ``num_cached_tokens`` 0) are the aggregated ones; prefill's are not.
        # With n > 1 a unary body's are the values of the child that came last (:func:`_last_child`).
        last = _last_child(obj, choices)
        if first and last is not _LastChild.UNSTARTED:
            self._join_prompt_logprobs(obj, edit, last)
        if _usage_details(obj) and last is not _LastChild.UNSTARTED:
            self._join_prompt_tokens_details(obj["usage"], edit, last, self._parallel(choices))
        for position, choice in enumerate(choices):
            if final or _finishes(choice) or choice.get(ROUTED_EXPERTS) is not None:
                self._join_experts(obj, choice, _choice_index(choice, position), edit)
        if edit.omitted:
            return (dump(obj) if edit.changed else body), Verdict.OMITTED
        if edit.changed:
            return dump(obj), Verdict.JOINED
        return body, Verdict.PASSTHROUGH

    def _prompt_tokens(self, obj: dict) -> int | None:
        """Prompt length per the decode chunk's usage, else the prefill's (None if neither says)."""
        own = usage_count(obj, "prompt_tokens")
        return own if own is not None else usage_count(self._prefill, "prompt_tokens")

    def _join_prompt_logprobs(self, obj: dict, edit: _Edit, last: _LastChild) -> None:
        """The prompt-side fields (``prompt_logprobs``; ``prompt_token_id_logprobs``, the scores of
        ``prompt_logprob_token_ids``) are their own sampling parameters, independent of ``logprobs``,
        and only unary bodies carry the keys (``GenerateResponse``; stream chunks have none). So a body
        without a key gets none, and a ``null`` stays ``null`` when prefill, which scored the prompt if
        asked to, has none either."""
        for field in PROMPT_SIDE_FIELDS:
            self._join_prompt_field(obj, field, edit, last)

    def _join_prompt_field(self, obj: dict, field: str, edit: _Edit, last: _LastChild) -> None:
        """Prefill's value wins over decode's whatever decode sent: prefill ran the whole prompt as the
        aggregated engine does, while a decode leg that loaded the prompt's KV (NIXL
        ``get_num_new_matched_tokens``) returns ``P - 1`` rows ``_get_prompt_logprobs_dict`` never wrote
        (``LogprobsTensors.empty_cpu``, uninitialised), and one that recomputed it (vLLM 0.34.0
        ``Request.skip_reading_external_kv``) floats of another engine and batch. Comparing the legs
        therefore omitted nearly every P/D answer; a list must instead cover the prompt. Decode's own
        value stands in only where it cannot be unwritten rows (:data:`DECODE_SELF_SCORED_FIELDS`, a
        one-token prompt's ``[None]``); otherwise, with prefill silent, the field is omitted. When the
        aggregated engine may have built the body from a child that scored the prompt or from one that
        did not (``_LastChild.EITHER``), a value that differs between the two is omitted (``decode_error``)."""
        if field not in obj:
            return
        from_prefill = self._prefill.get(field) if self._prefill is not None else None
        from_decode = obj.get(field)
        if from_prefill is not None:
            if self._prefill_scored_another_prompt(obj):
                edit.omit(obj, field, Omit.LENGTH_MISMATCH)  # one entry per prompt token, [0] null
            elif last is _LastChild.EITHER and not _unscored(from_prefill):
                edit.omit(obj, field, Omit.DECODE_ERROR)  # scored or not, as the abort order fell
            else:
                edit.provide(obj, field, from_prefill)
            return
        if from_decode is None and self._leg_reason is None:
            return  # neither leg scored the prompt: none were asked for (prefill runs the client's parameters)
        if from_decode is not None and field in DECODE_SELF_SCORED_FIELDS:
            if last is _LastChild.EITHER:
                edit.omit(obj, field, Omit.DECODE_ERROR)  # decode's last child's scores, or none
            return  # decode computed these itself (it never sends unwritten rows): the aggregated value
        if from_decode == [None] and self._prompt_tokens(obj) == 1:
            return  # a one-token prompt scores nothing on any engine: [None] is the aggregated list
        # Decode's list may be rows it never wrote (it loaded the prompt's KV: ``[None]``, or
        # ``LogprobsTensors.empty_cpu`` garbage of the right length) or its own recomputation (vLLM
        # 0.33.0's default ``skip_reading_prefix_cache``, 0.34.0's ``skip_reading_external_kv``), and no
        # body tells which; a prefill leg without the field (a router that stripped the parameter) does
        # not vouch for it. Without a prefill leg nothing tells whether the prompt was to be scored.
        edit.omit(obj, field, self._leg_reason if self._leg_reason is not None else Omit.PREFILL_MISSING)

    def _prefill_scored_another_prompt(self, obj: dict) -> bool:
        """Whether prefill's ``prompt_logprobs`` list has fewer or more entries than the prompt has
        tokens: it ran another prompt, so none of its prompt-side values is the aggregated one.

        A NIXL prefiller that backs off ``b`` prompt tokens (``_truncate_request_for_prefill``: Mamba,
        bounded replay, MTP lookahead; vLLM 0.33.0 does so for a scoring request whose client set
        ``skip_reading_prefix_cache=False``) scores ``P - b`` positions, while its
        ``prompt_token_id_logprobs`` buffer keeps the ``P - 1 - start`` rows ``InputProcessor`` checked
        and ``compute_prompt_token_id_logprobs`` writes only up to ``prompt_len - 1``: ``torch.empty_like``
        rows are published at its tail, of the right shape. The list is the only witness."""
        listed = self._prefill.get(PROMPT_LOGPROBS) if self._prefill is not None else None
        prompt_tokens = self._prompt_tokens(obj)
        return isinstance(listed, list) and prompt_tokens is not None and len(listed) != prompt_tokens

    def _parallel(self, choices: list[dict]) -> bool:
        """Whether the request runs ``n > 1`` children: the body (or the stream so far) or the prefill leg
        has more than one choice."""
        indices = len(self._tokens_seen.keys() | self._tokens_hidden)
        prefill = len(choices_of(self._prefill)) if self._prefill is not None else 0
        return max(len(choices), indices, prefill) > 1

    def _join_prompt_tokens_details(self, usage: dict, edit: _Edit, last: _LastChild, parallel: bool) -> None:
        """``usage.prompt_tokens_details`` is the engine's ``num_cached_tokens``
        (``serve_tokens_full_generator`` / ``serve_tokens_stream_generator``), which ``Scheduler.schedule``
        sets to local plus external computed tokens. A decode leg's external tokens are the prompt KV
        NIXL loaded (``get_num_new_matched_tokens``: every prompt token not cached locally), so it reports
        about the whole prompt as cached; a prefill leg loads nothing and reports its own prefix-cache
        hit, what an aggregated engine reports. So prefill's count (or its ``null``) replaces decode's;
        without it the field is omitted.

        Only the count: the rest of the object keeps decode's shape, which is the aggregated body's for
        its kind. vLLM 0.34.0's ``PromptTokenUsageInfo`` has ``cached_tokens``, ``created_cache_tokens`` and
        ``multimodal_tokens``; a unary body (every prefill leg) dumps all three (``model_dump()``), a stream's
        usage chunk only the non-null ones (``model_dump_json(exclude_none=True)``).

        With ``_LastChild.EITHER`` the aggregated count is prefill's or the unstarted child's 0: a count
        other than 0 is omitted (``decode_error``).

        With ``n > 1`` (``parallel``) the count is one child's, and siblings hit each other's prompt blocks
        (vLLM 0.34.0 ``KVCacheManager.allocate_slots`` caches a child's full blocks as they are allocated; a
        sibling scheduled after it finds them): child 0 counts the hits from before the request, a later
        child the prompt's full blocks. Prefill's unary body has its last child's count
        (``ParentRequest.get_outputs``, ``RequestState._new_request_output``; its ``max_tokens=1`` children
        finish together, the last scheduled last), the aggregated unary body the count of its own last
        child (child 0 when it generated longest), the aggregated stream its first output's
        (``serve_tokens_stream_generator``: ``if first_iteration``), child 0's. No body says which child a
        count is: a count other than 0 (every child's when none could hit) is omitted
        (``prefill_missing``: the prefill leg does not carry the count of the child the answer reports)."""
        if self._leg_reason is not None:
            edit.omit(usage, PROMPT_TOKENS_DETAILS, self._leg_reason)
            return
        prefill_usage = self._prefill.get("usage") if self._prefill is not None else None
        if not isinstance(prefill_usage, dict) or PROMPT_TOKENS_DETAILS not in prefill_usage:
            # Its server does not report details (no --enable-prompt-tokens-details), but its engine may
            # have handed the count to decode.
            handed_over = self._prefill_count_handed_to_decode()
            own = usage[PROMPT_TOKENS_DETAILS]
            if handed_over is None or not isinstance(own, dict):
                edit.omit(usage, PROMPT_TOKENS_DETAILS, Omit.PREFILL_MISSING)
            elif last is _LastChild.EITHER and handed_over != 0:
                edit.omit(usage, PROMPT_TOKENS_DETAILS, Omit.DECODE_ERROR)
            elif parallel and handed_over != 0:
                edit.omit(usage, PROMPT_TOKENS_DETAILS, Omit.PREFILL_MISSING)  # its last child's count
            else:
                edit.provide(usage, PROMPT_TOKENS_DETAILS, {**own, CACHED_TOKENS: handed_over})
            return
        from_prefill = prefill_usage[PROMPT_TOKENS_DETAILS]
        own = usage[PROMPT_TOKENS_DETAILS]
        if from_prefill is None or not isinstance(own, dict):
            edit.provide(usage, PROMPT_TOKENS_DETAILS, from_prefill)  # older serve/disagg: null for none cached
            return
        if not isinstance(from_prefill, dict) or CACHED_TOKENS not in from_prefill:
            edit.omit(usage, PROMPT_TOKENS_DETAILS, Omit.PREFILL_MISSING)  # no count to take
            return
        if last is _LastChild.EITHER and from_prefill[CACHED_TOKENS] != 0:
            edit.omit(usage, PROMPT_TOKENS_DETAILS, Omit.DECODE_ERROR)  # prefill's count, or 0
            return
        if parallel and from_prefill[CACHED_TOKENS] != 0:
            edit.omit(usage, PROMPT_TOKENS_DETAILS, Omit.PREFILL_MISSING)  # its last child's count
            return
        edit.provide(usage, PROMPT_TOKENS_DETAILS, {**own, CACHED_TOKENS: from_prefill[CACHED_TOKENS]})

    def _prefill_count_handed_to_decode(self) -> int | None:
        """Prefill's cached-token count as its engine hands it to decode, whatever its server reports:
        vLLM 0.34.0 ``Scheduler.update_from_output`` adds
        ``kv_transfer_params["remote_prefill_cached_tokens"] = prefill_stats.num_cached_tokens`` to a finished
        prefill's parameters, and the decode engine reports that as its own count (``RequestState``:
        ``req_state.num_cached_tokens = req_state.remote_prefill_cached_tokens``). None when the prefill leg
        carries no such count."""
        params = self._prefill.get(KV_TRANSFER_PARAMS) if self._prefill is not None else None
        count = params.get(REMOTE_PREFILL_CACHED_TOKENS) if isinstance(params, dict) else None
        return count if is_int(count) and count >= 0 else None

    def _completion_tokens(self, obj: dict, index: int) -> int:
        own = usage_count(obj, "completion_tokens")
        if own is not None and len(self._tokens_seen) <= 1:
            return own  # with n > 1 usage counts every choice together, so count this one's tokens
        if self._counts_lost:
            return -1  # not known: the rows are omitted (length_mismatch), never joined on a partial count
        return self._tokens_seen.get(index, 0)

    def _no_output_token(self, obj: dict, index: int) -> bool:
        """Whether the choice is known to have produced no token: its ``usage.completion_tokens`` (this
        choice's count, or with ``n > 1`` every choice's together) is 0, or every chunk of it listed its
        ``token_ids`` and none had one. Hidden ids (``derender`` with ``include_reasoning=false``) and no
        usage: not known."""
        own = usage_count(obj, COMPLETION_TOKENS)
        if own == 0:
            return True
        if index in self._tokens_hidden or self._tokens_seen.get(index, 0) or self._counts_lost:
            return False
        return own is None or len(self._tokens_seen) > 1  # with n > 1 usage counts every choice together

    def _join_experts(self, obj: dict, choice: dict, index: int, edit: _Edit) -> None:
        if self._stream_has_no_experts and ROUTED_EXPERTS not in choice and not is_unary(obj):
            # stream_routed_experts=no: this vLLM's stream choices have no such field, so its
            # aggregated stream has no key either. Prefill's rows (a unary leg) are not spliced in.
            return
        value = choice.get(ROUTED_EXPERTS)
        if value is None and self._no_output_token(obj, index):
            # A choice that ended before its first token (an abort: ``OutputProcessor.abort_requests``,
            # ``make_request_output(new_token_ids=[], finish_reason=FinishReason.ABORT)``) has no rows on any
            # engine: ``Scheduler.update_from_output`` hands rows over only with an output
            # (``should_emit_output = bool(new_token_ids or pooler_output is not None or stopped)``) and
            # ``RequestState._new_completion_output`` attaches them only ``if finished and
            # self.routed_experts_chunks``. The aggregated answer is decode's null: prefill's prompt rows
            # are not it, and nothing was lost.
            return
        slot = self._prefill_slot(index)
        # Did prefill send expert data at all (even data that turned out bad)?
        prefill_sent = self._leg_reason is None and not (isinstance(slot, str) and slot == Omit.PREFILL_MISSING)
        if value is None and ROUTED_EXPERTS in choice and not prefill_sent:
            return  # an explicit null on both legs: expert capture is off, nothing can be stale
        if value is None and not prefill_sent and self._leg_reason is None and self._prefill_known:
            # Neither leg has the key: a vLLM whose choices have no routed_experts field (protocol.py
            # GenerateResponseChoice before it was added), or a stream chunk's None left out
            # (exclude_none) while prefill answered without rows. The aggregated body has no key either.
            return
        if isinstance(slot, str):
            edit.omit(choice, ROUTED_EXPERTS, slot)
            return
        prefill_rows = slot
        # The prompt count P may be unknown: the older serve/disagg GenerateResponse declares no usage
        # (request_id, choices, prompt_logprobs, kv_transfer_params), in stored protocol.py versions whose
        # GenerateResponseChoice already has routed_experts, and stream chunks have none without
        # include_usage. The same-start join below needs no P; the suffix and decode-null cases do.
        prompt_tokens = self._prompt_tokens(obj)
        generated = self._completion_tokens(obj, index) - 1  # the last token is never forwarded
        # prefill forwarded its P prompt tokens
        start = leg_start(prompt_tokens, prefill_rows.shape[0]) if prompt_tokens is not None else None
        if (prompt_tokens is not None and start is None) or generated < 0:
            edit.omit(choice, ROUTED_EXPERTS, Omit.LENGTH_MISMATCH)  # prefill's rows imply S < 0
            return
        if value is None:
            if start is None and generated != 0:  # decode's generated rows are missing whatever P is
                edit.omit(choice, ROUTED_EXPERTS, Omit.DECODE_MISSING)
                return
            if start != 0:  # nothing from decode confirms prefill's S > 0 (or, without P, S = 0)
                edit.omit(choice, ROUTED_EXPERTS, Omit.LENGTH_MISMATCH)
                return
            if generated != 0:
                edit.omit(choice, ROUTED_EXPERTS, Omit.DECODE_MISSING)
                return
            joined = prefill_rows  # one-token completion: every decode row would be a prompt row
        else:
            self.decodes += 1
            try:
                decode_rows = self._experts.decode(value)
            except CorruptPayload as exc:
                edit.omit(choice, ROUTED_EXPERTS, Omit.of_leg(exc, "decode"))
                return
            if decode_rows.ndim != EXPERT_RANK:
                edit.omit(choice, ROUTED_EXPERTS, Omit.DECODE_CORRUPT)
                return
            if decode_rows.dtype != prefill_rows.dtype or decode_rows.shape[1:] != prefill_rows.shape[1:]:
                edit.omit(choice, ROUTED_EXPERTS, Omit.SHAPE_MISMATCH)
                return
            before = decode_rows.shape[0] - generated  # decode's rows before its generated ones
            if duplicate_ids(decode_rows[max(before, 0):]):
                edit.omit(choice, ROUTED_EXPERTS, Omit.DECODE_CORRUPT)  # its own rows are not a real capture
                return
            if before == prefill_rows.shape[0]:
                # Both legs' rows start at the same S: decode's P + O - 1 - S rows less its O - 1
                # generated ones are prefill's P - S (leg_start of both legs equal, with or without P).
                # Prefill's [S, P) replace decode's prompt rows (stale on some vLLM versions), then
                # decode's generated rows [P, P + O - 1).
                joined = np.concatenate([prefill_rows, decode_rows[before:]])
            elif start == 0 and before == 0:
                # Suffix coverage (a decode capturer that skips the prompt, start_tokens =
                # num_prompt_tokens) behind a whole-prompt prefill.
                joined = np.concatenate([prefill_rows, decode_rows])
            else:
                edit.omit(choice, ROUTED_EXPERTS, Omit.LENGTH_MISMATCH)  # a leg lost or gained rows
                return
        if joined.nbytes > self._max_bytes:
            edit.omit(choice, ROUTED_EXPERTS, Omit.TOO_LARGE)
            return
        edit.provide(choice, ROUTED_EXPERTS, self._experts.encode(joined))
