"""P/D fidelity of the vLLM codec against vLLM 0.33.0 and 0.34.0 (PyPI wheels), bodies written by hand.

Nothing here uses the simulator (``worker.py``) or ``streamproc_vllm.upstream``: each body is spelled out
from the upstream function named next to it, read in the unpacked wheels (``vllm-0.33.0`` and
``vllm-0.34.0``, ``cp38-abi3-manylinux_2_28_x86_64``), and each P/D result is compared with what the
aggregated engine returns for the same request.

The unary body is the same in both versions: ``ServingTokens.serve_tokens_full_generator``
(``vllm/entrypoints/scale_out/token_in_token_out/serving.py``) builds ``GenerateTokensResponse(choices=...,
**self._build_response_fields(...))`` and the router returns ``JSONResponse(content=response.model_dump())``;
``GenerateResponseBase`` declares ``request_id, model, created, usage, prompt_logprobs,
prompt_token_id_logprobs, prompt_token_ids, mm_placeholders, metrics, kv_transfer_params,
ec_transfer_params``, then ``output_mode`` and ``choices`` (``GenerateChoiceBase``: ``index, finish_reason,
stop_reason, token_ids, routed_experts, sampling_mask, weight_versions``, plus ``logprobs``).
``UsageInfo.prompt_tokens_details`` has ``exclude_if=lambda value: value is None``.
"""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from helpers import assert_same_body as assert_same
from helpers import drive_join as join
from helpers import upstream_json as dumps

from streamproc.codec import CodecOptions
from streamproc.wire import Verdict
from streamproc_vllm import VLLMCodec

OPTIONS = CodecOptions(max_decompressed_bytes=1 << 20)

RID = "generate-tokens-pd-9"
PROMPT = [101, 102, 103, 104, 105, 106]
OUT = [7, 8, 9]

# ``NixlConnectorScheduler.request_finished`` for a prefill request (``do_remote_decode``), as the router
# forwards it to decode; only its presence matters here.
PREFILL_KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [3],
              "remote_engine_id": "p0", "remote_request_id": RID, "remote_host": "10.0.0.2",
              "remote_port": 5601, "tp_size": 1}


def numpy2base64(arr: np.ndarray) -> str:
    """``vllm/utils/serial_utils.py`` ``numpy2base64``: ``np.save(buf, arr, allow_pickle=False)``, Base64."""
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def prompt_logprobs(scores: list[float], ids: list[int] = PROMPT) -> list:
    """``LogprobsProcessor.from_new_request``: ``create_prompt_logprobs`` (``vllm/logprobs.py``: "logprob of
    first prompt token is None", ``logprobs.append(None)``), then ``_update_prompt_logprobs`` appends per
    scored position ``{token_id: Logprob(logprob, rank, decoded_token)}`` (``prompt_logprobs=0``, tokens
    mode: ``decoded_token=None``); ``clamp_prompt_logprobs`` leaves finite values alone."""
    return [None] + [{str(t): {"logprob": lp, "rank": 1, "decoded_token": None}}
                     for t, lp in zip(ids[1:], scores)]


SCORES = [-2.5, -0.75, -1.125, -3.0, -0.5]


def unary(*, out: list[int], plp: list | None, scores: str | None = None, finish: str = "stop",
          kv: dict | None = None, prompt: list[int] = PROMPT) -> dict:
    """``_build_response_fields`` + ``GenerateTokensResponse.model_dump()`` (0.33.0 and 0.34.0 alike), no
    logprobs, no expert capture, no ``--enable-prompt-tokens-details``."""
    choice = {"index": 0, "finish_reason": finish, "stop_reason": None, "token_ids": out,
              "routed_experts": None, "sampling_mask": None, "weight_versions": None, "logprobs": None}
    return {"request_id": RID, "model": "m", "created": 1700000000,
            "usage": {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(out),
                      "completion_tokens": len(out), "completion_tokens_details": None},
            "prompt_logprobs": plp, "prompt_token_id_logprobs": scores, "prompt_token_ids": None,
            "mm_placeholders": None, "metrics": None, "kv_transfer_params": kv, "ec_transfer_params": None,
            "output_mode": "tokens", "choices": [choice]}


