"""``routed_experts`` of one vLLM body as the format-neutral :class:`RoutedExperts` (the edge's view).

The value sits on a choice (the finishing chunk's in a stream) as Base64 ``.npy`` of shape
``(rows, num_layers, top_k)``, rows covering positions ``[S, prompt + output - 1)``, ``S`` the
request's ``routed_experts_prompt_start`` (0 unless set; docs/formats-vllm.md). The shape is on the
wire, so layers and top-k are known. A joined P/D body's first ``prompt_tokens - S`` rows are the
prefill leg's; the prompt length is in ``usage`` when the body has it (unary bodies, streams with
``include_usage`` on their last chunk only), else the length of ``prompt_logprobs`` (index 0 is the
unscored first token), else unknown. ``S`` is not on the wire: it is what the rows leave out of
``[0, prompt + output - 1)`` when ``usage`` has both counts for one choice, else 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from streamproc.codec import CorruptPayload, RoutedExperts, omission_markers, row_spans
from streamproc.wire import Verdict

from .native import (
    COMPLETION_TOKENS,
    PROMPT_LOGPROBS,
    PROMPT_TOKENS,
    ROUTED_EXPERTS,
    choices_of,
    parse_object,
    usage_count,
)

if TYPE_CHECKING:
    from .codec import VLLMCodec


def routed_experts(codec: VLLMCodec, body: bytes, verdict: Verdict | None, limit: int) -> RoutedExperts:
    """The description of ``body``'s routed experts (the first choice that carries them);
    ``ValueError`` when the body is not a JSON object."""
    doc = parse_object(body)
    if doc is None:
        raise ValueError("the body is not a JSON object")
    view = RoutedExperts(field=ROUTED_EXPERTS, omitted=omission_markers(doc))
    choice = next((c for c in choices_of(doc) if c.get(ROUTED_EXPERTS) is not None), None)
    if choice is None:
        return view
    view.present = True
    view.prompt_tokens = usage_count(doc, PROMPT_TOKENS)
    view.completion_tokens = usage_count(doc, COMPLETION_TOKENS)
    scored = doc.get(PROMPT_LOGPROBS)
    if view.prompt_tokens is None and isinstance(scored, list) and scored:
        view.prompt_tokens = len(scored)
    try:
        rows = codec.sequences[ROUTED_EXPERTS].decode_within(choice[ROUTED_EXPERTS], limit)
    except CorruptPayload as exc:
        view.problem = f"cannot decode: {exc}"
        return view
    view.dtype = rows.dtype.name
    if rows.ndim == 3:
        view.layers, view.top_k = int(rows.shape[1]), int(rows.shape[2])
    view.matrix = rows.reshape(-1, 1) if rows.ndim == 1 else rows.reshape(rows.shape[0], -1)
    positions = view.matrix.shape[0]
    # With n > 1 usage counts every choice's tokens together: the rows' start is not known then.
    single = len(choices_of(doc)) == 1
    view.start = _start(view.prompt_tokens, view.completion_tokens if single else None, positions)
    prompt_rows = None if view.prompt_tokens is None else view.prompt_tokens - view.start
    if prompt_rows is not None and 0 < prompt_rows < positions:
        view.splice = prompt_rows
    view.spans = row_spans(positions, prompt_rows, verdict)
    return view


def _start(prompt_tokens: int | None, completion_tokens: int | None, positions: int) -> int:
    """Row 0's token position: ``routed_experts_prompt_start`` (vLLM 0.34.0) is not on the wire, but
    the rows end at ``P + O - 1`` (``take_output`` stops at ``num_tokens - 1``) and start at
    ``min(S, P)`` (``AuxOutputSchedulerConnector.build_connector_meta``), so ``S`` is what the rows
    leave out; 0 when a count is missing or the rows do not fit ``[0, P + O - 1)`` from a prompt
    position."""
    if prompt_tokens is None or completion_tokens is None:
        return 0
    start = prompt_tokens + completion_tokens - 1 - positions
    return start if 0 <= start <= prompt_tokens else 0
