"""SGLang bodies shaped the way upstream SGLang emits them, built independently of the simulator.

The simulator (``worker.py``) and the codec were written from the same understanding, so a test
that only uses the simulator cannot catch a shared misreading. This builder follows upstream's code
paths instead, one function per shape, each naming the upstream function it mirrors, and covers the
configurations the simulator's defaults do not: both streaming modes, the three wire dtypes,
``routed_experts_start_len > 0``, empty logprob windows, decode legs that return the generated
suffix only and prefill legs with stale (all-zero) rows. ``Shape(version="0.5.23")`` renders SGLang
0.5.23's bodies (``num_retractions``, ``reasoning_tokens``, ``weight_versions``, a real first-token
logprob on decode) and the request options only modelled for it: ``token_ids_logprob`` (decode's
reserved ``null`` row), top logprobs nested or flat (``return_flat_raw_top_logprobs[_b64]``) and
``return_hidden_states``.

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
    # "0.5": the bodies above (``total_retractions``; decode's first output logprob ``null``). "0.5.23":
    # ``TokenizerManager._handle_batch_output`` of SGLang 0.5.23 (see ``_render``).
    version: Literal["0.5", "0.5.23"] = "0.5"
    # 0.5.23 only. GenerateReqInput.top_logprobs_num = 2 (``"none"``: 0), the prompt's rows nested
    # (``input_top_logprobs``) or flat (``return_flat_raw_top_logprobs``, ``_b64``: Base64 arrays).
    top_logprobs: Literal["none", "nested", "flat", "flat_b64"] = "none"
    token_ids_logprob: bool = False  # 0.5.23 only. GenerateReqInput.token_ids_logprob = TOKEN_IDS
    hidden_states: bool = False  # 0.5.23 only. GenerateReqInput.return_hidden_states = True
    # The worker's prefix-cache hits for the prompt (``req.cached_tokens``, counted once at prefill by
    # ``ScheduleBatch.prepare_for_extend``), on every body; 0.5.23 adds ``cached_tokens_details``
    # (``OutputStreamer.get_cached_tokens_details``: ``{"device": n, "host": 0}`` without HiCache
    # storage, ``None`` without a hit).
    cached_tokens: int = 0
    # 0.5.23 only. ``ServerArgs.speculative_num_draft_tokens`` of a speculative-decoding server (0: none):
    # its finished bodies (aggregated and P/D decode) carry the request's ``spec_*`` counters
    # (``TokenizerManager._calculate_spec_decoding_metrics``, see ``_spec_metrics``).
    spec_draft_tokens: int = 0
    # 0.5.23 only. ``ServerArgs.enable_metrics`` (``--enable-metrics``): the scheduler's time stats on
    # every body and the tokenizer's request timings on the finished one (see ``_scheduler_timings``,
    # ``_request_timings``). ``e2e_latency`` and the first body's ``response_sent_to_client_ts`` come
    # without it.
    metrics: bool = False

    def __post_init__(self) -> None:
        if self.version != V0523 and (self.top_logprobs != "none" or self.token_ids_logprob or self.hidden_states
                                      or self.spec_draft_tokens or self.metrics):
            raise ValueError("top_logprobs, token_ids_logprob, hidden_states, spec_draft_tokens and metrics are "
                             "modelled for version 0.5.23 only")


V0523 = "0.5.23"
TOP_K = 2  # top_logprobs_num
TOKEN_IDS = (9, 42)  # token_ids_logprob
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


def _window(truth: Truth, shape: Shape) -> range:
    """The prompt positions ``logprob_start_len`` scores (none for ``-1``)."""
    if shape.logprob_start_len < 0 or shape.logprob_start_len >= truth.prompt_len:
        return range(0)
    return range(shape.logprob_start_len, truth.prompt_len)


def _top_row(logprob: float, token_id: int) -> list[list[Any]]:
    """One position's top-``TOP_K`` candidates, ``detokenize_top_logprobs_tokens(decode_to_text=False)``:
    ``[logprob, token_id, None]`` each, the scored token first."""
    return [[logprob, token_id, None], [logprob - 1.0, token_id + 1, None]]


def _ids_row(logprob: float) -> list[list[Any]]:
    """One position's ``token_ids_logprob`` scores, ``[logprob, token_id, None]`` per id in ``TOKEN_IDS``."""
    return [[logprob - 2.0 - k, token_id, None] for k, token_id in enumerate(TOKEN_IDS)]


def _input_rows(truth: Truth, shape: Shape, row: Callable[[float, int], Any]) -> list[Any]:
    """Per scored prompt position; the window's first position has no value (``None``)."""
    window = _window(truth, shape)
    return [None if i == window.start else row(truth.prompt_logprobs[i], truth.prompt_ids[i]) for i in window]


