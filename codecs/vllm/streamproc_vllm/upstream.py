"""vLLM ``/inference/v1/generate`` bodies shaped as upstream vLLM emits them, independent of the simulator.

One function per shape, each naming the upstream code it mirrors (``vllm/entrypoints/serve/disagg/``
``protocol.py`` and ``serving.py``; with ``Shape(version="0.34.0")`` vLLM 0.34.0's
``vllm/entrypoints/scale_out/token_in_token_out/`` ``protocol.py`` and ``serving.py``, tokens mode). Unlike the simulator's defaults it renders what the codec must
not assume: ``prompt_logprobs`` requested or not independently of ``logprobs``, stream chunks
without ``model`` or ``prompt_logprobs``, a usage-only final chunk with ``choices: []``, and P/D
decode legs whose rows cover the full sequence (stale prompt rows) or the generated suffix only.
"""

from __future__ import annotations

import base64
import uuid
from typing import Any, Literal

import msgspec
import numpy as np

from streamproc.simulation import Truth

from .native import PROMPT_LOGPROBS, ROUTED_EXPERTS, dump, token_label
from .sequence import npy_bytes

MODEL = "upstream-model"


class Shape(msgspec.Struct, frozen=True, kw_only=True):
    """The request fields that decide what vLLM's bodies look like."""

    prompt_logprobs: bool = False  # SamplingParams.prompt_logprobs (independent of ``logprobs``)
    include_usage: bool = True  # stream_options.include_usage: a final usage-only chunk
    decode_coverage: Literal["full", "suffix"] = "full"
    stale_prefill: bool = False  # prefill's prompt rows all zero (no working capture)
    # "serve-disagg": the ``serve/disagg`` bodies (labelled logprob entries, no ``output_mode``).
    # "0.34.0": ``scale_out/token_in_token_out`` ``GenerateTokensResponse`` (``output_mode="tokens"``):
    # logprob entries ``{token_id, logprob, rank, top_logprobs}`` on every leg, ``stop_reason``,
    # ``sampling_mask``, ``weight_versions``, ``created``, ``ec_transfer_params``...; the decode leg
    # scores the prompt itself when prompt logprobs are requested, and its "full" rows are real.
    version: Literal["serve-disagg", "0.34.0"] = "serve-disagg"
    # 0.34.0 only. ``GenerateRequest.return_token_ids``: the prompt's ids on the first stream chunk
    # (``serve_tokens_stream_generator``: ``chunk.prompt_token_ids = prompt_token_ids`` once, then
    # ``None``, excluded) and on the unary body (``prompt_token_ids=final_res.prompt_token_ids``).
    return_token_ids: bool = False
    # 0.34.0 only. The label the engine reports for the weights (``OutputProcessor`` ->
    # ``RequestState.track_weight_version``): the finishing choice then carries
    # ``weight_versions=[{"version", "start": 0, "end": output tokens}]`` (``_weight_version_spans``,
    # ``if finished else None``); one version for the whole request here.
    weight_version: str | None = None
    # 0.34.0 only. ``num_speculative_tokens`` of a server run with ``per_request_spec_decode_metrics=
    # "summary"`` (0: no speculative decoding): finished outputs carry the request's counters as the
    # response's ``metrics.speculative_decoding`` (``build_spec_decoding_metrics``, see ``_metrics_034``).
    num_spec_tokens: int = 0
    # serve-disagg only: whose ``serve_tokens_full_generator`` renders the unary body. "vllm-project" (also
    # furionw/vllm): ``GenerateResponse`` declares ``request_id, choices, prompt_logprobs,
    # kv_transfer_params`` and the call passes ``id=request_id`` (dropped): a fresh ``random_uuid()``.
    # "moreh-dev" (moreh-dev/vllm): ``usage`` is declared too and the call passes ``request_id=request_id``:
    # the chunks' id.
    older_unary: Literal["vllm-project", "moreh-dev"] = "vllm-project"


V034 = "0.34.0"
CREATED = 1_700_000_000  # ``int(time.time())`` on each leg; one clock here (the join keeps decode's)


