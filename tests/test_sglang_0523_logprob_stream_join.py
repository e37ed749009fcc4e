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
from typing import Any

import numpy as np
import pytest
import zstandard
from helpers import assert_same_body
from helpers import drive_join as join
from helpers import upstream_json as dumps

from streamproc.codec import CodecOptions
from streamproc.wire import Verdict
from streamproc_sglang import SGLangCodec
from streamproc_sglang_zstd import SGLangZstdCodec

OPTIONS = CodecOptions(max_decompressed_bytes=1 << 20)
RID = "4f1c0c2a9d7e4b51a3f0c2d8e6b7a901"
PROMPT = [11, 12, 13, 14]
# Item 1 (``n`` = 2: ``_handle_batch_request`` sends the prompt twice, each with ``regenerate_rid()``).
OUTS = ([201, 202, 203, 204, 205], [301, 302, 303, 304, 305])
# Tokens 202 and 203 are the two bytes of "é": the detokenizer holds the first back (an incomplete
# UTF-8 sequence decodes to U+FFFD, which ``DetokenizerManager`` does not emit), so the text after three
# tokens ends in "é" whole on both legs.
TEXTS = ({1: "H", 3: "Hé", 5: "Hé w!"}, {1: "O", 3: "Ok,", 5: "Ok, ☃"})
BOUNDARIES = (1, 3, 5)
TOKEN_IDS = [7, 9]
E2E = 0.75
IN_LP = [None, -2.5, -1.25, -0.5]


def rows(item: int) -> np.ndarray:
    """One row per token position ``[0, prompt + completion - 1)``: 2 layers x top-2, int32."""
    return np.array([[3 + p + item, 17 + p, 40 + p + item, 5 + p] for p in range(len(PROMPT) + 4)], dtype="<i4")


def _in_token_logprobs() -> list:
    return [[lp, t, None] for lp, t in zip(IN_LP, PROMPT)]


def _top(pos: int, base: int) -> list:
    return [[-0.03125 * (pos + 1), base + pos, None], [-3.0 - pos, base + 50 + pos, None]]


def _in_top() -> list:
    return [None] + [_top(p, 1000) for p in range(1, len(PROMPT))]


def _ids_row(pos: int, off: float) -> list:
    return [[-4.0 - pos - off, TOKEN_IDS[0], None], [-6.0 - pos - off, TOKEN_IDS[1], None]]


def _in_ids() -> list:
    return [None] + [_ids_row(p, 0.5) for p in range(1, len(PROMPT))]


def _rows_b64(rows: np.ndarray, zstd: bool) -> str:
    raw = np.ascontiguousarray(rows, dtype="<i4").tobytes()
    if zstd:
        raw = zstandard.ZstdCompressor(level=3).compress(raw)
    return base64.b64encode(raw).decode()


def _meta(item: int, lo: int, n: int, *, finished: bool, side: str, experts: str | None) -> dict[str, Any]:
    """``_handle_batch_output``'s ``meta_info`` after ``n`` output tokens of leg ``side``; the output lists
    start at ``lo`` (``_slice_streaming_output_meta_info`` in incremental mode, 0 when cumulative)."""
    out = OUTS[item]
    meta: dict[str, Any] = {
        "id": f"{RID}-{item}-{side == 'prefill'}",
        "finish_reason": {"type": "length", "length": 5} if finished else None,
        "prompt_tokens": len(PROMPT), "weight_version": "default", "num_retractions": 0,
    }
    pd_decode = side == "decode"
    meta.update({
        "input_token_logprobs": [] if pd_decode else _in_token_logprobs(),
        "output_token_logprobs": [[-0.0625 * (p + 1 + item), out[p], None] for p in range(lo, n)],
        "output_token_logprobs_length": n,
        "input_top_logprobs": [] if pd_decode else _in_top(),
        "output_top_logprobs": [_top(p, 2000 + 100 * item) for p in range(lo, n)],
        "input_token_ids_logprobs": [] if pd_decode else _in_ids(),
        "output_token_ids_logprobs": [None if pd_decode and p == 0 else _ids_row(p, 0.25 * (1 + item))
                                      for p in range(lo, n)],
    })
    meta.update({"reasoning_tokens": 0, "completion_tokens": n, "cached_tokens": 0})
    if finished:
        # add_weight_versions_to_meta_info: weight_versions, then weight_version (already a key) updated.
        meta["weight_versions"] = [{"version": "default", "start": 0, "end": n}]
        meta["weight_version"] = "default"
    meta["cached_tokens_details"] = None
    if experts is not None:
        meta["routed_experts"] = experts
    if finished:
        meta["e2e_latency"] = E2E
    return meta


def _body(item: int, prev: int, n: int, *, side: str, incremental: bool, batch: bool,
          experts: str | None = None, finished: bool | None = None) -> dict[str, Any]:
    lo = prev if incremental else 0
    text = TEXTS[item][n]
    if incremental and prev:
        text = text[len(TEXTS[item][prev]):]
    finished = n == len(OUTS[item]) if finished is None else finished
    body = {"text": text, "output_ids": OUTS[item][lo:n],
            "meta_info": _meta(item, lo, n, finished=finished, side=side, experts=experts)}
    if batch:
        body["index"] = item  # _stream_batch_responses: result["index"] = rid_to_index[...]
    return body


