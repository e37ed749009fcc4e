"""The routed-experts view of one result body, for the live page's heat map (``POST /v1/experts``).

Why the edge decodes and not the browser: a format may compress the value (``sglang-zstd`` sends
zstd, ``codecs/sglang-zstd``) and browsers have no zstd decoder we can count on
(``DecompressionStream`` knows gzip/deflate only), while the edge already holds the ``--format``
codec, which decodes every encoding the processor joins, bounded.

Why the page posts the body instead of the edge re-reading the request: with a core NATS feed (no
JetStream results stream, as in ``streamproc demo --serve``) a finished request cannot be read
again, but the page already holds the exact bytes it received. Nothing is kept between calls.

The edge knows no format: the codec's :meth:`~streamproc.core.codec.Codec.routed_experts` hook
finds, decodes and lays out the value (positions x row ids, splice row, which leg computed which
rows, omission markers); this module bounds it, pages it and makes it JSON.
"""

from __future__ import annotations

import msgspec

from ..core.codec import Codec, RowSpan
from ..core.events import Verdict

# Bounds of one view: the posted body, what its payload may decode to, and the ids one answer
# carries (about 1.5 MB of JSON). Larger captures are paged with ``offset``/``rows``.
MAX_BODY_BYTES = 32 << 20
MAX_DECODED_BYTES = 64 << 20
MAX_VIEW_IDS = 1 << 18
# Bytes of posted bodies the edge holds at once (read, or waiting for the one decode at a time).
# Without a bound a client's concurrent posts multiplied the edge's memory by the connections it
# opened: 16 posts of 32 MiB took the edge's peak RSS up by 0.9-1.0 GiB.
MAX_BODIES_BYTES = 2 * MAX_BODY_BYTES  # edge-wide: bytes actually read
MAX_CLIENT_BODIES_BYTES = MAX_BODY_BYTES  # per client: declared lengths (or bytes read, chunked)


class BodyBudget:
    """The bytes of posted bodies held. A client's share is claimed by declared length before its
    body is read (:meth:`claim`), so its concurrent posts past one body are refused at once; the
    edge-wide bound counts only bytes actually read (:meth:`hold`), so posts that declare a length
    and send nothing hold nothing of it, and cannot keep other clients out. :meth:`give` returns a
    post's claim and hold once its body is freed."""

    def __init__(self, total: int = MAX_BODIES_BYTES, per_client: int = MAX_CLIENT_BODIES_BYTES) -> None:
        self.total = total
        self.per_client = per_client
        self.held = 0
        self.by_client: dict[str, int] = {}

    def claim(self, client: str, size: int) -> bool:
        """``size`` more bytes of ``client``'s share, or False (nothing claimed)."""
        if size <= 0:  # nothing to hold, and no entry for the client (one per client would pile up)
            return True
        mine = self.by_client.get(client, 0)
        if mine + size > self.per_client:
            return False
        self.by_client[client] = mine + size
        return True

    def hold(self, size: int) -> bool:
        """``size`` more bytes read, or False when the edge-wide bound would pass (nothing held)."""
        if self.held + size > self.total:
            return False
        self.held += size
        return True

    def give(self, client: str, claimed: int, held: int) -> None:
        self.held -= held
        if claimed <= 0:
            return
        left = self.by_client.get(client, 0) - claimed
        if left > 0:
            self.by_client[client] = left
        else:
            self.by_client.pop(client, None)


class ExpertsView(msgspec.Struct, kw_only=True, omit_defaults=False):
    """A window of the expert-id matrix (positions x row ids) and what the page needs to draw it."""

    field: str | None = None  # the format's name for the value (display only)
    present: bool = False  # the body carries the value (else see ``omitted``)
    dtype: str | None = None
    start: int = 0  # token position of row 0
    positions: int = 0  # rows in the whole payload
    row_ids: int = 0  # ids per row (layers x top_k)
    layers: int | None = None  # known when the payload states its shape
    top_k: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    splice: int | None = None  # row index of the first decode row (position prompt_tokens)
    spans: list[RowSpan] = []  # which worker computed which rows; [] when no verdict was given
    offset: int = 0  # first row in ``ids``
    rows: int = 0  # rows in ``ids``
    ids: list[int] = []  # rows [offset, offset + rows), row-major
    max_id: int = 0  # over the whole payload, so every window shares one colour scale
    omitted: dict[str, str] = {}  # <field>: reason, from every <field>_unavailable_reason marker
    problem: str | None = None  # why the payload cannot be shown as a matrix


def build_view(codec: Codec, body: bytes, *, offset: int = 0, rows: int | None = None,
               verdict: Verdict | None = None) -> ExpertsView:
    """The view of one result body. Raises ``ValueError`` when the body is not a result body."""
    found = codec.routed_experts(body, verdict=verdict, limit=MAX_DECODED_BYTES)
    view = ExpertsView(field=found.field, present=found.present, dtype=found.dtype, start=found.start,
                       layers=found.layers, top_k=found.top_k, prompt_tokens=found.prompt_tokens,
                       completion_tokens=found.completion_tokens, splice=found.splice, spans=found.spans,
                       omitted=found.omitted, problem=found.problem)
    matrix = found.matrix
    if matrix is None or found.problem is not None:
        return view
    view.positions, view.row_ids = matrix.shape
    view.max_id = int(matrix.max()) if matrix.size else 0
    per_answer = max(1, MAX_VIEW_IDS // max(1, view.row_ids))
    view.offset = min(max(0, offset), view.positions)
    view.rows = min(per_answer if rows is None else max(0, min(rows, per_answer)), view.positions - view.offset)
    view.ids = matrix[view.offset:view.offset + view.rows].ravel().tolist()  # only the window becomes ints
    return view
