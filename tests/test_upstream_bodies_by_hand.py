"""Independent review: bodies written by hand from UPSTREAM SGLang / vLLM code, fed through the codec join.

Nothing here uses ``streamproc.sim``/``simulation`` builders, the simulated workers or the codecs'
``upstream.py`` builders: every body is spelled out below, following the upstream function named in
the comment above it. Each P/D case is compared with the body the aggregated engine would return
for the same request (parsed JSON equality, plus identical key order at every level).

Upstream sources read (stored snapshots; paths relative to the repository root):

* SGLang ``python/sglang/srt/managers/tokenizer_manager.py`` (sgl-project/sglang @ 001067ff):
  ``_handle_batch_output`` (meta_info = id, finish_reason, prompt_tokens, weight_version,
  retractions; ``convert_logprob_style`` -> ``add_logprob_to_meta_info`` writes input/output token
  logprobs, ``output_token_logprobs_length``, top logprobs, token-ids logprobs; then
  completion_tokens, cached_tokens; hidden_states; routed_experts = base64(raw tensor bytes);
  e2e_latency when finished), ``detokenize_logprob_tokens`` (triples ``(logprob, id, text|None)``),
  ``detokenize_top_logprobs_tokens`` (``None`` for an empty position),
  ``_slice_streaming_output_meta_info`` (incremental mode slices only the output_* lists),
  ``_handle_batch_request`` (non-stream batch / n>1: ``yield outputs`` -> a JSON *list*).
* SGLang ``python/sglang/srt/disaggregation/utils.py`` ``MetadataBuffers.set_buf/get_buf``: the
  prefill->decode metadata carries output_ids[0], cached_tokens, output_token_logprobs[0] and
  output_top_logprobs[0] ONLY (no token-ids logprobs); ``disaggregation/decode.py`` appends those
  to the decode Req when the KV transfer succeeds.
* SGLang ``python/sglang/srt/disaggregation/mini_lb.py`` ``MiniLoadBalancer.generate``: the
  reference P/D merge = decode body with ``input_token_logprobs`` = prefill's + decode's.
* vLLM ``vllm/entrypoints/serve/disagg/serving.py`` ``ServingTokens.serve_tokens_full_generator``
  / ``serve_tokens_stream_generator`` / ``_create_tokens_logprobs`` and
  ``vllm/entrypoints/serve/disagg/protocol.py`` ``GenerateResponse``/``GenerateResponseChoice``/
  ``GenerateStreamResponse`` in two versions: one whose choice has no ``routed_experts`` field
  (protocol.py @ 06408932), one with it on unary choices only (furionw/vllm @ 9cdf7782, a fork;
  the codec's ``stream_routed_experts=no``) and one with it on unary and stream choices.
"""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import numpy as np
import pytest
import zstandard
from helpers import assert_same_body as assert_same
from helpers import drive_join as join
from helpers import upstream_json as dumps
from sglang_0523_bodies import (
    INPUT_IDS_LP,
    INPUT_LP,
    INPUT_TOP,
    LAYERS,
    OPTIONS,
    OUT,
    OUT_TEXT,
    OUTPUT_IDS_LP,
    OUTPUT_LP,
    OUTPUT_TOP,
    PREFILL_FINISH,
    PROMPT,
    STOP,
    TOPK,
    b64,
    rows,
    sgl_body,
)
from streamproc_sglang import SGLangCodec
from streamproc_sglang_zstd import SGLangZstdCodec
from streamproc_vllm import VLLMCodec

from streamproc.codec import CodecOptions
from streamproc.wire import Verdict


def sgl_case(*, top: bool, ids_lp: bool, encode=b64, stale_value: int = 0x5A5A):
    """(agg, prefill, decode) unary bodies for one request with return_logprob, logprob_start_len=0."""
    def lp(out_slice: slice, *, prefill_side: bool) -> dict[str, Any]:
        d: dict[str, Any] = {
            "input": INPUT_LP if prefill_side else [],
            "output": OUTPUT_LP[out_slice],
            "length": len(OUTPUT_LP[out_slice]),
        }
        if top:
            d["input_top"] = INPUT_TOP if prefill_side else []
            d["output_top"] = OUTPUT_TOP[out_slice]
        if ids_lp:
            d["input_ids"] = INPUT_IDS_LP if prefill_side else []
            d["output_ids"] = OUTPUT_IDS_LP[out_slice]
        return d

    rows_all = len(PROMPT) + len(OUT) - 1
    agg = sgl_body(out=OUT, text="".join(OUT_TEXT), finish=STOP, completion=3,
                   lp=lp(slice(0, 3), prefill_side=True), experts=encode(rows(0, rows_all)))
    prefill = sgl_body(out=OUT[:1], text=OUT_TEXT[0], finish=PREFILL_FINISH, completion=1,
                       lp=lp(slice(0, 1), prefill_side=True), experts=encode(rows(0, len(PROMPT))))
    # Decode: MetadataBuffers carries output_token_logprobs[0] and output_top_logprobs[0] (so both are
    # present), but NOT the token-ids logprobs: decode's own steps append positions 1.. only.
    dec_lp = lp(slice(0, 3), prefill_side=False)
    if ids_lp:
        dec_lp["output_ids"] = OUTPUT_IDS_LP[1:]
    stale = np.full(len(PROMPT) * LAYERS * TOPK, stale_value, dtype="<i4")
    stale[1::2] += 1  # stale KV-slot leftovers, not a recognisable all-equal row
    decode = sgl_body(out=OUT, text="".join(OUT_TEXT), finish=STOP, completion=3, lp=dec_lp,
                      experts=encode(stale.tobytes() + rows(len(PROMPT), rows_all)))
    return agg, prefill, decode