def _input_top_flat(truth: Truth, shape: Shape, *, scored: bool) -> dict[str, Any]:
    """``return_flat_raw_top_logprobs``. Aggregated and prefill legs: the scheduler flattens the rows
    (``LogprobResultProcessor._flatten_input_top_logprobs`` -> ``build_flat_top_logprobs_arrays``: float32
    values, int32 ids, leading null rows counted in ``null_prefix``), encoded by
    ``_build_flat_top_logprobs_fields_from_arrays`` (``.tolist()`` of the float32 array, or Base64 of its
    bytes). A P/D decode leg never receives input logprobs (``OutputStreamer``: "Decode server does not
    send input logprobs"), so ``_build_flat_top_logprobs_fields`` describes zero rows, ``k = TOP_K``."""
    rows = [r for r in _input_rows(truth, shape, _top_row) if r is not None] if scored else []
    null_prefix = 1 if scored and _window(truth, shape) else 0
    val = np.asarray([[c[0] for c in r] for r in rows], dtype="<f4").reshape(len(rows), TOP_K)
    idx = np.asarray([[c[1] for c in r] for r in rows], dtype="<i4").reshape(len(rows), TOP_K)
    fields: dict[str, Any] = {}
    if shape.top_logprobs == "flat_b64":
        fields["input_top_logprobs_val_flat_b64"] = encode_base64(val.tobytes())
        fields["input_top_logprobs_idx_flat_b64"] = encode_base64(idx.tobytes())
        fields["input_top_logprobs_val_flat_b64_dtype"] = "float32"
        fields["input_top_logprobs_idx_flat_b64_dtype"] = "int32"
    else:
        fields["input_top_logprobs_val_flat"] = val.reshape(-1).tolist()
        fields["input_top_logprobs_idx_flat"] = idx.reshape(-1).tolist()
    fields["input_top_logprobs_shape"] = [len(rows), TOP_K]
    fields["input_top_logprobs_null_prefix"] = null_prefix
    return fields


def _hidden(p: int) -> list[float]:
    """The (2-wide) hidden vector of token position ``p``."""
    return [p + 0.5, -p - 0.25]


def _spec_metrics(completion: int, draft_tokens: int) -> dict[str, Any]:
    """0.5.23 ``TokenizerManager._calculate_spec_decoding_metrics`` on a finished body, from the request's
    own counters: ``batch_result_processor`` adds one ``req.spec_verify_ct`` and the step's correct drafts
    (``req.spec_num_correct_drafts``, ``update_spec_correct_drafts_histogram``) per verify step of this
    ``Req``. The first token comes from prefill; here every verify step accepts all ``draft_tokens - 1``
    drafts plus the bonus token but the last, which accepts what is left. Nothing without a verify step
    (``spec_verify_ct[i] > 0``)."""
    full, rest = divmod(completion - 1, draft_tokens)
    verify = full + (1 if rest else 0)
    if verify <= 0:
        return {}
    correct = full * (draft_tokens - 1) + (rest - 1 if rest else 0)
    proposed = verify * (draft_tokens - 1)  # spec_verify_ct * (speculative_num_draft_tokens - 1)
    histogram = [0] * draft_tokens
    histogram[draft_tokens - 1] += full
    if rest:
        histogram[rest - 1] += 1
    while histogram and not histogram[-1]:  # grown only as far as a step needed
        histogram.pop()
    return {"spec_accept_rate": correct / proposed, "spec_accept_length": completion / verify,
            "spec_num_correct_drafts": correct, "spec_num_proposed_drafts": proposed, "spec_verify_ct": verify,
            "spec_correct_drafts_histogram": histogram}


# The rendered worker's clock (``convert_time_to_realtime``: perf_counter + a per-process offset), at the
# request's receipt; every timing below is a deterministic function of the truth after it.
RECEIVED_TS = 1_765_000_000.0
STEP = 0.001  # seconds a forward pass takes, prefill or decode step alike


def _scheduler_timings(truth: Truth, leg: str) -> dict[str, Any]:
    """0.5.23 ``SchedulerReqTimeStats.convert_to_output_meta_info`` (``--enable-metrics``; on every body,
    ``_handle_batch_output`` updates ``meta_info`` with it right after ``num_retractions``):
    ``storage_prefetch_wait`` / ``storage_staging_wait`` (``0.0`` from ``set_wait_queue_entry_time``,
    not on a P/D decode), ``forward_entry_time``, ``prefill_finished_time`` (a P/D decode never sets it:
    its prebuilt batch sets ``decode_prebuilt_finish_time``), ``queue_time`` (``queue_duration_s``)."""
    timings: dict[str, Any] = {}
    if leg != "decode":
        timings.update(storage_prefetch_wait=0.0, storage_staging_wait=0.0)
    # A decode enters its first forward once prefill and the KV transfer are done.
    timings["forward_entry_time"] = RECEIVED_TS + 2 * STEP + (STEP * truth.prompt_len if leg == "decode" else 0.0)
    if leg != "decode":
        timings["prefill_finished_time"] = RECEIVED_TS + 2 * STEP + STEP * truth.prompt_len
    timings["queue_time"] = STEP
    return timings


