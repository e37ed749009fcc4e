"""Folding an SGLang stream into the unary body the same request returns (``Codec.fold``).

Either streaming mode is read from the chunks themselves (:func:`~.native.restates`): a cumulative
chunk replaces the accumulated text, ids and output logprob lists; an incremental one extends them.
A stream the scheduler aborted ends in a body that restates text and lists but not the ids
(:func:`~.native.abort_restatement`): its repeated last id is not appended. A streamed batch or
``n > 1`` request (chunks tagged ``"index"``) folds to the list its unary request answers
(:func:`fold_items`), each item folded alone. A stream with an abort that carries an HTTP status
folds to the error its unary request answers instead (:func:`abort_answer`).
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from streamproc.codec import UNAVAILABLE_SUFFIX, OmissionReason

from .native import (ABORT_RESTATED_FIELDS, FINISH_REASON, FIRST_TOKEN_TIMINGS, INDEX, META, OUTPUT_DELTA_FIELDS,
                     OUTPUT_IDS, RESPONSE_SENT_TS, TEXT, AbortRestatement,
                     abort_error, abort_restatement, abort_status, from_abort_req, meta_of, restated, restates)


SENT_REASON = RESPONSE_SENT_TS + UNAVAILABLE_SUFFIX


def abort_answer(docs: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The error a unary request answers when its stream has an abort with an HTTP status
    (:func:`~.native.abort_status`), or None.

    Unary, ``_handle_abort_finish_reason`` raises where the stream yields that abort body and stops
    (``yield abort_out; break``): a single request answers the error alone, never the output produced
    before it (:func:`~.native.abort_error`). A batch or ``n > 1`` request waits in
    ``_collect_batch_responses``: ``asyncio.gather`` without ``return_exceptions`` raises the first
    item's exception in time and the batch answers that error, no list; the stream sends each item's
    chunks as they come (``_stream_batch_responses``), so the first such abort in stream order. A
    chunk of the same item after its abort is no stream SGLang writes: ValueError.
    """
    first = None
    ended: set[int | None] = set()
    for position, doc in enumerate(docs):
        index = doc.get(INDEX)
        item = index if type(index) is int else None
        if item in ended:
            raise ValueError(f"chunk {position} follows its item's abort with an HTTP status: no stream "
                             "SGLang writes; it cannot be folded")
        meta = meta_of(doc)
        finish = meta.get(FINISH_REASON) if meta is not None else None
        if abort_status(finish) is not None:
            ended.add(item)
            if first is None:
                first = finish
    return None if first is None else abort_error(first)


