"""Format-fidelity review of the ``sglang`` codecs against SGLang 0.5.23: parallel sampling (``n > 1``).

Source: the PyPI wheel ``sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl`` (paths relative to
``sglang/srt/``). Bodies are written by hand from the functions quoted here: nothing comes from the
simulator (``worker.py``) or ``upstream.py``.

``io_struct.GenerateReqInput._handle_parallel_sampling`` turns a single prompt with ``n > 1`` into a
batch, and ``TokenizerManager._handle_batch_request`` sends ``n`` copies of each prompt, in order::

    for i in range(batch_size):
        for _ in range(obj.parallel_sample_num):
            ...
            tokenized_obj.rid = tmp_obj.regenerate_rid()      # a fresh uuid per sample, per server
            generators.append(self._wait_one_response(tmp_obj, request))
            rids.append(tmp_obj.rid)
    is_stream = hasattr(obj, "stream") and obj.stream
    if not is_stream:
        outputs = await self._collect_batch_responses(generators)   # asyncio.gather: rids order
        yield outputs                                               # one JSON list
    else:
        async for response in self._stream_batch_responses(generators, rids):
            yield response

and ``_stream_batch_responses`` tags each item's chunk with its place in that order, yielding the
items' chunks as they come (interleaved)::

    rid_to_index = {rid: i for i, rid in enumerate(rids)}
    ...
        result = task.result()
        result["index"] = rid_to_index[result["meta_info"]["id"]]
        yield result

Each item's own chunks are ``_stream_one_response``'s (``_handle_batch_output``'s bodies, no
``"index"``). So the unary answer of a streamed ``n > 1`` request (what the edge builds with
``Codec.fold`` for a client that asked for one body) is the list the same request answers without
streaming: item ``k`` folded from the chunks tagged ``k``, without the tag, in index order. Index
``k`` is ``i * n + j`` on both P/D legs (the rids differ: ``regenerate_rid`` runs on each server), so
items pair by index, never by ``meta_info.id``.

(0.5.23 copies ``objs[i]``'s one ``bootstrap_room`` into all ``n`` samples of prompt ``i``, so a
decode sample can take another sample's KV and token 0: sgl-project/sglang PRs #26486, #30723,
#40297 on P/D ``n > 1`` hangs. The samples share the prompt, so its rows and logprobs are the same;
the join's token-0 fields check the token id. Not a defect of the join.)
"""

from __future__ import annotations

import base64
import json
import os
from typing import Any

import numpy as np
import pytest
from helpers import assert_same_body
from helpers import drive_join as join
from helpers import least_seconds
from helpers import upstream_json as dumps
from streamproc_sglang import SGLangCodec
from streamproc_sglang_zstd import SGLangZstdCodec

from streamproc.codec import CodecOptions
from streamproc.wire import Verdict

OPTIONS = CodecOptions(max_decompressed_bytes=1 << 20)
PROMPT = 4
LAYERS, TOPK = 2, 2
OUT = {0: [201, 202, 203], 1: [211, 212, 213]}
TEXT = {0: ["He", "llo", "!"], 1: ["Hi", " there", "."]}
LP = {item: [[-0.25 - p / 8 - item, tok, None] for p, tok in enumerate(OUT[item])] for item in OUT}
STOP = {"type": "length", "length": 3}
# disaggregation/prefill.py process_disagg_prefill_inflight_queue: FINISH_LENGTH(length=0)
PREFILL_FINISH = {"type": "length", "length": 0}


