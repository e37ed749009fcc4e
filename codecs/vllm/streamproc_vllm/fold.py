"""Folding vLLM stream chunks into the unary response shape.

The rules mirror what a client accumulating the SSE stream would build: deltas concatenate,
terminal fields come from the last chunk that has them, prompt logprobs from the first. Keys the
codec does not know are kept (last one wins) so nothing a worker sent is silently lost.
"""

from __future__ import annotations

from typing import Sequence

from streamproc.codec import OmissionReason

from .native import (CHOICE_DELTA, CHOICE_MESSAGE, CHOICE_TEXT, KV_TRANSFER_PARAMS, METRICS, METRICS_034,
                     NEVER_STREAMED_034, OUTPUT_MODE, PROMPT_LOGPROBS, ROUTED_EXPERTS, SAMPLING_MASK,
                     UNARY_KEYS_034, USAGE_034, USAGE_CHUNK_FIELDS_034, ModelFields, choices_of, is_int,
                     is_unary, unavailable_key)

_TOP_KEYS = ("request_id", "model", "choices", "usage", PROMPT_LOGPROBS, "kv_transfer_params")
_CHOICE_KEYS = ("index", "logprobs", "finish_reason", "token_ids", ROUTED_EXPERTS, SAMPLING_MASK)


def _joined(deltas: list[dict], key: str) -> str | None:
    pieces = [d[key] for d in deltas if isinstance(d.get(key), str)]
    return "".join(pieces) if pieces else None


def _fold_tool_calls(deltas: list[dict]) -> list[dict]:
    """``DeltaToolCall`` pieces merged by their ``index`` into ``ToolCall`` dumps (id, type, function).
    A call streamed without an id (vLLM 0.34.0 ``CohereCommandParser._tool_call_deltas`` sets one only when
    it has it) keeps ``id: null`` with ``id_unavailable_reason``: the unary id is ``make_tool_call_id()``'s,
    made per answer (``_to_tool_calls``), so no stream says it and ``null`` alone is no vLLM value.
    Each call's name and argument pieces are joined once at the end: appended to a string per piece,
    they were copied each time (a stream of 4,096 pieces of 1 kB took seconds of CPU)."""
    calls: dict[int | None, tuple[dict, list[str], list[str]]] = {}
    for delta in deltas:
        pieces = delta.get("tool_calls")
        for piece in pieces if isinstance(pieces, list) else ():
            if not isinstance(piece, dict):
                continue
            index = piece.get("index")  # an int in vLLM's DeltaToolCall; the worker's value, maybe unhashable
            call, names, arguments = calls.setdefault(index if is_int(index) else None,
                                                      ({"id": None, "type": "function"}, [], []))
            if piece.get("id") is not None:
                call["id"] = piece["id"]
            function = piece.get("function")
            if isinstance(function, dict):
                if isinstance(function.get("name"), str):
                    names.append(function["name"])
                if isinstance(function.get("arguments"), str):
                    arguments.append(function["arguments"])
    return [{**call, "function": {"name": "".join(names), "arguments": "".join(arguments)},
             **({} if call["id"] is not None else {unavailable_key("id"): OmissionReason.FOLD_AMBIGUOUS.value})}
            for call, names, arguments in calls.values()]


def _fold_message(deltas: list[dict]) -> dict:
    """The unary ``ChatMessage`` dump from a derender stream's deltas (vLLM 0.34.0): role, content,
    refusal, audio, function_call, tool_calls (left out when empty), reasoning; ``annotations`` is
    excluded when None. A stream without a content piece fits a unary content of None (a parser that
    found none) and of ``""`` (no text without a parser; ``assemble_chat_message_fields`` under a
    forced ``tool_choice``): the content is omitted, never guessed, as the codec omits a field elsewhere
    (``null`` in its place, the reason beside it), so the message keeps ``ChatMessage``'s keys."""
    role = next((d["role"] for d in deltas if isinstance(d.get("role"), str)), "assistant")
    content = _joined(deltas, "content")
    tool_calls = _fold_tool_calls(deltas)
    message: dict = {"role": role, "content": content, "refusal": None, "audio": None, "function_call": None,
                     **({"tool_calls": tool_calls} if tool_calls else {}), "reasoning": _joined(deltas, "reasoning")}
    if content is None:
        message[unavailable_key("content")] = OmissionReason.FOLD_AMBIGUOUS.value
    return message


def _drop_reason_if_present(target: dict, field: str) -> None:
    """A value and an unavailability reason for the same field cannot both stand."""
    if target.get(field) is not None:
        target.pop(unavailable_key(field), None)


