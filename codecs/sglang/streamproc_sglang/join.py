"""The SGLang P/D join: prefill's prompt-side data merged into decode's chunks.

What a P/D decode chunk lacks and where it comes from (reference notes §4.3):

- ``input_token_logprobs`` (and ``input_top_logprobs`` / ``input_token_ids_logprobs`` when the
  prefill leg has them): only prefill computes them; decode sends ``[]``. Copied onto every decode
  chunk that carries ``output_token_logprobs``, because the aggregated stream re-emits them on each
  chunk. Prefill's lists are copied as sent: ``[]`` (a default request's empty window) is a complete
  answer, and so is a one-position window (``[[null, <last prompt id>, ...]]``; docs/codecs.md).
- The first output token's logprob: P/D decode reports ``[null, out0, null]`` (SGLang PR #40298; 0.5.23's
  decode reads the real value from the metadata buffer, and only a ``null`` is ever replaced).
  Taken from prefill's ``output_token_logprobs[0]`` when it names the same token id.
- ``output_token_ids_logprobs`` (``token_ids_logprob``): ``MetadataBuffers.set_buf``
  (``disaggregation/utils.py``) hands decode the first output token's logprob and top logprobs but
  not its token-ids logprobs, and decode's own steps append from output position 1. The
  scheduler's ``stream_output_generation`` slices that list at the offset of the complete
  ``output_token_logprobs`` list, so each send loses one more entry. A chunk one entry short that
  starts at position 0 lost position 0 only, which prefill computed: restored from prefill's
  list. A reserved row with no prefill row to fill it stays ``null`` (the field's reason beside it);
  any other shortfall cannot be rebuilt: the field is omitted.
- ``routed_experts``: rows cover ``[routed_experts_start_len, seqlen - 1)`` in the advertised wire
  dtype. Decode's copy of the prompt rows is stale KV-slot leftovers (or absent, when it returns the
  generated suffix only): the joined bytes are prefill's rows then decode's generated rows, the
  layout read from the stated start or, failing that, from the byte counts (:func:`_layout`).
  Rows no real capture produces (:func:`_stale`) are refused; a wrong but in-range expert id in a
  correctly sized raw payload cannot be detected here. A decode that was retracted
  (:func:`native.retracted`) got its KV back by copy or transfer, not by a forward, so the rows of
  its tokens before the retraction are another request's: its generated rows are never published.

- ``indexer_topk`` (``return_indexer_topk``): rows ``[0, seqlen - 1)`` read like decode's expert rows,
  so its prompt rows are stale KV-slot leftovers too, and no prefill collects its own (its
  ``process_batch_result_disagg_prefill`` only finalizes the capture). No leg has the prompt rows: the
  field is removed from every decode chunk (:meth:`SGLangJoinSession._omit_indexer_topk`).

- ``reasoning_tokens`` (a request with ``require_reasoning``): the aggregated engine counts output
  token 0 (``process_batch_result_prefill`` calls ``_maybe_update_reasoning_tokens``); the P/D
  prefill does not (``process_batch_result_disagg_prefill``, so its body says 0), and decode takes
  token 0 from the metadata buffer without counting it (``DecodeTransferQueue._commit_transfer_to_req``,
  sgl-project/sglang ``0035ca42``), then counts from token 1. No leg has the aggregated count: a
  decode value above 0 is removed from every chunk (:meth:`SGLangJoinSession._omit_reasoning_tokens`);
  0 (no reasoning asked) is kept.

- ``weight_versions`` (SGLang 0.5.23, finished bodies): which weights produced which output tokens.
  Token 0 is sampled by the prefill worker, whose body says under which version (``[{version, 0, 1}]``);
  decode appends it from the metadata buffer, which carries no version
  (``DecodeTransferQueue._commit_transfer_to_req``), so its spans give token 0 decode's weights. When
  the versions differ (an update reached the servers at different moments), token 0 gets prefill's
  (:meth:`SGLangJoinSession._join_weight_versions`); without prefill's the spans are removed.

Omission policy: a field that cannot be rebuilt completely is removed and
``<field>_unavailable_reason`` says why; decode's stale rows are never published.
"""

from __future__ import annotations

import base64
import math
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

import numpy as np
from streamproc.codec import (UNAVAILABLE_SUFFIX, ContractError, CorruptPayload, JoinSession,
                              SequenceCodec, json_structure, parsed_json_bound)
from streamproc.codec import OmissionReason as Omit
from streamproc.wire import Verdict

from . import native
from .fold import fold
from .native import (
    COMPLETION_TOKENS,
    EXPERT_DTYPE_SIZES,
    INPUT_LOGPROB_FIELDS,
    INPUT_LOGPROBS_UNAVAILABLE,
    INPUT_TOKEN_LOGPROBS,
    OUTPUT_TOKEN_IDS_LOGPROBS,
    OUTPUT_TOKEN_IDS_LOGPROBS_UNAVAILABLE,
    OUTPUT_TOKEN_LOGPROBS,
    OUTPUT_TOKEN_LOGPROBS_LENGTH,
    OUTPUT_TOKEN_LOGPROBS_UNAVAILABLE,
    OUTPUT_TOP_LOGPROBS,
    PROMPT_TOKENS,
    ROUTED_EXPERTS,
    ROUTED_EXPERTS_START_LEN,
    ROUTED_EXPERTS_UNAVAILABLE,
    WEIGHT_VERSION,
    WEIGHT_VERSIONS,
)

if TYPE_CHECKING:
    from .codec import SGLangCodec


# Where the aggregated body has each prompt-side list: just before its output counterpart
# (``tokenizer_manager.add_logprob_to_meta_info`` writes them in pairs).
INPUT_LOGPROB_ANCHORS = {
    INPUT_TOKEN_LOGPROBS: OUTPUT_TOKEN_LOGPROBS,
    "input_top_logprobs": OUTPUT_TOP_LOGPROBS,
    "input_token_ids_logprobs": OUTPUT_TOKEN_IDS_LOGPROBS,
}
# Keys ``tokenizer_manager._handle_batch_output`` writes before ``routed_experts``; everything after
# it (customized info, ``dp_rank``, ``e2e_latency`` and the finish-time metrics) comes later.
# SGLang 0.5.23 renamed ``total_retractions`` to ``num_retractions`` and writes ``reasoning_tokens``,
# ``weight_versions`` (finished bodies) and, for a request that has them, ``image_tokens`` /
# ``audio_tokens`` / ``video_tokens`` (after ``cached_tokens_details``) before ``hidden_states``.
ROUTED_EXPERTS_PREDECESSORS = (
    "id", native.FINISH_REASON, PROMPT_TOKENS, WEIGHT_VERSION, WEIGHT_VERSION + UNAVAILABLE_SUFFIX,
    *native.RETRACTION_COUNTS,
    INPUT_TOKEN_LOGPROBS, OUTPUT_TOKEN_LOGPROBS, OUTPUT_TOKEN_LOGPROBS_LENGTH, "input_top_logprobs",
    OUTPUT_TOP_LOGPROBS, "input_token_ids_logprobs", OUTPUT_TOKEN_IDS_LOGPROBS, "reasoning_tokens",
    "reasoning_tokens_unavailable_reason",
    COMPLETION_TOKENS, "cached_tokens", WEIGHT_VERSIONS, WEIGHT_VERSIONS + UNAVAILABLE_SUFFIX,
    "cached_tokens_details", "image_tokens",
    "audio_tokens", "video_tokens", "hidden_states",
)
INPUT_TOP_FLAT_FIELDS = native.INPUT_TOP_FLAT_FIELDS  # the flat prompt top logprobs (native.py)
INPUT_TOP_LOGPROBS_UNAVAILABLE = "input_top_logprobs_unavailable_reason"
HIDDEN_STATES = "hidden_states"
HIDDEN_STATES_UNAVAILABLE = "hidden_states_unavailable_reason"
INDEXER_TOPK = "indexer_topk"
INDEXER_TOPK_UNAVAILABLE = "indexer_topk_unavailable_reason"
REASONING_TOKENS = native.REASONING_TOKENS
REASONING_TOKENS_UNAVAILABLE = REASONING_TOKENS + UNAVAILABLE_SUFFIX
# A row of this many ids that are all equal (all-zero rows included) is no real capture: with
# top-k >= 2 the ids of one layer are distinct, and a top-1 model routing 16 (layer) slots to one
# expert is vanishingly unlikely. SGLang's raw payload carries no shape, so this is the strongest
# check that needs no top_k; it catches the all-zero prompt rows of a stale prefill capture.
STALE_ROW_VALUES = 16


# The widest row a real model produces is far below this: 4096 int32 ids (128 layers x top-32).
# Until prefill's rows give the real width it bounds what a payload may decode to per token, so a
# compression bomb on a short request is refused long before the global ceiling.
MAX_ROW_BYTES = 4096 * 4


class _PrefillRows(NamedTuple):
    rows: bytes
    dtype: str
    itemsize: int
    prompt_tokens: int
    start: int | None  # routed_experts_start_len when the prefill body states it


def _parse_expansion(bodies: Sequence[bytes], docs: Sequence[Any]) -> int:
    """Bytes a parsed prefill leg holds beyond its bodies' length (charged already, as buffered
    bodies): :func:`~streamproc.codec.parsed_json_bound` of each body, its ASCII ``meta_info``
    strings (the Base64 rows) one byte a character. Charged at body length alone, 1,000 legs with
    4,096 prompt logprobs each (88 MiB charged) held 805 MiB; at a fixed 6x their length, legs of
    ``[{"<key>":{}},...]`` (28x) held ~5x the budget (attack sessions)."""
    total = 0
    for body, doc in zip(bodies, docs):
        meta = native.meta_of(doc) if isinstance(doc, dict) else None
        narrow = sum(len(value) for value in meta.values()
                     if type(value) is str and value.isascii()) if meta is not None else 0
        total += parsed_json_bound(body, narrow) - len(body)
    return total


def _decode_bound(prefill: _PrefillRows, completion: int) -> int:
    """The most decode's payload may hold: every position ``[0, prompt + completion - 1)`` at the row
    width prefill's rows show (exact when the start is stated, else at most one prefill row's bytes)."""
    b_p, prompt, start = len(prefill.rows), prefill.prompt_tokens, prefill.start
    if start is not None and prompt > start:
        row_bytes = b_p // (prompt - start)
    else:
        row_bytes = min(b_p, MAX_ROW_BYTES) if b_p else MAX_ROW_BYTES
    return (prompt + completion - 1) * row_bytes