def meta(item: int, *, finish: Any, completion: int, version: str = "0.5.23", lp: list | None = None,
         length: int | None = None, experts: str | None = None) -> dict[str, Any]:
    """``TokenizerManager._handle_batch_output``, BatchStrOutput, one item. 0.5.23 writes
    ``num_retractions``, ``reasoning_tokens``, ``weight_versions`` (finished bodies:
    ``add_weight_versions_to_meta_info``) and ``cached_tokens_details``; older trees build
    ``{"id", "finish_reason", "prompt_tokens", "weight_version", "total_retractions"}``, then
    ``completion_tokens`` and ``cached_tokens``, and no spans."""
    new = version == "0.5.23"
    m: dict[str, Any] = {"id": f"rid-{item}", "finish_reason": finish, "prompt_tokens": PROMPT,
                         "weight_version": "default", ("num_retractions" if new else "total_retractions"): 0}
    if lp is not None:  # add_logprob_to_meta_info, top_logprobs_num=0, default logprob_start_len
        m.update({"input_token_logprobs": [], "output_token_logprobs": lp,
                  "output_token_logprobs_length": length})
    if new:
        m["reasoning_tokens"] = 0
    m["completion_tokens"] = completion
    m["cached_tokens"] = 0
    if new and finish is not None:
        m["weight_versions"] = [{"version": "default", "start": 0, "end": completion}]
    if new:
        m["cached_tokens_details"] = None
    if experts is not None:
        m["routed_experts"] = experts
    if finish is not None:
        m["e2e_latency"] = 0.5
    return m


def stream_chunk(item: int, lo: int, end: int, *, cumulative: bool, **kw: Any) -> dict[str, Any]:
    """One chunk of item ``item`` over output positions ``[lo, end)``: cumulative mode restates text,
    ids and ``output_token_logprobs`` from 0, incremental mode sends the span
    (``_slice_streaming_output_meta_info``); then ``result["index"] = ...``."""
    start = 0 if cumulative else lo
    finish = STOP if end == 3 else None
    m = meta(item, finish=finish, completion=end, lp=LP[item][start:end], length=end, **kw)
    return {"text": "".join(TEXT[item][start:end]), "output_ids": OUT[item][start:end], "meta_info": m,
            "index": item}


# The order the two samples' chunks reached _stream_batch_responses (asyncio.wait, FIRST_COMPLETED).
SPANS = [(0, 0, 1), (1, 0, 1), (1, 1, 2), (0, 1, 3), (1, 2, 3)]


@pytest.mark.parametrize("codec", [SGLangCodec, SGLangZstdCodec])
@pytest.mark.parametrize("cumulative", [True, False])
def test_a_folded_n_gt_1_stream_is_the_list_the_unary_request_answers(codec, cumulative):
    """Found by this review: ``fold`` merged every item's chunks into one body (item 1's text after
    item 0's, their ids interleaved, ``"index"`` of the last chunk), which the edge served as the
    unary answer. The unary ``n > 1`` answer is ``yield outputs``: a list, item ``k`` in index order."""
    stream = [dumps(stream_chunk(item, lo, end, cumulative=cumulative)) for item, lo, end in SPANS]
    unary = [{"text": "".join(TEXT[item]), "output_ids": OUT[item],
              "meta_info": meta(item, finish=STOP, completion=3, lp=LP[item], length=3)} for item in (0, 1)]
    assert_same_body(codec(OPTIONS).fold(stream), dumps(unary))


def test_folding_a_streamed_batch_with_a_missing_or_unnamed_item_is_refused():
    """A stream whose items are not 0..n-1 lost one (every item sends at least its finishing chunk),
    and a chunk naming no item cannot be placed: no list answers either, so ``fold`` refuses (the edge
    answers with its error body) instead of guessing."""
    item0 = dumps(stream_chunk(0, 0, 3, cumulative=True))
    item2 = dumps({**stream_chunk(1, 0, 3, cumulative=True), "index": 2})
    plain = dumps({key: value for key, value in stream_chunk(1, 0, 3, cumulative=True).items() if key != "index"})
    for stream in ([item0, item2], [item0, plain], [plain, item0]):
        with pytest.raises(ValueError):
            SGLangCodec(OPTIONS).fold(stream)
    # An ordinary (unindexed) stream still folds to one body.
    assert json.loads(SGLangCodec(OPTIONS).fold([plain]))["output_ids"] == OUT[1]


