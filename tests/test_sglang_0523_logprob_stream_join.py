"""A P/D ``/generate`` stream with every logprob option joins to the aggregated stream (SGLang 0.5.23).

Independent differential check: the bodies below are written by hand from the SGLang 0.5.23 PyPI wheel
(``sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl``, paths relative to ``sglang/srt/``), not from
the simulator, ``streamproc_sglang.upstream`` or another test's fixtures. The request is
``{"stream": true, "return_logprob": true, "logprob_start_len": 0, "top_logprobs_num": 2,
"token_ids_logprob": [7, 9], "return_routed_experts": true, "sampling_params": {"stream_interval": 2}}``
on a server without ``--incremental-streaming-output`` (cumulative, the default) and with it (incremental),
for one sample and for ``n`` = 2 (a streamed batch: ``TokenizerManager._stream_batch_responses`` tags each
item's chunk ``result["index"] = rid_to_index[...]``).

Chunk boundaries, ``managers/scheduler_components/output_streamer.py`` ``OutputStreamer.accept``::

    num_unsent = len(req.output_ids) - req.send_token_offset
    should_output = (stream_interval == 1 or num_unsent >= stream_interval
                     or (req.send_token_offset == 0 and num_unsent > 0))

so with ``stream_interval`` 2 both the aggregated engine and P/D decode (whose first output is token 0,
committed from the transfer) send after 1, 3 and 5 (finished) tokens.

Body, ``managers/tokenizer_manager.py`` ``TokenizerManager._handle_batch_output`` (BatchStrOutput)::

    meta_info = {"id": rid, "finish_reason": ..., "prompt_tokens": ..., "weight_version": ...,
                 "num_retractions": ...}
    if getattr(state.obj, "return_logprob", False): self.convert_logprob_style(...)
    meta_info.update({"reasoning_tokens": ..., "completion_tokens": ..., "cached_tokens": ...})
    if recv_obj.weight_versions is not None and (spans := ...) is not None:
        add_weight_versions_to_meta_info(meta_info, spans, num_output_tokens=...)
    if hasattr(recv_obj, "cached_tokens_details") and recv_obj.cached_tokens_details:
        meta_info["cached_tokens_details"] = recv_obj.cached_tokens_details[i]
    ...
    if getattr(recv_obj, "routed_experts", None): ... meta_info["routed_experts"] = val
    ...
    elif state.finished: out_dict = {"text": state.get_text(), "output_ids": state.output_ids.copy(), ...}
    else:  # Non-incremental intermediate
        out_dict = {"text": None, "output_ids": state.output_ids, "meta_info": meta_info}
    ...
    if state.finished: meta_info["e2e_latency"] = state.time_stats.get_e2e_latency()

(``_wait_one_response`` fills the intermediate ``text`` with ``state.get_text()``.) The logprob block,
``TokenizerManager.add_logprob_to_meta_info``, writes the whole lists on every cumulative chunk, in the
order ``input_token_logprobs``, ``output_token_logprobs``, ``output_token_logprobs_length``,
``input_top_logprobs``, ``output_top_logprobs``, ``input_token_ids_logprobs``,
``output_token_ids_logprobs``; entries are ``(logprob, token_id, None)`` (``detokenize_logprob_tokens``
without ``return_text_in_logprobs``) and a position without values is ``None``
(``detokenize_top_logprobs_tokens``: ``if token_logprobs_val[i]: ... else: ret.append(None)``).

P/D legs:

- prefill (``disaggregation/prefill.py`` ``process_batch_result_disagg_prefill`` calls
  ``add_logprob_return_values`` for the prompt and output token 0, token-ids scores included
  (``logprob_result_processor.py``: ``req.logprob.output_token_ids_logprobs_val.append(...)``); the request
  finishes ``FINISH_LENGTH(0)``): one finished body, ``output_ids`` ``[t0]``, ``completion_tokens`` 1, the
  prompt's logprob lists, and the prompt's routed-expert rows;
- decode (``disaggregation/decode.py`` ``DecodeTransferQueue._commit_transfer_to_req`` appends token 0's
  logprob and top logprobs from the metadata buffer, and for token-ids scores
  ``# Prefill omits these scores; reserve a row for the streaming offset.`` an empty row, sent ``None``);
  the prompt side is never scored (``input_*`` lists ``[]``); its routed-expert rows cover
  ``[0, prompt + completion - 1)`` with the prompt rows stale.
"""