def _start_of(meta: dict[str, Any]) -> int | None | bool:
    """The stated ``routed_experts_start_len``: None when absent, False when not a count."""
    start = meta.get(ROUTED_EXPERTS_START_LEN)
    if start is None:
        return None
    return start if _is_count(start) and start >= 0 else False


def _stale(rows: bytes | memoryview, row_bytes: int | None, itemsize: int) -> bool:
    """Rows no real capture produces: a row of >= STALE_ROW_VALUES equal ids, or an all-zero payload
    of that many ids when the row width is not known."""
    count = len(rows) // itemsize
    if count < STALE_ROW_VALUES:
        return False
    values = np.frombuffer(rows, dtype=f"<u{itemsize}", count=count)
    if row_bytes is None or row_bytes // itemsize < STALE_ROW_VALUES or row_bytes % itemsize:
        return not (values[:4096].any() or values.any())  # real rows show a nonzero id early
    table = values.reshape(-1, row_bytes // itemsize)
    # Only rows whose first two ids match can be stale: compare two columns over every row, then
    # whole rows only for those candidates (a full-table comparison cost ~1.5 ms per 9 MB join).
    candidates = table[table[:, 1] == table[:, 0]]
    return bool(len(candidates)) and bool((candidates == candidates[:, :1]).all(axis=1).any())


def _layout(prefill: _PrefillRows, decode_bytes: int, completion: int,
            start: int | None) -> tuple[int | None, int] | str:
    """``(row_bytes, skip)``: how decode's payload lines up with prefill's rows, ``skip`` being the
    bytes of decode's own (stale) copy of the prompt rows. Rows cover ``[start, seqlen - 1)``
    (``io_struct.GenerateReqInput.routed_experts_start_len``); decode covers the same start
    ("full") or only the generated suffix, as frameworks that set ``start = prompt`` on decode do.
    An unstated start is SGLang's default 0 when that fits the byte counts; otherwise it is inferred
    from them, and only used when every reading that fits publishes the same rows."""
    b_p, prompt, generated = len(prefill.rows), prefill.prompt_tokens, completion - 1
    if generated == 0:  # decode's rows, if any, are its stale copy of prefill's
        return (None, decode_bytes) if decode_bytes in (0, b_p) else Omit.LENGTH_MISMATCH
    readings: set[tuple[int, int]] = set()
    for candidate in ([start] if start is not None else [0, None]):
        for suffix in (False, True):
            row_bytes = _row_bytes(b_p, decode_bytes, prompt, generated, candidate, suffix, prefill.itemsize)
            if row_bytes is not None:
                readings.add((row_bytes, 0 if suffix else b_p))
        if readings:
            break  # SGLang's default start 0 fits: take it
    skips = {skip for _, skip in readings}
    if len(skips) != 1:
        return Omit.LENGTH_MISMATCH  # no reading fits, or two that would publish different rows
    widths = {row_bytes for row_bytes, _ in readings}
    return (widths.pop() if len(widths) == 1 else None), skips.pop()


def _row_bytes(b_p: int, b_d: int, prompt: int, generated: int, start: int | None, suffix: bool,
               itemsize: int) -> int | None:
    """The row width under one reading (a start, or None: infer it; full or suffix coverage)."""
    decode_rows_bytes = b_d if suffix else b_d - b_p
    if decode_rows_bytes < 0:
        return None
    if decode_rows_bytes % generated:
        return None
    row_bytes = decode_rows_bytes // generated
    if row_bytes <= 0 or row_bytes % itemsize or b_p % row_bytes:
        return None
    prefill_rows = b_p // row_bytes
    if start is None:
        return row_bytes if prefill_rows <= prompt else None
    return row_bytes if prefill_rows == prompt - start else None


def _insert_after_last(meta: dict[str, Any], key: str, value: Any, predecessors: Sequence[str]) -> None:
    """Add ``key`` where the aggregated body has it: after the last present predecessor."""
    anchor = None
    for name in meta:
        if name in predecessors:
            anchor = name
    if anchor is None:
        meta[key] = value
        return
    items = list(meta.items())
    meta.clear()
    for name, item in items:
        meta[name] = item
        if name == anchor:
            meta[key] = value


def _token_id(entry: object) -> object:
    """The token id of a ``[logprob, token_id, text]`` entry, or None."""
    return entry[1] if isinstance(entry, list) and len(entry) >= 2 else None


def _same_top_entry(mine: object, theirs: object) -> bool:
    """A top logprobs entry ``[logprob, token_id, ...]`` with prefill's logprob and id, JSON types alike
    (``201.0 == 201`` in Python); the text is left out (``return_text_in_logprobs`` is each leg's own).
    A flat Base64 row's ``-inf`` is the JSON form's ``null`` (orjson writes non-finite floats as null)."""
    if not (isinstance(mine, list) and isinstance(theirs, list) and len(mine) >= 2 and len(theirs) >= 2):
        return False
    a, b = (None if type(v) is float and not math.isfinite(v) else v for v in (mine[0], theirs[0]))
    return (type(a) is type(b) and a == b
            and _is_token(mine[1]) and type(theirs[1]) is int and mine[1] == theirs[1])


def _not_a_prefix(row: list[Any], row0: list[Any]) -> str | None:
    """Why decode's token-0 top row is not the start of prefill's ``row0`` (``shape_mismatch`` when wider:
    the slot's other columns are an earlier request's; ``prefill_corrupt`` when the entries differ), None
    when it is (the nested and the flat form's check, :meth:`SGLangJoinSession._check_first_top`)."""
    if len(row) > len(row0):
        return Omit.SHAPE_MISMATCH
    return None if all(map(_same_top_entry, row, row0)) else Omit.PREFILL_CORRUPT


def _is_count(value: object) -> bool:
    return type(value) is int


def _is_token(value: object) -> bool:
    """An id the handoff's slot can hold: a prefill body's ``output_ids[0]`` outside it is not a token."""
    return type(value) is int and 0 <= value < native.TOKEN_ID_LIMIT


def _first_of_every_token(meta: dict[str, Any], ids: object) -> bool:
    """Whether ``ids`` hold every output token so far (``completion_tokens == len(output_ids)``: a
    cumulative chunk, an incremental stream's first one, a unary body) and start with a token: then
    ``ids[0]`` is token 0. An int count only: ``true`` is no count, though ``True == 1``."""
    count = meta.get(COMPLETION_TOKENS)
    return (type(count) is int and isinstance(ids, list) and len(ids) == count > 0
            and _is_token(ids[0]))


def _insert_before(meta: dict[str, Any], anchor: str, items: dict[str, Any]) -> dict[str, Any]:
    """``meta`` with ``items`` placed where the aggregated body has them: just before ``anchor``."""
    out: dict[str, Any] = {}
    for key, value in meta.items():
        if key == anchor:
            out.update(items)
        out[key] = value
    out.update(items)  # no-op when the anchor was found (same keys, same values)
    return out


def _replace_key(meta: dict[str, Any], key: str, new_key: str, value: Any) -> None:
    """``meta`` with ``key`` replaced by ``new_key: value`` at the same place (an omission reason takes
    its field's place, so fields inserted later find their anchors)."""
    items = [(new_key, value) if name == key else (name, item) for name, item in meta.items()]
    meta.clear()
    meta.update(items)


def _first_positions(meta: dict[str, Any], entries: list[Any]) -> tuple[int, ...]:
    """Where output position 0 sits in a chunk's output lists. A chunk whose slice starts there
    (``output_token_logprobs_length`` = its length: any cumulative chunk, an incremental stream's
    first, an unsliced abort body) holds it first. An abort body (``native.from_abort_req``)
    coalesced with the incremental chunks still queued (``TokenizerManager._coalesce_streaming_chunks``
    puts their slices ``[s, n)`` before the whole lists ``_handle_abort_req`` restates) holds it at
    ``len - n``, and also first when nothing had been sent (``s`` = 0). Any other chunk: nowhere."""
    length = meta.get(OUTPUT_TOKEN_LOGPROBS_LENGTH)
    size = len(entries)
    if not _is_count(length) or length <= 0 or size < length:
        return ()
    if size == length:
        return (0,)
    if native.from_abort_req(meta) and size <= 2 * length:
        return (0, size - length) if size == 2 * length else (size - length,)
    return ()


def _null_first_flat_row(meta: dict[str, Any]) -> bool:
    """``return_flat_raw_output_top_logprobs``: output position 0's row (decode's copy of an unwritten
    slot) becomes a leading null row, as ``_build_flat_top_logprobs_fields`` writes one: counted in
    ``output_top_logprobs_null_prefix``, out of the arrays and ``output_top_logprobs_shape``. A layout
    it does not describe is left as sent (False)."""
    arrays = _flat_arrays(meta)
    if arrays is None:
        return False
    rows, k, raw = arrays
    cut: dict[str, Any] = {}
    for key, (value, size) in raw.items():
        cut[key] = value[k:] if isinstance(value, list) else \
            base64.b64encode(value[k * size:]).decode("ascii")
    meta.update(cut)
    meta[native.OUTPUT_TOP_SHAPE] = [rows - 1, k]
    meta[native.OUTPUT_TOP_NULL_PREFIX] = 1
    return True


def _flat_arrays(meta: dict[str, Any]) -> tuple[int, int, dict[str, tuple[Any, int]]] | None:
    """A ``return_flat_raw_output_top_logprobs`` layout whose first row is output position 0's: ``(rows,
    k, {key: (list or decoded Base64 bytes, itemsize)})``, where ``output_top_logprobs_shape`` describes
    every array present and no null row leads (``output_top_logprobs_null_prefix`` 0); else None."""
    shape, prefix = meta.get(native.OUTPUT_TOP_SHAPE), meta.get(native.OUTPUT_TOP_NULL_PREFIX)
    if not (isinstance(shape, list) and len(shape) == 2 and all(map(_is_count, shape)) and shape[0] >= 1
            and prefix == 0):
        return None
    rows, k = shape
    raw: dict[str, tuple[Any, int]] = {}
    for key in native.OUTPUT_TOP_FLAT_LISTS:
        if key in meta:
            value = meta[key]
            if not (isinstance(value, list) and len(value) == rows * k):
                return None
            raw[key] = (value, 1)
    for key in native.OUTPUT_TOP_FLAT_B64:
        if key in meta:
            value, dtype = meta[key], meta.get(key + "_dtype")
            try:
                data = base64.b64decode(value, validate=True) if isinstance(value, str) else None
                size = np.dtype(dtype).itemsize if dtype in ("float32", "int32") else 0
            except (ValueError, TypeError):
                return None
            if data is None or not size or len(data) != rows * k * size:
                return None
            raw[key] = (data, size)
    return (rows, k, raw) if raw else None


def _flat_row_0(meta: dict[str, Any]) -> list[list[Any]] | None:
    """Output position 0's top row of a flat layout (:func:`_flat_arrays`) as ``[logprob, id]`` pairs
    (Base64 arrays read as the float32/int32 they state), or None (no layout, or one without both)."""
    arrays = _flat_arrays(meta)
    if arrays is None:
        return None
    _rows, k, raw = arrays
    found: list[list[Any] | None] = []
    for listed, b64 in zip(native.OUTPUT_TOP_FLAT_LISTS, native.OUTPUT_TOP_FLAT_B64):
        if listed in raw:
            found.append(list(raw[listed][0][:k]))
        elif b64 in raw:
            data, size = raw[b64]
            found.append(np.frombuffer(data[:k * size], dtype=meta[b64 + "_dtype"]).tolist())
        else:
            found.append(None)
    vals, idxs = found
    return None if vals is None or idxs is None else [[v, i] for v, i in zip(vals, idxs)]


def _no_token_span(value: object) -> bool:
    """``[{version, start: 0, end: 0}]``: the spans of a body with no output token (a request aborted
    before its first: ``_make_abort_req`` / ``accept`` with ``len(output_ids)`` 0, and
    ``add_weight_versions_to_meta_info`` keeps a span starting at 0), the server's current version on
    either engine."""
    if not (isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict)):
        return False
    span = value[0]
    return (isinstance(span.get("version"), str) and _is_count(span.get("start")) and _is_count(span.get("end"))
            and span["start"] == span["end"] == 0)