def _fold_choice(parts: list[dict], index: int) -> dict:
    token_ids: list | None = None  # None when no chunk had a list (derender's hidden ids): the unary's too
    deltas: list[dict] = []
    content: list | None = None
    logprobs_extra: dict = {}
    finish_reason = None
    experts = None
    mask: list | None = None  # one list per token, each chunk's covering its own delta: concatenated
    has_mask = False
    extras: dict = {}
    for part in parts:
        ids = part.get("token_ids")
        if isinstance(ids, list):
            if token_ids is None:
                token_ids = []
            token_ids.extend(ids)
        if isinstance(part.get(CHOICE_DELTA), dict):
            deltas.append(part[CHOICE_DELTA])
        if SAMPLING_MASK in part:
            has_mask = True
            rows = part[SAMPLING_MASK]
            if isinstance(rows, list):  # extended in place, as the logprob entries are
                if mask is None:
                    mask = []
                mask.extend(rows)
        logprobs = part.get("logprobs")
        if isinstance(logprobs, dict):
            entries = logprobs.get("content")
            if isinstance(entries, list):  # extended in place: a new list per part was quadratic
                if content is None:
                    content = []
                content.extend(entries)
            logprobs_extra.update((k, v) for k, v in logprobs.items() if k != "content")
        if part.get("finish_reason") is not None:
            finish_reason = part["finish_reason"]
        if part.get(ROUTED_EXPERTS) is not None:
            experts = part[ROUTED_EXPERTS]
        extras.update((k, v) for k, v in part.items() if k not in _CHOICE_KEYS)
    pieces = [part[CHOICE_TEXT] for part in parts if CHOICE_TEXT in part]
    if pieces and all(isinstance(piece, str) for piece in pieces):  # each chunk's is its delta's: joined
        extras[CHOICE_TEXT] = "".join(pieces)  # (anything else is not vLLM's: kept as sent, last one wins)
    if deltas:  # a derender stream: its deltas concatenate into the unary body's message
        extras.pop(CHOICE_DELTA, None)
        extras[CHOICE_MESSAGE] = _fold_message(deltas)
    logprobs_out = None
    if content is not None or logprobs_extra:
        logprobs_out = {"content": content, **logprobs_extra}
    choice = {
        "index": index,
        "logprobs": logprobs_out,
        "finish_reason": finish_reason,
        "token_ids": token_ids,
        ROUTED_EXPERTS: experts,
        **({SAMPLING_MASK: mask} if has_mask else {}),
        **extras,
    }
    _drop_reason_if_present(choice, ROUTED_EXPERTS)
    # In the chunks' key order: vLLM's stream and unary choices declare the same fields in the same order.
    # A derender chunk's delta stands where the unary choice's message does.
    renamed = (CHOICE_MESSAGE if key == CHOICE_DELTA and deltas else key for part in parts for key in part)
    order = dict.fromkeys(key for key in renamed if key in choice)
    return {**{key: choice[key] for key in order}, **choice}


def _dumped_whole(obj: object, model: ModelFields) -> object:
    """A model a usage chunk dumped ``exclude_none`` as the unary body's ``model_dump()`` writes it: each
    declared field in order, ``null`` where it was left out (not an ``exclude_if`` one); other keys after."""
    if not isinstance(obj, dict):
        return obj
    fields, optional, nested = model
    whole = {field: obj.get(field) for field in fields if field in obj or field not in optional}
    for field, inner in nested.items():
        if field in whole:
            whole[field] = _dumped_whole(whole[field], inner)
    return {**whole, **{key: value for key, value in obj.items() if key not in whole}}


def _omit_unstreamed(folded: dict) -> None:
    """A 0.34.0 field no chunk carried stays ``null`` with ``not_streamed`` beside it (the omission policy):
    the unary body has a value there (``model``, ``created`` and ``usage`` always) that no stream says. Without
    a usage chunk (no ``include_usage``) ``usage`` and ``metrics`` are such fields too; with one, a ``null``
    ``metrics`` is the unary value (both dump the same ``per_request_metrics``), left bare, as are
    ``prompt_token_ids`` / ``mm_placeholders``, on the first chunk exactly when the request asked for them."""
    fields = NEVER_STREAMED_034 + (() if isinstance(folded["usage"], dict) else USAGE_CHUNK_FIELDS_034)
    for field in fields:
        if folded[field] is None and unavailable_key(field) not in folded:
            folded[unavailable_key(field)] = OmissionReason.NOT_STREAMED.value


