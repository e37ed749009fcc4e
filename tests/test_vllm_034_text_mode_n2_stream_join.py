"""A P/D ``output_mode="text"`` stream with ``n`` = 2, logprobs and ``return_token_ids`` joins to the aggregated stream.

Independent differential check against vLLM 0.34.0 (``vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl``, paths
relative to ``vllm/entrypoints/``); the bodies are written by hand from the code quoted here (pydantic and
torch are not installed, so the wheel's models cannot be imported), not from the simulator,
``streamproc_vllm.upstream`` or another test's fixtures. The request is ``/inference/v1/generate`` with
``{"output_mode": "text", "stream": true, "stream_options": {"include_usage": true}, "return_token_ids": true,
"sampling_params": {"n": 2, "max_tokens": 3, "logprobs": 1}}`` and routed-expert capture on.

``scale_out/token_in_token_out/serving.py`` ``ServingTokens.serve_tokens_stream_generator``::

    for output in res.outputs:
        ...
        logprobs = self._create_text_logprobs(token_ids=delta_token_ids, top_logprobs=out_logprobs, ...)
        routed_experts_b64 = numpy2base64(output.routed_experts) if output.routed_experts is not None else None
        choice_fields = dict(index=i, logprobs=logprobs, finish_reason=finish_reason, stop_reason=output.stop_reason,
                             token_ids=token_ids_out, routed_experts=routed_experts_b64,
                             sampling_mask=sampling_mask, weight_versions=output.weight_versions)
        choice = GenerateTextStreamChoice(text=output.text, **choice_fields)
        chunk = response_cls(request_id=request_id, choices=[choice])
        if prompt_token_ids is not None:
            chunk.prompt_token_ids = prompt_token_ids
            chunk.mm_placeholders = request._response_mm_placeholders
            prompt_token_ids = None
        exclude = {name for name in ("prompt_token_ids", "mm_placeholders", "metrics") if getattr(chunk, name) is None}
        yield f"data: {chunk.model_dump_json(exclude=exclude)}\\n\\n"
    ...
    final_usage_info = UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=total_completion_tokens,
                                 total_tokens=num_prompt_tokens + total_completion_tokens)
    if include_usage:
        final_chunk = response_cls(request_id=request_id, choices=[], usage=final_usage_info, metrics=...)
        yield f"data: {final_chunk.model_dump_json(exclude_none=True)}\\n\\n"

Field order: ``GenerateStreamResponseBase`` (``request_id``, ``usage``, ``prompt_token_ids``, ``mm_placeholders``,
``metrics``), then ``GenerateTextStreamResponse`` (``output_mode``, ``choices``); ``GenerateStreamChoiceBase``
(``index``, ``finish_reason``, ``stop_reason``, ``token_ids``, ``routed_experts``, ``sampling_mask``,
``weight_versions``), then ``GenerateTextStreamChoice`` (``text``, ``logprobs``). ``_create_text_logprobs`` with
the server's tokenizer: ``ChatCompletionLogProbsContent(token, logprob, bytes, top_logprobs)``, ``bytes`` =
``list(token.encode("utf-8", errors="replace"))`` (``_logprob_token``). ``UsageInfo``: ``prompt_tokens``,
``total_tokens``, ``completion_tokens``, ``prompt_tokens_details`` (``exclude_if`` None),
``completion_tokens_details``. ``numpy2base64`` (``vllm/utils/serial_utils.py``): ``np.save(buffer, array,
allow_pickle=False)``, Base64 of the buffer.

P/D legs (docs/formats-vllm.md "The two P/D legs"): prefill is a unary ``GenerateTextResponse``
(``max_tokens=1``, one choice per child, rows ``[0, prompt)``, ``kv_transfer_params`` for the decode); decode
samples every output token itself (``Scheduler._update_waiting_for_remote_kv``: ``num_computed_tokens =
num_tokens - 1``), so its chunks are the aggregated ones except the finishing choices' rows, whose prompt rows
are another engine's (stale here, which the splice must replace).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import drive_join as join
from helpers import upstream_json as dumps
from vllm_034_bodies import npy_b64

from streamproc.codec import CodecOptions
from streamproc.wire import Verdict
from streamproc_vllm import VLLMCodec

OPTIONS = CodecOptions(max_decompressed_bytes=1 << 20)
RID = "cmpl-7d3c2b1a-0"
PROMPT = [101, 102, 103, 104]
OUTS = ([72, 195, 169], [79, 107, 33])  # choice 0 ends in the two bytes of "é"; the tokenizer decodes each
TOKENS = (["H", "\ufffd", "é"], ["O", "k", "!"])  # byte-level tokens alone: "\ufffd" then "é"
TEXT = (["H", "", "é"], ["O", "k", "!"])  # the detokenizer holds the incomplete byte back
LAYERS, TOP_K = 2, 2


def rows(choice: int) -> np.ndarray:
    """``(prompt + completion - 1, layers, top_k)`` uint8 (``num_experts <= 256``), distinct ids per layer."""
    n = len(PROMPT) + len(OUTS[choice]) - 1
    return np.array([[[(p + choice) % 60, 60 + (p + layer) % 60] for layer in range(LAYERS)] for p in range(n)],
                    dtype=np.uint8)


def _content(choice: int, pos: int) -> dict:
    token = TOKENS[choice][pos]
    lp = -0.125 * (pos + 1) - choice
    return {"token": token, "logprob": lp, "bytes": list(token.encode("utf-8", errors="replace")),
            "top_logprobs": [{"token": token, "logprob": lp, "bytes": list(token.encode("utf-8", errors="replace"))},
                             {"token": "x", "logprob": -7.5, "bytes": [120]}]}


def _choice(choice: int, pos: int, experts: str | None, ends: tuple[int, int]) -> dict:
    last = pos == ends[choice] - 1
    finish = ("length" if ends[choice] == 3 else "stop") if last else None  # "stop" on EOS: stop_reason None
    return {"index": choice, "finish_reason": finish, "stop_reason": None,
            "token_ids": [OUTS[choice][pos]], "routed_experts": experts, "sampling_mask": None,
            "weight_versions": None, "text": TEXT[choice][pos], "logprobs": {"content": [_content(choice, pos)]}}


def stream(stale_prompt_rows: bool, ends: tuple[int, int] = (3, 3)) -> list[bytes]:
    """One chunk per choice per step (``for output in res.outputs``), then the usage chunk; choice ``c``
    generates ``ends[c]`` tokens (a finished child has no further output)."""
    out = []
    first = True
    for pos in range(3):
        for choice in (0, 1):
            if pos >= ends[choice]:
                continue
            experts = None
            if pos == ends[choice] - 1:
                r = rows(choice)[:len(PROMPT) + ends[choice] - 1]
                if stale_prompt_rows:
                    r[:len(PROMPT)] = (r[:len(PROMPT)] + 7) % 60  # another request's rows, still distinct
                experts = npy_b64(r)
            chunk: dict = {"request_id": RID, "usage": None}
            if first:
                chunk["prompt_token_ids"] = PROMPT
                first = False
            chunk.update({"output_mode": "text", "choices": [_choice(choice, pos, experts, ends)]})
            out.append(dumps(chunk))
    total = sum(ends)
    out.append(dumps({"request_id": RID, "usage": {"prompt_tokens": len(PROMPT), "total_tokens": len(PROMPT) + total,
                                                    "completion_tokens": total},
                      "output_mode": "text", "choices": []}))
    return out


def prefill() -> list[bytes]:
    """``serve_tokens_full_generator``'s ``GenerateTextResponse`` for ``max_tokens=1``, written by
    ``JSONResponse(content=generator.model_dump())``: one choice per child, rows ``[0, prompt)``."""
    choices = [{"index": c, "finish_reason": "length", "stop_reason": None, "token_ids": [OUTS[c][0]],
                "routed_experts": npy_b64(rows(c)[:len(PROMPT)]), "sampling_mask": None, "weight_versions": None,
                "text": TEXT[c][0], "logprobs": {"content": [_content(c, 0)]}} for c in (0, 1)]
    body = {"request_id": RID, "model": "m", "created": 1764979200,
            "usage": {"prompt_tokens": len(PROMPT), "total_tokens": len(PROMPT) + 2, "completion_tokens": 2,
                      "completion_tokens_details": None},
            "prompt_logprobs": None, "prompt_token_id_logprobs": None, "prompt_token_ids": PROMPT,
            "mm_placeholders": None, "metrics": None,
            "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1]],
                                   "remote_engine_id": "e", "remote_request_id": RID, "remote_host": "127.0.0.1",
                                   "remote_port": 5600, "tp_size": 1, "remote_prefill_cached_tokens": 0},
            "ec_transfer_params": None, "output_mode": "text", "choices": choices}
    return [json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()]


@pytest.mark.parametrize("ends", [(3, 3), (3, 2), (2, 3), (1, 3)], ids=str)
@pytest.mark.parametrize("option", ["unknown", "yes"])
def test_every_joined_text_mode_chunk_equals_the_aggregated_chunk_byte_for_byte(option, ends):
    """Also with children of different lengths: each finishing choice's rows are counted from its own tokens."""
    codec = VLLMCodec(CodecOptions(max_decompressed_bytes=1 << 20, format_options=(("stream_routed_experts", option),)))
    agg = stream(stale_prompt_rows=False, ends=ends)
    decode = stream(stale_prompt_rows=True, ends=ends)
    assert decode != agg
    out = join(codec, decode, prefill())
    for (got, verdict), want in zip(out, agg):
        assert got == want
        assert verdict in (Verdict.PASSTHROUGH, Verdict.JOINED)


def test_without_a_prefill_leg_the_finishing_choices_omit_their_rows_and_nothing_else_changes():
    agg = stream(stale_prompt_rows=False)
    out = join(VLLMCodec(OPTIONS), stream(stale_prompt_rows=True), None)
    for (got, verdict), want in zip(out, agg):
        g, w = json.loads(got), json.loads(want)
        for gc, wc in zip(g["choices"], w["choices"]):
            if wc["routed_experts"] is not None:
                assert verdict is Verdict.OMITTED
                assert gc.pop("routed_experts") is None
                assert gc.pop("routed_experts_unavailable_reason") == "prefill_timeout"
                wc.pop("routed_experts")
        assert g == w