from __future__ import annotations

import base64
import json
from typing import Any, NamedTuple

import numpy as np
import pytest
import zstandard
from helpers import assert_same_body
from helpers import drive_join as join
from helpers import upstream_json as dumps
from sglang_0523_bodies import add_counts

from streamproc.codec import CodecOptions
from streamproc.wire import Verdict
from streamproc_sglang import SGLangCodec
from streamproc_sglang_zstd import SGLangZstdCodec

OPTIONS = CodecOptions(max_decompressed_bytes=1 << 20)
RID = "4f1c0c2a9d7e4b51a3f0c2d8e6b7a901"
TOKEN_IDS = [7, 9]
E2E = 0.75


class Item(NamedTuple):
    """One sample: its prompt, output ids, cumulative text after each chunk boundary, and finish."""
    prompt: list[int]
    out: list[int]
    texts: dict[int, str]
    finish: dict[str, Any]


# Tokens 202 and 203 are the two bytes of "é": the detokenizer holds the first back (an incomplete UTF-8
# sequence decodes to U+FFFD, which ``DetokenizerManager`` does not emit), so the text after three tokens
# ends in "é" whole on both legs.
A = Item([11, 12, 13, 14], [201, 202, 203, 204, 205], {1: "H", 3: "Hé", 5: "Hé w!"}, {"type": "length", "length": 5})
# ``n`` = 2: ``_handle_batch_request`` sends the same prompt again, with ``regenerate_rid()``.
B = Item(A.prompt, [301, 302, 303, 304, 305], {1: "O", 3: "Ok,", 5: "Ok, ☃"}, A.finish)
# A batch of two prompts (``text: [..., ...]``): the second is longer and ends on EOS after 3 tokens
# (``FINISH_MATCHED_TOKEN.to_json()``).
C = Item([21, 22, 23, 24, 25, 26], [401, 402, 2], {1: "Y", 3: "Yes"}, {"type": "stop", "matched": 2})


def rows(item: Item) -> np.ndarray:
    """One row per token position ``[0, prompt + completion - 1)``: 2 layers x top-2, int32."""
    return np.array([[3 + p + item.out[0] % 7, 17 + p, 40 + p, 5 + p]
                     for p in range(len(item.prompt) + len(item.out) - 1)], dtype="<i4")


def _top(pos: int, base: int) -> list:
    return [[-0.03125 * (pos + 1), base + pos, None], [-3.0 - pos, base + 50 + pos, None]]


def _ids_row(pos: int, off: float) -> list:
    return [[-4.0 - pos - off, TOKEN_IDS[0], None], [-6.0 - pos - off, TOKEN_IDS[1], None]]


def _rows_b64(rows: np.ndarray, zstd: bool) -> str:
    raw = np.ascontiguousarray(rows, dtype="<i4").tobytes()
    if zstd:
        raw = zstandard.ZstdCompressor(level=3).compress(raw)
    return base64.b64encode(raw).decode()


def _meta(item: Item, lo: int, n: int, *, finished: bool, side: str, experts: str | None) -> dict[str, Any]:
    """``_handle_batch_output``'s ``meta_info`` after ``n`` output tokens of leg ``side``; the output lists
    start at ``lo`` (``_slice_streaming_output_meta_info`` in incremental mode, 0 when cumulative)."""
    out, prompt, salt = item.out, item.prompt, item.out[0] % 7
    meta: dict[str, Any] = {
        "id": f"{RID}-{out[0]}-{side == 'prefill'}",
        "finish_reason": item.finish if finished else None,
        "prompt_tokens": len(prompt), "weight_version": "default", "num_retractions": 0,
    }
    pd_decode = side == "decode"
    meta.update({
        "input_token_logprobs": [] if pd_decode else
        [[None if p == 0 else -0.5 * p - salt, t, None] for p, t in enumerate(prompt)],
        "output_token_logprobs": [[-0.0625 * (p + 1 + salt), out[p], None] for p in range(lo, n)],
        "output_token_logprobs_length": n,
        "input_top_logprobs": [] if pd_decode else [None] + [_top(p, 1000 + salt) for p in range(1, len(prompt))],
        "output_top_logprobs": [_top(p, 2000 + 100 * salt) for p in range(lo, n)],
        "input_token_ids_logprobs": [] if pd_decode else [None] + [_ids_row(p, 0.5) for p in range(1, len(prompt))],
        "output_token_ids_logprobs": [None if pd_decode and p == 0 else _ids_row(p, 0.25 * (1 + salt))
                                      for p in range(lo, n)],
    })
    add_counts(meta, n, finished=finished)
    if experts is not None:
        meta["routed_experts"] = experts
    if finished:
        meta["e2e_latency"] = E2E
    return meta