def _version_spans(value: object) -> list[tuple[str, int, int]] | None:
    """``weight_versions`` as ``(version, start, end)`` spans covering ``[0, end)`` in order, or None
    for anything ``add_weight_versions_to_meta_info`` does not write."""
    if not isinstance(value, list) or not value:
        return None
    spans: list[tuple[str, int, int]] = []
    for span in value:
        if not isinstance(span, dict):
            return None
        version, start, end = span.get("version"), span.get("start"), span.get("end")
        if not (isinstance(version, str) and _is_count(start) and _is_count(end) and start < end
                and start == (spans[-1][2] if spans else 0)):
            return None
        spans.append((version, start, end))
    return spans


# The most items of a batch body joined one by one (a join session each): n > 1 and batches are
# far smaller, and a 1 MiB list of 60,000 tiny items cost ~0.3-0.4 s of CPU to join item by item.
MAX_BATCH_ITEMS = 1024
# The most bytes msgspec's encoding of one JSON number adds to its text (``1e15`` ->
# ``1000000000000000.0``; the longest float it writes, ``-2.2250738585072014e-308``, is 24 bytes).
_NUMBER_GROWTH = 24
# A batch body's verdict is its strongest item's (the edge ranks verdicts the same way).
_VERDICT_ORDER = (Verdict.PASSTHROUGH, Verdict.JOINED, Verdict.STITCHED, Verdict.OMITTED)