def expert_dtype(truth: Truth) -> np.dtype:
    """``GenerateResponseChoice.routed_experts``: uint8 when ids fit a byte, else uint16."""
    return np.dtype(np.uint8 if truth.num_experts <= 256 else np.uint16)


def _rows(truth: Truth, start: int, end: int) -> np.ndarray:
    ids = np.frombuffer(truth.expert_rows(start, end), dtype="<i4")
    return ids.reshape(end - start, truth.num_layers, truth.top_k).astype(expert_dtype(truth))


def encode_rows(rows: np.ndarray) -> str:
    """Base64 of ``np.save`` bytes, shape ``(num_tokens - 1, num_layers, num_experts_per_tok)``."""
    return base64.b64encode(npy_bytes(rows)).decode("ascii")


def _logprobs(truth: Truth, start: int, end: int, *, labels: bool) -> dict[str, Any] | None:
    """``ServingTokens._create_tokens_logprobs``: one entry per sampled token, labelled
    ``token_id:<id>`` (a P/D decode worker leaves the label out)."""
    if not truth.return_logprob:
        return None
    content = []
    for token_id, logprob in zip(truth.output_ids[start:end], truth.output_logprobs[start:end]):
        entry: dict[str, Any] = {"token": token_label(token_id)} if labels else {}
        entry.update(logprob=logprob, bytes=None, top_logprobs=[])
        content.append(entry)
    return {"content": content}


def _prompt_logprobs(truth: Truth) -> list:
    """``clamp_prompt_logprobs(final_res.prompt_logprobs)``: aligned to the prompt, position 0 ``None``."""
    return [None, *({str(t): {"logprob": lp, "rank": 1, "decoded_token": token_label(t)}}
                    for t, lp in zip(truth.prompt_ids[1:], truth.prompt_logprobs[1:]))]


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def fresh_request_id(truth: Truth) -> str:
    """``GenerateResponse.request_id``'s ``default_factory=lambda: f"{random_uuid()}"`` (``random_uuid``:
    ``str(uuid.uuid4().hex)``), never the chunks' ``truth.request_id``. One uuid per request here (upstream: a
    new one per response), so the legs' and the aggregated run's bodies still compare equal."""
    return uuid.uuid5(uuid.NAMESPACE_OID, f"vllm-unary/{truth.request_id}").hex


def unary(truth: Truth, shape: Shape, *, rows: np.ndarray | None, output: tuple[int, int] | None = None,
          prompt_logprobs: bool | None = None, labels: bool = True, finish: str | None = None) -> bytes:
    """``ServingTokens.serve_tokens_full_generator`` -> ``GenerateResponse`` (vllm-project/vllm @ fef8b03f,
    furionw/vllm @ 9cdf7782 ``serve/disagg/serving.py``)::

        response = GenerateResponse(id=request_id, created=created_time, model=model_name, choices=choices,
            usage=usage, prompt_logprobs=clamp_prompt_logprobs(final_res.prompt_logprobs),
            kv_transfer_params=final_res.kv_transfer_params)

    ``GenerateResponse(BaseModel)`` declares ``request_id`` (default factory), ``choices``,
    ``prompt_logprobs``, ``kv_transfer_params`` and pydantic ignores the rest: a fresh ``request_id``, no ``model``, no ``usage``;
    ``prompt_logprobs`` and ``kv_transfer_params`` always keys (``null`` unless requested / returned).
    ``Shape(older_unary="moreh-dev")``: ``usage`` after ``choices`` and the chunks' id (``request_id=``)."""
    start, end = output or (0, truth.output_len)
    want_prompt = shape.prompt_logprobs if prompt_logprobs is None else prompt_logprobs
    choice: dict[str, Any] = {
        "index": 0,
        "logprobs": _logprobs(truth, start, end, labels=labels),
        "finish_reason": finish or truth.finish,
        "token_ids": truth.output_ids[start:end],
        ROUTED_EXPERTS: encode_rows(rows) if rows is not None else None,
    }
    moreh = shape.older_unary == "moreh-dev"
    body: dict[str, Any] = {"request_id": truth.request_id if moreh else fresh_request_id(truth),
                            "choices": [choice]}
    if moreh:
        body["usage"] = _usage(truth.prompt_len, end - start)
    body[PROMPT_LOGPROBS] = _prompt_logprobs(truth) if want_prompt else None
    body["kv_transfer_params"] = None
    return dump(body)


