"""SGLang bodies shaped the way upstream SGLang emits them, built independently of the simulator.

The simulator (``worker.py``) and the codec were written from the same understanding, so a test
that only uses the simulator cannot catch a shared misreading. This builder follows upstream's code
paths instead, one function per shape, each naming the upstream function it mirrors, and covers the
configurations the simulator's defaults do not: both streaming modes, the three wire dtypes,
``routed_experts_start_len > 0``, empty logprob windows, decode legs that return the generated
suffix only and prefill legs with stale (all-zero) rows.

Codec authors deriving from ``sglang`` (``sglang-zstd`` for one) can render the same shapes with
their own expert encoding by passing ``encode``.
"""

from __future__ import annotations

from typing import Any, Callable, Literal

import msgspec
import numpy as np

from streamproc.decompress import encode_base64
from streamproc.simulation import Truth

from . import native

Streaming = Literal["cumulative", "incremental"]
Coverage = Literal["full", "suffix"]


class Shape(msgspec.Struct, frozen=True, kw_only=True):
    """The server flags and request fields that decide what SGLang's bodies look like."""

    # ServerArgs.incremental_streaming_output (default False: cumulative text/ids/output logprobs).
    streaming: Streaming = "cumulative"
    # SGLANG_ROUTED_EXPERTS_DTYPE; advertised as meta_info.routed_experts_dtype when ``advertise_dtype``.
    dtype: Literal["int32", "uint16", "uint8"] = "int32"
    advertise_dtype: bool = False
    # GenerateReqInput.routed_experts_start_len: rows cover [start, seqlen - 1); 0 <= start <= prompt.
    start_len: int = 0
    echo_start_len: bool = False  # the worker states it in meta_info (some RL frameworks do)
    # GenerateReqInput.logprob_start_len: -1 (default) scores no prompt position.
    logprob_start_len: int = -1
    # Decode's rows: "full" covers [start, seqlen - 1) with stale prompt rows (SGLang's decode), "suffix"
    # only the generated positions (frameworks that set start = prompt on the decode request).
    decode_coverage: Coverage = "full"
    # Prefill's prompt rows as a prefill without a working capture sends them (between the fix that
    # makes prefill collect routed experts and the overlap-scheduling fix): all zeros.
    stale_prefill: bool = False


Encode = Callable[[bytes], object]


def default_encode(raw: bytes) -> object:
    """``tokenizer_manager._handle_batch_output``: Base64 of the capture tensor's raw bytes."""
    return encode_base64(raw)


def rows(truth: Truth, shape: Shape, start: int, end: int) -> bytes:
    """Rows ``[start, end)`` in the wire dtype (``routed_experts_capturer`` keeps ids in that dtype)."""
    ids = np.frombuffer(truth.expert_rows(start, end), dtype="<i4")
    return ids.astype(np.dtype(shape.dtype).newbyteorder("<")).tobytes()


def _input_logprobs(truth: Truth, shape: Shape) -> list[list[Any]]:
    """``add_logprob_to_meta_info``: ``[logprob, token_id, text]`` from ``logprob_start_len``; the first
    entry has no logprob (the scheduler pads it). ``-1`` scores no prompt position: ``[]``."""
    if shape.logprob_start_len < 0 or shape.logprob_start_len >= truth.prompt_len:
        return []
    start = shape.logprob_start_len
    return [[None if i == start else truth.prompt_logprobs[i], truth.prompt_ids[i], None]
            for i in range(start, truth.prompt_len)]


def _finish(truth: Truth) -> dict[str, Any]:
    if truth.finish == "length":
        return {"type": "length", "length": truth.output_len}
    return {"type": "stop", "matched": truth.output_ids[-1]}


def _spans(truth: Truth, stream: bool) -> list[tuple[int, int]]:
    return truth.chunk_spans() if stream else [(0, truth.output_len)]


