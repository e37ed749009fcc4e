"""vLLM 0.34.0 ``/inference/v1/generate`` bodies written by hand from the wheel, shared by the tests that
join them (``test_vllm_034_bodies_by_hand.py``, the codec mutation tests, the P/D failure joins): each builder
names the upstream function its shape comes from. Nothing here uses the simulator or ``streamproc_vllm.upstream``."""

from __future__ import annotations

import base64
import io

import numpy as np

from streamproc.codec import CodecOptions

OPTIONS = CodecOptions(max_decompressed_bytes=1 << 20)

RID = "generate-tokens-r9"
PROMPT = list(range(300, 340))  # 40 tokens
OUT = [51, 52, 53]
LAYERS, TOPK = 2, 2


def npy_b64(arr: np.ndarray) -> str:
    """``vllm/utils/serial_utils.py`` ``numpy2base64``: ``np.save(buffer, array, allow_pickle=False)``,
    then Base64."""
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def pd_rows(prompt: int, completion: int, *, child: int = 0, stale: bool = False) -> np.ndarray:
    """``(prompt + completion - 1, layers, top_k)`` uint8 expert ids of child ``child`` (distinct per layer);
    decode's prompt rows are its KV slots' leftovers (``stale``)."""
    r = np.array([[[(p * 3 + child) % 64, 64 + (p + child) % 64] for _ in range(2)]
                  for p in range(prompt + completion - 1)], dtype=np.uint8)
    if stale:
        r[:prompt] = (r[:prompt] + 11) % 60
    return r


def rows(start: int, end: int) -> np.ndarray:
    """Expert ids of positions [start, end), distinct within a (position, layer)."""
    ids = [[[(p * 3 + layer * 5 + k * 11 + 2) % 64 + k * 64 for k in range(TOPK)] for layer in range(LAYERS)]
           for p in range(start, end)]
    return np.asarray(ids, dtype=np.uint8).reshape(-1, LAYERS, TOPK)


def details(cached: int, *, exclude_none: bool) -> dict:
    """``PromptTokenUsageInfo(cached_tokens=num_cached_tokens)`` (``serve_tokens_full_generator`` via
    ``_build_response_fields``, and the usage chunk of ``serve_tokens_stream_generator``)."""
    if exclude_none:
        return {"cached_tokens": cached}
    return {"cached_tokens": cached, "created_cache_tokens": None, "multimodal_tokens": None}


def usage(completion: int, cached: int | None, *, exclude_none: bool = False) -> dict:
    """``UsageInfo``: prompt_tokens, total_tokens, completion_tokens, prompt_tokens_details (left out when
    ``None``: ``exclude_if``; ``cached=None``: a server without ``--enable-prompt-tokens-details``),
    completion_tokens_details (left out under ``exclude_none``)."""
    u: dict = {"prompt_tokens": len(PROMPT), "total_tokens": len(PROMPT) + completion,
               "completion_tokens": completion}
    if cached is not None:
        u["prompt_tokens_details"] = details(cached, exclude_none=exclude_none)
    if not exclude_none:
        u["completion_tokens_details"] = None
    return u


def choice(out: list[int], finish: str | None, experts: str | None) -> dict:
    """``GenerateTokensChoice`` / ``GenerateTokensStreamChoice``: the ``GenerateChoiceBase`` fields, then
    ``logprobs`` (``None``: not requested)."""
    return {"index": 0, "finish_reason": finish, "stop_reason": None, "token_ids": out,
            "routed_experts": experts, "sampling_mask": None, "weight_versions": None, "logprobs": None}


def unary(*, out: list[int], cached: int | None, experts: str | None, finish: str = "stop",
          kv: dict | None = None) -> dict:
    """``serve_tokens_full_generator`` -> ``GenerateTokensResponse`` (``GenerateResponseBase`` fields, then
    ``output_mode`` and ``choices``), ``JSONResponse(content=model_dump())``."""
    return {"request_id": RID, "model": "m", "created": 1700000000, "usage": usage(len(out), cached),
            "prompt_logprobs": None, "prompt_token_id_logprobs": None, "prompt_token_ids": None,
            "mm_placeholders": None, "metrics": None, "kv_transfer_params": kv, "ec_transfer_params": None,
            "output_mode": "tokens", "choices": [choice(out, finish, experts)]}


def stream(chunks: list[list[int]], experts_last: str | None, cached: int | None) -> list[dict]:
    """``serve_tokens_stream_generator`` with ``stream_options.include_usage``: one
    ``GenerateTokensStreamResponse`` per delta (``request_id``, ``usage``, then ``output_mode`` and
    ``choices``; ``routed_experts`` only on the finished output, ``RequestState._new_completion_output``),
    then the ``choices: []`` usage chunk (``exclude_none=True``)."""
    bodies = []
    for k, ids in enumerate(chunks):
        last = k == len(chunks) - 1
        bodies.append({"request_id": RID, "usage": None, "output_mode": "tokens",
                       "choices": [choice(ids, "stop" if last else None, experts_last if last else None)]})
    completion = sum(len(ids) for ids in chunks)
    bodies.append({"request_id": RID, "usage": usage(completion, cached, exclude_none=True),
                   "output_mode": "tokens", "choices": []})
    return bodies


def prefill_kv(cached: int) -> dict:
    """``NixlConnectorScheduler.request_finished`` (``nixl/pull_scheduler.py``) for a length-capped
    prefill request, plus what ``Scheduler.update_from_output`` adds when the request finishes:
    ``kv_transfer_params["remote_prefill_cached_tokens"] = prefill_stats.num_cached_tokens`` ("P-side cache
    hits, so D can report them in prompt_tokens_details instead of its own (~100%) hit rate")."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[4, 5, 6]],
            "remote_engine_id": "p0", "remote_request_id": RID, "remote_host": "10.0.0.1",
            "remote_port": 5600, "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": len(PROMPT),
            "remote_blocks_expiry_time": None, "remote_registration_generation": 0, "transfer_mode": "pull",
            "remote_prefill_cached_tokens": cached}


def prefill(cached: int | None, kv_cached: int) -> dict:
    """The NIXL prefill leg: the client's request with ``max_tokens=1`` and ``stream=False``."""
    return unary(out=OUT[:1], cached=cached, experts=npy_b64(rows(0, len(PROMPT))), finish="length",
                 kv=prefill_kv(kv_cached))


TOTAL = len(PROMPT) + len(OUT) - 1