# ------------------------------------------------- prompt_logprobs when the prefill leg has none
#
# What a decode leg sends for ``prompt_logprobs`` depends on whether it loaded the prompt's KV, and
# nothing in its body says which:
#
# * It recomputes the prompt, so its list is real: vLLM 0.33.0 ``SamplingParams.__post_init__`` ("If
#   prefix caching is enabled, the output of prompt logprobs may less than n_prompt_tokens"):
#   ``self.skip_reading_prefix_cache = self.prompt_logprobs is not None or ...`` when unset, and
#   ``Scheduler.schedule``: ``if request.skip_reading_prefix_cache: ext_tokens, load_kv_async = 0,
#   False``; vLLM 0.34.0 ``Request.skip_reading_external_kv`` (``prefix_cache_hit_limit is not None``,
#   set by ``get_prefix_cache_hit_limit`` for any ``prompt_logprobs``) and the same line in ``schedule``.
# * It loaded the KV (0.33.0 with the client's ``skip_reading_prefix_cache=False``, or a version
#   before either guard) and computed only the last prompt token: the V2 runner
#   (``vllm/v1/worker/gpu/sample/prompt_logprob.py`` ``PromptLogprobsWorker.compute_prompt_logprobs``:
#   ``if not req_is_prompt_chunked: end_idx -= 1`` then ``logprobs = None if start_idx >= end_idx``)
#   leaves ``create_prompt_logprobs``'s ``[None]``; the V1 runner (0.33.0
#   ``vllm/v1/worker/gpu_model_runner.py`` ``GPUModelRunner._get_prompt_logprobs_dict``:
#   ``logprobs_tensors = LogprobsTensors.empty_cpu(num_prompt_tokens - 1, num_prompt_logprobs + 1)``,
#   ``start_idx = request.num_computed_tokens``, nothing left to copy) sends ``P - 1`` rows of
#   ``torch.empty``: the right length, garbage entries.
#
# The aggregated engine, asked for prompt logprobs, returns the real list. A prefill leg that ran the
# client's parameters would have it; one without it (a router that stripped the parameter) vouches for
# nothing, so decode's list cannot be told from garbage and the field must be omitted.

DECODE_LISTS = {
    "v1_runner_unwritten_rows": [None] + [{"0": {"logprob": 0.0, "rank": 0, "decoded_token": None}}] * 5,
    "v2_runner_loaded_kv": [None],
    "recomputed_by_decode": prompt_logprobs([s + 2.0 ** -20 for s in SCORES]),
}


@pytest.mark.parametrize("decode_list", sorted(DECODE_LISTS))
def test_a_decode_prompt_logprobs_list_without_prefills_is_omitted_as_prefill_missing(decode_list):
    """Until 2026-12-05 decode's list was kept (rule 3), so garbage rows reached the client."""
    prefill = unary(out=OUT[:1], plp=None, finish="length", kv=PREFILL_KV)
    decode = unary(out=OUT, plp=DECODE_LISTS[decode_list])
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    got = json.loads(body)
    assert (got["prompt_logprobs"], got["prompt_logprobs_unavailable_reason"]) == (None, "prefill_missing")
    assert verdict is Verdict.OMITTED
    assert DECODE_LISTS[decode_list] != got["prompt_logprobs"]


@pytest.mark.parametrize("decode_list", sorted(DECODE_LISTS))
def test_a_decode_prompt_logprobs_list_without_a_prefill_leg_is_omitted_with_its_reason(decode_list):
    """Prefill timed out: decode's list is no more trustworthy than with a silent prefill."""
    decode = unary(out=OUT, plp=DECODE_LISTS[decode_list])
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], None)
    got = json.loads(body)
    assert (got["prompt_logprobs"], got["prompt_logprobs_unavailable_reason"]) == (None, "prefill_timeout")
    assert verdict is Verdict.OMITTED