def _request_timings(truth: Truth, completion: int, *, sent: bool) -> dict[str, Any]:
    """0.5.23 ``APIServerReqTimeStats.convert_to_output_meta_info`` (``--enable-metrics``, finished body,
    after ``e2e_latency`` and the ``spec_*`` counters): ``request_received_ts``, ``first_token_latency``,
    ``api_server_dispatch_finish_ts``, ``response_sent_to_client_ts`` (only once a body was sent:
    ``generate_request`` sets it on the first), ``request_finished_ts``, ``decode_throughput``
    (``1 / get_time_per_output_token``, more than one token)."""
    first_token = STEP * (2 + truth.prompt_len)
    timings: dict[str, Any] = {"request_received_ts": RECEIVED_TS, "first_token_latency": first_token,
                               "api_server_dispatch_finish_ts": RECEIVED_TS + STEP / 2}
    if sent:
        timings[native.RESPONSE_SENT_TS] = RECEIVED_TS + first_token
    timings["request_finished_ts"] = RECEIVED_TS + _e2e_latency(truth)
    if completion > 1:
        timings["decode_throughput"] = (completion - 1) / (_e2e_latency(truth) - first_token)
    return timings


def _e2e_latency(truth: Truth) -> float:
    return round(STEP * (truth.prompt_len + truth.output_len), 6)


