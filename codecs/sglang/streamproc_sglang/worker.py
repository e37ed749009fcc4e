"""A simulated SGLang worker: renders a :class:`~streamproc.simulation.Truth` as native bodies.

It reproduces what real disaggregated SGLang serving emits, artefacts included:

- agg: full ``meta_info``; stream chunks carry ``output_token_logprobs`` slices, cumulative
  ``input_token_logprobs`` and counts; ``routed_experts`` rows ``[0, prompt + output - 1)`` on the
  final chunk only.
- prefill (``max_new_tokens=1``): always one body with the first sampled token, the prompt's logprobs
  and rows ``[0, prompt_len)``.
- decode: no ``input_token_logprobs``, a ``null`` logprob for output position 0 (SGLang PR #40298),
  and rows ``[0, prompt + output - 1)`` whose prompt rows are stale (zeros or garbage, as the KV slots
  were filled by transfer, not by a forward pass); a one-token decode may omit the field (#39146).

Subclasses change only :meth:`SGLangWorker.encode_experts` (and the matching :meth:`SGLangWorker.bomb`).

``SGLangWorker(shape=upstream.Shape(...))`` renders every leg with the upstream-shaped builder
instead (cumulative or incremental streaming, uint8/uint16/int32 rows, ``routed_experts_start_len``,
empty logprob windows, suffix decode coverage, stale prefill rows), so the processor can be driven
end to end with what real SGLang deployments emit.
"""

from __future__ import annotations

import json
import random
import zlib
from typing import Any, Callable, ClassVar

import msgspec
import numpy as np

from streamproc.codec import CodecOptions, CorruptPayload, OmissionReason, SequenceCodec
from streamproc.decompress import encode_base64
from streamproc.simulation import Damage, SimulatedWorker, Truth, emitted_in

from . import migration, native, upstream
from .codec import SGLangCodec
from .fold import SENT_REASON

_ABSENT: Any = object()
GARBAGE_VALUE = "!!not base64!!"
WRONG_TYPE_VALUE = 12345
# Views decode what a processor published; they trust it more than the processor trusts workers.
_VIEW_LIMIT = 1 << 30