def stream(truth: Truth, shape: Shape, *, rows: np.ndarray | None, labels: bool = True) -> list[bytes]:
    """The streaming generator -> ``GenerateStreamResponse`` chunks: ``{request_id, choices, usage}``
    with no ``model`` and no ``prompt_logprobs``; ``routed_experts`` on the finishing choice; with
    ``include_usage`` a last chunk that has ``choices: []`` and the usage."""
    spans = truth.chunk_spans()
    bodies = []
    for index, (start, end) in enumerate(spans):
        last = index == len(spans) - 1
        choice = {
            "index": 0,
            "logprobs": _logprobs(truth, start, end, labels=labels),
            "finish_reason": truth.finish if last else None,
            "token_ids": truth.output_ids[start:end],
            ROUTED_EXPERTS: encode_rows(rows) if last and rows is not None else None,
        }
        bodies.append(dump({"request_id": truth.request_id, "choices": [choice], "usage": None}))
    if shape.include_usage:
        bodies.append(dump({"request_id": truth.request_id, "choices": [],
                            "usage": _usage(truth.prompt_len, truth.output_len)}))
    return bodies


# ------------------------------------------------------------------------------ vLLM 0.34.0


def _tokens_logprobs(truth: Truth, start: int, end: int) -> dict[str, Any] | None:
    """0.34.0 ``ServingTokens._create_tokens_logprobs`` (tokens mode, no tokenizer):
    ``GenerateLogProbsContent(token_id, logprob, rank, top_logprobs=[GenerateLogProb(token_id, logprob,
    rank) for every candidate the engine returned, the sampled one first])``; no ``token``, no
    ``bytes``, the same on every leg. Rendered for ``logprobs=2`` with the sampled token ranked 1."""
    if not truth.return_logprob:
        return None
    content = []
    for token_id, logprob in zip(truth.output_ids[start:end], truth.output_logprobs[start:end]):
        top = [{"token_id": token_id, "logprob": logprob, "rank": 1},
               {"token_id": token_id + 1, "logprob": logprob - 1.0, "rank": 2}]
        content.append({"token_id": token_id, "logprob": logprob, "rank": 1, "top_logprobs": top})
    return {"content": content}


def _prompt_logprobs_034(truth: Truth) -> list:
    """``clamp_prompt_logprobs(final_res.prompt_logprobs)``: ``Logprob(logprob, rank, decoded_token)``
    per position, position 0 ``None``; no tokenizer in tokens mode, so ``decoded_token`` is ``None``."""
    return [None, *({str(t): {"logprob": lp, "rank": 1, "decoded_token": None}}
                    for t, lp in zip(truth.prompt_ids[1:], truth.prompt_logprobs[1:]))]


def _usage_034(prompt: int, completion: int, *, exclude_none: bool = False) -> dict[str, Any]:
    """``UsageInfo`` field order (``serve/engine/protocol.py``): ``prompt_tokens_details`` is excluded
    when ``None`` (``exclude_if``), ``completion_tokens_details`` only under ``exclude_none``."""
    usage: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                             "completion_tokens": completion}
    if not exclude_none:
        usage["completion_tokens_details"] = None
    return usage


def _choice_034(truth: Truth, start: int, end: int, finish: str | None, experts: str | None,
                weight_version: str | None = None) -> dict[str, Any]:
    """``GenerateChoiceBase`` / ``GenerateStreamChoiceBase`` fields then ``logprobs``
    (``GenerateTokensChoice`` / ``GenerateTokensStreamChoice``); ``stop_reason`` is ``None`` on EOS and
    length, ``sampling_mask`` unset, ``weight_versions`` on the finishing choice when the engine
    labels its weights (spans over this request's output tokens, from 0)."""
    spans = ([{"version": weight_version, "start": 0, "end": truth.output_len}]
             if weight_version is not None and finish is not None else None)
    return {"index": 0, "finish_reason": finish, "stop_reason": None, "token_ids": truth.output_ids[start:end],
            ROUTED_EXPERTS: experts, "sampling_mask": None, "weight_versions": spans,
            "logprobs": _tokens_logprobs(truth, start, end)}


