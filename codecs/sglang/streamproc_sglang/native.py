"""SGLang's native ``/generate`` body: field names, tolerant parsing and stream folding.

Bodies are ``{"text", "output_ids", "meta_info"}``. SGLang streams in one of two modes
(``tokenizer_manager._handle_batch_output``, server flag ``--incremental-streaming-output``):

- cumulative (the default): every chunk restates ``text``, ``output_ids`` and the ``output_*logprobs``
  lists from output position 0;
- incremental: ``text``/``output_ids`` and the ``output_*logprobs`` lists are per-chunk deltas.

Every other ``meta_info`` key is cumulative or terminal in both modes. Which mode a chunk is in is
read from the chunk itself (:func:`restates`), so no setting has to match the workers.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import msgspec

TEXT = "text"
OUTPUT_IDS = "output_ids"
META = "meta_info"
ERROR = "error"

FINISH_REASON = "finish_reason"
PROMPT_TOKENS = "prompt_tokens"
COMPLETION_TOKENS = "completion_tokens"
ROUTED_EXPERTS = "routed_experts"
# SGLANG_ROUTED_EXPERTS_DTYPE on the worker, advertised per body (int32 when absent).
ROUTED_EXPERTS_DTYPE = "routed_experts_dtype"
# GenerateReqInput.routed_experts_start_len: rows cover [start, seqlen - 1). Read from meta_info when
# a worker echoes it; otherwise the join infers it from the byte counts.
ROUTED_EXPERTS_START_LEN = "routed_experts_start_len"
CUMULATIVE = "cumulative"
INCREMENTAL = "incremental"
EXPERT_DTYPE_SIZES = {"int32": 4, "uint16": 2, "uint8": 1}
DEFAULT_EXPERT_DTYPE = "int32"

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


def restates(doc: dict[str, Any], seen: Sequence[Any]) -> bool:
    """Whether ``doc`` is a cumulative-mode chunk that restates the ``seen`` output ids.

    Decided from counts, not guessed: a chunk's ``completion_tokens`` is cumulative in both modes, so
    after any earlier token an incremental chunk has fewer ids than that count and a cumulative
    chunk exactly as many, starting with what was already seen. Before the first token both modes
    send the same thing, so False is then also the right answer.
    """
    if not seen:
        return False
    ids = doc.get(OUTPUT_IDS)
    meta = meta_of(doc)
    count = meta.get(COMPLETION_TOKENS) if meta is not None else None
    if type(count) is not int and meta is not None:
        count = meta.get(OUTPUT_TOKEN_LOGPROBS_LENGTH)
    if not (isinstance(ids, list) and type(count) is int and len(ids) == count >= len(seen)):
        return False
    return ids[:len(seen)] == (seen if isinstance(seen, list) else list(seen))


def fold(docs: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Merge stream chunks (either mode, see :func:`restates`) into the equivalent unary body.

    Incremental chunks: ``text`` and ``output_ids`` concatenate, ``meta_info`` merges with
    ``dict.update`` semantics except the per-chunk ``output_*logprobs`` slices, which concatenate.
    A cumulative chunk replaces all of those. Inputs are not mutated.
    """
    out: dict[str, Any] = {}
    text: list[str] = []
    ids: list[Any] = []
    meta: dict[str, Any] = {}
    deltas: dict[str, list[Any]] = {}
    for doc in docs:
        if restates(doc, ids):
            text.clear()
            ids.clear()
            deltas.clear()
            _reset_deltas(meta)
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


def _reset_deltas(meta: dict[str, Any]) -> None:
    """A cumulative chunk restates the output logprob lists: forget the accumulated copies (the key
    stays, so the folded body keeps the position where the lists first appeared)."""
    for key in OUTPUT_DELTA_FIELDS:
        if isinstance(meta.get(key), list):
            meta[key] = []


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