def _body(item: Item, index: int | None, prev: int, n: int, *, side: str, incremental: bool,
          experts: str | None = None, finished: bool | None = None) -> dict[str, Any]:
    lo = prev if incremental else 0
    text = item.texts[n]
    if incremental and prev:
        text = text[len(item.texts[prev]):]
    finished = n == len(item.out) if finished is None else finished
    body = {"text": text, "output_ids": item.out[lo:n],
            "meta_info": _meta(item, lo, n, finished=finished, side=side, experts=experts)}
    if index is not None:
        body["index"] = index  # _stream_batch_responses: result["index"] = rid_to_index[...]
    return body


# (item, its index or None for a single request, previous boundary, boundary), in the order
# ``_stream_batch_responses`` yields them (whichever generator has output first).
ORDERS = {
    "one": [(A, None, 0, 1), (A, None, 1, 3), (A, None, 3, 5)],
    "n2": [(A, 0, 0, 1), (B, 1, 0, 1), (A, 0, 1, 3), (B, 1, 1, 3), (B, 1, 3, 5), (A, 0, 3, 5)],
    # Item 1 (longer prompt) finishes first, after 3 tokens; item 0 goes on.
    "batch": [(A, 0, 0, 1), (C, 1, 0, 1), (C, 1, 1, 3), (A, 0, 1, 3), (A, 0, 3, 5)],
    # A reader that fell behind gets ``_coalesce_streaming_chunks`` of the queued incremental chunks: token
    # 0's chunk and the next one as one body over ``[0, 3)`` (output lists concatenated, the rest the last's).
    "coalesced": [(A, None, 0, 3), (A, None, 3, 5)],
}


def _items(order: str) -> list[tuple[Item, int | None]]:
    seen: dict[int, tuple[Item, int | None]] = {}
    for item, index, _, _ in ORDERS[order]:
        seen.setdefault(-1 if index is None else index, (item, index))
    return [seen[k] for k in sorted(seen)]


def aggregated(zstd: bool, *, incremental: bool = False, order: str = "one") -> list[bytes]:
    return [dumps(_body(item, index, prev, n, side="agg", incremental=incremental,
                        experts=_rows_b64(rows(item), zstd) if n == len(item.out) else None))
            for item, index, prev, n in ORDERS[order]]


def prefill(zstd: bool, *, incremental: bool = False, order: str = "one") -> list[bytes]:
    """The prefill leg: per item one finished body for token 0, ``FINISH_LENGTH(0)``, the prompt's rows."""
    out = []
    for item, index in _items(order):
        body = _body(item, index, 0, 1, side="prefill", incremental=incremental, finished=True,
                     experts=_rows_b64(rows(item)[:len(item.prompt)], zstd))
        body["meta_info"]["finish_reason"] = {"type": "length", "length": 0}
        out.append(dumps(body))
    return out


def decode(zstd: bool, *, incremental: bool = False, order: str = "one") -> list[bytes]:
    def stale(item: Item) -> np.ndarray:
        r = rows(item)
        r[:len(item.prompt)] = [[60 + p, 61 + p, 62 + p, 63 + p] for p in range(len(item.prompt))]  # KV leftovers
        return r

    return [dumps(_body(item, index, prev, n, side="decode", incremental=incremental,
                        experts=_rows_b64(stale(item), zstd) if n == len(item.out) else None))
            for item, index, prev, n in ORDERS[order]]


def _same_but_ids(got: bytes, want: bytes) -> None:
    """Equal byte for byte once ``meta_info.id`` (``regenerate_rid``: each server's own) is the same."""
    g = json.loads(got)
    g["meta_info"]["id"] = json.loads(want)["meta_info"]["id"]
    assert dumps(g) == want