def _metrics_034(shape: Shape, completion: int, *, exclude_none: bool) -> dict[str, Any] | None:
    """0.34.0 ``PerRequestMetrics(speculative_decoding=build_spec_decoding_metrics(final_res))``: the
    ``RequestSpecDecodeMetrics`` the scheduler keeps per engine ``Request`` (``observe`` once per verify
    step, ``update_from_output``) as ``to_dict`` reports it. The first token comes from prefill; here each
    verify step accepts all ``num_spec_tokens`` drafts plus the bonus token but the last, which accepts
    what is left. ``model_dump()`` (unary) keeps the ``None`` timings; ``exclude_none`` (the stream's
    usage chunk) drops them."""
    if not shape.num_spec_tokens:
        return None
    k = shape.num_spec_tokens
    full, rest = divmod(max(completion - 1, 0), k + 1)
    histogram = [0] * (k + 1)
    histogram[k] += full
    if rest:
        histogram[rest - 1] += 1
    steps = sum(histogram)
    accepted = sum(j * count for j, count in enumerate(histogram))
    spec: dict[str, Any] = {
        "mean_acceptance_length": 1.0 + accepted / steps if steps else 1.0,
        "draft_acceptance_rate": accepted / (steps * k) if steps else 0.0,
        "acceptance_histogram": histogram, "num_spec_steps": steps, "num_accepted_draft_tokens": accepted,
        "num_draft_tokens": steps * k, "num_spec_tokens": k}
    if exclude_none:
        return dict(speculative_decoding=spec)
    return dict(time_to_first_token_ms=None, generation_time_ms=None, queue_time_ms=None, mean_itl_ms=None,
                tokens_per_second=None, speculative_decoding={**spec, "per_step_accepted": None,
                                                              "per_step_drafted": None})


def _kv_params(truth: Truth) -> dict[str, Any]:
    """What a P/D prefill's connector returns as ``final_res.kv_transfer_params`` (NIXL-style)."""
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": list(range(-(-truth.prompt_len // 16))), "remote_engine_id": "prefill-engine",
            "remote_host": "10.0.0.1", "remote_port": 5600, "tp_size": 1}


def unary_034(truth: Truth, shape: Shape, *, rows: np.ndarray | None, output: tuple[int, int] | None = None,
              finish: str | None = None, kv: dict[str, Any] | None = None) -> bytes:
    """0.34.0 ``serve_tokens_full_generator`` + ``_build_response_fields`` -> ``GenerateTokensResponse``,
    ``JSONResponse(content=model_dump())``: the base fields, then ``output_mode`` and ``choices``."""
    start, end = output or (0, truth.output_len)
    # Keyword form, as upstream's ``dict(...)`` in ``_build_response_fields``.
    fields: dict[str, Any] = dict(
        request_id=truth.request_id, model=MODEL, created=CREATED, usage=_usage_034(truth.prompt_len, end - start),
        prompt_logprobs=_prompt_logprobs_034(truth) if shape.prompt_logprobs else None,
        prompt_token_id_logprobs=None,
        prompt_token_ids=truth.prompt_ids if shape.return_token_ids else None, mm_placeholders=None,
        metrics=_metrics_034(shape, end - start, exclude_none=False),
        kv_transfer_params=kv, ec_transfer_params=None, output_mode="tokens",
        choices=[_choice_034(truth, start, end, finish or truth.finish,
                             encode_rows(rows) if rows is not None else None, shape.weight_version)])
    return dump(fields)