@pytest.mark.parametrize("codec", [SGLangCodec, SGLangZstdCodec])
def test_a_streamed_batch_of_one_in_one_chunk_folds_to_a_list_of_one_and_other_single_bodies_stay(codec):
    """``text: ["..."]`` is a batch of one (``_determine_batch_size``: ``is_single = False``); its one
    streamed chunk is tagged ``"index": 0`` and its unary answer is ``[item]`` (``yield outputs``).
    ``folds_alone`` tells the edge that one result needs ``fold``; ``fold`` of one body that is no
    batch item gives back the very bytes (the edge served them verbatim before, and still does)."""
    one = dumps(stream_chunk(0, 0, 3, cumulative=True))
    unary = [{"text": "".join(TEXT[0]), "output_ids": OUT[0],
              "meta_info": meta(0, finish=STOP, completion=3, lp=LP[0], length=3)}]
    assert codec(OPTIONS).folds_alone(one)
    assert_same_body(codec(OPTIONS).fold([one]), dumps(unary))
    plain = b'{"text": "index", "meta_info": {"id": "rid-1"}}'  # "index" as a value: folded, then verbatim
    for body in (plain, b'{"text":"Hi","meta_info":{}}', dumps(unary), b'[{"text": "index"}]'):
        assert codec(OPTIONS).fold([body]) == body
    assert not codec(OPTIONS).folds_alone(b'{"text":"Hi","meta_info":{}}')


@pytest.mark.parametrize("codec", [SGLangCodec, SGLangZstdCodec])
def test_folds_alone_costs_the_same_for_a_large_sglang_shaped_unary_body_as_for_a_small_one(codec):
    """``folds_alone`` runs on the edge's event loop for every unary answer of one result (every
    non-streamed request's). ``result["index"] = ...`` is set on the item's finished dict
    (``_stream_batch_responses``), after ``text``, ``output_ids``, ``meta_info`` and
    ``prompt_token_ids``, so the key is the body's last; searching all of a 64 MiB body with
    ``routed_experts`` (no ``"index"``) held the loop ~60 ms. The abort look stops at the finish
    reason, which ``_handle_batch_output`` writes right after the id, in front of the rows. A tagged
    chunk still folds, trailing whitespace included."""
    big = (b'{"text":"x","output_ids":[1],"meta_info":{"id":"rid-0","finish_reason":{"type":"length",'
           b'"length":1},"routed_experts":"' + base64.b64encode(os.urandom(48 << 20)) + b'"}}')
    c = codec(OPTIONS)
    assert not c.folds_alone(big)
    spent = least_seconds(lambda: c.folds_alone(big))
    assert spent < 0.002, f"{spent * 1e3:.1f} ms for a {len(big) >> 20} MiB body"
    tagged = big[:-1] + b',"index":0}'
    assert c.folds_alone(tagged) and c.folds_alone(tagged + b"\n") and c.folds_alone(b'{"index": 12345} \r\n')


# ============================================================================ P/D: an item that ends first

def rows(start: int, end: int, item: int) -> bytes:
    """int32 expert ids of positions [start, end) of item ``item``, distinct per layer."""
    ids = [[(p * 7 + j * 3 + 1 + item * 11) % 61 + (j % TOPK) * 61 for j in range(LAYERS * TOPK)]
           for p in range(start, end)]
    return np.asarray(ids, dtype="<i4").tobytes()


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()  # _handle_batch_output: pybase64.b64encode(val.numpy().tobytes())


def item_chunk(item: int, out: list[int], m: dict[str, Any]) -> dict[str, Any]:
    return {"text": "", "output_ids": out, "meta_info": m, "index": item}


ONE = {"type": "length", "length": 1}