@pytest.mark.parametrize("top", [False, True])
def test_sglang_unary_logprobs_unicode_top_logprobs_and_experts_join_to_agg(top):
    agg, prefill, decode = sgl_case(top=top, ids_lp=False)
    [(body, verdict)] = join(SGLangCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert verdict is Verdict.JOINED
    assert_same(body, dumps(agg))


def test_sglang_token_ids_logprob_first_position_is_restored_from_prefill():
    """``token_ids_logprob=[9, 42]`` (GenerateReqInput.token_ids_logprob). MetadataBuffers.set_buf
    transfers no token-ids logprobs, so the P/D decode body's ``output_token_ids_logprobs`` starts at
    output position 1; the prefill body holds position 0. The aggregated body has all positions."""
    agg, prefill, decode = sgl_case(top=True, ids_lp=True)
    [(body, _)] = join(SGLangCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    got = json.loads(body)["meta_info"]
    assert got["input_token_ids_logprobs"] == agg["meta_info"]["input_token_ids_logprobs"]
    assert got["output_token_ids_logprobs"] == agg["meta_info"]["output_token_ids_logprobs"]


def _ids_stream_decode(spans: list[tuple[int, int]], *, cumulative: bool) -> list[dict]:
    """P/D decode's stream with ``token_ids_logprob``: the scheduler's ``stream_output_generation``
    sends ``output_token_ids_logprobs_val[offset:]`` with ``offset`` = the sent length of the complete
    ``output_token_logprobs_val``, from a list that starts at output position 1 on decode; the
    tokenizer manager concatenates the sends (cumulative mode) or passes each on (incremental)."""
    decode_ids = OUTPUT_IDS_LP[1:]
    sent, chunks, offset = [], [], 0
    for lo, end in spans:
        piece = decode_ids[offset:end - 1]  # what decode's list holds at this send, from the offset
        sent += piece
        offset = end
        last = end == len(OUT)
        lp = {"input": [], "output": OUTPUT_LP[0 if cumulative else lo:end], "length": end,
              "input_top": [], "output_top": OUTPUT_TOP[0 if cumulative else lo:end],
              "input_ids": [], "output_ids": list(sent) if cumulative else piece}
        chunks.append(sgl_body(out=OUT[0 if cumulative else lo:end], text="", finish=STOP if last else None,
                               completion=end, lp=lp, finished=last))
    return chunks


def assert_ids_logprobs_omitted(body: bytes, verdict: Verdict, reason: str) -> None:
    meta = json.loads(body)["meta_info"]
    assert "output_token_ids_logprobs" not in meta
    assert meta["output_token_ids_logprobs_unavailable_reason"] == reason
    assert verdict is Verdict.OMITTED


@pytest.mark.parametrize("cumulative", [True, False])
def test_sglang_token_ids_logprob_lost_between_decode_sends_is_omitted_not_misaligned(cumulative):
    """Two sends (positions 0-1, then 2): the second send's slice starts past the entry of position 1
    (decode's list is one behind), so that entry is never sent. The first chunk is restored from
    prefill; a later chunk that lacks entries no leg has loses the field, with the reason."""
    _, prefill, _ = sgl_case(top=True, ids_lp=True)
    decode = _ids_stream_decode([(0, 2), (2, 3)], cumulative=cumulative)
    (first, _), (second, verdict) = join(SGLangCodec(OPTIONS), [dumps(d) for d in decode], [dumps(prefill)])
    assert json.loads(first)["meta_info"]["output_token_ids_logprobs"] == OUTPUT_IDS_LP[:2]
    assert_ids_logprobs_omitted(second, verdict, "length_mismatch")


def test_sglang_token_ids_logprob_without_prefills_entry_is_omitted_with_its_reason():
    _, prefill, decode = sgl_case(top=True, ids_lp=True)
    del prefill["meta_info"]["output_token_ids_logprobs"]
    [(body, verdict)] = join(SGLangCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert_ids_logprobs_omitted(body, verdict, "prefill_missing")


def test_sglang_token_ids_logprob_a_decode_that_sends_every_position_is_left_as_it_is():
    """A decode worker whose list is complete (a later SGLang that transfers it): nothing to restore."""
    agg, prefill, decode = sgl_case(top=True, ids_lp=True)
    decode["meta_info"]["output_token_ids_logprobs"] = OUTPUT_IDS_LP
    [(body, _)] = join(SGLangCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert json.loads(body)["meta_info"]["output_token_ids_logprobs"] == OUTPUT_IDS_LP


def _cumulative_stream(lp_input: list, first_known: bool = True, ids_slice=None):
    """Cumulative stream (server default, ``incremental_streaming_output=False``): each chunk restates
    text, output_ids and output_*logprobs from position 0; input lists restated too."""
    chunks = []
    spans = [(0, 1), (1, 2), (2, 3)]
    for k, (_, end) in enumerate(spans):
        last = k == len(spans) - 1
        lp = {"input": lp_input, "output": OUTPUT_LP[:end], "length": end}
        chunks.append(sgl_body(out=OUT[:end], text="".join(OUT_TEXT[:end]), finish=STOP if last else None,
                               completion=end, lp=lp,
                               experts=b64(rows(0, 6)) if last else None, finished=last))
    return chunks


def test_sglang_cumulative_stream_joins_to_agg_stream():
    agg = _cumulative_stream(INPUT_LP)
    # Decode's stream: its first body already has 2 tokens (out0 arrives with the KV); input lists [].
    decode = []
    for k, end in enumerate([2, 3]):
        last = end == 3
        stale = bytes(4 * LAYERS * TOPK * len(PROMPT)) if last else b""
        decode.append(sgl_body(out=OUT[:end], text="".join(OUT_TEXT[:end]), finish=STOP if last else None,
                               completion=end, lp={"input": [], "output": OUTPUT_LP[:end], "length": end},
                               experts=b64(stale + rows(4, 6)) if last else None, finished=last))
    prefill = sgl_body(out=OUT[:1], text=OUT_TEXT[0], finish=PREFILL_FINISH, completion=1,
                       lp={"input": INPUT_LP, "output": OUTPUT_LP[:1], "length": 1},
                       experts=b64(rows(0, 4)))
    results = join(SGLangCodec(OPTIONS), [dumps(d) for d in decode], [dumps(prefill)])
    for (body, _), want in zip(results, agg[1:]):
        assert_same(body, dumps(want))


def test_sglang_incremental_stream_joins_to_agg_stream():
    """``_slice_streaming_output_meta_info``: only output_* lists are sliced; input lists and
    output_token_logprobs_length stay cumulative."""
    def chunk(lo, end, lp_input, experts, last):
        return sgl_body(out=OUT[lo:end], text="".join(OUT_TEXT[lo:end]), finish=STOP if last else None,
                        completion=end, lp={"input": lp_input, "output": OUTPUT_LP[lo:end], "length": end},
                        experts=experts, finished=last)
    agg = [chunk(0, 2, INPUT_LP, None, False), chunk(2, 3, INPUT_LP, b64(rows(0, 6)), True)]
    stale = bytes(4 * LAYERS * TOPK * len(PROMPT))
    decode = [chunk(0, 2, [], None, False), chunk(2, 3, [], b64(stale + rows(4, 6)), True)]
    prefill = chunk(0, 1, INPUT_LP, b64(rows(0, 4)), True)
    prefill["meta_info"]["finish_reason"] = PREFILL_FINISH
    results = join(SGLangCodec(OPTIONS), [dumps(d) for d in decode], [dumps(prefill)])
    for (body, _), want in zip(results, agg):
        assert_same(body, dumps(want))


def test_sglang_skip_tokenizer_none_texts_and_matched_string_finish():
    """return_text_in_logprobs=False: triples end in None; FINISH_MATCHED_STR: matched is a str."""
    none_in = [[e[0], e[1], None] for e in INPUT_LP]
    none_out = [[e[0], e[1], None] for e in OUTPUT_LP]
    fin = {"type": "stop", "matched": "\n\n"}
    lp = {"input": none_in, "output": none_out, "length": 3}
    agg = sgl_body(out=OUT, text="Héllo 世", finish=fin, completion=3, lp=lp, experts=b64(rows(0, 6)))
    prefill = sgl_body(out=OUT[:1], text="Hé", finish=PREFILL_FINISH, completion=1,
                       lp={"input": none_in, "output": none_out[:1], "length": 1}, experts=b64(rows(0, 4)))
    decode = sgl_body(out=OUT, text="Héllo 世", finish=fin, completion=3,
                      lp={"input": [], "output": none_out, "length": 3},
                      experts=b64(bytes(4 * 16) + rows(4, 6)))
    [(body, _)] = join(SGLangCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert_same(body, dumps(agg))


def test_sglang_default_logprob_start_len_empty_input_window():
    """logprob_start_len=-1 (default): every leg sends input_token_logprobs: []."""
    lp = {"input": [], "output": OUTPUT_LP, "length": 3}
    agg = sgl_body(out=OUT, text="x", finish=STOP, completion=3, lp=lp, experts=b64(rows(0, 6)))
    prefill = sgl_body(out=OUT[:1], text="x", finish=PREFILL_FINISH, completion=1,
                       lp={"input": [], "output": OUTPUT_LP[:1], "length": 1}, experts=b64(rows(0, 4)))
    decode = sgl_body(out=OUT, text="x", finish=STOP, completion=3, lp=lp, experts=b64(bytes(64) + rows(4, 6)))
    [(body, _)] = join(SGLangCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert_same(body, dumps(agg))


def test_sglang_one_token_request_decode_without_experts():
    """max_new_tokens=1 on a P/D pair: decode's body has completion 1 and no rows to add."""
    lp = {"input": INPUT_LP, "output": OUTPUT_LP[:1], "length": 1}
    fin = {"type": "length", "length": 1}
    agg = sgl_body(out=OUT[:1], text="Hé", finish=fin, completion=1, lp=lp, experts=b64(rows(0, 4)))
    prefill = sgl_body(out=OUT[:1], text="Hé", finish=fin, completion=1, lp=lp, experts=b64(rows(0, 4)))
    decode = sgl_body(out=OUT[:1], text="Hé", finish=fin, completion=1,
                      lp={"input": [], "output": OUTPUT_LP[:1], "length": 1})
    [(body, _)] = join(SGLangCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert_same(body, dumps(agg))


def test_sglang_zstd_payload_join():
    """Base64(zstd(raw int32 rows)) on both legs; compared after decompression."""
    cctx = zstandard.ZstdCompressor(level=3)

    def enc(raw):
        return b64(cctx.compress(raw))
    agg, prefill, decode = sgl_case(top=True, ids_lp=False, encode=enc)
    [(body, verdict)] = join(SGLangZstdCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    got, want = json.loads(body), agg
    dctx = zstandard.ZstdDecompressor()
    g = dctx.decompress(base64.b64decode(got["meta_info"].pop("routed_experts")))
    w = dctx.decompress(base64.b64decode(want["meta_info"].pop("routed_experts")))
    assert g == w
    assert got == json.loads(dumps(want))


def _start_at_prompt_end_one_token(prefill_value: str) -> tuple[dict, bytes, Verdict]:
    """max_new_tokens=1 with ``routed_experts_start_len`` = the prompt's length, stated by both legs.
    ``BaseTopkCapturer.get_topk``: ``start_len = min(start_len, seqlen - 1)`` and the rows are
    ``req_to_token[req_pool_idx][start_len : seqlen - 1]``: none on either leg (prefill's seqlen
    counts token 0, ``_maybe_collect_routed_experts``), so the engine's value is zstd of no bytes."""
    fin = {"type": "length", "length": 1}
    lp = {"input": INPUT_LP, "output": OUTPUT_LP[:1], "length": 1}
    empty = b64(zstandard.ZstdCompressor(level=3, write_checksum=True).compress(b""))
    agg, prefill, decode = (sgl_body(out=OUT[:1], text="Hé", finish=fin, completion=1, lp=lp, experts=value)
                            for value in (empty, prefill_value, empty))
    for body in (agg, prefill, decode):
        body["meta_info"]["routed_experts_start_len"] = len(PROMPT)
    [(body, verdict)] = join(SGLangZstdCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    return agg, body, verdict


def test_sglang_zstd_empty_rows_join_to_agg_and_an_empty_frame_with_a_tail_is_never_published():
    """The empty frame (a header that declares 0 bytes) is the answer as the engine sent it; the same
    frame with anything after it is no valid frame, and a one-token answer would publish prefill's
    value as it came: it is omitted, never handed to clients."""
    frame = zstandard.ZstdCompressor(level=3, write_checksum=True).compress(b"")
    agg, body, verdict = _start_at_prompt_end_one_token(b64(frame))
    assert_same(body, dumps(agg))
    for tail in (b"garbage", frame, zstandard.ZstdCompressor().compress(rows(0, 4))):
        _, body, verdict = _start_at_prompt_end_one_token(b64(frame + tail))
        meta = json.loads(body)["meta_info"]
        assert "routed_experts" not in meta, tail
        assert meta["routed_experts_unavailable_reason"] == "prefill_corrupt"
        assert verdict == Verdict.OMITTED


def test_sglang_batch_request_decode_list_body_never_publishes_stale_rows():
    """``_handle_batch_request``, non-stream: ``outputs = await asyncio.gather(...); yield outputs``,
    so a batch (or n>1) ``/generate`` answers with a JSON *list* of per-request bodies (mini_lb
    supports batch P/D: bootstrap_room per item). The decode list carries stale prompt rows; the
    aggregated list has the real ones. Whatever the join does, it must not publish decode's rows."""
    agg, prefill, decode = sgl_case(top=False, ids_lp=False)
    [(body, verdict)] = join(SGLangCodec(OPTIONS), [dumps([decode, decode])], [dumps([prefill, prefill])])
    out = json.loads(body)
    for item in out:
        meta = item["meta_info"]
        assert meta.get("routed_experts") in (None, agg["meta_info"]["routed_experts"]), (
            f"published decode's stale rows (verdict {verdict})")


def test_sglang_batch_request_joins_item_by_item_to_the_aggregated_batch():
    """The same batch through a P/D pair: item i of decode's list joined with item i of prefill's."""
    agg, prefill, decode = sgl_case(top=True, ids_lp=True)
    other_agg, other_prefill, other_decode = sgl_case(top=False, ids_lp=False, stale_value=0x1111)
    [(body, verdict)] = join(SGLangCodec(OPTIONS), [dumps([decode, other_decode])],
                             [dumps([prefill, other_prefill])])
    assert_same(body, dumps([agg, other_agg]))
    assert verdict is Verdict.JOINED


def test_sglang_batch_without_a_matching_prefill_batch_omits_each_items_rows():
    _, prefill, decode = sgl_case(top=False, ids_lp=False)
    for prefill_leg in ([prefill], [prefill, prefill, prefill]):  # not a batch; a batch of another length
        [(body, verdict)] = join(SGLangCodec(OPTIONS), [dumps([decode, decode])], [dumps(prefill_leg)])
        for item in json.loads(body):
            assert "routed_experts" not in item["meta_info"]
            assert item["meta_info"]["routed_experts_unavailable_reason"] == "length_mismatch"
        assert verdict is Verdict.OMITTED


# ==================================================== streamed batches: items tagged "index"
ITEM_PROMPT, ITEM_OUT = 4, 3


def item_rows(start: int, end: int, item: int) -> bytes:
    """Expert ids of positions [start, end) of batch item ``item`` (distinct per item and position)."""
    ids = [[(p * 7 + j * 3 + 1 + item * 11) % 61 + (j % TOPK) * 61 for j in range(LAYERS * TOPK)]
           for p in range(start, end)]
    return np.asarray(ids, dtype="<i4").tobytes()


def item_meta(item: int, *, finish: Any, completion: int, experts: str | None, input_lp: list,
         output_lp: list, finished: bool) -> dict[str, Any]:
    """``TokenizerManager._handle_batch_output`` for one request (return_logprob=True)."""
    m: dict[str, Any] = {"id": f"rid-{item}", "finish_reason": finish, "prompt_tokens": ITEM_PROMPT,
                         "weight_version": "default", "num_retractions": 0,
                         "input_token_logprobs": input_lp, "output_token_logprobs": output_lp,
                         "output_token_logprobs_length": len(output_lp),
                         "completion_tokens": completion, "cached_tokens": 0}
    if experts is not None:
        m["routed_experts"] = experts
    if finished:
        m["e2e_latency"] = 0.5
    return m


def input_lp(item: int) -> list:
    return [[None, 100 + item, None]] + [[-1.0 - item - p / 10, 100 + item + p, None] for p in range(1, ITEM_PROMPT)]


def output_lp(item: int, end: int) -> list:
    return [[-0.5 - item - p / 10, 200 + 10 * item + p, None] for p in range(end)]


def out_ids(item: int, end: int) -> list[int]:
    return [200 + 10 * item + p for p in range(end)]


ITEM_STOP = {"type": "length", "length": ITEM_OUT}
ITEM_PREFILL_FINISH = {"type": "length", "length": 0}  # process_disagg_prefill_inflight_queue: FINISH_LENGTH(length=0)


def stream_chunk(item: int, doc_meta: dict[str, Any], end: int) -> dict[str, Any]:
    """``_stream_batch_responses``: the item's (cumulative) chunk, then ``result["index"]``."""
    return {"text": "", "output_ids": out_ids(item, end), "meta_info": doc_meta, "index": item}


def item_prefill_chunk(item: int) -> dict:
    return stream_chunk(item, item_meta(item, finish=ITEM_PREFILL_FINISH, completion=1,
                                   experts=b64(item_rows(0, ITEM_PROMPT, item)), input_lp=input_lp(item),
                                   output_lp=output_lp(item, 1), finished=True), 1)

def item_decode_final(item: int) -> dict:
    stale = item_rows(0, ITEM_PROMPT, 7)  # decode's stale copy of the prompt rows (KV-slot leftovers)
    return stream_chunk(item, item_meta(item, finish=ITEM_STOP, completion=ITEM_OUT,
                                   experts=b64(stale + item_rows(ITEM_PROMPT, ITEM_PROMPT + ITEM_OUT - 1, item)),
                                   input_lp=[], output_lp=output_lp(item, ITEM_OUT), finished=True),
                        ITEM_OUT)


def test_streamed_batch_item_is_not_joined_with_another_items_prefill():
    """Found by a review (2026-12-03). A stream batch (``text`` a list, or ``n > 1``, with ``stream: true``) is one HTTP request per
    leg whose chunks are per-item objects tagged ``"index"`` (``_stream_batch_responses``), not a
    JSON list, so ``_join_items`` never sees it. The prefill leg holds one final chunk per item; the
    codec folds them into one ``meta_info`` (the last item's wins) and joins every decode item with
    it: item 0's result got item 1's prompt rows and input logprobs. Now each item is joined with the
    prefill chunks of its own index, to exactly the aggregated item."""
    prefill = [dumps(item_prefill_chunk(0)), dumps(item_prefill_chunk(1))]
    decode = [dumps(item_decode_final(0)), dumps(item_decode_final(1))]
    results = join(SGLangCodec(OPTIONS), decode, prefill)
    for (body, verdict), item in zip(results, (0, 1)):
        got = json.loads(body)
        assert got["index"] == item
        m = got["meta_info"]
        want_rows = b64(item_rows(0, ITEM_PROMPT + ITEM_OUT - 1, item))
        assert m.get("routed_experts") == want_rows, (
            f"item {item}: published rows that are not its own (verdict {verdict.value})")
        assert m.get("input_token_logprobs") == input_lp(item), f"item {item}: another item's input logprobs"
        assert verdict is Verdict.JOINED
    # A prefill leg that is no batch: each item is joined as without one, never with that leg.
    results = join(SGLangCodec(OPTIONS), decode, [prefill[0][:-len(b',"index":0}')] + b"}"])
    for body, verdict in results:
        m = json.loads(body)["meta_info"]
        assert "routed_experts" not in m and m["routed_experts_unavailable_reason"] == "length_mismatch"
        assert verdict is Verdict.OMITTED



# ============================================================================================ vLLM

VPROMPT = [11, 12, 13, 14, 15]
VOUT = [21, 22, 23]
VL, VK = 3, 2


def npy_b64(arr: np.ndarray) -> str:
    """serving.py: ``buf = io.BytesIO(); np.save(buf, output.routed_experts); base64.b64encode``."""
    buf = io.BytesIO()
    np.save(buf, arr)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def vrows(start: int, end: int) -> np.ndarray:
    ids = [[[(p * 5 + layer * 3 + k * 7 + 1) % 64 + k * 64 for k in range(VK)] for layer in range(VL)]
           for p in range(start, end)]
    return np.asarray(ids, dtype=np.uint8)


def v_logprobs(ids: list[int], lps: list[float]) -> dict:
    """``_create_tokens_logprobs``: token ``token_id:N``, logprob, bytes None, top_logprobs."""
    return {"content": [{"token": f"token_id:{t}", "logprob": lp, "bytes": None,
                         "top_logprobs": [{"token": f"token_id:{t}", "logprob": lp, "bytes": None}]}
                        for t, lp in zip(ids, lps)]}


VLPS = [-0.5, -0.25, -1.0]
# clamp_prompt_logprobs(final_res.prompt_logprobs): list[dict[int, Logprob] | None], position 0 None;
# Logprob dataclass fields logprob, rank, decoded_token; int keys serialised as strings.
VPROMPT_LP = [None] + [{str(t): {"logprob": -1.0 - i, "rank": 1, "decoded_token": f"tok{t}"},
                        "7": {"logprob": -0.5, "rank": 0 + 1, "decoded_token": "é"}}
                       for i, t in enumerate(VPROMPT[1:])]


def v_unary(*, out, lps, experts, prompt_lp, kv=None, with_experts_field=True, finish="stop"):
    """``serve_tokens_full_generator`` -> GenerateResponse (protocol with model/created/usage)."""
    choice = {"index": 0, "logprobs": v_logprobs(out, lps), "finish_reason": finish, "token_ids": out}
    if with_experts_field:
        choice["routed_experts"] = experts
    return {"request_id": "generate-tokens-r1", "model": "m", "created": 1700000000, "choices": [choice],
            "usage": {"prompt_tokens": len(VPROMPT), "total_tokens": len(VPROMPT) + len(out),
                      "completion_tokens": len(out), "prompt_tokens_details": None},
            "prompt_logprobs": prompt_lp, "kv_transfer_params": kv}


def test_vllm_unary_pd_with_prompt_logprobs_joins_to_agg():
    total = len(VPROMPT) + len(VOUT) - 1
    agg = v_unary(out=VOUT, lps=VLPS, experts=npy_b64(vrows(0, total)), prompt_lp=VPROMPT_LP)
    # Prefill (max_tokens=1, kv_transfer_params do_remote_decode): rows [0, prompt), prompt logprobs.
    prefill = v_unary(out=VOUT[:1], lps=VLPS[:1], experts=npy_b64(vrows(0, len(VPROMPT))),
                      prompt_lp=VPROMPT_LP, finish="length",
                      kv={"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1],
                          "remote_engine_id": "e", "remote_host": "h", "remote_port": 1, "tp_size": 1})
    stale = np.zeros_like(vrows(0, len(VPROMPT)))
    decode = v_unary(out=VOUT, lps=VLPS, experts=npy_b64(np.concatenate([stale, vrows(len(VPROMPT), total)])),
                     prompt_lp=None)
    [(body, _)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert_same(body, dumps(agg))


def _v_stream(out_chunks, experts_last, *, include_usage=True, with_experts_field=True):
    """``serve_tokens_stream_generator``: one GenerateStreamResponse per delta (``model_dump_json``
    keeps nulls), then with include_usage a usage-only chunk dumped with ``exclude_none=True``."""
    bodies = []
    pos = 0
    for k, ids in enumerate(out_chunks):
        last = k == len(out_chunks) - 1
        choice = {"index": 0, "logprobs": v_logprobs(ids, VLPS[pos:pos + len(ids)]),
                  "finish_reason": "stop" if last else None, "token_ids": ids}
        if with_experts_field:
            choice["routed_experts"] = experts_last if last else None
        bodies.append({"request_id": "generate-tokens-r1", "choices": [choice], "usage": None})
        pos += len(ids)
    if include_usage:
        bodies.append({"request_id": "generate-tokens-r1", "choices": [],
                       "usage": {"prompt_tokens": len(VPROMPT), "total_tokens": len(VPROMPT) + pos,
                                 "completion_tokens": pos}})
    return bodies


@pytest.mark.parametrize("include_usage", [True, False])
def test_vllm_stream_pd_joins_to_agg(include_usage):
    total = len(VPROMPT) + len(VOUT) - 1
    agg = _v_stream([[21], [22, 23]], npy_b64(vrows(0, total)), include_usage=include_usage)
    prefill = v_unary(out=VOUT[:1], lps=VLPS[:1], experts=npy_b64(vrows(0, len(VPROMPT))), prompt_lp=None,
                      finish="length")
    decode = _v_stream([[21], [22, 23]], npy_b64(vrows(len(VPROMPT), total)), include_usage=include_usage)
    results = join(VLLMCodec(OPTIONS), [dumps(d) for d in decode], [dumps(prefill)])
    for (body, _), want in zip(results, agg):
        assert_same(body, dumps(want))


def test_vllm_n2_unary_pd_joins_to_agg():
    """n=2: usage counts both choices (``num_generated_tokens += len(output.token_ids)``)."""
    total0 = len(VPROMPT) + 3 - 1
    total1 = len(VPROMPT) + 2 - 1

    def body(experts0, experts1, plp, out1=(24, 25)):
        b = v_unary(out=VOUT, lps=VLPS, experts=experts0, prompt_lp=plp)
        c1 = {"index": 1, "logprobs": v_logprobs(list(out1), [-0.1, -0.2][:len(out1)]), "finish_reason": "length",
              "token_ids": list(out1), "routed_experts": experts1}
        b["choices"].append(c1)
        n = 3 + len(out1)
        b["usage"] = {"prompt_tokens": 5, "total_tokens": 5 + n, "completion_tokens": n, "prompt_tokens_details": None}
        return b
    agg = body(npy_b64(vrows(0, total0)), npy_b64(vrows(0, total1)), None)
    prefill = body(npy_b64(vrows(0, 5)), npy_b64(vrows(0, 5)), None, out1=(24,))
    prefill["choices"][0].update(token_ids=[21], logprobs=v_logprobs([21], [-0.5]), finish_reason="length")
    prefill["usage"] = {"prompt_tokens": 5, "total_tokens": 7, "completion_tokens": 2, "prompt_tokens_details": None}
    decode = body(npy_b64(np.concatenate([np.zeros_like(vrows(0, 5)), vrows(5, total0)])),
                  npy_b64(np.concatenate([np.zeros_like(vrows(0, 5)), vrows(5, total1)])), None)
    [(out, _)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert_same(out, dumps(agg))


def test_vllm_version_without_routed_experts_field_passes_through_like_agg():
    """protocol.py @ 06408932: ``GenerateResponseChoice`` = index, logprobs, finish_reason, token_ids
    (no routed_experts), ``GenerateResponse`` = request_id, choices, prompt_logprobs,
    kv_transfer_params. Neither leg (nor the aggregated engine) can carry experts; the P/D result
    must equal the aggregated body."""
    def old(out, lps, plp, finish="stop"):
        return {"request_id": "generate-tokens-r1",
                "choices": [{"index": 0, "logprobs": v_logprobs(out, lps), "finish_reason": finish,
                             "token_ids": out}],
                "prompt_logprobs": plp, "kv_transfer_params": None}
    agg = old(VOUT, VLPS, VPROMPT_LP)
    prefill = old(VOUT[:1], VLPS[:1], VPROMPT_LP, finish="length")
    decode = old(VOUT, VLPS, None)
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert_same(body, dumps(agg))
    assert verdict is not Verdict.OMITTED


# vLLM codec option stream_routed_experts: whether the deployment's stream choices have the field.
NO_STREAM_EXPERTS = CodecOptions(max_decompressed_bytes=1 << 20, format_options=(("stream_routed_experts", "no"),))


def _v_told(told: str | None) -> VLLMCodec:
    pairs = () if told is None else (("stream_routed_experts", told),)
    return VLLMCodec(CodecOptions(max_decompressed_bytes=1 << 20, format_options=pairs))


@pytest.mark.parametrize("include_usage", [True, False])
@pytest.mark.parametrize("prefill_leg", ["rows", "timeout"])
def test_vllm_stream_version_without_stream_routed_experts_matches_agg_stream(include_usage, prefill_leg):
    """protocol.py / serving.py of vllm/entrypoints/serve/disagg at furionw/vllm @ 9cdf7782 (a fork
    of vllm-project/vllm; the same protocol.py is in vllm-project/vllm's stored history, index id
    52130986979): ``GenerateResponseChoice`` has ``routed_experts`` and
    ``serve_tokens_full_generator`` fills it, but stream choices are
    ``GenerateResponseStreamChoice(index, logprobs, finish_reason, token_ids)``. The prefill leg
    (unary, max_tokens=1) carries prompt rows; the aggregated stream has no experts key. Told
    ``stream_routed_experts=no``, the join adds none (nor splices prefill's rows in), whatever the
    prefill leg did. Without the option this was a strict xfail (decode_missing on the last chunk)."""
    agg = _v_stream([[21], [22, 23]], None, with_experts_field=False, include_usage=include_usage)
    prefill = v_unary(out=VOUT[:1], lps=VLPS[:1], experts=npy_b64(vrows(0, len(VPROMPT))), prompt_lp=None,
                      finish="length")
    decode = _v_stream([[21], [22, 23]], None, with_experts_field=False, include_usage=include_usage)
    legs = [dumps(prefill)] if prefill_leg == "rows" else None
    results = join(VLLMCodec(NO_STREAM_EXPERTS), [dumps(d) for d in decode], legs)
    assert len(results) == len(agg)
    for (body, verdict), want in zip(results, agg):
        assert_same(body, dumps(want))
        assert verdict is not Verdict.OMITTED


@pytest.mark.parametrize("told", [None, "unknown", "yes"])
def test_vllm_stream_chunk_without_routed_experts_is_decode_missing_unless_told_streams_have_none(told):
    """The same bodies read as a version whose stream choices have the field (serving.py of
    scale_out/token_in_token_out at vllm-project/vllm @ 00a80787 passes ``routed_experts=`` to every
    ``GenerateResponseStreamChoice``): a finishing chunk without it lost decode's rows, which the
    aggregated stream would carry. The default (not told) keeps that safe reading."""
    prefill = v_unary(out=VOUT[:1], lps=VLPS[:1], experts=npy_b64(vrows(0, len(VPROMPT))), prompt_lp=None,
                      finish="length")
    decode = _v_stream([[21], [22, 23]], None, with_experts_field=False)
    results = join(_v_told(told), [dumps(d) for d in decode], [dumps(prefill)])
    finishing = json.loads(results[1][0])["choices"][0]
    assert finishing["routed_experts"] is None
    assert finishing["routed_experts_unavailable_reason"] == "decode_missing"
    assert results[1][1] is Verdict.OMITTED
    assert_same(results[0][0], dumps(decode[0]))  # a middle chunk is left alone either way


@pytest.mark.parametrize("include_usage", [True, False])
def test_vllm_stream_whose_chunks_carry_routed_experts_joins_to_agg_whatever_the_option_says(include_usage):
    """``stream_routed_experts=no`` only reads an absent key: a stream chunk that has the key shows
    the field exists, and is joined by the usual rules (here as test_vllm_stream_pd_joins_to_agg)."""
    total = len(VPROMPT) + len(VOUT) - 1
    agg = _v_stream([[21], [22, 23]], npy_b64(vrows(0, total)), include_usage=include_usage)
    prefill = v_unary(out=VOUT[:1], lps=VLPS[:1], experts=npy_b64(vrows(0, len(VPROMPT))), prompt_lp=None,
                      finish="length")
    decode = _v_stream([[21], [22, 23]], npy_b64(vrows(len(VPROMPT), total)), include_usage=include_usage)
    results = join(VLLMCodec(NO_STREAM_EXPERTS), [dumps(d) for d in decode], [dumps(prefill)])
    for (body, _), want in zip(results, agg):
        assert_same(body, dumps(want))


def test_vllm_unary_decode_without_routed_experts_stays_decode_missing_when_told_streams_have_none():
    """The option is about stream choices: in that version the unary choice has the field
    (``GenerateResponseChoice.routed_experts``, JSONResponse keeps nulls), so a unary decode body
    without the key (a null left out on the way) while prefill sent rows is still decode_missing."""
    prefill = v_unary(out=VOUT[:1], lps=VLPS[:1], experts=npy_b64(vrows(0, len(VPROMPT))), prompt_lp=None,
                      finish="length")
    decode = v_unary(out=VOUT, lps=VLPS, experts=None, prompt_lp=None, with_experts_field=False)
    [(body, verdict)] = join(VLLMCodec(NO_STREAM_EXPERTS), [dumps(decode)], [dumps(prefill)])
    choice = json.loads(body)["choices"][0]
    assert verdict is Verdict.OMITTED
    assert choice["routed_experts"] is None and choice["routed_experts_unavailable_reason"] == "decode_missing"


def test_a_batch_body_of_more_items_than_are_joined_ends_the_request_as_an_invalid_chunk():
    """Each item costs a join session: a 1 MiB list of tiny items would cost ~0.3 s of CPU."""
    from streamproc_sglang.join import MAX_BATCH_ITEMS

    from streamproc.codec import ContractError

    items = [{"meta_info": {}}] * (MAX_BATCH_ITEMS + 1)
    with pytest.raises(ContractError, match="at most"):
        join(SGLangCodec(OPTIONS), [dumps(items)], [dumps(items)])
    [(body, verdict)] = join(SGLangCodec(OPTIONS), [dumps(items[:-1])], [dumps(items[:-1])])
    assert verdict is Verdict.PASSTHROUGH and body == dumps(items[:-1])


def test_batch_items_are_held_to_the_processors_byte_budget_as_one_body_is():
    """Found by a review (2026-12-03): each item's join session had no ``decode_budget`` (the
    processor's global bound, which the correlator sets before every join), so a batch's items
    decoded past it. With almost nothing left, each item's rows are omitted ``too_large``."""
    cctx = zstandard.ZstdCompressor(level=3)
    agg, prefill, decode = sgl_case(top=False, ids_lp=False, encode=lambda raw: b64(cctx.compress(raw)))
    for prefill_body, decode_body, count in ((dumps(prefill), dumps(decode), 1),
                                             (dumps([prefill, prefill]), dumps([decode, decode]), 2)):
        session = SGLangZstdCodec(OPTIONS).open_session()
        session.decode_budget = 8  # the processor's max_total_bytes is all but used up
        session.absorb_prefill([prefill_body])
        session.needs_prefill(decode_body, True)
        body, _ = session.join(decode_body, True)
        doc = json.loads(body)
        items = doc if isinstance(doc, list) else [doc]
        assert [item["meta_info"].get("routed_experts_unavailable_reason") for item in items] == ["too_large"] * count


def test_a_streamed_batch_item_frees_its_prefill_rows_when_it_finishes_and_keeps_to_the_budget():
    """Found by a review (2026-12-03): each item's session kept its decoded prefill rows until the
    request's last chunk, uncounted in retained_bytes (so uncharged to --max-total-bytes), and each
    item was given the whole remaining budget. An item now ends at its own finishing chunk (rows
    freed there), the sessions' rows are counted, and each item gets what the others leave."""
    session = SGLangCodec(OPTIONS).open_session()
    session.absorb_prefill([dumps(item_prefill_chunk(0)), dumps(item_prefill_chunk(1))])
    body = dumps(item_decode_final(0))  # item 0 ends; item 1 (and the request) goes on
    session.needs_prefill(body, False)
    joined, verdict = session.join(body, False)
    assert json.loads(joined)["meta_info"]["routed_experts"] == b64(item_rows(0, ITEM_PROMPT + ITEM_OUT - 1, 0))
    # Freed when item 0 finished, not held to the request's end (and what any item holds is counted).
    assert [item.retained_bytes() for item in session._item_sessions.values()] == [0]
    assert session.retained_bytes() == 0
    tight = SGLangCodec(OPTIONS).open_session()
    tight.decode_budget = 8  # the processor's budget all but used up
    tight.absorb_prefill([dumps(item_prefill_chunk(0)), dumps(item_prefill_chunk(1))])
    tight.needs_prefill(body, False)
    joined, verdict = tight.join(body, False)
    assert json.loads(joined)["meta_info"]["routed_experts_unavailable_reason"] == "too_large"


def test_a_streamed_batch_naming_more_items_than_are_joined_ends_the_request_as_an_invalid_chunk():
    """Each index a decode chunk names costs a join session: a worker naming a new index in every
    chunk is refused past MAX_BATCH_ITEMS, as a batch body of that many items is."""
    from streamproc_sglang.join import MAX_BATCH_ITEMS

    from streamproc.codec import ContractError

    session = SGLangCodec(OPTIONS).open_session()
    session.absorb_prefill([dumps(item_prefill_chunk(0)), dumps(item_prefill_chunk(1))])
    chunk = item_decode_final(0)
    for index in range(MAX_BATCH_ITEMS):
        body = dumps({**chunk, "index": index})
        session.needs_prefill(body, False)
        session.join(body, False)
    body = dumps({**chunk, "index": MAX_BATCH_ITEMS})
    session.needs_prefill(body, False)
    with pytest.raises(ContractError, match="at most"):
        session.join(body, False)