def test_a_one_token_prompts_single_null_from_decode_is_the_aggregated_list():
    """``P = 1``: no engine scores anything (``[None]`` from ``create_prompt_logprobs``, nothing appended;
    the V1 runner's ``empty_cpu(0, ...)`` has no rows), so decode's ``[None]`` equals the aggregated one."""
    agg = unary(out=OUT, plp=[None], prompt=PROMPT[:1])
    prefill = unary(out=OUT[:1], plp=None, finish="length", kv=PREFILL_KV, prompt=PROMPT[:1])
    decode = unary(out=OUT, plp=[None], prompt=PROMPT[:1])
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert_same(body, dumps(agg))
    assert verdict is Verdict.PASSTHROUGH


def test_prompt_logprobs_requested_on_neither_leg_stay_null():
    """The request asked for none: both legs ``null``, the aggregated ``null``, nothing changes."""
    prefill = unary(out=OUT[:1], plp=None, finish="length", kv=PREFILL_KV)
    decode = unary(out=OUT, plp=None)
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert body == dumps(decode)
    assert verdict is Verdict.PASSTHROUGH


# ------------------------------------------ prompt_token_id_logprobs when the prefill leg has none
#
# Only the V2 runner computes these (0.33.0 and 0.34.0 ``InputProcessor``: "prompt_logprob_token_ids
# requires the V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1)"), and
# ``PromptLogprobsWorker.compute_prompt_token_id_logprobs`` never emits a row it did not write:
#
#     if req.scores is None:
#         if chunk_start > req.start:          # 0.34.0: `start`
#             # This prefill starts past the first scored row, so those
#             # rows will never be written; drop the request instead of
#             # emitting a buffer with unwritten rows.
#             self.token_id_scores.pop(req_id, None)
#             continue
#
# So a decode that loaded the prompt's KV sends ``null`` (prefill's scores replace it:
# ``tests/test_upstream_drift.py``), and a decode that sends scores computed every row itself, from
# the whole prompt (0.33.0: ``skip_reading_prefix_cache`` defaults to true for them; 0.34.0:
# ``skip_reading_external_kv``): an engine's answer, which the join keeps.

ID_SCORES = numpy2base64(np.asarray([[-0.5, -1.5], [-2.5, -3.5], [-0.25, -4.0], [-1.0, -2.0],
                                     [-0.125, -9999.0]], dtype=np.float32))


def test_decode_prompt_token_id_logprobs_without_prefills_are_the_aggregated_scores():
    agg = unary(out=OUT, plp=None, scores=ID_SCORES)
    prefill = unary(out=OUT[:1], plp=None, finish="length", kv=PREFILL_KV)
    decode = unary(out=OUT, plp=None, scores=ID_SCORES)
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert_same(body, dumps(agg))
    assert verdict is Verdict.PASSTHROUGH


def test_decode_prompt_token_id_logprobs_are_kept_when_prefill_timed_out_but_logprobs_omitted():
    """The two prompt-side fields differ: decode's scores are its own computation, its list may not be."""
    decode = unary(out=OUT, plp=DECODE_LISTS["v1_runner_unwritten_rows"], scores=ID_SCORES)
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], None)
    got = json.loads(body)
    assert got["prompt_token_id_logprobs"] == ID_SCORES
    assert "prompt_token_id_logprobs_unavailable_reason" not in got
    assert (got["prompt_logprobs"], got["prompt_logprobs_unavailable_reason"]) == (None, "prefill_timeout")
    assert verdict is Verdict.OMITTED


# ------------------------------------- vLLM 0.34.0 derender streams that hide their token ids
#
# ``output_mode="derender"`` (new in 0.34.0) with a reasoning parser and ``include_reasoning=false``:
# ``ChatStreamProcessor.__init__`` sets ``self.hide_metadata = parser is not None and not
# request.include_reasoning`` for the whole request, and ``serve_tokens_stream_generator`` then sends
# every chunk with ``token_ids_out = None`` (and ``logprobs = None``) while the finishing choice still
# carries ``routed_experts=routed_experts_b64``. Chunks are ``GenerateDerenderStreamResponse(
# request_id=..., choices=[GenerateDerenderStreamChoice(delta=..., **choice_fields)])`` dumped with
# ``model_dump_json(exclude={"prompt_token_ids", "mm_placeholders", "metrics"})``; the usage chunk
# (``include_usage``) comes after the finishing one. So the finishing chunk gives no count of decode's
# generated tokens, and nothing checks that decode's rows start where prefill's do: the rows are
# omitted (``length_mismatch``), never spliced unchecked. A documented limit (docs/formats-vllm.md).

