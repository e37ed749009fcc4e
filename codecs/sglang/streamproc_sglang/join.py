"""The SGLang P/D join: prefill's prompt-side data merged into decode's chunks.

What a P/D decode chunk lacks and where it comes from (reference notes §4.3):

- ``input_token_logprobs`` (and ``input_top_logprobs`` / ``input_token_ids_logprobs`` when the
  prefill leg has them): only prefill computes them. Copied onto every decode chunk that carries
  ``output_token_logprobs``, because the aggregated stream re-emits them cumulatively on each chunk.
- The first output token's logprob: P/D decode reports ``[null, out0, null]`` (SGLang PR #40298).
  Taken from prefill's ``output_token_logprobs[0]`` when it names the same token id.
- ``routed_experts``: decode's rows ``[0, prompt_len)`` are stale KV-slot leftovers. Joined bytes are
  ``P + D[len(P):]`` (prefill's prompt rows, then decode's own rows), validated against the token
  counts. Rows must start at position 0 (``routed_experts_start_len == 0`` on both legs), which is
  the SGLang default; a shifted start shows up as a ``length_mismatch``. Value-level corruption of a
  correctly sized raw payload (a wrong but in-range expert id) cannot be detected here.

Omission policy: a field that cannot be rebuilt completely is removed and
``<field>_unavailable_reason`` says why; decode's stale rows are never published.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from streamproc.codec import CorruptPayload, JoinSession, SequenceCodec
from streamproc.decompress import TOO_LARGE
from streamproc.wire import Verdict

from . import native
from .native import (
    COMPLETION_TOKENS,
    INPUT_LOGPROB_FIELDS,
    INPUT_LOGPROBS_UNAVAILABLE,
    INPUT_TOKEN_LOGPROBS,
    OUTPUT_TOKEN_LOGPROBS,
    OUTPUT_TOKEN_LOGPROBS_LENGTH,
    OUTPUT_TOP_LOGPROBS,
    PROMPT_TOKENS,
    ROUTED_EXPERTS,
    ROUTED_EXPERTS_UNAVAILABLE,
)

PREFILL_MISSING = "prefill_missing"
PREFILL_CORRUPT = "prefill_corrupt"
PREFILL_ERROR = "prefill_error"
DECODE_MISSING = "decode_missing"
DECODE_CORRUPT = "decode_corrupt"
LENGTH_MISMATCH = "length_mismatch"

_INT32 = 4


def _is_count(value: object) -> bool:
    return type(value) is int


def _leg_reason(exc: CorruptPayload, leg: str) -> str:
    return TOO_LARGE if exc.reason == TOO_LARGE else f"{leg}_corrupt"


def _insert_before(meta: dict[str, Any], anchor: str, items: dict[str, Any]) -> dict[str, Any]:
    """``meta`` with ``items`` placed where the aggregated body has them: just before ``anchor``."""
    out: dict[str, Any] = {}
    for key, value in meta.items():
        if key == anchor:
            out.update(items)
        out[key] = value
    out.update(items)  # no-op when the anchor was found (same keys, same values)
    return out


class SGLangJoinSession(JoinSession):
    """Join state for one P/D request. The prefill leg is parsed once and its rows decoded once."""

    def __init__(self, sequences: Mapping[str, SequenceCodec]) -> None:
        self._experts: SequenceCodec = sequences[ROUTED_EXPERTS]
        self._known = False  # absorb_prefill or prefill_unavailable happened
        self._prefill: dict[str, Any] | None = None  # meta_info of a usable prefill leg
        self._unavailable: str | None = None  # why there is no usable prefill leg
        self._rows: tuple[bytes, int] | str | None = None  # (prefill rows, row bytes) or a reason
        self._last: tuple[bytes, dict[str, Any] | None] | None = None  # needs_prefill -> join parse cache
        self._changed = False
        self._omitted = False

    # ------------------------------------------------------------ JoinSession

    def needs_prefill(self, body: bytes, final: bool) -> bool:
        """Logprob chunks (decode lacks prompt and first-token logprobs), chunks carrying rows, and the
        final chunk: only the prefill leg tells whether experts were requested, so a decode that
        dropped the field (or a one-token decode that legitimately omits it) is judged against it."""
        doc = self._parse(body)
        meta = native.meta_of(doc) if doc is not None else None
        return meta is not None and self._wants(meta, final)

    def absorb_prefill(self, bodies: Sequence[bytes]) -> None:
        self._known = True
        docs = [native.parse(body) for body in bodies]
        if not docs:
            self._unavailable = PREFILL_MISSING
            return
        if any(doc is None for doc in docs):
            self._unavailable = PREFILL_CORRUPT
            return
        doc = docs[0] if len(docs) == 1 else native.fold(docs)  # type: ignore[arg-type]
        meta = native.meta_of(doc)  # type: ignore[arg-type]
        if native.failed(doc):  # type: ignore[arg-type]
            self._unavailable = PREFILL_ERROR
        elif meta is None:
            self._unavailable = PREFILL_CORRUPT
        else:
            self._prefill = meta

    def prefill_unavailable(self, reason: str) -> None:
        self._known = True
        self._prefill = None
        self._unavailable = reason or PREFILL_MISSING

    def join(self, body: bytes, final: bool) -> tuple[bytes, Verdict]:
        doc = self._parse(body)
        self._last = None  # the parsed dict is edited below; never hand it out again
        meta = native.meta_of(doc) if doc is not None else None
        if meta is None or not self._wants(meta, final):
            return body, Verdict.PASSTHROUGH
        if not self._known:
            raise RuntimeError("join() on a chunk that needs prefill before the prefill leg was settled")
        self._changed = self._omitted = False
        if OUTPUT_TOKEN_LOGPROBS in meta:
            meta = self._fill_input_logprobs(doc, meta)  # type: ignore[arg-type]
            self._fill_first_token(meta)
        if final or ROUTED_EXPERTS in meta:
            self._join_experts(meta)
        if self._omitted:
            return native.encode(doc), Verdict.OMITTED
        if self._changed:
            joined = native.encode(doc)
            if joined != body:
                return joined, Verdict.JOINED
        return body, Verdict.PASSTHROUGH

    # -------------------------------------------------------------- internals

    @staticmethod
    def _wants(meta: dict[str, Any], final: bool) -> bool:
        return final or OUTPUT_TOKEN_LOGPROBS in meta or ROUTED_EXPERTS in meta

    def _parse(self, body: bytes) -> dict[str, Any] | None:
        last = self._last
        if last is not None and last[0] is body:
            return last[1]
        doc = native.parse(body)
        self._last = (body, doc)
        return doc

    def _fill_input_logprobs(self, doc: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
        if meta.get(INPUT_TOKEN_LOGPROBS):
            return meta  # this decode worker computed them itself
        source = self._prefill
        reason = self._unavailable
        if source is not None:
            logprobs = source.get(INPUT_TOKEN_LOGPROBS)
            if logprobs is None or logprobs == []:
                reason = PREFILL_MISSING
            elif not isinstance(logprobs, list):
                reason = PREFILL_CORRUPT
        if reason is not None or source is None:
            meta[INPUT_LOGPROBS_UNAVAILABLE] = reason or PREFILL_MISSING
            self._omitted = True
            return meta
        fill = {f: source[f] for f in INPUT_LOGPROB_FIELDS if source.get(f) is not None and not meta.get(f)}
        new = {}
        for key, value in fill.items():
            if key in meta:
                meta[key] = value  # replace decode's empty list in place
            else:
                new[key] = value
        meta.pop(INPUT_LOGPROBS_UNAVAILABLE, None)  # a decode worker's own marker is now wrong
        if new:
            meta = _insert_before(meta, OUTPUT_TOKEN_LOGPROBS, new)
            doc[native.META] = meta
        self._changed = True
        return meta

    def _fill_first_token(self, meta: dict[str, Any]) -> None:
        entries = meta.get(OUTPUT_TOKEN_LOGPROBS)
        length = meta.get(OUTPUT_TOKEN_LOGPROBS_LENGTH)
        # Only the chunk whose slice starts at output position 0 holds the first token.
        if not (isinstance(entries, list) and entries and _is_count(length) and length == len(entries)):
            return
        first = entries[0]
        if not (isinstance(first, list) and len(first) >= 2 and first[0] is None) or self._prefill is None:
            return
        source = self._prefill.get(OUTPUT_TOKEN_LOGPROBS)
        if not (isinstance(source, list) and source):
            return
        theirs = source[0]
        if not (isinstance(theirs, list) and len(theirs) >= 2 and theirs[0] is not None
                and theirs[1] == first[1]):
            return  # a different token was sampled: prefill's logprob is not this token's
        entries[0] = theirs
        self._changed = True
        top, source_top = meta.get(OUTPUT_TOP_LOGPROBS), self._prefill.get(OUTPUT_TOP_LOGPROBS)
        if isinstance(top, list) and top and not top[0] and isinstance(source_top, list) and source_top \
                and source_top[0]:
            top[0] = source_top[0]

    def _join_experts(self, meta: dict[str, Any]) -> None:
        if self._unavailable is not None:
            return self._omit(meta, self._unavailable)
        assert self._prefill is not None
        present = ROUTED_EXPERTS in meta
        source_value = self._prefill.get(ROUTED_EXPERTS)
        if not present and source_value is None:
            return  # experts were not requested (indistinguishable from both legs dropping them)
        rows = self._prefill_rows()
        if isinstance(rows, str):
            return self._omit(meta, rows)
        prefill_rows, row_bytes = rows
        completion = meta.get(COMPLETION_TOKENS)
        one_token = _is_count(completion) and completion == 1
        if not present:
            if not one_token:
                return self._omit(meta, DECODE_MISSING)
            # One-token decode may omit the field (SGLang #39146): the answer is prefill's rows.
            meta[ROUTED_EXPERTS] = source_value
            meta.pop(ROUTED_EXPERTS_UNAVAILABLE, None)
            self._changed = True
            return
        value = meta[ROUTED_EXPERTS]
        if value is None:
            return self._omit(meta, DECODE_MISSING)
        try:
            decode_rows = self._experts.decode(value)
        except CorruptPayload as exc:
            return self._omit(meta, _leg_reason(exc, "decode"))
        if not _is_count(completion) or completion < 1 or len(decode_rows) % _INT32:
            return self._omit(meta, DECODE_CORRUPT)
        if len(decode_rows) != len(prefill_rows) + (completion - 1) * row_bytes:
            return self._omit(meta, LENGTH_MISMATCH)
        if one_token:
            joined = source_value  # every decode row is stale; prefill's own encoding is the answer
        else:
            joined = self._experts.encode(
                b"".join((prefill_rows, memoryview(decode_rows)[len(prefill_rows):])))
        if joined != value:
            meta[ROUTED_EXPERTS] = joined
            self._changed = True
        if meta.pop(ROUTED_EXPERTS_UNAVAILABLE, None) is not None:
            self._changed = True

    def _prefill_rows(self) -> tuple[bytes, int] | str:
        """Prefill's prompt rows and the row size, decoded and validated once per session."""
        if self._rows is None:
            self._rows = self._decode_prefill_rows()
        return self._rows

    def _decode_prefill_rows(self) -> tuple[bytes, int] | str:
        assert self._prefill is not None
        value = self._prefill.get(ROUTED_EXPERTS)
        if value is None:
            return PREFILL_MISSING
        try:
            rows = self._experts.decode(value)
        except CorruptPayload as exc:
            return _leg_reason(exc, "prefill")
        prompt_tokens = self._prefill.get(PROMPT_TOKENS)
        if not _is_count(prompt_tokens) or prompt_tokens <= 0 or len(rows) % prompt_tokens:
            return PREFILL_CORRUPT
        row_bytes = len(rows) // prompt_tokens
        if row_bytes <= 0 or row_bytes % _INT32:
            return PREFILL_CORRUPT
        return rows, row_bytes

    def _omit(self, meta: dict[str, Any], reason: str) -> None:
        meta.pop(ROUTED_EXPERTS, None)
        meta[ROUTED_EXPERTS_UNAVAILABLE] = reason
        self._omitted = True
