"""The routed-experts view of one result body, for the live page's heat map (``POST /v1/experts``).

Why the edge decodes and not the browser: ``sglang-zstd`` sends ``Base64(zstd(raw rows))``
(``codecs/sglang-zstd``) and browsers have no zstd decoder we can count on (``DecompressionStream``
knows gzip/deflate only), while the edge already holds the ``--format`` codec whose
``sequences["routed_experts"]`` decodes every encoding the processor joins, bounded.

Why the page posts the body instead of the edge re-reading the request: with a core NATS feed (no
JetStream results stream, as in ``streamproc demo --serve``) a finished request cannot be read
again, but the page already holds the exact bytes it received. Nothing is kept between calls.

Layout. SGLang's payload carries no shape: raw little-endian ids in ``routed_experts_dtype``
(int32 by default), one row per token position in ``[start, prompt + completion - 1)``
(``io_struct.GenerateReqInput.routed_experts_start_len``; ``start`` from
``meta_info.routed_experts_start_len``, else 0), each row ``layers x top_k`` ids. The row width is
the id count over the positions; splitting it into layers needs the model's top-k, which the page
asks for. A joined P/D body's rows before position ``prompt_tokens`` are the prefill leg's, the
rest the decode leg's (``streamproc_sglang.join``): that row index is the splice boundary. A
``.npy`` payload (vLLM) states its shape, so ``layers`` and ``top_k`` come from it.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from ..core.codec import Codec, CorruptPayload

FIELD = "routed_experts"
REASON_SUFFIX = "_unavailable_reason"
# SGLANG_ROUTED_EXPERTS_DTYPE values (``meta_info.routed_experts_dtype``, SGLang PR #31219).
DTYPES = {"int32": "<i4", "uint16": "<u2", "uint8": "<u1"}

# Bounds of one view: the posted body, what its payload may decode to, and the ids one answer
# carries (about 1.5 MB of JSON). Larger captures are paged with ``offset``/``rows``.
MAX_BODY_BYTES = 32 << 20
MAX_DECODED_BYTES = 64 << 20
MAX_VIEW_IDS = 1 << 18
_SEARCH_DEPTH = 4


class ExpertsView(msgspec.Struct, kw_only=True, omit_defaults=False):
    """A window of the expert-id matrix (positions x row ids) and what the page needs to draw it."""

    field: str = FIELD
    present: bool = False  # the body carries the field (else see ``omitted``)
    dtype: str | None = None
    start: int = 0  # token position of row 0
    positions: int = 0  # rows in the whole payload
    row_ids: int = 0  # ids per row (layers x top_k)
    layers: int | None = None  # known when the payload states its shape
    top_k: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    splice: int | None = None  # row index of the first decode row (position prompt_tokens)
    offset: int = 0  # first row in ``ids``
    rows: int = 0  # rows in ``ids``
    ids: list[int] = []  # rows [offset, offset + rows), row-major
    max_id: int = 0  # over the whole payload, so every window shares one colour scale
    omitted: dict[str, str] = {}  # <field>: reason, from every <field>_unavailable_reason marker
    problem: str | None = None  # why the payload cannot be shown as a matrix


def omission_markers(value: Any, out: dict[str, str] | None = None, depth: int = 0) -> dict[str, str]:
    """Every ``<field>_unavailable_reason`` in a body (Dynamo's omission convention), as field -> reason."""
    out = {} if out is None else out
    if depth > _SEARCH_DEPTH:
        return out
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, inner in items:
        if isinstance(key, str) and key.endswith(REASON_SUFFIX) and isinstance(inner, str):
            out[key.removesuffix(REASON_SUFFIX)] = inner
        elif isinstance(inner, (dict, list)):
            omission_markers(inner, out, depth + 1)
    return out


def _holder(value: Any, depth: int = 0) -> dict[str, Any] | None:
    """The object that holds the field (SGLang: ``meta_info``; first found, depth-bounded)."""
    if depth > _SEARCH_DEPTH:
        return None
    if isinstance(value, dict):
        if FIELD in value:
            return value
        children = value.values()
    elif isinstance(value, list):
        children = value
    else:
        return None
    for inner in children:
        if isinstance(inner, (dict, list)):
            found = _holder(inner, depth + 1)
            if found is not None:
                return found
    return None


def _count(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None


def build_view(codec: Codec, body: bytes, *, offset: int = 0, rows: int | None = None) -> ExpertsView:
    """The view of one result body. Raises ``ValueError`` when the body is not a JSON object."""
    doc = msgspec.json.decode(body)
    if not isinstance(doc, dict):
        raise ValueError("the body is not a JSON object")
    view = ExpertsView(omitted=omission_markers(doc))
    holder = _holder(doc)
    if holder is None or holder.get(FIELD) is None:
        return view
    view.present = True
    view.prompt_tokens = _count(holder.get("prompt_tokens"))
    view.completion_tokens = _count(holder.get("completion_tokens"))
    sequence = codec.sequences.get(FIELD)
    if sequence is None:
        view.problem = f"format {codec.name} has no {FIELD} codec"
        return view
    try:
        decoded = sequence.decode_within(holder[FIELD], MAX_DECODED_BYTES)
    except CorruptPayload as exc:
        view.problem = f"cannot decode: {exc}"
        return view
    matrix = _matrix(decoded, holder, view)
    if matrix is None:
        return view
    view.positions, view.row_ids = matrix.shape
    view.max_id = int(matrix.max()) if matrix.size else 0
    if view.prompt_tokens is not None and 0 < view.prompt_tokens - view.start < view.positions:
        view.splice = view.prompt_tokens - view.start
    per_answer = max(1, MAX_VIEW_IDS // max(1, view.row_ids))
    view.offset = min(max(0, offset), view.positions)
    view.rows = min(per_answer if rows is None else max(0, min(rows, per_answer)), view.positions - view.offset)
    view.ids = matrix[view.offset:view.offset + view.rows].ravel().tolist()  # only the window becomes ints
    return view


def _matrix(decoded: Any, holder: dict[str, Any], view: ExpertsView) -> np.ndarray | None:
    """(positions, row ids) integer matrix, or None with ``view.problem`` set."""
    if isinstance(decoded, np.ndarray):  # .npy: the shape is on the wire
        view.dtype = decoded.dtype.name
        if decoded.ndim == 3:
            view.layers, view.top_k = int(decoded.shape[1]), int(decoded.shape[2])
        if decoded.ndim == 1:
            return decoded.reshape(-1, 1)
        return decoded.reshape(decoded.shape[0], -1)
    dtype = holder.get("routed_experts_dtype", "int32")
    if dtype not in DTYPES:
        view.problem = f"unknown routed_experts_dtype {dtype!r}"
        return None
    view.dtype = dtype
    ids = np.frombuffer(decoded, dtype=np.dtype(DTYPES[dtype]).newbyteorder("<"),
                        count=len(decoded) // np.dtype(DTYPES[dtype]).itemsize)
    if len(decoded) % ids.itemsize:
        view.problem = f"{len(decoded)} bytes are not whole {dtype} ids"
        return None
    start = _count(holder.get("routed_experts_start_len")) or 0
    view.start = start
    if view.prompt_tokens is None or view.completion_tokens is None:
        view.problem = "prompt_tokens or completion_tokens missing: the rows cannot be laid out"
        return None
    positions = view.prompt_tokens + view.completion_tokens - 1 - start
    if positions <= 0 or ids.size % positions:
        view.problem = (f"{ids.size} ids do not divide into {positions} positions "
                        f"[{start}, {view.prompt_tokens} + {view.completion_tokens} - 1)")
        return None
    return ids.reshape(positions, ids.size // positions)  # a view of the decoded bytes, no copy