def _render(truth: Truth, shape: Shape, *, stream: bool, spans: list[tuple[int, int]], input_logprobs: list,
            first_logprob_known: bool, experts: object, finish: dict[str, Any], completion_offset: int = 0,
            prompt_tokens: int | None = None) -> list[bytes]:
    """``tokenizer_manager._handle_batch_output``: one body per scheduler output of a request.

    ``meta_info`` key order is upstream's: id, finish_reason, prompt_tokens, weight_version,
    total_retractions, the logprob lists (``add_logprob_to_meta_info``), completion_tokens,
    cached_tokens, routed_experts, then e2e_latency once finished. In cumulative mode ``text``,
    ``output_ids`` and the output logprob list restate everything from position 0; in incremental
    mode they are the chunk's span (``slice_streaming_output_meta_info`` slices only the output lists).
    """
    cumulative = shape.streaming == "cumulative" or not stream
    bodies = []
    for index, (start, end) in enumerate(spans):
        last = index == len(spans) - 1
        lo = 0 if cumulative else start
        meta: dict[str, Any] = {
            "id": truth.request_id,
            native.FINISH_REASON: finish if last else None,
            native.PROMPT_TOKENS: truth.prompt_len if prompt_tokens is None else prompt_tokens,
            "weight_version": "default",
            "total_retractions": 0,
        }
        if truth.return_logprob:
            meta[native.INPUT_TOKEN_LOGPROBS] = input_logprobs
            meta[native.OUTPUT_TOKEN_LOGPROBS] = [
                [truth.output_logprobs[p] if (p or first_logprob_known) else None, truth.output_ids[p], None]
                for p in range(lo, end)]
            meta[native.OUTPUT_TOKEN_LOGPROBS_LENGTH] = end
        meta[native.COMPLETION_TOKENS] = end + completion_offset
        meta["cached_tokens"] = 0
        if last and experts is not None:
            meta[native.ROUTED_EXPERTS] = experts
            if shape.advertise_dtype:
                meta[native.ROUTED_EXPERTS_DTYPE] = shape.dtype
            if shape.echo_start_len:
                meta[native.ROUTED_EXPERTS_START_LEN] = shape.start_len
        if last:
            meta["e2e_latency"] = round(0.001 * (truth.prompt_len + truth.output_len), 6)
        ids = truth.output_ids[lo:end]
        text = "".join(truth.token_text(t) for t in ids)
        doc = {native.TEXT: text, native.OUTPUT_IDS: ids, native.META: meta}
        bodies.append(native.encode(doc))
    return bodies


def agg(truth: Truth, shape: Shape, *, stream: bool, encode: Encode = default_encode) -> list[bytes]:
    """An aggregated worker: rows ``[start, prompt + output - 1)`` on the finishing body only
    (``routed_experts_capturer`` hands them over when the request finishes)."""
    experts = encode(rows(truth, shape, shape.start_len, truth.rows)) if truth.return_experts else None
    return _render(truth, shape, stream=stream, spans=_spans(truth, stream),
                   input_logprobs=_input_logprobs(truth, shape), first_logprob_known=True, experts=experts,
                   finish=_finish(truth))


def prefill(truth: Truth, shape: Shape, *, encode: Encode = default_encode) -> list[bytes]:
    """A P/D prefill worker (``disaggregation/prefill.py``): one body for the first sampled token, the
    prompt's logprob window and the prompt rows ``[start, prompt)``."""
    experts = None
    if truth.return_experts:
        raw = rows(truth, shape, shape.start_len, truth.prompt_len)
        experts = encode(bytes(len(raw)) if shape.stale_prefill else raw)
    return _render(truth, shape, stream=False, spans=[(0, 1)], input_logprobs=_input_logprobs(truth, shape),
                   first_logprob_known=True, experts=experts, finish={"type": "length", "length": 1})


def decode(truth: Truth, shape: Shape, *, stream: bool, encode: Encode = default_encode) -> list[bytes]:
    """A P/D decode worker (``disaggregation/decode.py``): ``input_token_logprobs`` is always ``[]`` (the
    decode server does not send input logprobs), the first output token's logprob is ``null``, and
    the prompt rows it returns were never computed by it (zeros) unless it covers the suffix only."""
    experts = None
    if truth.return_experts:
        generated = rows(truth, shape, truth.prompt_len, truth.rows)
        if shape.decode_coverage == "full":
            generated = bytes(len(rows(truth, shape, shape.start_len, truth.prompt_len))) + generated
        experts = encode(generated)
    return _render(truth, shape, stream=stream, spans=_spans(truth, stream), input_logprobs=[],
                   first_logprob_known=False, experts=experts, finish=_finish(truth))


def request(truth: Truth, shape: Shape, *, stream: bool) -> bytes:
    """The ``/generate`` request (``io_struct.GenerateReqInput``) these bodies answer."""
    doc: dict[str, Any] = {
        "input_ids": truth.prompt_ids,
        "sampling_params": {"max_new_tokens": truth.output_len},
        "stream": stream,
        "return_logprob": truth.return_logprob,
        "logprob_start_len": shape.logprob_start_len,
        "return_routed_experts": truth.return_experts,
        "routed_experts_start_len": shape.start_len,
    }
    return native.encode(doc)