def one_token_item_legs(version: str) -> tuple[list[bytes], list[bytes], dict[str, Any]]:
    """Item 0 asks ``max_new_tokens=1`` and finishes while item 1 still streams (batch items may carry
    their own sampling params). Aggregated: ``process_batch_result_prefill`` collects item 0's rows
    when it finishes, ``[0, prompt + 1 - 1)``, its prompt rows. P/D decode: token 0 arrives through the
    metadata buffer and ``process_batch_result_prebuilt`` finishes the request::

        req.update_finish_state()
        if req.finished(): ... release_kv_cache(req, self.tree_cache, checkpoint=True)
        self.output_streamer.stream_output(batch.reqs, batch.return_logprob)

    with no ``_maybe_collect_routed_experts``: decode's item 0 has no rows. The prefill leg has them."""
    prefill = [dumps(item_chunk(item, [OUT[item][0]], meta(item, finish=PREFILL_FINISH, completion=1,
                                                            version=version, experts=b64(rows(0, PROMPT, item)))))
               for item in (0, 1)]
    stale = rows(0, PROMPT, 7)  # decode's copy of the prompt rows: KV-slot leftovers
    decode = [
        dumps(item_chunk(0, OUT[0][:1], meta(0, finish=ONE, completion=1, version=version))),
        dumps(item_chunk(1, OUT[1][:1], meta(1, finish=None, completion=1, version=version))),
        dumps(item_chunk(1, OUT[1], meta(1, finish=STOP, completion=3, version=version,
                                         experts=b64(stale + rows(PROMPT, PROMPT + 2, 1))))),
    ]
    agg_item0 = item_chunk(0, OUT[0][:1], meta(0, finish=ONE, completion=1, version=version,
                                               experts=b64(rows(0, PROMPT, 0))))
    return prefill, decode, agg_item0


@pytest.mark.parametrize("version", ["0.5.23", "0.5"])
def test_an_n_gt_1_item_that_finishes_before_the_last_gets_its_prefill_rows(version):
    """Found by this review. An item's finishing chunk is not the leg's last when another item still
    streams, so it waited for prefill only if it carried logprobs, rows or ``weight_versions``. 0.5.23
    writes spans on every finished body, so it waits; a tree without them sent item 0 on as decode
    wrote it: no rows and no reason, where the aggregated item has its prompt rows. An item's own
    finish now ends it for the join, as it already did for freeing its rows (``_join_indexed``)."""
    prefill, decode, agg_item0 = one_token_item_legs(version)
    results = join(SGLangCodec(OPTIONS), decode, prefill)
    out, verdict = results[0]
    assert_same_body(out, dumps(agg_item0))
    assert verdict is Verdict.JOINED
    last = json.loads(results[2][0])["meta_info"]
    assert last["routed_experts"] == b64(rows(0, PROMPT + 2, 1))  # item 1: its own prompt rows, not item 0's


@pytest.mark.parametrize("cumulative", [True, False])
def test_a_joined_pd_n_gt_1_stream_folds_to_the_aggregated_unary_list(cumulative):
    """End to end: a P/D ``n = 2`` stream (decode's prompt rows stale, no prompt logprobs) joined chunk
    by chunk with the prefill leg's items by index, then folded, is the aggregated unary answer."""
    def experts(item: int, prefix: bytes) -> str:
        return b64(prefix + rows(PROMPT, PROMPT + 2, item))

    def leg(pd: bool) -> list[bytes]:
        out = []
        for item, lo, end in SPANS:
            kw = {"experts": experts(item, rows(0, PROMPT, 7) if pd else rows(0, PROMPT, item))} if end == 3 else {}
            out.append(dumps(stream_chunk(item, lo, end, cumulative=cumulative, **kw)))
        return out

    prefill = []
    for item in (0, 1):
        m = meta(item, finish=PREFILL_FINISH, completion=1, lp=LP[item][:1], length=1,
                 experts=b64(rows(0, PROMPT, item)))
        prefill.append(dumps({"text": TEXT[item][0], "output_ids": OUT[item][:1], "meta_info": m, "index": item}))
    joined = [body for body, _ in join(SGLangCodec(OPTIONS), leg(pd=True), prefill)]
    unary = [{"text": "".join(TEXT[item]), "output_ids": OUT[item],
              "meta_info": meta(item, finish=STOP, completion=3, lp=LP[item], length=3,
                                experts=experts(item, rows(0, PROMPT, item)))} for item in (0, 1)]
    assert_same_body(SGLangCodec(OPTIONS).fold(joined), dumps(unary))
    assert SGLangCodec(OPTIONS).fold(joined) == SGLangCodec(OPTIONS).fold(leg(pd=False))