LAYERS, TOPK = 2, 2


def expert_rows(start: int, end: int) -> np.ndarray:
    ids = [[[(p * 3 + layer * 5 + k * 11 + 1) % 60 + k * 64 for k in range(TOPK)] for layer in range(LAYERS)]
           for p in range(start, end)]
    return np.asarray(ids, dtype=np.uint8).reshape(-1, LAYERS, TOPK)


def derender_stream(deltas: list[dict], experts: str, *, continuous: bool = False) -> list[dict]:
    """``serve_tokens_stream_generator`` in derender mode, hidden metadata; ``continuous``:
    ``include_continuous_usage`` puts ``UsageInfo(prompt_tokens, completion_tokens=num_generated_tokens[i],
    total_tokens)`` on every chunk (no ``prompt_tokens_details``: ``exclude_if`` drops its ``None``).
    One token per step, so chunk ``i`` has counted ``i + 1`` tokens."""
    chunks = []
    for i, delta in enumerate(deltas):
        last = i == len(deltas) - 1
        usage = ({"prompt_tokens": len(PROMPT), "total_tokens": len(PROMPT) + i + 1, "completion_tokens": i + 1,
                  "completion_tokens_details": None} if continuous else None)
        choice = {"index": 0, "finish_reason": "stop" if last else None, "stop_reason": None, "token_ids": None,
                  "routed_experts": experts if last else None, "sampling_mask": None, "weight_versions": None,
                  "delta": delta, "logprobs": None}
        chunks.append({"request_id": RID, "usage": usage, "output_mode": "derender", "choices": [choice]})
    return chunks


DELTAS = [{"role": "assistant", "content": ""}, {"content": "Hi"}, {"content": "!"}]  # one per token of OUT


def derender_prefill() -> dict:
    """The prefill leg: ``GenerateDerenderResponse`` (unary, ``max_tokens=1``), metadata hidden alike."""
    return {"request_id": RID, "model": "m", "created": 1700000000,
               "usage": {"prompt_tokens": len(PROMPT), "total_tokens": len(PROMPT) + 1, "completion_tokens": 1,
                         "completion_tokens_details": None},
               "prompt_logprobs": None, "prompt_token_id_logprobs": None, "prompt_token_ids": None,
               "mm_placeholders": None, "metrics": None, "kv_transfer_params": PREFILL_KV,
               "ec_transfer_params": None, "output_mode": "derender",
               "choices": [{"index": 0, "finish_reason": "length", "stop_reason": None, "token_ids": None,
                            "routed_experts": numpy2base64(expert_rows(0, len(PROMPT))), "sampling_mask": None,
                            "weight_versions": None, "message": {"role": "assistant", "content": "Hi"},
                            "logprobs": None}]}


def test_a_derender_stream_hiding_its_token_ids_omits_the_rows_it_cannot_check():
    whole = numpy2base64(expert_rows(0, len(PROMPT) + len(OUT) - 1))
    agg, decode = derender_stream(DELTAS, whole), derender_stream(DELTAS, whole)
    results = join(VLLMCodec(OPTIONS), [dumps(c) for c in decode], [dumps(derender_prefill())])
    for (body, _), want in zip(results[:-1], agg[:-1]):
        assert_same(body, dumps(want))  # the chunks before the finishing one are the aggregated ones
    body, verdict = results[-1]
    choice = json.loads(body)["choices"][0]
    assert (choice["routed_experts"], choice["routed_experts_unavailable_reason"]) == (None, "length_mismatch")
    assert verdict is Verdict.OMITTED