# Keys of every older unary ``GenerateResponse`` whose value no ``GenerateStreamResponse`` chunk carries,
# in the unary key order. ``serve_tokens_full_generator`` (furionw/vllm @ 9cdf7782, vllm-project/vllm @
# 0001948b, fef8b03f)::
#
#     response = GenerateResponse(id=request_id, created=created_time, model=model_name, choices=choices,
#         usage=usage, prompt_logprobs=clamp_prompt_logprobs(final_res.prompt_logprobs),
#         kv_transfer_params=final_res.kv_transfer_params)
#
# ``GenerateResponse(BaseModel)`` declares ``request_id: str = Field(default_factory=lambda:
# f"{random_uuid()}")``, ``choices``, ``prompt_logprobs``, ``kv_transfer_params`` (moreh-dev: ``usage`` too)
# and pydantic drops the rest (``extra="ignore"``): the unary ``request_id`` is a fresh uuid, never the
# chunks' ``generate-tokens-...`` id, and no older unary body has ``created`` or ``ec_transfer_params``.
# moreh-dev/vllm @ 2f585f1b passes ``request_id=request_id`` instead: there it is the chunks' id. A stream
# fits both, so its ``request_id`` is omitted as ``fold_ambiguous``, the others as ``not_streamed``.
_OLDER_NEVER_STREAMED = ("request_id", "model", "usage", PROMPT_LOGPROBS, KV_TRANSFER_PARAMS)


def _older_unary_fields(folded: dict, chunks: Sequence[dict]) -> None:
    """The top level of a fold of older ``serve/disagg`` bodies (no ``output_mode``). Upstream's chunks are
    ``GenerateStreamResponse(request_id, choices, usage)``; the unary answer's ``request_id`` is its own
    ``random_uuid()``, its ``prompt_logprobs`` a list when asked and its ``kv_transfer_params`` the
    connector's, ``model`` / ``usage`` no key or a string / object (``_OLDER_NEVER_STREAMED``). Such a stream
    does not say them, so each is ``null`` with ``not_streamed`` (the omission policy; ``request_id``
    ``fold_ambiguous``: one fork's unary body has the chunks' id), never the stream's id or a bare ``null``
    read as the engine's (a usage chunk's ``usage`` stays). One rule for every older stream: no
    ``GenerateStreamResponse`` carries ``model`` or ``prompt_logprobs``. A unary body (the join folds a
    prefill leg too) has what its engine wrote: a key none of its bodies has stays out."""
    if not any(is_unary(chunk) for chunk in chunks):
        # The unary id is a uuid no chunk shows, or (moreh-dev) the chunks' id: not said which.
        folded["request_id"] = None
        folded.setdefault(unavailable_key("request_id"), OmissionReason.FOLD_AMBIGUOUS.value)
        for field in _OLDER_NEVER_STREAMED:
            if folded[field] is None and unavailable_key(field) not in folded:
                folded[unavailable_key(field)] = OmissionReason.NOT_STREAMED.value
        return
    for field in ("model", "usage"):
        if folded[field] is None and not any(field in chunk for chunk in chunks):
            del folded[field]


def fold_objects(chunks: Sequence[dict]) -> dict:
    """One unary body from parsed stream chunks (a single unary body folds to itself). A 0.34.0 body (it has
    ``output_mode``) gets every key of the unary ``GenerateResponseBase`` dump in its order (``UNARY_KEYS_034``):
    a stream never carries ``model``, ``created`` or the prompt-side fields, which are then ``null`` with their
    reason (:func:`_omit_unstreamed`); its ``usage`` and ``metrics``, dumped ``exclude_none`` in the usage chunk,
    get their ``null`` fields back."""
    if not chunks:
        raise ValueError("cannot fold an empty stream")
    by_index: dict[int, list[dict]] = {}
    model = kv_transfer_params = usage = prompt_logprobs = None
    extras: dict = {}
    for chunk in chunks:
        for position, choice in enumerate(choices_of(chunk)):
            index = choice.get("index", position)
            by_index.setdefault(index if is_int(index) else position, []).append(choice)
        if model is None:
            model = chunk.get("model")
        if chunk.get("kv_transfer_params") is not None:
            kv_transfer_params = chunk["kv_transfer_params"]
        if chunk.get("usage") is not None:
            usage = chunk["usage"]
        if prompt_logprobs is None:
            prompt_logprobs = chunk.get(PROMPT_LOGPROBS)
        extras.update((k, v) for k, v in chunk.items() if k not in _TOP_KEYS)
    folded = {
        "request_id": chunks[0].get("request_id"),
        "model": model,
        "choices": [_fold_choice(by_index[i], i) for i in sorted(by_index)],
        "usage": usage,
        PROMPT_LOGPROBS: prompt_logprobs,
        "kv_transfer_params": kv_transfer_params,
        **extras,
    }
    _drop_reason_if_present(folded, PROMPT_LOGPROBS)
    if OUTPUT_MODE not in folded:  # an older serve/disagg body
        _older_unary_fields(folded, chunks)
    else:  # a 0.34.0 body: the unary one's keys in its order, null where no chunk said
        folded = {**{key: folded.get(key) for key in UNARY_KEYS_034}, **folded}
        folded["usage"] = _dumped_whole(folded["usage"], USAGE_034)
        folded[METRICS] = _dumped_whole(folded[METRICS], METRICS_034)
        _omit_unstreamed(folded)
    return folded