def _render(truth: Truth, shape: Shape, *, stream: bool, spans: list[tuple[int, int]], input_logprobs: list,
            first_logprob_known: bool, experts: object, finish: dict[str, Any], completion_offset: int = 0,
            prompt_tokens: int | None = None, leg: Literal["agg", "prefill", "decode"] = "agg") -> list[bytes]:
    """``tokenizer_manager._handle_batch_output``: one body per scheduler output of a request.

    ``meta_info`` key order is upstream's: id, finish_reason, prompt_tokens, weight_version,
    total_retractions, the logprob lists (``add_logprob_to_meta_info``), completion_tokens,
    cached_tokens, routed_experts, then e2e_latency once finished. In cumulative mode ``text``,
    ``output_ids`` and the output logprob list restate everything from position 0; in incremental
    mode they are the chunk's span (``slice_streaming_output_meta_info`` slices only the output lists).

    0.5.23 (``Shape.version``): ``num_retractions`` (renamed), the logprob lists of
    ``add_logprob_to_meta_info`` (token logprobs; top logprobs, the prompt's nested or flat; token-ids
    logprobs), ``reasoning_tokens``, completion_tokens, cached_tokens, ``weight_versions``
    (``add_weight_versions_to_meta_info``, finished bodies), ``cached_tokens_details`` (``None``: no
    cache hit), ``hidden_states``, routed_experts, e2e_latency. ``_INCREMENTAL_STREAMING_META_INFO_KEYS``
    slices output_token_logprobs, output_top_logprobs and output_token_ids_logprobs.
    """
    cumulative = shape.streaming == "cumulative" or not stream
    new = shape.version == V0523
    scored = leg != "decode"  # only prefill (and the aggregated engine) sends input logprobs
    bodies = []
    for index, (start, end) in enumerate(spans):
        last = index == len(spans) - 1
        lo = 0 if cumulative else start
        meta: dict[str, Any] = {
            "id": truth.request_id,
            native.FINISH_REASON: finish if last else None,
            native.PROMPT_TOKENS: truth.prompt_len if prompt_tokens is None else prompt_tokens,
            "weight_version": "default",
            # 0.5.23: recv_obj.retraction_counts[i] under its new name
            "num_retractions" if new else "total_retractions": 0,
        }
        if shape.metrics:
            meta.update(_scheduler_timings(truth, leg))
        if truth.return_logprob:
            meta[native.INPUT_TOKEN_LOGPROBS] = input_logprobs
            meta[native.OUTPUT_TOKEN_LOGPROBS] = [
                [truth.output_logprobs[p] if (p or first_logprob_known) else None, truth.output_ids[p], None]
                for p in range(lo, end)]
            meta[native.OUTPUT_TOKEN_LOGPROBS_LENGTH] = end
            if shape.top_logprobs == "nested":
                meta["input_top_logprobs"] = _input_rows(truth, shape, _top_row) if scored else []
            elif shape.top_logprobs != "none":
                meta.update(_input_top_flat(truth, shape, scored=scored))
            if shape.top_logprobs != "none":
                # 0.5.23 DecodeTransferQueue._commit_transfer_to_req appends the first token's top
                # logprobs from the metadata buffer: position 0 is real on decode too.
                meta[native.OUTPUT_TOP_LOGPROBS] = [_top_row(truth.output_logprobs[p], truth.output_ids[p])
                                                    for p in range(lo, end)]
            if shape.token_ids_logprob:
                meta["input_token_ids_logprobs"] = (
                    _input_rows(truth, shape, lambda lp, _t: _ids_row(lp)) if scored else [])
                # _commit_transfer_to_req: "Prefill omits these scores; reserve a row for the streaming
                # offset" (an empty row, which detokenize_top_logprobs_tokens renders as None).
                meta[native.OUTPUT_TOKEN_IDS_LOGPROBS] = [
                    None if p == 0 and leg == "decode" else _ids_row(truth.output_logprobs[p])
                    for p in range(lo, end)]
        completion = end + completion_offset
        if new:
            meta["reasoning_tokens"] = 0
        meta[native.COMPLETION_TOKENS] = completion
        meta["cached_tokens"] = shape.cached_tokens
        if new:
            if last:  # OutputStreamer.accept computes weight-version spans for a finished request only
                meta["weight_versions"] = [dict(version="default", start=0, end=completion)]  # a WeightVersionSpan
            meta["cached_tokens_details"] = ({"device": shape.cached_tokens, "host": 0}
                                             if shape.cached_tokens else None)
            if shape.hidden_states:
                # Aggregated: _append_prefill_hidden_states appends the prompt's block, then one vector
                # per decode step (OutputStreamer.accept sends req.hidden_states, unsliced). P/D prefill
                # never appends the block (``[]``) and decode's list holds its own steps only.
                steps = [_hidden(p) for p in range(truth.prompt_len, truth.prompt_len + end - 1)]
                if leg == "agg":
                    meta["hidden_states"] = [[_hidden(p) for p in range(truth.prompt_len)], *steps]
                else:
                    meta["hidden_states"] = steps if leg == "decode" else []
        if last and experts is not None:
            meta[native.ROUTED_EXPERTS] = experts
            if shape.advertise_dtype:
                meta[native.ROUTED_EXPERTS_DTYPE] = shape.dtype
            if shape.echo_start_len:
                meta[native.ROUTED_EXPERTS_START_LEN] = shape.start_len
        if last:
            meta["e2e_latency"] = _e2e_latency(truth)
            if shape.spec_draft_tokens and leg != "prefill":  # prefill runs no verify step
                meta.update(_spec_metrics(completion, shape.spec_draft_tokens))
            if shape.metrics:
                meta.update(_request_timings(truth, completion, sent=index > 0))
        if new and index == 0:
            # 0.5.23 ``_stream_one_response``: the first body sent (streamed, or the finished one) gets
            # ``response_sent_to_client_ts`` last, without --enable-metrics too: sent at the first token, or,
            # when it is the finished body (a unary answer, a one-chunk stream), once the request finished.
            meta[native.RESPONSE_SENT_TS] = RECEIVED_TS + (_e2e_latency(truth) if last
                                                           else STEP * (2 + truth.prompt_len))
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
    # 0.5.23 process_disagg_prefill_inflight_queue, on KVPoll.Success: FINISH_LENGTH(length=0).
    length = 0 if shape.version == V0523 else 1
    return _render(truth, shape, stream=False, spans=[(0, 1)], input_logprobs=_input_logprobs(truth, shape),
                   first_logprob_known=True, experts=experts, finish={"type": "length", "length": length},
                   leg="prefill")


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
    # 0.5.23 DecodeTransferQueue._commit_transfer_to_req appends the first token's logprob read from
    # the metadata buffer (output_token_logprobs_val[0].item()): no longer null.
    return _render(truth, shape, stream=stream, spans=_spans(truth, stream), input_logprobs=[],
                   first_logprob_known=shape.version == V0523, experts=experts, finish=_finish(truth),
                   leg="decode")


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
    if shape.top_logprobs != "none":
        doc["top_logprobs_num"] = TOP_K
        if shape.top_logprobs != "nested":
            doc["return_flat_raw_top_logprobs"] = True
            doc["return_flat_raw_top_logprobs_b64"] = shape.top_logprobs == "flat_b64"
    if shape.token_ids_logprob:
        doc["token_ids_logprob"] = list(TOKEN_IDS)
    if shape.hidden_states:
        doc["return_hidden_states"] = True
    return native.encode(doc)