def test_a_derender_stream_with_continuous_usage_joins_to_the_aggregated_stream():
    """``continuous_usage_stats`` counts decode's tokens on the finishing chunk: the rows are checked and
    joined (prefill's prompt rows, decode's generated ones), equal to the aggregated stream."""
    whole = expert_rows(0, len(PROMPT) + len(OUT) - 1)
    agg = derender_stream(DELTAS, numpy2base64(whole), continuous=True)
    stale = whole.copy()
    stale[:len(PROMPT)] = expert_rows(7, 7 + len(PROMPT))  # decode's prompt rows: another request's
    decode = derender_stream(DELTAS, numpy2base64(stale), continuous=True)
    results = join(VLLMCodec(OPTIONS), [dumps(c) for c in decode], [dumps(derender_prefill())])
    for (body, _), want in zip(results, agg):
        got, want = json.loads(body), dict(want)
        rows_got = got["choices"][0].pop("routed_experts")
        rows_want = want["choices"][0]["routed_experts"]
        assert got == {**want, "choices": [{k: v for k, v in want["choices"][0].items() if k != "routed_experts"}]}
        if rows_want is not None:
            assert np.array_equal(np.load(io.BytesIO(base64.b64decode(rows_got))), whole)
    assert results[-1][1] is Verdict.JOINED


# ------------------------------ vLLM 0.33.0: a prefiller that backed off the prompt's last tokens
#
# ``NixlConnectorScheduler.on_new_request`` calls ``_truncate_request_for_prefill`` for a
# ``do_remote_decode`` request; 0.33.0 guards it only with ``and not
# request.get_skip_reading_prefix_cache()``, so a scoring request whose client set
# ``skip_reading_prefix_cache=False`` loses its last ``_prefill_backoff()`` prompt tokens (``1 if
# self._has_mamba or self._bounded_replay``, or ``num_prefill_lookahead_tokens - 1``) on the prefiller
# (0.34.0 adds ``and not request.skip_reading_external_kv``: never for such a request). Its
# ``PromptLogprobsWorker`` then scores ``prompt_len = P - b`` positions:
#
# * ``prompt_logprobs``: ``create_prompt_logprobs``'s ``[None]`` plus ``P - b - 1`` entries;
# * ``prompt_token_id_logprobs``: ``req.scores = torch.empty_like(req.token_ids, ...)`` has the
#   ``P - 1 - start`` rows ``InputProcessor`` checked against the whole prompt, but
#   ``hi = min(chunk_end, prompt_len - 1)`` writes only the first ``P - b - 1``: the last ``b`` rows
#   are uninitialised, and the array is emitted (``if chunk_end >= prompt_len: ... out[req_id] =
#   req.scores``). ``usage.prompt_tokens`` stays ``P`` (the frontend's ``prompt_token_ids``).
#
# The decode leg loaded the KV (``skip_reading_prefix_cache=False``): ``[None]`` and no scores.

BACKOFF = 1


def test_scores_of_a_prefiller_that_scored_a_shortened_prompt_are_omitted_with_its_short_list():
    """Until 2026-12-05 the short list was omitted (``length_mismatch``) but the scores, whose last
    ``b`` rows no engine wrote, were published as the aggregated ones."""
    written = np.asarray([[-0.5, -1.5], [-2.5, -3.5], [-0.25, -4.0], [-1.0, -2.0]], dtype=np.float32)
    garbage = np.asarray([[3.4e38, -0.0]], dtype=np.float32)  # torch.empty_like: whatever was there
    scores = numpy2base64(np.concatenate([written, garbage]))  # P - 1 = 5 rows, the last unwritten
    prefill = unary(out=OUT[:1], plp=prompt_logprobs(SCORES[:len(PROMPT) - 1 - BACKOFF]), scores=scores,
                    finish="length", kv=PREFILL_KV)
    decode = unary(out=OUT, plp=[None], scores=None)
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    got = json.loads(body)
    for field in ("prompt_logprobs", "prompt_token_id_logprobs"):
        assert (got[field], got[field + "_unavailable_reason"]) == (None, "length_mismatch")
    assert verdict is Verdict.OMITTED