def fold_items(docs: Sequence[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """A streamed batch or ``n > 1`` request folded into the list the same request answers unary, or
    None for a stream whose chunks name no item.

    ``TokenizerManager._stream_batch_responses`` tags each item's chunk ``result["index"] =
    rid_to_index[...]`` (its place in ``rids``, the order ``_handle_batch_request`` sent them) and
    yields the items' chunks interleaved; unary, the request answers ``yield outputs``, the items'
    bodies (no ``"index"``) in that order. Item ``k`` is :func:`fold` of the chunks tagged ``k``. A
    chunk that names no item, or items that are not ``0 .. n-1`` (one was lost: every item sends at
    least its finishing chunk), answer no list: ValueError.
    """
    indices = [doc.get(INDEX) for doc in docs]
    if not any(type(index) is int for index in indices):
        return None
    items: dict[int, list[dict[str, Any]]] = {}
    for doc, index in zip(docs, indices):
        if type(index) is not int:
            raise ValueError("a streamed batch has a chunk that names no item (no integer index)")
        items.setdefault(index, []).append(doc)
    if any(index not in items for index in range(len(items))):
        raise ValueError(f"a streamed batch's {len(items)} items are not numbered 0..{len(items) - 1}: "
                         "one is missing")
    out = []
    for index in range(len(items)):
        item = fold(items[index])
        item.pop(INDEX, None)
        out.append(item)
    return out


def fold(docs: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Merge stream chunks (either mode, see :func:`restates`) into the equivalent unary body.

    Incremental chunks: ``text`` and ``output_ids`` concatenate, ``meta_info`` merges with
    ``dict.update`` semantics except the per-chunk ``output_*logprobs`` slices, which concatenate.
    A cumulative chunk replaces all of those. Inputs are not mutated.

    A stream of two or more bodies folds ``response_sent_to_client_ts`` to
    ``response_sent_to_client_ts_unavailable_reason: not_streamed`` where the unary body has the key (last):
    its value is the first chunk's send time, while the same request unary is stamped when its whole answer
    is sent, a time no chunk carries (``native.RESPONSE_SENT_TS``); restated, it would date the answer at its
    first token, and left out unmarked, a client could not tell it from a server that writes no stamp (a
    stream without the key, an older tree's, folds without either). A reason a chunk already gave (a stitched
    body's ``stitch_incomplete``) is kept.

    Every folded stream (several bodies, or a streamed batch item of one) has ``first_token_latency`` and
    ``decode_throughput`` (``--enable-metrics``) replaced in place by ``<field>_unavailable_reason:
    not_streamed``: a stream counts them from the tokenizer's receipt of its first output, the same
    request unary from the scheduler's ``prefill_finished_time`` (``native.FIRST_TOKEN_TIMINGS``).

    A stream that ends in ``_handle_abort_req``'s body (:func:`~.native.from_abort_req`) folds to that body's
    ``meta_info`` keys in its order: it is a fresh dict (no ``prompt_tokens``, ``cached_tokens``...), and
    unary it is the whole answer, as nothing is queued for a non-stream request before its finish.
    """
    out: dict[str, Any] = {}
    count = 0
    text = _Text()
    ids: list[Any] = []
    meta: dict[str, Any] = {}
    deltas: dict[str, list[Any]] = {}
    abort_keys: list[str] | None = None  # the last body's meta_info keys when it is _handle_abort_req's
    for doc in docs:
        count += 1
        chunk_meta = meta_of(doc)
        abort_keys = list(chunk_meta) if chunk_meta is not None and from_abort_req(chunk_meta) else None
        abort = abort_restatement(doc, ids)
        if abort is None and restates(doc, ids):
            text.clear()
            ids.clear()
            deltas.clear()
            _reset_deltas(meta)
        for key, value in doc.items():
            if key == TEXT and isinstance(value, str):
                out.setdefault(key, None)
                if abort is not None:
                    whole, more = restated(value, text.size, text.tail, abort.doubled)
                    if whole is not None:
                        text.clear()
                    value = whole if whole is not None else more
                text.append(value)
            elif key == OUTPUT_IDS and isinstance(value, list):
                out.setdefault(key, None)
                ids.extend(value if abort is None else abort.ids)
            elif key == META and isinstance(value, dict):
                out.setdefault(key, None)
                _merge_meta(meta, deltas, value, abort)
            else:
                out[key] = value
    if TEXT in out and out[TEXT] is None:
        out[TEXT] = "".join(text.pieces)
    if OUTPUT_IDS in out and out[OUTPUT_IDS] is None:
        out[OUTPUT_IDS] = ids
    # A server that stamps (0.5.23; older trees write no stamp), or a stitch that gave the stamp its reason.
    sent_reason = meta.get(SENT_REASON, OmissionReason.NOT_STREAMED.value) if (
        RESPONSE_SENT_TS in meta or SENT_REASON in meta) else None
    if abort_keys is not None:
        meta = {key: meta[key] for key in abort_keys if key in meta}
    if count > 1 and sent_reason is not None:
        meta.pop(RESPONSE_SENT_TS, None)
        meta.setdefault(SENT_REASON, sent_reason)
    if any(field in meta for field in FIRST_TOKEN_TIMINGS):
        meta = _not_streamed(meta, FIRST_TOKEN_TIMINGS)
    if META in out and out[META] is None:
        out[META] = meta
    return out


def _not_streamed(meta: dict[str, Any], fields: Sequence[str]) -> dict[str, Any]:
    """``meta`` with each of ``fields`` replaced where it stands by ``<field>_unavailable_reason:
    not_streamed`` (the unary body's key order)."""
    reason = OmissionReason.NOT_STREAMED.value
    return dict((key + UNAVAILABLE_SUFFIX, reason) if key in fields else (key, value) for key, value in meta.items())


class _Text:
    """The folded text as its chunks' pieces (joined once, at the end), its length, and its tail."""

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.size = 0

    def append(self, piece: str) -> None:
        if piece:  # no empty pieces: a tail of k characters reads at most k pieces
            self.pieces.append(piece)
            self.size += len(piece)

    def clear(self) -> None:
        self.pieces.clear()
        self.size = 0

    def tail(self, count: int) -> str:
        """The last ``count`` characters (what an abort body is compared with)."""
        taken: list[str] = []
        need = count
        for piece in reversed(self.pieces):
            if need <= 0:
                break
            taken.append(piece)
            need -= len(piece)
        joined = "".join(reversed(taken))
        return joined[len(joined) - count:] if count else ""


def _reset_deltas(meta: dict[str, Any]) -> None:
    """A cumulative chunk restates the output logprob lists: forget the accumulated copies (the key
    stays, so the folded body keeps the position where the lists first appeared)."""
    for key in OUTPUT_DELTA_FIELDS:
        if isinstance(meta.get(key), list):
            meta[key] = []


def _merge_meta(meta: dict[str, Any], deltas: dict[str, list[Any]], chunk: dict[str, Any],
                abort: AbortRestatement | None) -> None:
    if meta and any(key not in meta for key in chunk):
        _place_new_keys(meta, chunk)
    for key, value in chunk.items():
        if key in OUTPUT_DELTA_FIELDS and isinstance(value, list):
            acc = deltas.get(key)
            if acc is None or meta.get(key) is not acc:
                acc = deltas[key] = list(meta[key]) if isinstance(meta.get(key), list) else []
                meta[key] = acc
            if abort is not None and key in ABORT_RESTATED_FIELDS:
                whole, more = restated(value, len(acc), lambda k, acc=acc: acc[len(acc) - k:], abort.doubled,
                                       len(abort.ids))
                if whole is not None:
                    acc[:] = whole
                else:
                    acc.extend(more)
            else:
                acc.extend(value)
        else:
            meta[key] = value
            # A field and its omission reason are one state: the later chunk's wins (a P/D stream's
            # first chunk may carry a count its later ones omit, join.py _omit_reasoning_tokens).
            # Except a marker beside its own field in the chunk (join.py _omit_first_token and
            # _fill_token_ids_logprobs): the list stays with its unavailable entries null.
            if key.endswith(UNAVAILABLE_SUFFIX) and key[:-len(UNAVAILABLE_SUFFIX)] in chunk:
                continue
            if key.endswith(UNAVAILABLE_SUFFIX):
                meta.pop(key[:-len(UNAVAILABLE_SUFFIX)], None)
            else:
                meta.pop(key + UNAVAILABLE_SUFFIX, None)


def _place_new_keys(meta: dict[str, Any], chunk: dict[str, Any]) -> None:
    """A key a later chunk adds goes where that chunk has it (after its predecessor there), not at
    the end: SGLang 0.5.23 writes ``weight_versions`` on the finished body only, between
    ``cached_tokens`` and ``cached_tokens_details`` (``TokenizerManager._handle_batch_output``), and
    the unary body has it there. Values are kept (placeholders until the merge assigns them)."""
    # Each new key goes right after the chunk's key before it (None: first), so they form chains
    # from a key already there; laid out in one pass (an index() and insert() per key took 7 s of
    # CPU on the event loop for a 430 KB chunk of 40,000 new keys).
    follower: dict[str | None, str] = {}
    previous = None
    for key in chunk:
        if key not in meta:
            follower[previous] = key
            meta[key] = None
        previous = key
    added = set(follower.values())
    order: list[str] = []
    for start in (None, *(key for key in meta if key not in added)):
        if start is not None:
            order.append(start)
        key = follower.get(start)
        while key is not None:
            order.append(key)
            key = follower.get(key)
    items = {key: meta[key] for key in order}
    meta.clear()
    meta.update(items)