class SGLangJoinSession(JoinSession):
    """Join state for one P/D request. The prefill leg is parsed once and its rows decoded once."""

    def __init__(self, codec: SGLangCodec) -> None:
        self._codec = codec
        self._experts: SequenceCodec = codec.sequences[ROUTED_EXPERTS]
        self._prefill_items: list[bytes] | None = None  # a batch prefill leg's bodies (_join_items)
        # A streamed batch: prefill's chunks by item index, and each item's own session (_join_indexed).
        self._prefill_by_index: dict[int, list[bytes]] | None = None
        self._item_sessions: dict[int, SGLangJoinSession] = {}
        # A streamed batch item's decode token 0, seen at needs_prefill before the item has a session
        # (its first chunk may want no prefill: never joined); at most MAX_BATCH_ITEMS (_note_item_token).
        self._item_tokens: dict[int, int] = {}
        # What decoding the prefill rows of a batch's items (all of them) or of a streamed batch's item
        # (by index) may allocate, judged at absorb from the values' lengths and headers (join_bytes).
        self._items_rows_bound = 0
        # What a batch prefill leg's re-encoded items hold beyond the leg's length (charged already):
        # msgspec writes ``1e15`` as ``1000000000000000.0``, so they can hold ~3.8x it.
        self._items_extra = 0
        self._rows_bound_by_index: dict[int, int] = {}
        # The most one batch prefill item's parsed form holds: each item's join parses it again (_join_items).
        self._items_parse = 0
        # The last batch body _items_copies counted (one body is asked about twice: join_bytes, then
        # _join_items in the join thread; each count is a few passes over a body of many MiB).
        self._copies_of: bytes | None = None
        self._copies_paired = False
        self._copies = 0
        self._item = False  # this session joins one item of a streamed batch (routes by index no more)
        self._known = False  # absorb_prefill or prefill_unavailable happened
        self._prefill: dict[str, Any] | None = None  # meta_info of a usable prefill leg
        self._prefill_token: int | None = None  # the token prefill sampled (its output_ids[0]), in range
        self._decode_token: int | None = None  # decode's output_ids[0], from the chunk that held it
        self._prefill_no_token = False  # the prefill leg's output_ids[0] is stated and is no token
        self._disowned = False  # the prefill leg is not this decode's slot's (_disown_another_slots_leg)
        self._unavailable: str | None = None  # why there is no usable prefill leg
        self._rows: _PrefillRows | str | None = None  # prefill's decoded rows or why they are unusable
        self._last: tuple[bytes, Any] | None = None  # needs_prefill -> join decode cache (_decoded)
        self._changed = False
        self._omitted = False
        self.decodes = 0  # rows payloads decoded or tried (JoinSession.decodes: max_decode_cpu)
        # What the parsed prefill leg holds beyond its body length, which the correlator charges
        # already (retained_bytes): lists of numbers take 6x their JSON as Python objects, and more.
        self._parsed_extra = 0

    # ------------------------------------------------------------ JoinSession

    def needs_prefill(self, body: bytes, final: bool) -> bool:
        """Logprob chunks (decode lacks prompt and first-token logprobs), chunks carrying rows or weight
        versions (token 0's is prefill's), and the final chunk: only the prefill leg tells whether
        experts were requested, so a decode that dropped the field (or a one-token decode that
        legitimately omits it) is judged against it. A streamed batch item's finishing chunk is its
        item's final one (:meth:`_item_final`)."""
        doc = self._decoded(body)
        if not isinstance(doc, dict):  # a batch body is a whole answer: its items are joined with prefill's
            return native.items_of(doc) is not None
        meta = native.meta_of(doc)
        if meta is None:
            return False
        index = doc.get(native.INDEX)
        if type(index) is int and not self._item:
            self._note_item_token(index, meta, doc.get(native.OUTPUT_IDS))
        elif self._decode_token is None:
            self._note_decode_token(meta, doc.get(native.OUTPUT_IDS))  # a chunk the join may never see
        return self._wants(meta, self._item_final(doc, meta, final))

    def set_aside(self) -> None:
        self._last = None  # the waiting chunk's parsed form: parsed again when it resumes

    def absorb_prefill(self, bodies: Sequence[bytes]) -> None:
        self._known = True
        values = [native.decode(body) for body in bodies]
        docs = [value if isinstance(value, dict) else None for value in values]
        if not docs:
            self._unavailable = Omit.PREFILL_MISSING
            return
        if any(doc is None for doc in docs):
            items = native.items_of(values[0]) if len(values) == 1 else None
            if items is not None and len(items) <= MAX_BATCH_ITEMS:  # a batch: each decode item is joined with its own (_join_items)
                # copied to their length: msgspec's output keeps the slack of its growing buffer
                self._prefill_items = [bytes(memoryview(native.encode(item))) for item in items]
                self._items_extra = max(0, sum(map(len, self._prefill_items)) - sum(map(len, bodies)))
                self._items_rows_bound = sum(self._rows_bound(native.meta_of(item)) for item in items)
                self._items_parse = max(map(parsed_json_bound, self._prefill_items), default=0)
            self._unavailable = Omit.PREFILL_CORRUPT  # for a decode body that is not a batch
            return
        indices = [doc.get(native.INDEX) for doc in docs]  # type: ignore[union-attr]
        if any(type(index) is int for index in indices):  # a streamed batch: never folded across items
            by_index: dict[int, list[bytes]] = {}
            bounds = self._rows_bound_by_index
            for body, index, leg in zip(bodies, indices, docs):
                key = index if type(index) is int else -1
                by_index.setdefault(key, []).append(body)
                bounds[key] = bounds.get(key, 0) + self._rows_bound(native.meta_of(leg))  # type: ignore[arg-type]
            self._prefill_by_index = by_index
            if len(by_index) > 1:
                # For a decode chunk that names no item, and an item without chunks of its own: the
                # worker's error frame (untagged, ``stream_results``) ended the leg when it holds one
                # (``_stream_batch_responses``: one item's exception ends every item's stream).
                failed = any(type(index) is not int and native.http_error(leg)  # type: ignore[arg-type]
                             for index, leg in zip(indices, docs))
                self._unavailable = Omit.PREFILL_ERROR if failed else Omit.LENGTH_MISMATCH
                return
        doc = docs[0] if len(docs) == 1 else fold(docs)  # type: ignore[arg-type]
        meta = native.meta_of(doc)  # type: ignore[arg-type]
        if native.failed(doc):  # type: ignore[arg-type]
            self._unavailable = Omit.PREFILL_ERROR
        elif meta is None:
            self._unavailable = Omit.PREFILL_CORRUPT
        else:
            self._prefill = meta
            ids = doc.get(native.OUTPUT_IDS)  # type: ignore[union-attr]
            self._prefill_token = ids[0] if isinstance(ids, list) and ids and _is_token(ids[0]) else None
            # a stated ``output_ids`` naming no token an int32 slot holds (_disown_another_slots_leg)
            stated = native.OUTPUT_IDS in doc  # type: ignore[operator]
            self._prefill_no_token = stated and self._prefill_token is None and ids != []
            self._parsed_extra = _parse_expansion(bodies, docs)

    def retained_bytes(self) -> int:
        rows = self._rows
        own = len(rows.rows) if isinstance(rows, _PrefillRows) else 0
        own += self._parsed_extra if self._prefill is not None else 0
        own += self._items_extra if self._prefill_items is not None else 0
        return own + sum(session.retained_bytes() for session in self._item_sessions.values())

    def join_bytes(self, body: bytes, final: bool) -> int | None:
        """The joined body's encoding, plus the rows :meth:`join` may decode: prefill's (once per
        session, or per item of a batch) and this chunk's, each as its encoding declares (Base64
        length, zstd header) within the limit the join decodes it with. Its parsed form was allocated
        by :meth:`needs_prefill`, before the join was handed out."""
        doc = self._decoded(body)  # parsed by needs_prefill already
        if not isinstance(doc, dict):
            items = native.items_of(doc)
            if items is None or len(items) > MAX_BATCH_ITEMS:
                return 0  # passed through, or refused whole (ContractError) before any decoding
            limit = self._experts.options.max_decompressed_bytes
            return self._items_copies(body, items) + self._items_rows_bound + sum(
                self._value_bound(native.meta_of(item), limit) for item in items)
        meta = native.meta_of(doc)
        if meta is None:
            return 0
        final = self._item_final(doc, meta, final)
        if not self._wants(meta, final):
            return 0
        need = len(body)
        index = doc.get(native.INDEX)
        if type(index) is int and not self._item:  # joined in the item's own session (_join_indexed)
            session = self._item_sessions.get(index)
            if session is None or session._rows is None:
                need += self._rows_bound_by_index.get(index, 0)
        elif not (final or ROUTED_EXPERTS in meta) or self._unavailable is not None or self._prefill is None:
            return need
        elif self._rows is None:
            need += self._rows_bound(self._prefill)
        return need + self._value_bound(meta, self._experts.options.max_decompressed_bytes)

    def _paired(self, items: list[Any]) -> bool:
        """Whether a batch body's items are joined with a batch prefill leg's, item by item."""
        return self._prefill_items is not None and len(self._prefill_items) == len(items)

    def _items_copies(self, body: bytes, items: list[Any]) -> int:
        """What :meth:`_join_items` allocates besides rows: one prefill item and one decode item
        parsed again at a time (their sessions), every item's output (prefill's lists copied into
        decode's item, re-encoded: ``1e15`` as ``1000000000000000.0``, in msgspec's
        buffer that keeps up to half its length spare) and the joined body, all held at the end.
        Charged at the decode body's length alone, a batch of 8 items with 40,000 prompt logprobs
        each allocated 57 MiB beyond everything charged (tracemalloc) while its request held 65 MiB
        of a 96 MiB budget."""
        paired = self._paired(items)
        if self._copies_of is body and self._copies_paired is paired:
            return self._copies  # join_bytes counted this body on the event loop; _join_items asks again
        # A number re-encoded grows by at most 24 bytes, and every number but the first follows one
        # of ``,:[``; prefill's items are msgspec's encodings already (absorb_prefill).
        structure = json_structure(body)
        separators = sum(structure) - structure[0]  # the ``:``, ``[`` and ``,``, not the ``{``
        grown = len(body) + _NUMBER_GROWTH * (1 + separators)
        copied = grown + (sum(map(len, self._prefill_items)) if paired else 0)  # type: ignore[arg-type]
        parsed = parsed_json_bound(body, structure=structure) + (self._items_parse if paired else 0)
        self._copies_of, self._copies_paired = body, paired
        self._copies = parsed + copied + copied + copied // 2
        return self._copies

    def _rows_bound(self, meta: dict[str, Any] | None) -> int:
        """What decoding the prefill rows in ``meta`` may allocate (:meth:`_decode_prefill_rows`)."""
        if meta is None:
            return 0
        prompt = meta.get(PROMPT_TOKENS)
        return self._value_bound(meta, prompt * MAX_ROW_BYTES) if _is_count(prompt) and prompt > 0 else 0

    def _value_bound(self, meta: dict[str, Any] | None, limit: int) -> int:
        value = meta.get(ROUTED_EXPERTS) if meta is not None else None
        return 0 if value is None else self._experts.decoded_bound(value, limit)

    def prefill_unavailable(self, reason: str) -> None:
        self._known = True
        self._prefill = None
        self._unavailable = reason or Omit.PREFILL_MISSING

    def join(self, body: bytes, final: bool) -> tuple[bytes, Verdict]:
        try:
            return self._join(body, final)
        finally:
            if final:
                # The request ends with this chunk, so prefill's decoded rows (and parsed leg) are
                # dropped here, in the thread that joins: freed when the request was forgotten on the
                # event loop, 32 MiB held the GIL ~2 ms while every other request waited.
                self._rows = self._prefill = self._prefill_items = self._prefill_by_index = None
                self._item_sessions, self._item_tokens = {}, {}

    def _join(self, body: bytes, final: bool) -> tuple[bytes, Verdict]:
        doc = self._decoded(body)
        self._last = None  # the parsed dict is edited below; never hand it out again
        if not isinstance(doc, dict):
            items = native.items_of(doc)
            return self._join_items(body, items, final) if items is not None else (body, Verdict.PASSTHROUGH)
        meta = native.meta_of(doc)
        if meta is None:
            return body, Verdict.PASSTHROUGH
        wants = self._wants(meta, self._item_final(doc, meta, final))  # type: ignore[arg-type]
        indexed = type(doc.get(native.INDEX)) is int and not self._item  # type: ignore[union-attr]
        # A streamed batch item's chunk that waits is joined in the item's own session, which decides.
        chunk_omitted = False if indexed and wants else (
            self._omit_partial_hidden_states(meta) | self._omit_indexer_topk(meta)
            | self._omit_reasoning_tokens(meta))
        if not wants:
            return (native.encode(doc), Verdict.OMITTED) if chunk_omitted else (body, Verdict.PASSTHROUGH)
        if not self._known:
            raise RuntimeError("join() on a chunk that needs prefill before the prefill leg was settled")
        index = doc.get(native.INDEX)  # type: ignore[union-attr]
        if type(index) is int and not self._item:
            return self._join_indexed(index, body, doc, final)  # type: ignore[arg-type]
        self._changed, self._omitted = False, chunk_omitted
        self._disown_another_slots_leg(meta, doc.get(native.OUTPUT_IDS))  # type: ignore[union-attr]
        if OUTPUT_TOKEN_LOGPROBS in meta:
            meta = self._fill_input_logprobs(doc, meta)  # type: ignore[arg-type]
            self._fill_first_token(meta, doc.get(native.OUTPUT_IDS))  # type: ignore[union-attr]
            self._check_first_top_width(meta)
            self._fill_token_ids_logprobs(meta)
        if WEIGHT_VERSIONS in meta:
            self._join_weight_versions(meta)
        if final or ROUTED_EXPERTS in meta:
            self._join_experts(meta)
        if self._omitted:
            return native.encode(doc), Verdict.OMITTED
        if self._changed:
            joined = native.encode(doc)
            if joined != body:
                return joined, Verdict.JOINED
        return body, Verdict.PASSTHROUGH

    def _join_indexed(self, index: int, body: bytes, doc: dict[str, Any], final: bool) -> tuple[bytes, Verdict]:
        """A chunk of item ``index`` of a streamed batch, joined in that item's own session with the
        prefill leg's chunks of the same index: folded together, every item took the last item's
        prompt rows and logprobs. Without such chunks (a prefill leg that is no batch, or none) the
        item is joined as without a prefill leg."""
        session = self._item_sessions.get(index)
        if session is None:
            if len(self._item_sessions) >= MAX_BATCH_ITEMS:
                raise ContractError(f"a streamed batch of more than {MAX_BATCH_ITEMS} items: at most "
                                    f"{MAX_BATCH_ITEMS} are joined")
            session = self._item_sessions[index] = SGLangJoinSession(self._codec)
            session._item = True
            session._decode_token = self._item_tokens.pop(index, None)
            legs = self._prefill_by_index.get(index) if self._prefill_by_index is not None else None
            if legs is not None:
                session.absorb_prefill(legs)
            else:
                session.prefill_unavailable(self._unavailable if self._prefill is None and self._unavailable
                                            else Omit.LENGTH_MISMATCH)
        budget = self.decode_budget
        # The items' decoded rows are held at once: each may take what the others leave of the budget.
        session.decode_budget = None if budget is None else budget - (self.retained_bytes() - session.retained_bytes())
        session._last = (body, doc)  # parsed once
        decodes = session.decodes
        meta = native.meta_of(doc)
        # An item ends with its own finishing chunk (its rows are freed there), not the request's last.
        ends = final or (meta is not None and meta.get(native.FINISH_REASON) is not None)
        try:
            return session.join(body, ends)
        finally:
            self.decodes += session.decodes - decodes

    def _join_items(self, body: bytes, items: list[dict[str, Any]], final: bool) -> tuple[bytes, Verdict]:
        """A batch answer: item i joined with prefill's item i, each as a request of its own (so a
        decode item's stale rows are never published), or, without a batch prefill of the same
        length, with no prefill leg. The strongest verdict of the items is the body's."""
        if len(items) > MAX_BATCH_ITEMS:
            raise ContractError(f"a batch body of {len(items)} items: at most {MAX_BATCH_ITEMS} are joined")
        prefill = self._prefill_items
        paired = self._paired(items)
        reason = Omit.LENGTH_MISMATCH if prefill is not None or self._prefill is not None else None
        budget = self.decode_budget
        if paired and budget is not None and self._items_copies(body, items) > budget:
            # The copies of prefill's items do not fit what the byte budget has left (join_bytes
            # declared them; the reservation fell short): the items are joined without them.
            paired, reason = False, Omit.TOO_LARGE
        joined: list[bytes] = []
        verdict = Verdict.PASSTHROUGH
        for i, item in enumerate(items):
            session = SGLangJoinSession(self._codec)
            # The processor's byte budget, as for a body of one request: items are joined one after
            # another, and each session frees its decoded rows when its (final) join ends.
            session.decode_budget = self.decode_budget
            if paired:
                session.absorb_prefill([prefill[i]])  # type: ignore[index]
            else:
                session.prefill_unavailable(reason or self._unavailable or Omit.PREFILL_MISSING)
            item_body = native.encode(item)
            session.needs_prefill(item_body, final)
            out, item_verdict = session.join(item_body, final)
            self.decodes += session.decodes
            joined.append(out)
            if _VERDICT_ORDER.index(item_verdict) > _VERDICT_ORDER.index(verdict):
                verdict = item_verdict
        if verdict is Verdict.PASSTHROUGH:
            return body, verdict
        return b"[" + b",".join(joined) + b"]", verdict

    # -------------------------------------------------------------- internals

    @staticmethod
    def _wants(meta: dict[str, Any], final: bool) -> bool:
        return final or OUTPUT_TOKEN_LOGPROBS in meta or ROUTED_EXPERTS in meta or WEIGHT_VERSIONS in meta

    def _item_final(self, doc: dict[str, Any], meta: dict[str, Any], final: bool) -> bool:
        """``final``, or a streamed batch item's finishing chunk (``_stream_batch_responses``): another
        item may still stream, so the leg goes on, but this item ends here (:meth:`_join_indexed`
        frees its rows there) and is judged as a final chunk: a one-token decode item has no rows
        (``process_batch_result_prebuilt`` collects none) and takes prefill's."""
        return final or (not self._item and type(doc.get(native.INDEX)) is int
                         and meta.get(native.FINISH_REASON) is not None)

    def _decoded(self, body: bytes) -> Any:
        """The body's JSON value (an object, a batch's list, or None), decoded once for
        ``needs_prefill`` and the ``join`` after it."""
        last = self._last
        if last is not None and last[0] is body:
            return last[1]
        doc = native.decode(body)
        self._last = (body, doc)
        return doc

    def _note_decode_token(self, meta: dict[str, Any], ids: object) -> None:
        """Decode's token 0 from a chunk whose ``output_ids`` start at output position 0 (they hold every
        token so far: ``completion_tokens == len(output_ids)``, a cumulative chunk, an incremental stream's
        first one, a unary body), where no logprob list places position 0 (:meth:`_decode_first`)."""
        if _first_of_every_token(meta, ids):
            self._decode_token = ids[0]

    def _note_item_token(self, index: int, meta: dict[str, Any], ids: object) -> None:
        """A streamed batch item's token 0 (:meth:`_note_decode_token`) from a chunk of item ``index``, for
        the item's session (:meth:`_join_indexed`). Without logprob lists an item's first chunk wants no
        prefill leg and is never joined, and its later incremental chunks (``output_ids`` =
        ``state.output_ids[state.last_output_offset:]``, ``TokenizerManager._handle_batch_output``) do not
        start at token 0: the item's session never learnt it, and a prefill item naming another token 0
        gave its prompt rows and token 0's version. Items beyond MAX_BATCH_ITEMS are never joined."""
        session = self._item_sessions.get(index)
        if session is not None:
            if session._decode_token is None:
                session._note_decode_token(meta, ids)
            return
        if index in self._item_tokens or len(self._item_tokens) >= MAX_BATCH_ITEMS:
            return
        if _first_of_every_token(meta, ids):
            self._item_tokens[index] = ids[0]

    def _disown_another_slots_leg(self, meta: dict[str, Any], ids: object) -> None:
        """A prefill leg whose ``output_ids[0]`` is not decode's token 0 is not the leg that fed this
        decode (:meth:`_same_token_0`: SGLang 0.5.23 ``MetadataBuffers.set_buf`` writes
        ``self.output_ids[req.metadata_buffer_index][0] = req.output_ids[0]``, and
        ``DecodeTransferQueue._commit_transfer_to_req`` makes ``staged_output_id = output_id[0].item()``
        decode's first id): another request's leg, a stale or corrupt one. Nothing is taken from it, its
        prompt-side fields no more than its token 0: from here on the session joins as without a usable
        prefill leg, every field it would have given omitted as ``prefill_corrupt`` (its prompt logprobs,
        token 0's version, its expert rows; token 0 itself as before, :meth:`_omit_left_over`).

        A leg whose stated ``output_ids[0]`` is no id an int32 slot holds (``-1``, ``2^31``, ``201.0``,
        ``true``, a string, ``null``; or an ``output_ids`` that is no list) names no token ``set_buf`` could
        have written (``req.output_ids[0]``, a sampled vocabulary index): never this slot's, whatever decode
        says. Until 2026-12-07 the comparison was skipped for it and its prompt side spliced. A leg without
        ``output_ids`` (or with ``[]``) states nothing and is judged by nothing here."""
        if self._prefill is None:
            return
        if not self._prefill_no_token:
            if self._prefill_token is None:
                return
            entries = meta.get(OUTPUT_TOKEN_LOGPROBS)
            if isinstance(entries, list):
                token = self._decode_first(meta, entries, ids)[1]
            else:
                if self._decode_token is None:
                    self._note_decode_token(meta, ids)
                token = self._decode_token
            if self._same_token_0(token):
                return
        self._prefill, self._rows, self._unavailable = None, None, Omit.PREFILL_CORRUPT
        self._disowned = True

    def _check_first_top_width(self, meta: dict[str, Any]) -> None:
        """Decode's token 0 top row is never wider than its own other rows: SGLang 0.5.23
        ``DecodeTransferQueue._commit_transfer_to_req`` copies ``output_top_logprobs_val[:top_logprobs_num]``
        of the slot (``MetadataBuffers``: ``max_top_logprobs_num: int = 128`` columns), decode's own
        ``top_logprobs_num`` (at most 128 of it), and each later step's row is that same number wide. A
        row 0 wider than the chunk's other (non-empty, all one width) rows came from no decode: nulled,
        ``output_top_logprobs_unavailable_reason: decode_corrupt`` (an earlier reason for the row kept).
        The flat form's ``[rows, k]`` arrays cannot hold such a row."""
        top, entries = meta.get(OUTPUT_TOP_LOGPROBS), meta.get(OUTPUT_TOKEN_LOGPROBS)
        if not (isinstance(top, list) and isinstance(entries, list)):
            return
        positions = _first_positions(meta, entries)
        widths = {len(row) for at, row in enumerate(top)
                  if at not in positions and isinstance(row, list) and row}
        if len(widths) != 1:
            return  # no other row in the chunk (a stream's first chunk) tells decode's width
        width = widths.pop()
        wide = [at for at in positions
                if at < len(top) and isinstance(top[at], list) and len(top[at]) > width]
        for at in wide:
            top[at] = None
        if wide:
            reason = meta.get(native.OUTPUT_TOP_LOGPROBS_UNAVAILABLE) or Omit.DECODE_CORRUPT
            self._mark_first_top(meta, reason, (OUTPUT_TOP_LOGPROBS,))

    def _fill_input_logprobs(self, doc: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
        """Prefill's prompt-side lists onto a decode chunk, as sent: both engines shape them in the same
        scheduler code (``_process_input_token_logprobs``: ``[None] + input_token_logprobs[:-1]``, so a
        window's first entry has no logprob; ``_process_input_top_logprobs`` starts at ``[None]``). An
        empty list is a complete answer: ``handle_generate_request`` sets ``logprob_start_len =
        len(origin_input_ids)`` for a default request with ``return_logprob``, and every leg sends ``[]``."""
        if meta.get(INPUT_TOKEN_LOGPROBS):
            return meta  # this decode worker computed them itself
        # An int count only (as :func:`_first_of_every_token`): upstream's is always an int (sglang
        # ``OutputStreamer``, commit 00bc3073: ``self.completion_tokens.append(len(output_ids_))``, copied by
        # ``TokenizerManager._handle_batch_output``; ``_handle_abort_req`` at 001067ff: ``meta_info[
        # "completion_tokens"] = len(output_ids)``); ``false`` or ``0.0`` equal 0 in Python.
        count = meta.get(COMPLETION_TOKENS)
        before_token_0 = _is_count(count) and count == 0 and not meta.get(OUTPUT_TOKEN_LOGPROBS)
        if native.failed_finish(meta) and before_token_0:
            # A request that failed before output token 0 has no prompt logprobs on any engine: the
            # scheduler sets them in the step that samples token 0 (``add_input_logprob_return_values``
            # with ``last_prefill_chunk``), and one rejected at intake (``set_finish_with_abort``, e.g.
            # ``logprob_start_len`` past the prompt) has ``return_logprob`` cleared: P/D retires it unrun
            # (``retire_unadmitted_request``), the aggregated engine runs its one-token stub without
            # logprobs. Decode's ``[]`` is the aggregated answer.
            return meta
        source = self._prefill
        reason = self._unavailable
        if source is not None:
            logprobs = source.get(INPUT_TOKEN_LOGPROBS)
            if logprobs is None:
                reason = Omit.PREFILL_MISSING
            elif not isinstance(logprobs, list):
                reason = Omit.PREFILL_CORRUPT
        if reason is not None or source is None:
            # Decode's own prompt-side fields go with the answer: a P/D decode never scores the prompt
            # (``_GenerationStreamAccumulator.accept``: "Decode server does not send input logprobs"), so
            # ``add_logprob_to_meta_info`` writes ``input_token_logprobs: []`` (and ``input_top_logprobs``,
            # ``input_token_ids_logprobs`` ``[]``, the flat fields of zero rows) whatever the window:
            # published with the marker, they would claim an empty window that only prefill can vouch for.
            reason = reason or Omit.PREFILL_MISSING
            if INPUT_TOKEN_LOGPROBS in meta:  # the reason takes its field's place
                _replace_key(meta, INPUT_TOKEN_LOGPROBS, INPUT_LOGPROBS_UNAVAILABLE, reason)
            else:
                meta[INPUT_LOGPROBS_UNAVAILABLE] = reason
            for field in (*INPUT_LOGPROB_FIELDS, *INPUT_TOP_FLAT_FIELDS):
                meta.pop(field, None)
            self._omitted = True
            return meta
        for field, anchor in INPUT_LOGPROB_ANCHORS.items():
            value = source.get(field)
            if value is None or meta.get(field):
                continue
            if field in meta:
                if meta[field] != value:
                    meta[field] = value  # replace decode's empty list in place
                    self._changed = True
            else:
                meta = _insert_before(meta, anchor, {field: value})
                doc[native.META] = meta
                self._changed = True
        self._fill_input_top_flat(meta, source)
        # A decode worker's own marker is now wrong.
        if meta.pop(INPUT_LOGPROBS_UNAVAILABLE, None) is not None:
            self._changed = True
        return meta

    def _fill_first_token(self, meta: dict[str, Any], ids: object) -> None:
        entries = meta.get(OUTPUT_TOKEN_LOGPROBS)
        if not isinstance(entries, list):
            return
        prefill = self._prefill
        if self._disowned:
            # Not one slot's pair: decode's entry is not published either, even where no chunk named token 0
            # (an abort body's ``[last]`` alone); a corrupt decode id is still said to be decode's.
            self._omit_left_over(meta, entries, ids, Omit.PREFILL_CORRUPT)
            if OUTPUT_TOKEN_LOGPROBS_UNAVAILABLE not in meta:
                self._omit_first_token(meta, entries, ids, Omit.PREFILL_CORRUPT)
            return
        if prefill is not None and OUTPUT_TOKEN_LOGPROBS not in prefill:
            self._omit_first_token(meta, entries, ids)
            return
        source = prefill.get(OUTPUT_TOKEN_LOGPROBS) if prefill is not None else None
        if not (isinstance(source, list) and source):
            # No leg says whether prefill wrote the slot (timed out, failed, unreadable, Dynamo's frame alone)
            self._omit_left_over(meta, entries, ids, Omit.PREFILL_CORRUPT if prefill is not None
                                 else self._unavailable or Omit.PREFILL_MISSING)
            return
        theirs = source[0]
        top, source_top = meta.get(OUTPUT_TOP_LOGPROBS), self._prefill.get(OUTPUT_TOP_LOGPROBS)
        positions, token = self._decode_first(meta, entries, ids)
        if not self._same_token_0(token):
            positions = ()  # not this slot's prefill: nothing of its token 0 is spliced (_omit_left_over)
        spliced: list[int] = []
        for at in positions:  # only where the chunk holds output position 0
            first = entries[at]
            if not (isinstance(first, list) and len(first) >= 2 and first[0] is None):
                continue
            # Ids compared as int32 ids only: ``201.0 == 201`` and ``True == 1`` in Python, never on the
            # wire (the slot's ids are int32, ``_commit_transfer_to_req`` appends ``.item()``).
            if not (isinstance(theirs, list) and len(theirs) >= 2 and theirs[0] is not None
                    and _is_token(first[1]) and type(theirs[1]) is int and theirs[1] == first[1]):
                continue  # a different token was sampled: prefill's logprob is not this token's
            entries[at] = theirs
            self._changed = True
            if isinstance(top, list) and len(top) > at and not top[at] and isinstance(source_top, list) \
                    and source_top and source_top[0]:
                top[at] = source_top[0]
                spliced.append(at)
        # Prefill's body has logprob lists, yet the slot says it was not written: the leg is not this slot's.
        self._omit_left_over(meta, entries, ids, Omit.PREFILL_CORRUPT)
        self._check_first_top(meta, entries, positions, spliced, prefill)

    def _check_first_top(self, meta: dict[str, Any], entries: list[Any], positions: tuple[int, ...],
                         spliced: list[int], prefill: dict[str, Any] | None) -> None:
        """Token 0's top row is published only as a prefix of the prefill leg's row. SGLang 0.5.23
        ``MetadataBuffers.set_buf`` writes prefill's own ``top_logprobs_num`` columns of the 128-wide slot
        (``self.output_top_logprobs_val[idx][: len(req.logprob.output_top_logprobs_val[0])] = ...``; the
        other columns keep what an earlier request left) and ``DecodeTransferQueue._commit_transfer_to_req``
        copies decode's own width (``output_top_logprobs_val[:top_logprobs_num].tolist()``). Where decode
        asked more than prefill, its row ends in another request's columns: nulled, marker
        ``output_top_logprobs_unavailable_reason`` (``shape_mismatch``; ``prefill_missing`` where prefill
        has no row; ``prefill_corrupt`` where the columns are not prefill's). A row spliced from prefill
        (:meth:`_fill_first_token`) takes the width of decode's other rows in the chunk: cut to it, or
        nulled (``shape_mismatch``) where prefill's is narrower or the other (non-empty) rows disagree. A
        prefill leg whose token 0 entry names another token says nothing about this slot's columns (as a
        timed-out one): decode's row is left as sent there."""
        top = meta.get(OUTPUT_TOP_LOGPROBS)
        if prefill is None:
            return
        source_top = prefill.get(OUTPUT_TOP_LOGPROBS)
        row0 = source_top[0] if isinstance(source_top, list) and source_top else None
        flat_source = not isinstance(source_top, list) and native.OUTPUT_TOP_SHAPE in prefill
        if flat_source:  # prefill's row 0 as [logprob, id] pairs: compared, never spliced (no text)
            row0 = _flat_row_0(prefill)
        source = prefill.get(OUTPUT_TOKEN_LOGPROBS)
        named = _token_id(source[0]) if isinstance(source, list) and source else None
        if not isinstance(top, list):
            self._check_first_flat_top(meta, entries, positions, named, row0, flat_source)
            return
        reason: str | None = None
        for at in positions:
            row = top[at] if at < len(top) else None
            if not (isinstance(row, list) and row and type(named) is int and named == _token_id(entries[at])):
                continue
            if not isinstance(row0, list):
                reason = Omit.PREFILL_CORRUPT if flat_source else Omit.PREFILL_MISSING
            elif at in spliced:
                widths = {len(other) for i, other in enumerate(top)
                          if i not in positions and isinstance(other, list) and other}
                width = widths.pop() if len(widths) == 1 else len(row0) if not widths else -1
                if 0 <= width <= len(row0):
                    top[at] = row0[:width]
                    continue
                reason = Omit.SHAPE_MISMATCH
            elif (verdict := _not_a_prefix(row, row0)) is not None:
                reason = verdict
            else:
                continue
            top[at] = None
        if reason is not None:
            self._mark_first_top(meta, reason, (OUTPUT_TOP_LOGPROBS,))

    def _check_first_flat_top(self, meta: dict[str, Any], entries: list[Any], positions: tuple[int, ...],
                              named: object, row0: list[Any] | None, flat_source: bool) -> None:
        """:meth:`_check_first_top` for decode's ``return_flat_raw_output_top_logprobs`` rows (unary: the
        body's slice starts at output position 0, row 0 first in the ``[rows, k]`` arrays). Decode's row
        0 is the slot's first ``k`` columns (``_commit_transfer_to_req``), so the same rule: published only
        as a prefix of prefill's row (nested or flat), else row 0 leaves the arrays as a null row
        (:func:`_null_first_flat_row`) and the marker follows the flat fields."""
        if positions != (0,) or not (type(named) is int and named == _token_id(entries[0])):
            return
        row = _flat_row_0(meta)
        if row is None:
            return  # no flat row 0 (none asked, a leading null row, or a layout the shape does not describe)
        if not isinstance(row0, list):
            reason = Omit.PREFILL_CORRUPT if flat_source else Omit.PREFILL_MISSING
        elif (verdict := _not_a_prefix(row, row0)) is not None:
            reason = verdict
        else:
            return
        if _null_first_flat_row(meta):
            self._mark_first_top(meta, reason, (*native.OUTPUT_TOP_FLAT_LISTS, *native.OUTPUT_TOP_FLAT_B64,
                                                *(key + "_dtype" for key in native.OUTPUT_TOP_FLAT_B64),
                                                native.OUTPUT_TOP_SHAPE, native.OUTPUT_TOP_NULL_PREFIX))

    def _mark_first_top(self, meta: dict[str, Any], reason: str, after: Sequence[str]) -> None:
        """``output_top_logprobs_unavailable_reason`` after the top rows' last field; verdict omitted."""
        if native.OUTPUT_TOP_LOGPROBS_UNAVAILABLE not in meta:
            _insert_after_last(meta, native.OUTPUT_TOP_LOGPROBS_UNAVAILABLE, reason, after)
        else:
            meta[native.OUTPUT_TOP_LOGPROBS_UNAVAILABLE] = reason
        self._changed = True
        self._omitted = True

    def _omit_left_over(self, meta: dict[str, Any], entries: list[Any], ids: object, reason: str) -> None:
        """Token 0's entry omitted (:meth:`_omit_first_token`, marked ``reason``) where it names another
        token than decode's own token 0. SGLang 0.5.23 ``MetadataBuffers.set_buf``:
        ``self.output_ids[req.metadata_buffer_index][0] = req.output_ids[0]``, then only ``if
        req.return_logprob:`` the logprob val/idx and top logprobs; ``DecodeTransferQueue.
        _commit_transfer_to_req`` appends ``output_id[0]`` to ``output_ids`` and
        ``output_token_logprobs_idx[0]`` to the logprob ids. A written slot names the sampled token in
        both; an entry naming another is what a previous request left in the slot (or zeros), never this
        token's. One naming decode's own token passes (left-over values of the same id cannot be told).

        Not trusted either, as nothing confirms them: an entry or an ``output_ids`` holding an id that is
        no JSON integer (``201.0``, ``true``: equal to the token in Python; ``_commit_transfer_to_req``
        appends ``output_id[0].item()`` of the int32 slot, the detokenizer's lists are ints) or no id
        the slot can hold (negative, ``2^31`` or more: ``MetadataBuffers.output_ids`` and
        ``output_token_logprobs_idx`` are ``torch.int32``, written from a sampled vocabulary index),
        omitted as ``decode_corrupt``; and a chunk without ``output_ids`` with no earlier chunk naming token 0
        (``TokenizerManager._handle_batch_output`` puts ``output_ids`` in every ``out_dict``): judged by
        prefill's ``output_ids[0]`` (what ``set_buf`` wrote into the slot's ids), else omitted."""
        positions, token = self._decode_first(meta, entries, ids)
        named = [entries[at][1] for at in positions
                 if isinstance(entries[at], list) and len(entries[at]) >= 2]
        if not named:
            return
        # An id no int32 slot holds (no int, negative, 2^31 or more) is no sampled token: the leg is corrupt.
        if not all(map(_is_token, named)) or (isinstance(ids, list) and not all(map(_is_token, ids))):
            self._omit_first_token(meta, entries, ids, Omit.DECODE_CORRUPT)
            return
        if not self._same_token_0(token):
            self._omit_first_token(meta, entries, ids, Omit.PREFILL_CORRUPT)
            return
        if token is None and not isinstance(ids, list):
            token = self._prefill_token
            if token is None:
                self._omit_first_token(meta, entries, ids, reason)
                return
        if token is not None and any(value != token for value in named):
            self._omit_first_token(meta, entries, ids, reason)

    def _same_token_0(self, token: int | None) -> bool:
        """Decode's token 0 is the prefill leg's ``output_ids[0]`` where both are known. SGLang 0.5.23
        ``MetadataBuffers.set_buf``: ``self.output_ids[req.metadata_buffer_index][0] = req.output_ids[0]``
        (prefill's sampled token, written whatever it was asked); ``DecodeTransferQueue.
        _commit_transfer_to_req``: ``staged_output_id = output_id[0].item()``, decode's first output id.
        Legs that disagree are not one slot's pair (another request's prefill leg, or a corrupt one)."""
        return token is None or self._prefill_token is None or token == self._prefill_token

    def _decode_first(self, meta: dict[str, Any], entries: list[Any],
                      ids: object) -> tuple[tuple[int, ...], int | None]:
        """Where output position 0 sits in the chunk (:func:`_first_positions`) and decode's token 0: the
        chunk's ``output_ids[0]`` where its ids start there (also queued chunks coalesced in front of an
        abort body when nothing had been sent, and an abort body restating every id), else the one an
        earlier chunk of the attempt started with (kept here), else None. Only an id the slot's int32
        ``MetadataBuffers.output_ids`` holds is one (``_commit_transfer_to_req`` appends
        ``output_id[0].item()``): another did not come from the slot and names no token 0 to judge by."""
        positions = _first_positions(meta, entries)
        abort = native.from_abort_req(meta)
        # Ids from position 0: a body's own slice from there, or queued chunks' coalesced in front of
        # an abort body when nothing had been sent (position 0 in both parts), or an abort's whole ids.
        # An int count only (as :func:`_first_of_every_token`): ``true`` and ``1.0`` equal 1 in Python, and an
        # abort body's ``[last]`` with either was read as every id, its last id as token 0.
        count = meta.get(native.COMPLETION_TOKENS)
        whole = isinstance(ids, list) and type(count) is int and count == len(ids)
        from_zero = positions[:1] == (0,) and (not abort or len(positions) == 2 or whole)
        own = ids[0] if from_zero and isinstance(ids, list) and ids and _is_token(ids[0]) else None
        if own is not None and self._decode_token is None:
            self._decode_token = own
        return positions, own if own is not None else self._decode_token

    def _omit_first_token(self, meta: dict[str, Any], entries: list[Any], ids: object,
                          reason: str = Omit.PREFILL_MISSING) -> None:
        """Prefill ran without ``return_logprob`` (a router that asks only decode for logprobs), so its
        metadata slot never got token 0's logprob (``MetadataBuffers.set_buf`` writes them only
        ``if req.return_logprob``), yet decode copies them from that slot
        (``DecodeTransferQueue._commit_transfer_to_req``): zeros, or the last request's values. Position
        0 becomes ``[null, <token 0>, null]`` and its top logprobs ``null`` (a position without
        values), the list's length kept for the other positions, which are decode's own; the marker
        follows ``output_token_logprobs_length``. The token is decode's ``output_ids[0]`` (the slot's ids
        are written whatever prefill was asked: the token the client got): this chunk's where its ids
        start there, else the one an earlier chunk of the attempt started with; only an abort body
        without either (``_handle_abort_req`` cuts its ids to ``[last]``) takes prefill's, if in range.
        ``reason``: the marker's value (a leg that says nothing about the slot gives its own:
        :meth:`_fill_first_token`)."""
        positions, token = self._decode_first(meta, entries, ids)
        if token is None:
            token = self._prefill_token
        for at in positions:
            entry = entries[at]
            if isinstance(entry, list) and len(entry) >= 2:
                entries[at] = [None, token, *([None] * (len(entry) - 2))]
            top = meta.get(OUTPUT_TOP_LOGPROBS)
            if isinstance(top, list) and len(top) > at:
                top[at] = None
        if not positions:
            return
        if positions == (0,):
            _null_first_flat_row(meta)
        anchor = OUTPUT_TOKEN_LOGPROBS_LENGTH if OUTPUT_TOKEN_LOGPROBS_LENGTH in meta else OUTPUT_TOKEN_LOGPROBS
        items = []
        for key, value in meta.items():
            if key != OUTPUT_TOKEN_LOGPROBS_UNAVAILABLE:
                items.append((key, value))
            if key == anchor:
                items.append((OUTPUT_TOKEN_LOGPROBS_UNAVAILABLE, reason))
        meta.clear()
        meta.update(items)
        self._omitted = True

    def _fill_token_ids_logprobs(self, meta: dict[str, Any]) -> None:
        """Decode's ``output_token_ids_logprobs`` has one entry per position of
        ``output_token_logprobs`` in the aggregated body; P/D decode's lacks position 0's values: one
        entry short (before SGLang 0.5.23), or a ``null`` in a row ``_commit_transfer_to_req`` reserves
        (0.5.23: "Prefill omits these scores; reserve a row for the streaming offset"). Position 0 is
        restored from prefill when it is the only one missing; a reserved row prefill cannot fill stays
        ``null`` beside the field's reason (the other rows are decode's own); any other shortfall: the
        field goes."""
        ids, entries = meta.get(OUTPUT_TOKEN_IDS_LOGPROBS), meta.get(OUTPUT_TOKEN_LOGPROBS)
        if not isinstance(ids, list) or not isinstance(entries, list):
            return
        length = meta.get(OUTPUT_TOKEN_LOGPROBS_LENGTH)
        from_zero = _is_count(length) and length == len(entries)  # this chunk's slice starts at position 0
        short = from_zero and len(ids) == len(entries) - 1
        # Where output position 0 sits (twice in an abort body coalesced with chunks: _first_positions)
        # and decode reserved its row.
        reserved = [at for at in _first_positions(meta, entries) if ids[at] is None] \
            if len(ids) == len(entries) else []
        if len(ids) == len(entries) and not reserved:
            return
        source = self._prefill
        theirs = source.get(OUTPUT_TOKEN_IDS_LOGPROBS) if source is not None else None
        their_tokens = source.get(OUTPUT_TOKEN_LOGPROBS) if source is not None else None
        first_id = _token_id(their_tokens[0]) if isinstance(their_tokens, list) and their_tokens else None
        if ((short or reserved) and isinstance(theirs, list) and theirs and first_id is not None
                and all(_token_id(entries[at]) == first_id for at in reserved or [0])):
            if reserved:
                if theirs[0] is None:
                    return  # prefill scored no token ids at position 0 either: null is the answer
                filled = list(ids)
                for at in reserved:
                    filled[at] = theirs[0]
                meta[OUTPUT_TOKEN_IDS_LOGPROBS] = filled
            else:
                meta[OUTPUT_TOKEN_IDS_LOGPROBS] = [theirs[0], *ids]
            self._changed = True
            return
        if source is None:
            reason = self._unavailable or Omit.PREFILL_MISSING
        elif short or reserved:
            reason = Omit.PREFILL_MISSING if not (isinstance(theirs, list) and theirs) else Omit.LENGTH_MISMATCH
        else:
            reason = Omit.LENGTH_MISMATCH  # entries no leg has: lost between decode's sends
        self._omitted = True
        if reserved:
            # Only the reserved rows lack values (the others are decode's own steps): the list stays,
            # those rows null, as output_token_logprobs keeps its other positions (_omit_first_token).
            _insert_after_last(meta, OUTPUT_TOKEN_IDS_LOGPROBS_UNAVAILABLE, reason, (OUTPUT_TOKEN_IDS_LOGPROBS,))
            return
        meta.pop(OUTPUT_TOKEN_IDS_LOGPROBS)
        meta[OUTPUT_TOKEN_IDS_LOGPROBS_UNAVAILABLE] = reason

    def _fill_input_top_flat(self, meta: dict[str, Any], source: dict[str, Any]) -> None:
        """``return_flat_raw_top_logprobs``: decode's flat prompt top logprobs describe zero rows; the
        prefill leg's replace them in place (same keys, same order as the aggregated body). A prefill
        leg with the nested ``input_top_logprobs`` instead fell back as the aggregated engine does for
        rows the flat form cannot hold (``flat_top_logprobs_layout`` raises on ragged rows or interior
        nulls; decode's zero rows never do): decode's flat fields go, prefill's list (put in by
        :meth:`_fill_input_logprobs`) is the answer. With neither on prefill, decode's are removed and
        ``input_top_logprobs_unavailable_reason`` is set."""
        shape = meta.get("input_top_logprobs_shape")
        if not (isinstance(shape, list) and shape and shape[0] == 0):
            return  # no flat fields, or decode scored prompt rows itself
        theirs = source.get("input_top_logprobs_shape")
        present = [key for key in INPUT_TOP_FLAT_FIELDS if key in meta]
        if not isinstance(theirs, list):
            if isinstance(source.get("input_top_logprobs"), list) and isinstance(meta.get("input_top_logprobs"), list):
                # where the aggregated fallback writes it: the flat fields' place (add_logprob_to_meta_info),
                # which is before ``output_top_logprobs`` unless that is flat too (finished bodies)
                value = meta.pop("input_top_logprobs")
                _replace_key(meta, next(key for key in meta if key in present), "input_top_logprobs", value)
                for key in present:
                    meta.pop(key, None)
                self._changed = True
                return
            for key in present:
                meta.pop(key)
            meta[INPUT_TOP_LOGPROBS_UNAVAILABLE] = Omit.PREFILL_MISSING
            self._omitted = True
            return
        for key in present:
            if key in source and meta[key] != source[key]:
                meta[key] = source[key]
                self._changed = True

    def _omit_partial_hidden_states(self, meta: dict[str, Any]) -> bool:
        """``return_hidden_states=True``: the aggregated list starts with the prompt's block (a list of
        vectors, ``_append_prefill_hidden_states``), then one vector per decode step. P/D prefill never
        appends that block and decode's list holds its own steps only, so a list that does not start
        with a block cannot equal the aggregated one: it is removed (a function of the chunk alone).
        ``"last"`` mode sends one vector (numbers), which both legs compute the same way: kept."""
        value = meta.get(HIDDEN_STATES)
        if not isinstance(value, list):
            return False
        if value and not (isinstance(value[0], list) and value[0] and isinstance(value[0][0], (int, float))):
            return False  # a prompt block first ([[...], ...]), or "last" mode's single vector
        meta.pop(HIDDEN_STATES)
        meta[HIDDEN_STATES_UNAVAILABLE] = Omit.PREFILL_MISSING
        return True

    @staticmethod
    def _omit_indexer_topk(meta: dict[str, Any]) -> bool:
        """``return_indexer_topk``: decode's rows ``[0, prompt)`` were read from its host cache at KV
        slots the transfer filled (``BaseTopkCapturer.get_topk``), which no forward of this request
        wrote, and the prefill leg never collects the field. The prompt rows exist on no leg, so
        decode's value cannot equal the aggregated one: removed (a function of the chunk alone)."""
        if INDEXER_TOPK not in meta:
            return False
        meta.pop(INDEXER_TOPK)
        meta[INDEXER_TOPK_UNAVAILABLE] = Omit.PREFILL_MISSING
        return True

    @staticmethod
    def _omit_reasoning_tokens(meta: dict[str, Any]) -> bool:
        """``reasoning_tokens`` above 0 (the request asked for reasoning): decode never counted output
        token 0 and prefill counted nothing (module doc), so the value is the aggregated one minus one,
        or, when token 0 ended the reasoning, every later token: removed (a function of the chunk
        alone). 0 is right whenever reasoning was not asked, the common case: kept. A one-token
        reasoning answer reads 0 on both legs where the aggregated engine says 1: no body tells it
        from a request without reasoning (docs/codecs.md)."""
        value = meta.get(REASONING_TOKENS)
        if type(value) is not int or value <= 0:
            return False
        # the reason takes the count's place: routed_experts is put after it (ROUTED_EXPERTS_PREDECESSORS)
        _replace_key(meta, REASONING_TOKENS, REASONING_TOKENS_UNAVAILABLE, Omit.PREFILL_MISSING.value)
        return True

    def _join_weight_versions(self, meta: dict[str, Any]) -> None:
        """Token 0's version from the prefill leg, the rest from decode's spans, merged as
        ``compute_weight_version_spans`` merges them; ``weight_version`` follows the last span, as
        ``add_weight_versions_to_meta_info`` sets it. Legs on the same weights: nothing changes. No
        version for token 0 (no usable prefill leg, or no spans on it) or decode spans that are no
        span list: the field is removed, and so is ``weight_version`` of a one-token answer (its last
        token is token 0)."""
        if _no_token_span(meta[WEIGHT_VERSIONS]):
            return  # no output token (a decode aborted before token 0): no weights to attribute
        ours = _version_spans(meta[WEIGHT_VERSIONS])
        theirs = None
        if ours is None:
            reason = Omit.DECODE_CORRUPT
        elif self._prefill is None:
            reason = self._unavailable or Omit.PREFILL_MISSING
        else:
            source = self._prefill.get(WEIGHT_VERSIONS)
            spans = _version_spans(source)
            theirs = spans[0][0] if spans is not None else None
            reason = Omit.PREFILL_MISSING if source is None else Omit.PREFILL_CORRUPT
        if ours is None or theirs is None:
            _replace_key(meta, WEIGHT_VERSIONS, WEIGHT_VERSIONS + UNAVAILABLE_SUFFIX, str(reason))
            count = meta.get(COMPLETION_TOKENS)  # an int only: ``true``, ``1.0`` are no count (``True == 1``)
            if _is_count(count) and count == 1 and WEIGHT_VERSION in meta:
                _replace_key(meta, WEIGHT_VERSION, WEIGHT_VERSION + UNAVAILABLE_SUFFIX, str(reason))
            self._omitted = True
            return
        if ours[0][0] == theirs:
            return
        joined = [{"version": theirs, "start": 0, "end": 1}]
        for version, start, end in ours:
            start = max(start, 1)
            if end <= start:
                continue
            if joined[-1]["version"] == version:
                joined[-1]["end"] = end
            else:
                joined.append({"version": version, "start": start, "end": end})
        meta[WEIGHT_VERSIONS] = joined
        if WEIGHT_VERSION in meta:
            meta[WEIGHT_VERSION] = joined[-1]["version"]
        self._changed = True

    def _join_experts(self, meta: dict[str, Any]) -> None:
        if ROUTED_EXPERTS not in meta and native.failed_finish(meta):
            # A failed finish without the field: the aggregated answer has neither rows nor a marker,
            # whatever the prefill leg became (SGLang 0.5.23), for ``TokenizerManager._handle_abort_req``
            # (writes none, before or after token 0) and ``_handle_sampling_mask_abort`` (skips
            # ``BatchResultProcessor._maybe_collect_routed_experts``, which runs only once a request
            # finishes after sampling a token). An abort that finishes through ``to_finish``
            # (``Scheduler.abort_request`` on a running request) is collected like any finish: its body
            # has the field and is joined below. Known limit: a request rejected at intake
            # (``set_finish_with_abort``) is retired unrun by both P/D legs, while the aggregated engine
            # runs its one-token stub and, if experts were asked, sends that stub's row; no leg says
            # whether they were (docs/codecs.md), so no marker, as for a request that never asked.
            return None
        if self._unavailable is not None:
            return self._omit(meta, self._unavailable)
        assert self._prefill is not None
        present = ROUTED_EXPERTS in meta
        source_value = self._prefill.get(ROUTED_EXPERTS)
        if not present and source_value is None:
            return  # experts were not requested (indistinguishable from both legs dropping them)
        prefill = self._prefill_rows()
        if isinstance(prefill, str):
            return self._omit(meta, prefill)
        completion = meta.get(COMPLETION_TOKENS)
        if not _is_count(completion) or completion < 1:
            return self._omit(meta, Omit.DECODE_CORRUPT)
        value = meta.get(ROUTED_EXPERTS)
        if value is None:
            if present or completion != 1:
                return self._omit(meta, Omit.DECODE_MISSING)
            # One-token decode may omit the field (SGLang #39146): the answer is prefill's rows.
            return self._provide(meta, source_value)
        if completion > 1 and native.retracted(meta):
            return self._omit(meta, Omit.DECODE_CORRUPT)  # its early generated rows are stale (native.retracted)
        self.decodes += 1
        try:
            decode_rows = self._experts.decode_within(value, self._within(_decode_bound(prefill, completion)))
        except CorruptPayload as exc:
            return self._omit(meta, Omit.of_leg(exc, "decode"))
        dtype = native.expert_dtype(meta)
        if dtype is None or len(decode_rows) % EXPERT_DTYPE_SIZES[dtype]:
            return self._omit(meta, Omit.DECODE_CORRUPT)
        if dtype != prefill.dtype:
            return self._omit(meta, Omit.SHAPE_MISMATCH)
        if meta.get(PROMPT_TOKENS, prefill.prompt_tokens) != prefill.prompt_tokens:
            return self._omit(meta, Omit.LENGTH_MISMATCH)  # the legs disagree about the prompt
        start = _start_of(meta)
        if start is False or (start is not None and prefill.start is not None and start != prefill.start):
            return self._omit(meta, Omit.LENGTH_MISMATCH)
        layout = _layout(prefill, len(decode_rows), completion, start if start is not None else prefill.start)
        if isinstance(layout, str):
            return self._omit(meta, layout)
        row_bytes, skip = layout
        if row_bytes is not None and _stale(prefill.rows, row_bytes, prefill.itemsize):
            return self._omit(meta, Omit.PREFILL_CORRUPT)
        if completion == 1:
            joined = source_value  # decode's rows are all stale (or none): prefill's encoding is the answer
        else:
            generated = memoryview(decode_rows)[skip:]
            if _stale(generated, row_bytes, prefill.itemsize):
                return self._omit(meta, Omit.DECODE_CORRUPT)
            joined = self._encode_joined(source_value, prefill.rows, generated)
        self._provide(meta, joined)

    def _encode_joined(self, prefill_value: Any, rows: bytes, generated: memoryview) -> Any:
        """The joined rows' encoding. A sequence codec that can extend prefill's own encoding
        (``encode_after``, e.g. sglang-zstd reusing prefill's compressed blocks) is asked to."""
        encode_after = getattr(self._experts, "encode_after", None)
        if encode_after is not None:
            return encode_after(prefill_value, rows, generated)
        # numpy copies without the GIL; ``bytes.join`` holds it for the whole copy when a part is
        # a memoryview (CPython ``stringlib/join.h`` drops it only for exact bytes): 18 ms for
        # 2 x 32 MiB, every other request's passthrough waiting (docs/operations.md, limits and abuse).
        parts = (np.frombuffer(rows, np.uint8), np.frombuffer(generated, np.uint8))
        return self._experts.encode(np.concatenate(parts))

    def _provide(self, meta: dict[str, Any], value: Any) -> None:
        if meta.get(ROUTED_EXPERTS) != value or ROUTED_EXPERTS not in meta:
            if ROUTED_EXPERTS in meta:
                meta[ROUTED_EXPERTS] = value
            else:
                _insert_after_last(meta, ROUTED_EXPERTS, value, ROUTED_EXPERTS_PREDECESSORS)
            self._changed = True
        if meta.pop(ROUTED_EXPERTS_UNAVAILABLE, None) is not None:
            self._changed = True

    def _prefill_rows(self) -> _PrefillRows | str:
        """Prefill's prompt rows, decoded and validated once per session."""
        if self._rows is None:
            self._rows = self._decode_prefill_rows()
        return self._rows

    def _decode_prefill_rows(self) -> _PrefillRows | str:
        assert self._prefill is not None
        value = self._prefill.get(ROUTED_EXPERTS)
        if value is None:
            return Omit.PREFILL_MISSING
        dtype = native.expert_dtype(self._prefill)
        start = _start_of(self._prefill)
        prompt_tokens = self._prefill.get(PROMPT_TOKENS)
        if dtype is None or start is False or not _is_count(prompt_tokens) or prompt_tokens <= 0:
            return Omit.PREFILL_CORRUPT
        self.decodes += 1
        try:  # at most one row of the widest plausible model per prompt token
            rows = self._experts.decode_within(value, self._within(prompt_tokens * MAX_ROW_BYTES))
        except CorruptPayload as exc:
            return Omit.of_leg(exc, "prefill")
        itemsize = EXPERT_DTYPE_SIZES[dtype]
        if len(rows) % itemsize:
            return Omit.PREFILL_CORRUPT
        if start is None and not rows:
            # Only a start at the prompt's end leaves prefill no rows; unstated, an empty payload is
            # far more likely lost rows than that, so it is not taken as an answer.
            return Omit.PREFILL_CORRUPT
        if start is not None:
            if start > prompt_tokens or (start == prompt_tokens) != (len(rows) == 0):
                return Omit.PREFILL_CORRUPT
            if start < prompt_tokens and len(rows) % ((prompt_tokens - start) * itemsize):
                return Omit.PREFILL_CORRUPT
        row_bytes = None
        if start is not None and start < prompt_tokens:
            row_bytes = len(rows) // (prompt_tokens - start)
        if _stale(rows, row_bytes, itemsize):
            return Omit.PREFILL_CORRUPT
        return _PrefillRows(rows, dtype, itemsize, prompt_tokens, start)

    def _within(self, limit: int) -> int:
        """``limit``, lowered to what the processor's byte budget still allows. The budget counts
        what this session keeps, so prefill's decoded rows are subtracted from it."""
        budget = self.decode_budget
        if budget is None:
            return limit
        if isinstance(self._rows, _PrefillRows):
            budget -= len(self._rows.rows)
        return max(0, min(limit, budget))

    def _omit(self, meta: dict[str, Any], reason: str) -> None:
        meta.pop(ROUTED_EXPERTS, None)
        meta[ROUTED_EXPERTS_UNAVAILABLE] = reason
        self._omitted = True