# ------------------------------------------------------------------- n > 1: choices by index
#
# ``SamplingParams.n = 2``: ``serve_tokens_full_generator`` makes one choice per ``final_res.outputs``
# entry (``index=output.index``, ``routed_experts=numpy2base64(output.routed_experts)``) and counts
# ``usage.completion_tokens`` over all of them (``num_generated_tokens += len(output.token_ids)``);
# ``serve_tokens_stream_generator`` sends one chunk per output per step (``choices=[choice]``), the
# finishing one with its rows, and with ``include_usage`` the total in the ``choices: []`` chunk. Each
# choice is a child request with its own rows ``[0, P + O_i - 1)``; a prefill (``max_tokens=1``) sends
# the prompt's ``[0, P)`` for each.

N_OUTS = [[7, 8, 9], [4, 5]]


def choice_rows(index: int, out: list[int], *, stale_prompt: bool = False) -> np.ndarray:
    rows = expert_rows(0, len(PROMPT) + len(out) - 1)
    rows[len(PROMPT):] = expert_rows(20 + 9 * index, 20 + 9 * index + len(out) - 1)
    if stale_prompt:
        rows[:len(PROMPT)] = expert_rows(7, 7 + len(PROMPT))  # a P/D decode's prompt rows: another request's
    return rows


def n_unary(outs: list[list[int]], rows: list[np.ndarray], *, finish: str, kv: dict | None) -> dict:
    body = unary(out=[], plp=None, finish=finish, kv=kv)
    template = body["choices"][0]
    body["choices"] = [{**template, "index": i, "token_ids": out, "routed_experts": numpy2base64(r)}
                       for i, (out, r) in enumerate(zip(outs, rows))]
    done = sum(map(len, outs))
    body["usage"].update(total_tokens=len(PROMPT) + done, completion_tokens=done)
    return body


def n_stream(rows: list[np.ndarray]) -> list[dict]:
    chunks = []
    for step in range(max(map(len, N_OUTS))):
        for i, out in enumerate(N_OUTS):
            if step < len(out):
                last = step == len(out) - 1
                choice = {"index": i, "finish_reason": "stop" if last else None, "stop_reason": None,
                          "token_ids": [out[step]], "routed_experts": numpy2base64(rows[i]) if last else None,
                          "sampling_mask": None, "weight_versions": None, "logprobs": None}
                chunks.append({"request_id": RID, "usage": None, "output_mode": "tokens", "choices": [choice]})
    done = sum(map(len, N_OUTS))
    chunks.append({"request_id": RID, "usage": {"prompt_tokens": len(PROMPT), "total_tokens": len(PROMPT) + done,
                                                "completion_tokens": done},
                   "output_mode": "tokens", "choices": []})
    return chunks


def n_prefill() -> dict:
    return n_unary([out[:1] for out in N_OUTS], [expert_rows(0, len(PROMPT))] * len(N_OUTS), finish="length",
                   kv=PREFILL_KV)


def test_several_choices_join_each_by_its_index_to_the_aggregated_body():
    agg = n_unary(N_OUTS, [choice_rows(i, o) for i, o in enumerate(N_OUTS)], finish="stop", kv=None)
    decode = n_unary(N_OUTS, [choice_rows(i, o, stale_prompt=True) for i, o in enumerate(N_OUTS)],
                     finish="stop", kv=None)
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(n_prefill())])
    assert_same(body, dumps(agg))
    assert verdict is Verdict.JOINED


def test_several_interleaved_stream_choices_join_to_the_aggregated_stream():
    agg = n_stream([choice_rows(i, o) for i, o in enumerate(N_OUTS)])
    decode = n_stream([choice_rows(i, o, stale_prompt=True) for i, o in enumerate(N_OUTS)])
    results = join(VLLMCodec(OPTIONS), [dumps(c) for c in decode], [dumps(n_prefill())])
    assert len(results) == len(agg)
    for (body, _), want in zip(results, agg):
        assert_same(body, dumps(want))