class SGLangWorker(SimulatedWorker):
    format: ClassVar[str] = "sglang"
    codec_class: ClassVar[type[SGLangCodec]] = SGLangCodec

    def __init__(self, options: CodecOptions | None = None, *, shape: upstream.Shape | None = None) -> None:
        """``options`` must match the processor's: ``Damage.BOMB`` is sized from its limit. ``shape``
        switches to upstream-shaped bodies (``upstream.py``)."""
        self.options = options or CodecOptions()
        self.shape = shape
        view = CodecOptions(max_decompressed_bytes=max(self.options.max_decompressed_bytes, _VIEW_LIMIT))
        self._view: SequenceCodec = self.codec_class(view).sequences[native.ROUTED_EXPERTS]

    # ------------------------------------------------------------ encoding hooks

    def encode_experts(self, raw: bytes) -> object:
        """The engine's wire value for raw int32 rows."""
        return self._view.encode(raw)

    def bomb(self, truth: Truth, role: str) -> object:
        """A value that decodes past ``max_decompressed_bytes``.

        Plain Base64 cannot be small and large at once, so this string has ``O(limit)`` characters
        (use a small limit in tests); the codec must reject it by its length, before decoding.
        """
        groups = -(-self.options.max_decompressed_bytes // 3) + 1
        return "AAAA" * groups

    # ------------------------------------------------------------------- legs

    def agg(self, truth: Truth, *, stream: bool) -> list[bytes]:
        if self.shape is not None:
            return upstream.agg(truth, self.shape, stream=stream, encode=self.encode_experts)
        experts = self.encode_experts(truth.experts) if truth.return_experts else _ABSENT
        return self._render(truth, self._spans(truth, stream), experts=experts)

    def prefill(self, truth: Truth, *, stream: bool, damage: Damage | None = None) -> list[bytes]:
        if self.shape is not None:
            return self._damage_last(upstream.prefill(truth, self.shape, encode=self.encode_experts), damage,
                                     truth, "prefill")
        experts = _ABSENT
        if truth.return_experts:
            experts = self._damaged(truth.expert_rows(0, truth.prompt_len), damage, truth, "prefill")
        return self._render(truth, [(0, 1)], experts=experts, finish={"type": "length", "length": 1})

    def decode(self, truth: Truth, *, stream: bool, damage: Damage | None = None) -> list[bytes]:
        if self.shape is not None:
            bodies = upstream.decode(truth, self.shape, stream=stream, encode=self.encode_experts)
            return self._damage_last(bodies, damage, truth, "decode")
        experts = _ABSENT
        omitted = truth.output_len == 1 and truth.decode_omits_one_token_experts
        if truth.return_experts and not omitted:
            raw = stale_prompt_rows(truth) + truth.expert_rows(truth.prompt_len, truth.rows)
            experts = self._damaged(raw, damage, truth, "decode")
        return self._render(truth, self._spans(truth, stream), experts=experts, prompt_logprobs=False)

    def opaque_agg(self, truth: Truth, *, stream: bool, rng: random.Random) -> list[bytes]:
        value = rng.choice(self._opaque_values(truth, rng))()
        bodies = self._render(truth, self._spans(truth, stream), experts=value)
        out = []
        for body in bodies:
            roll = rng.random()
            if roll < 0.125:
                out.append(b"\xffnot json at all \x00" + rng.randbytes(rng.randint(0, 48)))
            elif roll < 0.25:  # same document, formatted differently: must not be normalised
                out.append(json.dumps(json.loads(body), indent=rng.choice([None, 1]),
                                      ensure_ascii=rng.random() < 0.5).encode())
            else:
                out.append(body)
        return out

    def _damage_last(self, bodies: list[bytes], damage: Damage | None, truth: Truth,
                     role: str) -> list[bytes]:
        """Upstream-shaped bodies with the final body's ``routed_experts`` damaged."""
        if damage is None or not truth.return_experts:
            return bodies  # nothing to damage in a field that was never requested
        doc = msgspec.json.decode(bodies[-1])
        meta = doc[native.META]
        raw = self._view.decode(meta.pop(native.ROUTED_EXPERTS))
        value = self._damaged(raw, damage, truth, role)
        if value is not _ABSENT:
            meta[native.ROUTED_EXPERTS] = value
        return bodies[:-1] + [native.encode(doc)]

    # ------------------------------------------------------------------ views

    # ------------------------------------------------------------ requests (migration)

    def request(self, truth: Truth, **extra: object) -> bytes:
        """``/generate`` as ``io_struct.GenerateReqInput``: ``rid``, ``input_ids``,
        ``sampling_params.max_new_tokens``."""
        doc: dict[str, Any] = {"rid": truth.request_id, migration.INPUT_IDS: truth.prompt_ids, "stream": True,
                               "return_logprob": truth.return_logprob,
                               migration.SAMPLING_PARAMS: {migration.MAX_NEW_TOKENS: truth.output_len}}
        doc.update(extra)
        return native.encode(doc)

    def emitted_in(self, truth: Truth, request: bytes) -> int | None:
        return emitted_in(truth, request, migration.INPUT_IDS, migration.SAMPLING_PARAMS, migration.MAX_NEW_TOKENS)

    def expert_view(self, body: bytes) -> tuple[bytes | None, str | None]:
        """Raises ``ValueError`` for a body that is not JSON or a present but undecodable value."""
        doc = msgspec.json.decode(body)
        meta = doc.get(native.META) if isinstance(doc, dict) else None
        if not isinstance(meta, dict):
            return None, None
        reason = meta.get(native.ROUTED_EXPERTS_UNAVAILABLE)
        if native.ROUTED_EXPERTS not in meta:
            return None, reason
        return as_int32(self._view.decode(meta[native.ROUTED_EXPERTS]), meta), reason

    def canonical(self, body: bytes) -> object:
        try:
            doc = msgspec.json.decode(body)
        except msgspec.DecodeError:
            return body
        meta = doc.get(native.META) if isinstance(doc, dict) else None
        if isinstance(meta, dict):
            # A unary answer's send time is no function of the output: a folded stream cannot have it
            # (fold.py puts its ``not_streamed`` reason there), so the laws compare bodies without either.
            meta.pop(native.RESPONSE_SENT_TS, None)
            if meta.get(SENT_REASON) == OmissionReason.NOT_STREAMED:
                del meta[SENT_REASON]
        if isinstance(meta, dict) and native.ROUTED_EXPERTS in meta:
            try:
                meta[native.ROUTED_EXPERTS] = as_int32(self._view.decode(meta[native.ROUTED_EXPERTS]), meta)
            except CorruptPayload:
                pass  # opaque stays opaque; it then only equals itself
        return doc

    # -------------------------------------------------------------- internals

    @staticmethod
    def _spans(truth: Truth, stream: bool) -> list[tuple[int, int]]:
        return truth.chunk_spans() if stream else [(0, truth.output_len)]

    def _render(self, truth: Truth, spans: list[tuple[int, int]], *, experts: object,
                prompt_logprobs: bool = True, finish: dict | None = None) -> list[bytes]:
        """One body per span. ``prompt_logprobs=False`` renders a P/D decode worker's view."""
        if finish is None:
            finish = final_finish_reason(truth)
        input_logprobs = input_token_logprobs(truth) if truth.return_logprob and prompt_logprobs else None
        bodies = []
        last = len(spans) - 1
        for index, (start, end) in enumerate(spans):
            ids = truth.output_ids[start:end]
            meta: dict[str, Any] = {
                "id": truth.request_id,
                native.FINISH_REASON: finish if index == last else None,
                native.PROMPT_TOKENS: truth.prompt_len,
                native.COMPLETION_TOKENS: end,
                "cached_tokens": 0,
            }
            if truth.return_logprob:
                if input_logprobs is not None:
                    meta[native.INPUT_TOKEN_LOGPROBS] = input_logprobs
                meta[native.OUTPUT_TOKEN_LOGPROBS] = [
                    [None if position == 0 and not prompt_logprobs else truth.output_logprobs[position],
                     truth.output_ids[position], None]
                    for position in range(start, end)
                ]
                meta[native.OUTPUT_TOKEN_LOGPROBS_LENGTH] = end
            if index == last and experts is not _ABSENT:
                meta[native.ROUTED_EXPERTS] = experts
            doc = {native.TEXT: "".join(truth.token_text(t) for t in ids), native.OUTPUT_IDS: ids,
                   native.META: meta}
            bodies.append(native.encode(doc))
        return bodies

    def _damaged(self, raw: bytes, damage: Damage | None, truth: Truth, role: str) -> object:
        if damage is None:
            return self.encode_experts(raw)
        if damage is Damage.DROP:
            return _ABSENT
        if damage is Damage.GARBAGE:
            return GARBAGE_VALUE
        if damage is Damage.TRUNCATE:
            return self.encode_experts(raw[:-3])
        if damage is Damage.WRONG_TYPE:
            return WRONG_TYPE_VALUE
        if damage is Damage.BOMB:
            return self.bomb(truth, role)
        raise ValueError(f"unknown damage {damage!r}")

    def _opaque_values(self, truth: Truth, rng: random.Random) -> list[Callable[[], object]]:
        values: list[Callable[[], object]] = [
            lambda: "not base64 at all: ünïcödé ☃ \u2028 🙂",
            lambda: GARBAGE_VALUE,
            lambda: "",
            lambda: "\"quoted\" \\ back\\slash \n\t\u0001",
            lambda: "QUJD" + "=" * rng.randint(1, 3),
            lambda: rng.randint(-(2**63), 2**63 - 1),
            lambda: rng.uniform(-1e6, 1e6),
            lambda: None,
            lambda: True,
            lambda: {"nested": [1, {"deep": None, "s": "é"}], "n": -0.5},
            lambda: [rng.randrange(256) for _ in range(rng.randint(0, 8))],
            lambda: encode_base64(rng.randbytes(rng.randint(0, 64))),  # Base64 of random bytes
            lambda: self.encode_experts(rng.randbytes(rng.randint(0, 64))),  # valid encoding, no row layout
        ]
        if self.options.max_decompressed_bytes <= 1 << 20:  # only then is a bomb cheap to build
            values.append(lambda: self.bomb(truth, "agg"))
        return values


def as_int32(rows: bytes, meta: dict[str, Any]) -> bytes:
    """Rows in the advertised wire dtype as int32 LE, the form the truth holds (views only)."""
    dtype = meta.get(native.ROUTED_EXPERTS_DTYPE, native.DEFAULT_EXPERT_DTYPE)
    if dtype == native.DEFAULT_EXPERT_DTYPE or dtype not in native.EXPERT_DTYPE_SIZES:
        return rows
    if len(rows) % native.EXPERT_DTYPE_SIZES[dtype]:
        raise CorruptPayload("corrupt", f"{len(rows)} bytes are not whole {dtype} ids")
    return np.frombuffer(rows, dtype=np.dtype(dtype).newbyteorder("<")).astype("<i4").tobytes()


def final_finish_reason(truth: Truth) -> dict[str, Any]:
    if truth.finish == "length":
        return {"type": "length", "length": truth.output_len}
    return {"type": "stop", "matched": truth.output_ids[-1]}


def input_token_logprobs(truth: Truth) -> list[list[Any]]:
    """``[logprob, token_id, text]`` per prompt position; position 0 has no logprob (§2.3)."""
    return [[None if i == 0 else truth.prompt_logprobs[i], token, None]
            for i, token in enumerate(truth.prompt_ids)]


def stale_prompt_rows(truth: Truth) -> bytes:
    """What a P/D decode worker returns for the prompt rows: zeros, or deterministic garbage that
    differs from the truth in every value (left-over KV-slot rows of earlier requests)."""
    size = truth.prompt_len * truth.row_bytes
    if truth.stale == "zeros":
        return bytes(size)
    true = np.frombuffer(truth.expert_rows(0, truth.prompt_len), dtype="<i4").astype(np.int64)
    rng = np.random.default_rng(zlib.crc32(truth.request_id.encode()))
    if truth.num_experts >= 2:
        stale = (true + rng.integers(1, truth.num_experts, size=true.size)) % truth.num_experts
    else:
        stale = true + 1
    return stale.astype("<i4").tobytes()