def _rows_of(body: bytes, zstd: bool) -> bytes:
    raw = base64.b64decode(json.loads(body)["meta_info"]["routed_experts"])
    return zstandard.ZstdDecompressor().decompress(raw) if zstd else raw


def test_every_joined_cumulative_chunk_equals_the_aggregated_chunk_byte_for_byte():
    agg = aggregated(zstd=False)
    out = join(SGLangCodec(OPTIONS), decode(zstd=False), prefill(zstd=False))
    assert [v for _, v in out] == [Verdict.JOINED] * len(agg)
    for (got, _), want in zip(out, agg):
        _same_but_ids(got, want)


@pytest.mark.parametrize("order", ["n2", "batch"])
@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
def test_every_joined_chunk_of_a_streamed_batch_equals_the_aggregated_item_chunk(incremental, order):
    """``n`` = 2, or two prompts of different lengths whose second finishes first: items interleaved and
    tagged ``index``; each item's chunks join with that item's prefill body (its own prompt lists and rows),
    the output lists sliced per chunk in incremental mode and restated in cumulative."""
    kw = {"incremental": incremental, "order": order}
    agg = aggregated(False, **kw)
    assert all(d != a for d, a in zip(decode(False, **kw), agg))  # every chunk needs the join
    out = join(SGLangCodec(OPTIONS), decode(False, **kw), prefill(False, **kw))
    assert [v for _, v in out] == [Verdict.JOINED] * len(agg)
    for (got, _), want in zip(out, agg):
        _same_but_ids(got, want)


def test_a_coalesced_incremental_chunk_holding_token_0_joins_to_the_same_coalesced_aggregated_chunk():
    """Decode's reserved ``None`` row and ``[]`` prompt lists sit in a chunk over ``[0, 3)``: position 0 is still
    the slice's first (``output_token_logprobs_length`` equals the list's length), and it is filled there."""
    kw = {"incremental": True, "order": "coalesced"}
    agg = aggregated(False, **kw)
    out = join(SGLangCodec(OPTIONS), decode(False, **kw), prefill(False, **kw))
    assert [v for _, v in out] == [Verdict.JOINED] * len(agg)
    for (got, _), want in zip(out, agg):
        _same_but_ids(got, want)


def test_the_zstd_join_restores_the_aggregated_rows_and_every_other_field():
    agg = aggregated(zstd=True)
    out = join(SGLangZstdCodec(OPTIONS), decode(zstd=True), prefill(zstd=True))
    assert [v for _, v in out] == [Verdict.JOINED] * len(agg)
    for (got, _), want in zip(out[:-1], agg[:-1]):
        _same_but_ids(got, want)
    got, want = out[-1][0], agg[-1]
    assert _rows_of(got, zstd=True) == rows(A).tobytes()
    g, w = json.loads(got), json.loads(want)
    g["meta_info"]["routed_experts"] = w["meta_info"]["routed_experts"] = "rows"
    g["meta_info"]["id"] = w["meta_info"]["id"]
    assert_same_body(dumps(g), dumps(w))


@pytest.mark.parametrize("codec", [SGLangCodec, SGLangZstdCodec])
def test_without_a_prefill_leg_no_chunk_carries_decode_prompt_side_or_stale_rows(codec):
    """The prefill leg timed out: every chunk omits the prompt-side lists (decode's ``[]`` would read as an
    empty window), position 0's token-ids row and the routed experts, with reasons; nothing stale is kept."""
    zstd = codec is SGLangZstdCodec
    out = join(codec(OPTIONS), decode(zstd=zstd), None)
    for body, verdict in out:
        assert verdict is Verdict.OMITTED
        meta = json.loads(body)["meta_info"]
        assert meta["input_logprobs_unavailable_reason"] == "prefill_timeout"
        for key in ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs"):
            assert key not in meta
        ids = meta.get("output_token_ids_logprobs")  # decode's reserved row 0: null, with its reason
        assert ids is None or ids[0] is not None \
            or meta["output_token_ids_logprobs_unavailable_reason"] == "prefill_timeout"
    final = json.loads(out[-1][0])["meta_info"]
    assert "routed_experts" not in final
    assert final["routed_experts_unavailable_reason"] == "prefill_timeout"
    assert "weight_versions" not in final