# A reader that fell behind gets ``_coalesce_streaming_chunks`` of the queued incremental chunks: token 0's
# chunk and the next one as one body over ``[0, 3)`` (the output lists concatenated, the rest the last's).
COALESCED = [(0, 0, 3), (0, 3, 5)]


def _order(batch: bool, coalesced: bool = False) -> list[tuple[int, int, int]]:
    """(item, previous boundary, boundary) in the order ``_stream_batch_responses`` yields them."""
    if coalesced:
        return COALESCED
    steps = [(0, 0, 1), (1, 0, 1), (0, 1, 3), (1, 1, 3), (1, 3, 5), (0, 3, 5)]
    return steps if batch else [s for s in steps if s[0] == 0]


def aggregated(zstd: bool, *, incremental: bool = False, batch: bool = False,
               coalesced: bool = False) -> list[bytes]:
    return [dumps(_body(i, prev, n, side="agg", incremental=incremental, batch=batch,
                        experts=_rows_b64(rows(i), zstd) if n == 5 else None)) for i, prev, n in _order(batch, coalesced)]


def prefill(zstd: bool, *, incremental: bool = False, batch: bool = False) -> list[bytes]:
    """The prefill leg: per item one finished body for token 0, ``FINISH_LENGTH(0)``, the prompt's rows."""
    out = []
    for item in range(2 if batch else 1):
        body = _body(item, 0, 1, side="prefill", incremental=incremental, batch=batch, finished=True,
                     experts=_rows_b64(rows(item)[:len(PROMPT)], zstd))
        body["meta_info"]["finish_reason"] = {"type": "length", "length": 0}
        out.append(dumps(body))
    return out


def decode(zstd: bool, *, incremental: bool = False, batch: bool = False,
           coalesced: bool = False) -> list[bytes]:
    def stale(item: int) -> np.ndarray:
        r = rows(item)
        r[:len(PROMPT)] = [[60 + p, 61 + p, 62 + p, 63 + p] for p in range(len(PROMPT))]  # KV-slot leftovers
        return r

    return [dumps(_body(i, prev, n, side="decode", incremental=incremental, batch=batch,
                        experts=_rows_b64(stale(i), zstd) if n == 5 else None)) for i, prev, n in _order(batch, coalesced)]


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
    assert [v for _, v in out] == [Verdict.JOINED] * len(BOUNDARIES)
    for (got, _), want in zip(out, agg):
        _same_but_ids(got, want)


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
def test_every_joined_chunk_of_an_n2_stream_equals_the_aggregated_item_chunk(incremental):
    """``n`` = 2, items interleaved and tagged ``index``: each item's chunks join with that item's
    prefill body, the output lists sliced per chunk in incremental mode and restated in cumulative."""
    kw = {"incremental": incremental, "batch": True}
    agg = aggregated(False, **kw)
    assert all(d != a for d, a in zip(decode(False, **kw), agg))  # every chunk needs the join
    out = join(SGLangCodec(OPTIONS), decode(False, **kw), prefill(False, **kw))
    assert [v for _, v in out] == [Verdict.JOINED] * len(agg)
    for (got, _), want in zip(out, agg):
        _same_but_ids(got, want)


def test_a_coalesced_incremental_chunk_holding_token_0_joins_to_the_same_coalesced_aggregated_chunk():
    """Decode's reserved ``None`` row and ``[]`` prompt lists sit in a chunk over ``[0, 3)``: position 0 is still
    the slice's first (``output_token_logprobs_length`` equals the list's length), and it is filled there."""
    kw = {"incremental": True, "coalesced": True}
    agg = aggregated(False, **kw)
    out = join(SGLangCodec(OPTIONS), decode(False, **kw), prefill(False, incremental=True))
    assert [v for _, v in out] == [Verdict.JOINED] * len(agg)
    for (got, _), want in zip(out, agg):
        _same_but_ids(got, want)


def test_the_zstd_join_restores_the_aggregated_rows_and_every_other_field():
    agg = aggregated(zstd=True)
    out = join(SGLangZstdCodec(OPTIONS), decode(zstd=True), prefill(zstd=True))
    assert [v for _, v in out] == [Verdict.JOINED] * len(BOUNDARIES)
    for (got, _), want in zip(out[:-1], agg[:-1]):
        _same_but_ids(got, want)
    got, want = out[-1][0], agg[-1]
    assert _rows_of(got, zstd=True) == rows(0).tobytes()
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
        ids = meta.get("output_token_ids_logprobs")
        assert ids is None or ids[0] is not None
    final = json.loads(out[-1][0])["meta_info"]
    assert "routed_experts" not in final
    assert final["routed_experts_unavailable_reason"] == "prefill_timeout"
    assert "weight_versions" not in final
