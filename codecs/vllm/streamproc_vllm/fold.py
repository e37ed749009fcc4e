"""Folding vLLM stream chunks into the unary response shape.

The rules mirror what a client accumulating the SSE stream would build: deltas concatenate,
terminal fields come from the last chunk that has them, prompt logprobs from the first. Keys the
codec does not know are kept (last one wins) so nothing a worker sent is silently lost.
"""

from __future__ import annotations

from typing import Sequence

from .native import (CHOICE_TEXT, PROMPT_LOGPROBS, ROUTED_EXPERTS, SAMPLING_MASK, choices_of, is_int,
                     unavailable_key)

_TOP_KEYS = ("request_id", "model", "choices", "usage", PROMPT_LOGPROBS, "kv_transfer_params")
_CHOICE_KEYS = ("index", "logprobs", "finish_reason", "token_ids", ROUTED_EXPERTS, SAMPLING_MASK)


def _drop_reason_if_present(target: dict, field: str) -> None:
    """A value and an unavailability reason for the same field cannot both stand."""
    if target.get(field) is not None:
        target.pop(unavailable_key(field), None)


def _fold_choice(parts: list[dict], index: int) -> dict:
    token_ids: list = []
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
            token_ids.extend(ids)
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
    order = dict.fromkeys(key for part in parts for key in part if key in choice)
    return {**{key: choice[key] for key in order}, **choice}


def fold_objects(chunks: Sequence[dict]) -> dict:
    """One unary body from parsed stream chunks (a single unary body folds to itself)."""
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
    return folded
