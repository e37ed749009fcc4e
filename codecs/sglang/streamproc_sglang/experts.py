"""``routed_experts`` of one SGLang body as the format-neutral :class:`RoutedExperts` (the edge's view).

SGLang's payload carries no shape: raw little-endian ids in ``meta_info.routed_experts_dtype``
(int32 by default, SGLang PR #31219), one row per token position in ``[start, prompt + completion
- 1)`` (``io_struct.GenerateReqInput.routed_experts_start_len``; ``start`` from
``meta_info.routed_experts_start_len``, else 0), each row ``layers x top_k`` ids. The row width is
the id count over the positions; splitting it into layers needs the model's top-k, which is not on
the wire. A joined P/D body's rows before position ``prompt_tokens`` are the prefill leg's, the rest
the decode leg's (``join.py``): that row index is the splice boundary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from streamproc.codec import CorruptPayload, RoutedExperts, omission_markers, row_spans
from streamproc.core.errors import shown
from streamproc.wire import Verdict

from . import native

if TYPE_CHECKING:
    from .codec import SGLangCodec

# numpy dtypes of SGLANG_ROUTED_EXPERTS_DTYPE's values, little-endian as on the wire.
NUMPY_DTYPES = {"int32": "<i4", "uint16": "<u2", "uint8": "<u1"}
assert NUMPY_DTYPES.keys() == native.EXPERT_DTYPE_SIZES.keys()


def _count(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None


def routed_experts(codec: SGLangCodec, body: bytes, verdict: Verdict | None, limit: int) -> RoutedExperts:
    """The description of ``body``'s routed experts; ``ValueError`` when it is not a JSON object."""
    doc = native.parse(body)
    if doc is None:
        raise ValueError("the body is not a JSON object")
    view = RoutedExperts(field=native.ROUTED_EXPERTS, omitted=omission_markers(doc))
    meta = native.meta_of(doc)
    if meta is None or meta.get(native.ROUTED_EXPERTS) is None:
        return view
    view.present = True
    view.prompt_tokens = _count(meta.get(native.PROMPT_TOKENS))
    view.completion_tokens = _count(meta.get(native.COMPLETION_TOKENS))
    try:  # the format's own sequence codec: plain Base64 here, Base64(zstd) in sglang-zstd
        decoded = codec.sequences[native.ROUTED_EXPERTS].decode_within(meta[native.ROUTED_EXPERTS], limit)
    except CorruptPayload as exc:
        view.problem = f"cannot decode: {exc}"
        return view
    dtype = native.expert_dtype(meta)
    if dtype is None:
        view.problem = f"unknown {native.ROUTED_EXPERTS_DTYPE} {shown(str(meta[native.ROUTED_EXPERTS_DTYPE]))}"
        return view
    view.dtype = dtype
    wire = np.dtype(NUMPY_DTYPES[dtype])
    if len(decoded) % wire.itemsize:
        view.problem = f"{len(decoded)} bytes are not whole {dtype} ids"
        return view
    ids = np.frombuffer(decoded, dtype=wire)
    view.start = start = _count(meta.get(native.ROUTED_EXPERTS_START_LEN)) or 0
    if view.prompt_tokens is None or view.completion_tokens is None:
        view.problem = "prompt_tokens or completion_tokens missing: the rows cannot be laid out"
        return view
    positions = view.prompt_tokens + view.completion_tokens - 1 - start
    if positions <= 0 or ids.size % positions:
        view.problem = (f"{ids.size} ids do not divide into {positions} positions "
                        f"[{start}, {view.prompt_tokens} + {view.completion_tokens} - 1)")
        return view
    view.matrix = ids.reshape(positions, ids.size // positions)  # a view of the decoded bytes, no copy
    prefill_rows = view.prompt_tokens - start
    if 0 < prefill_rows < positions:
        view.splice = prefill_rows
    view.spans = row_spans(positions, prefill_rows, verdict)
    return view
