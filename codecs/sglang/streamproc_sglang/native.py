"""SGLang's native ``/generate`` body: field names, tolerant parsing and stream folding.

Bodies are ``{"text", "output_ids", "meta_info"}`` (reference notes §2). Streaming chunks are
incremental: ``text``/``output_ids`` and the ``output_*logprobs`` lists are per-chunk deltas, every
other ``meta_info`` key is cumulative or terminal, so later chunks simply overwrite earlier ones.
"""

from __future__ import annotations

from typing import Any, Iterable

import msgspec

TEXT = "text"
OUTPUT_IDS = "output_ids"
META = "meta_info"
ERROR = "error"

FINISH_REASON = "finish_reason"
PROMPT_TOKENS = "prompt_tokens"
COMPLETION_TOKENS = "completion_tokens"
ROUTED_EXPERTS = "routed_experts"

INPUT_TOKEN_LOGPROBS = "input_token_logprobs"
OUTPUT_TOKEN_LOGPROBS = "output_token_logprobs"
OUTPUT_TOP_LOGPROBS = "output_top_logprobs"
OUTPUT_TOKEN_LOGPROBS_LENGTH = "output_token_logprobs_length"
# Prompt-side logprob fields only a prefill worker computes; copied together.
INPUT_LOGPROB_FIELDS = (INPUT_TOKEN_LOGPROBS, "input_top_logprobs", "input_token_ids_logprobs")
# Fields SGLang slices to each chunk's span in incremental streaming; folding concatenates them.
OUTPUT_DELTA_FIELDS = frozenset({OUTPUT_TOKEN_LOGPROBS, OUTPUT_TOP_LOGPROBS, "output_token_ids_logprobs"})

# Omission markers (Dynamo's ``input_logprobs_unavailable_reason`` convention, §2.3).
INPUT_LOGPROBS_UNAVAILABLE = "input_logprobs_unavailable_reason"
ROUTED_EXPERTS_UNAVAILABLE = "routed_experts_unavailable_reason"

# finish_reason types that mean the leg did not complete (sidecar ``terminal_failure``).
FAILED_FINISH_TYPES = frozenset({"abort", "error"})

_decode = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


def parse(body: bytes) -> dict[str, Any] | None:
    """The body as a dict, or None when it is not a JSON object (such bodies are never rewritten)."""
    try:
        doc = _decode.decode(body)
    except msgspec.DecodeError:
        return None
    return doc if isinstance(doc, dict) else None


def meta_of(doc: dict[str, Any]) -> dict[str, Any] | None:
    meta = doc.get(META)
    return meta if isinstance(meta, dict) else None


def encode(doc: object) -> bytes:
    """Compact JSON; dicts keep insertion order, so an edited body keeps its key order."""
    return _encoder.encode(doc)


def failed(doc: dict[str, Any]) -> bool:
    """Whether a (folded) leg ended in an error or abort rather than a normal finish."""
    if ERROR in doc:
        return True
    meta = meta_of(doc)
    finish = meta.get(FINISH_REASON) if meta is not None else None
    kind = finish.get("type") if isinstance(finish, dict) else None
    return isinstance(kind, str) and (kind in FAILED_FINISH_TYPES or kind.startswith("abort"))


def fold(docs: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Merge incremental chunks into the equivalent unary body.

    ``text`` and ``output_ids`` concatenate, ``meta_info`` merges with ``dict.update`` semantics
    except the per-chunk ``output_*logprobs`` slices, which concatenate. Inputs are not mutated.
    """
    out: dict[str, Any] = {}
    text: list[str] = []
    ids: list[Any] = []
    meta: dict[str, Any] = {}
    deltas: dict[str, list[Any]] = {}
    for doc in docs:
        for key, value in doc.items():
            if key == TEXT and isinstance(value, str):
                out.setdefault(key, None)
                text.append(value)
            elif key == OUTPUT_IDS and isinstance(value, list):
                out.setdefault(key, None)
                ids.extend(value)
            elif key == META and isinstance(value, dict):
                out.setdefault(key, None)
                _merge_meta(meta, deltas, value)
            else:
                out[key] = value
    if TEXT in out and out[TEXT] is None:
        out[TEXT] = "".join(text)
    if OUTPUT_IDS in out and out[OUTPUT_IDS] is None:
        out[OUTPUT_IDS] = ids
    if META in out and out[META] is None:
        out[META] = meta
    return out


def _merge_meta(meta: dict[str, Any], deltas: dict[str, list[Any]], chunk: dict[str, Any]) -> None:
    for key, value in chunk.items():
        if key in OUTPUT_DELTA_FIELDS and isinstance(value, list):
            acc = deltas.get(key)
            if acc is None or meta.get(key) is not acc:
                acc = deltas[key] = list(meta[key]) if isinstance(meta.get(key), list) else []
                meta[key] = acc
            acc.extend(value)
        else:
            meta[key] = value