def stream_034(truth: Truth, shape: Shape, *, rows: np.ndarray | None) -> list[bytes]:
    """0.34.0 ``serve_tokens_stream_generator``: ``GenerateTokensStreamResponse`` per delta dumped with
    ``exclude`` of the ``None`` ``prompt_token_ids`` / ``mm_placeholders`` / ``metrics`` (so
    ``request_id, usage, output_mode, choices``; no ``prompt_logprobs`` in a stream);
    ``routed_experts`` on the finishing output only; with include_usage a ``choices: []`` chunk dumped
    with ``exclude_none=True``."""
    spans = truth.chunk_spans()
    bodies = []
    for index, (start, end) in enumerate(spans):
        last = index == len(spans) - 1
        experts = encode_rows(rows) if last and rows is not None else None
        choice = _choice_034(truth, start, end, truth.finish if last else None, experts, shape.weight_version)
        chunk: dict[str, Any] = {"request_id": truth.request_id, "usage": None}
        if index == 0 and shape.return_token_ids:
            chunk["prompt_token_ids"] = truth.prompt_ids  # mm_placeholders: None for a text prompt, excluded
        chunk.update(output_mode="tokens", choices=[choice])
        bodies.append(dump(chunk))
    if shape.include_usage:
        final: dict[str, Any] = {"request_id": truth.request_id,
                                 "usage": _usage_034(truth.prompt_len, truth.output_len, exclude_none=True)}
        metrics = _metrics_034(shape, truth.output_len, exclude_none=True)
        if metrics is not None:  # PerRequestMetrics on the usage chunk only (``if include_usage``)
            final["metrics"] = metrics
        final.update(output_mode="tokens", choices=[])
        bodies.append(dump(final))
    return bodies


def agg(truth: Truth, shape: Shape, *, stream_: bool) -> list[bytes]:
    """An aggregated worker: rows for every forwarded position, ``[0, prompt + output - 1)``."""
    rows = _rows(truth, 0, truth.rows) if truth.return_experts else None
    if shape.version == V034:
        return stream_034(truth, shape, rows=rows) if stream_ else [unary_034(truth, shape, rows=rows)]
    return stream(truth, shape, rows=rows) if stream_ else [unary(truth, shape, rows=rows)]


def prefill(truth: Truth, shape: Shape) -> list[bytes]:
    """A P/D prefill worker runs the request with ``max_tokens=1``: one unary body with the first
    token, the prompt logprobs if requested and the prompt rows."""
    rows = None
    if truth.return_experts:
        rows = _rows(truth, 0, truth.prompt_len)
        if shape.stale_prefill:
            rows = np.zeros_like(rows)
    if shape.version == V034:
        return [unary_034(truth, shape, rows=rows, output=(0, 1), finish="length", kv=_kv_params(truth))]
    return [unary(truth, shape, rows=rows, output=(0, 1), finish="length")]


def decode(truth: Truth, shape: Shape, *, stream_: bool) -> list[bytes]:
    """A P/D decode worker: no prompt scoring (``prompt_logprobs`` null on unary bodies), unlabelled
    logprob entries, and rows that are stale (zero) for the prompt or cover the suffix only.

    0.34.0: a request with ``prompt_logprobs`` sets ``skip_reading_prefix_cache``
    (``SamplingParams.__post_init__``), so ``Request.skip_reading_external_kv`` holds and decode
    recomputes the prompt: its unary body carries the same ``prompt_logprobs`` as the aggregated one.
    Its "full" rows are real for the prompt too (``AuxOutputWorkerConnector._commit_output`` fills
    them from the aux-output store for the KV it loaded; ``AuxOutputSchedulerConnector.cap_external_hit``)."""
    rows = None
    if shape.version == V034:
        if truth.return_experts:
            rows = _rows(truth, 0 if shape.decode_coverage == "full" else truth.prompt_len, truth.rows)
        return stream_034(truth, shape, rows=rows) if stream_ else [unary_034(truth, shape, rows=rows)]
    if truth.return_experts:
        rows = _rows(truth, truth.prompt_len, truth.rows)
        if shape.decode_coverage == "full":
            rows = np.concatenate([np.zeros_like(_rows(truth, 0, truth.prompt_len)), rows])
    if stream_:
        return stream(truth, shape, rows=rows, labels=False)
    return [unary(truth, shape, rows=rows, prompt_logprobs=False, labels=False)]
