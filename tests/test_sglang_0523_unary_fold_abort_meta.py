"""A folded SGLang 0.5.23 stream the scheduler aborted has the unary abort body's ``meta_info``: its keys, in its order.

Written by hand from the SGLang 0.5.23 PyPI wheel (``managers/tokenizer_manager.py``), not from the simulator.
``TokenizerManager._handle_abort_req`` builds the body a request aborted by the scheduler ends with (a queued or
retracted request ``abort_request`` aborts, without a ``status_code``, so no error is raised unary)::

    meta_info = {"id": recv_obj.rid, "finish_reason": finish_reason,
                 "weight_version": self.config_value("weight_version"),
                 "e2e_latency": state.time_stats.get_e2e_latency()}
    if recv_obj.weight_versions is not None: add_weight_versions_to_meta_info(...)
    if getattr(state.obj, "return_logprob", False): self.add_logprob_to_meta_info(...)
    output_ids = state.output_ids
    meta_info["completion_tokens"] = len(output_ids)
    if is_stream and self.incremental_streaming_output:
        output_ids = [output_ids[-1]] if len(output_ids) > 0 else []
    out = {"text": state.get_text(), "output_ids": output_ids, "meta_info": meta_info}

A fresh ``meta_info``: no ``prompt_tokens``, ``num_retractions``, ``reasoning_tokens``, ``cached_tokens`` or
``cached_tokens_details``, which every ``_handle_batch_output`` chunk before it has. Unary, ``_handle_batch_output``
queues nothing before the finish (``out_dict = None`` while ``not state.finished``), so this body is the whole
answer (``_stream_one_response`` appends ``response_sent_to_client_ts`` to it, the first body yielded). The
folded stream is that body: the earlier chunks' keys are no part of it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from helpers import upstream_json as dumps
from sglang_0523_bodies import add_counts

from streamproc.codec import CodecOptions
from streamproc_sglang import SGLangCodec

RID = "5a6b7c8d9e0f41a2b3c4d5e6f7a8b9c0"
OUT = [401, 402, 403]
TEXT = ["x", "yz", "!"]
QUEUED_ABORT = {"type": "abort", "message": "Abort in waiting queue"}
RECEIVED = 1765000200.0


def batch_chunk(end: int, *, incremental: bool, stamp: float | None = None) -> dict[str, Any]:
    """``_handle_batch_output`` (0.5.23, BatchStrOutput): an unfinished stream chunk of tokens ``[.., end)``."""
    meta: dict[str, Any] = {"id": RID, "finish_reason": None, "prompt_tokens": 6, "weight_version": "default",
                            "num_retractions": 1}
    add_counts(meta, end, finished=False, cached=2)
    if stamp is not None:  # _stream_one_response: the first body yielded
        meta["response_sent_to_client_ts"] = stamp
    lo = end - 1 if incremental else 0
    return {"text": "".join(TEXT[lo:end]), "output_ids": OUT[lo:end], "meta_info": meta}


def abort_body(seen: int, *, incremental_stream: bool, stamp: float | None = None) -> dict[str, Any]:
    """``_handle_abort_req`` (0.5.23) once the tokenizer holds ``seen`` tokens."""
    meta: dict[str, Any] = {"id": RID, "finish_reason": QUEUED_ABORT, "weight_version": "default",
                            "e2e_latency": 0.75, "completion_tokens": seen}
    if stamp is not None:
        meta["response_sent_to_client_ts"] = stamp
    ids = OUT[:seen]
    if incremental_stream:
        ids = [ids[-1]] if ids else []
    return {"text": "".join(TEXT[:seen]), "output_ids": ids, "meta_info": meta}


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
def test_a_folded_stream_the_scheduler_aborted_has_the_unary_abort_meta_info(incremental):
    """The folded answer is the unary abort body: every token, and ``meta_info`` with the abort body's keys in
    its order, not the earlier chunks' ``prompt_tokens``, ``num_retractions``, ``reasoning_tokens``,
    ``cached_tokens``, ``cached_tokens_details``; the send stamp, which no chunk has, marked in its place."""
    chunks = [batch_chunk(1, incremental=incremental, stamp=RECEIVED + 0.1),
              batch_chunk(2, incremental=incremental),
              abort_body(3, incremental_stream=incremental)]
    options = CodecOptions(max_decompressed_bytes=1 << 20,
                           format_options=(("streaming", "incremental" if incremental else "cumulative"),))
    folded = json.loads(SGLangCodec(options).fold([dumps(chunk) for chunk in chunks]))
    want = abort_body(3, incremental_stream=False)
    want["meta_info"]["response_sent_to_client_ts_unavailable_reason"] = "not_streamed"
    assert folded == want
    assert list(folded["meta_info"]) == list(want["meta_info"])


def test_a_folded_streamed_batch_item_the_scheduler_aborted_has_the_unary_abort_meta_info():
    """Each item of a streamed batch folds alone (``_stream_batch_responses``' ``index``): an aborted item is
    its unary abort body, the other item its finished body."""
    aborted = [batch_chunk(1, incremental=True, stamp=RECEIVED + 0.1), abort_body(2, incremental_stream=True)]
    done: dict[str, Any] = {"id": RID + "-1", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 6,
                            "weight_version": "default", "num_retractions": 0}
    add_counts(done, 1, finished=True)
    done["e2e_latency"] = 0.5
    done["response_sent_to_client_ts"] = RECEIVED + 0.5
    finished = {"text": "x", "output_ids": OUT[:1], "meta_info": done}
    chunks = [{**aborted[0], "index": 0}, {**finished, "index": 1}, {**aborted[1], "index": 0}]
    folded = json.loads(SGLangCodec(CodecOptions(max_decompressed_bytes=1 << 20)).fold(
        [dumps(chunk) for chunk in chunks]))
    want = abort_body(2, incremental_stream=False)
    want["meta_info"]["response_sent_to_client_ts_unavailable_reason"] = "not_streamed"
    assert folded == [want, finished]
    assert list(folded[0]["meta_info"]) == list(want["meta_info"])


def test_a_stitched_streams_send_stamp_reason_survives_its_abort():
    """A migrated stream's stitched bodies carry ``response_sent_to_client_ts_unavailable_reason:
    stitch_incomplete`` (migration.py ``TIMING_FIELDS``); ending in the abort body, whose keys the folded
    ``meta_info`` takes, the stitch's reason is kept (last, where the unary stamp stands), not dropped."""
    first = batch_chunk(1, incremental=True)
    first["meta_info"]["response_sent_to_client_ts_unavailable_reason"] = "stitch_incomplete"
    chunks = [first, batch_chunk(2, incremental=True), abort_body(3, incremental_stream=True)]
    folded = json.loads(SGLangCodec(CodecOptions(max_decompressed_bytes=1 << 20)).fold(
        [dumps(chunk) for chunk in chunks]))
    assert list(folded["meta_info"])[-1] == "response_sent_to_client_ts_unavailable_reason"
    assert folded["meta_info"]["response_sent_to_client_ts_unavailable_reason"] == "stitch_incomplete"
    assert "prompt_tokens" not in folded["meta_info"]


def coalesced_lone_abort(seen: int) -> dict[str, Any]:
    """The only body an incremental stream yields when its consumer was behind from the start and the
    scheduler aborted it (``_stream_one_response``: ``_coalesce_streaming_chunks(out_list, ...)`` over the
    queued deltas and ``_handle_abort_req``'s body): every delta's ids then ``[output_ids[-1]]`` again, every
    delta's text then the whole text again; ``meta_info`` is the last (the abort body's)."""
    queued = [batch_chunk(k, incremental=True) for k in range(1, seen + 1)]
    abort = abort_body(seen, incremental_stream=True, stamp=RECEIVED + 0.2)  # the first body yielded
    out = dict(abort)
    out["output_ids"] = [i for chunk in [*queued, abort] for i in chunk["output_ids"]]
    out["text"] = "".join(chunk["text"] for chunk in [*queued, abort])
    return out


@pytest.mark.parametrize("seen", [2, 3])
def test_a_lone_coalesced_abort_body_folds_to_the_unary_abort_answer(seen):
    """Served as sent, it doubled the text (``"xyz!xyz!"``) and repeated the last id; unary the same request
    answers the abort body with every id once. ``folds_alone`` sends it to ``fold`` (its finish reason, an
    abort, is followed by ``weight_version``, as ``_handle_abort_req`` writes it; a ``_handle_batch_output``
    body has ``prompt_tokens`` there), which folds it."""
    body = dumps(coalesced_lone_abort(seen))
    codec = SGLangCodec(CodecOptions(max_decompressed_bytes=1 << 20))
    assert codec.folds_alone(body)
    want = abort_body(seen, incremental_stream=False, stamp=RECEIVED + 0.2)
    folded = json.loads(codec.fold([body]))
    assert folded == want
    assert list(folded["meta_info"]) == list(want["meta_info"])


def test_a_lone_abort_body_of_a_batch_output_is_not_sent_to_fold():
    """A running request aborted through ``to_finish`` ends in a ``_handle_batch_output`` body (``prompt_tokens``
    right after its finish reason): it is the unary answer as sent, and is not parsed for nothing."""
    chunk = batch_chunk(2, incremental=False, stamp=RECEIVED + 0.2)
    chunk["meta_info"]["finish_reason"] = {"type": "abort", "message": "Aborted", "status_code": None,
                                           "err_type": None}
    body = dumps(chunk)
    codec = SGLangCodec(CodecOptions(max_decompressed_bytes=1 << 20))
    assert not codec.folds_alone(body)
    assert codec.fold([body]) == body


def test_a_lone_abort_body_with_every_id_once_is_not_sent_to_fold():
    """A cumulative stream's lone ``_handle_abort_req`` body (0.5.23 cuts its ids only with
    ``--incremental-streaming-output``) is the unary answer as sent: not parsed for nothing."""
    body = dumps(abort_body(3, incremental_stream=False, stamp=RECEIVED + 0.2))
    assert not SGLangCodec(CodecOptions(max_decompressed_bytes=1 << 20)).folds_alone(body)


@pytest.mark.parametrize("weight_version", [False, True], ids=["no-weight-version", "weight-version"])
def test_a_lone_abort_body_with_its_last_id_only_is_given_back_as_sent(weight_version):
    """A stream's only body that is ``_handle_abort_req``'s with ``[output_ids[-1]]`` of several tokens (trees
    before 0.5.23 cut a stream's ids so in both modes, and took only ``out_list[-1]`` of what was queued) and a
    message longer than the ``FINISH_SPAN`` that ``folds_alone`` reads, so ``fold`` decides: nothing is coalesced
    in it and the missing ids cannot be placed, so it is given back as sent, as every other lone body whose
    message is short. Folded, its one id was dropped (``output_ids: []``)."""
    meta: dict[str, Any] = {"id": RID, "finish_reason": {"type": "abort", "message": "m" * 5000}}
    if weight_version:
        meta["weight_version"] = "default"
        meta["e2e_latency"] = 0.75
    meta["completion_tokens"] = 3
    body = dumps({"text": "".join(TEXT), "output_ids": OUT[-1:], "meta_info": meta})
    codec = SGLangCodec(CodecOptions(max_decompressed_bytes=1 << 20))
    assert codec.folds_alone(body)  # the message runs past the span: fold decides
    assert codec.fold([body]) == body


class ScanCountingBytes(bytes):
    """A body that counts the bytes its ``find``/``rfind`` calls pass over (to the match, or the whole range)."""

    scanned = 0

    def find(self, sub, start=0, end=None):  # type: ignore[override]
        end = len(self) if end is None else min(end, len(self))
        at = bytes.find(self, sub, start, end)
        type(self).scanned += (at if at >= 0 else end) - start
        return at

    def rfind(self, sub, start=0, end=None):  # type: ignore[override]
        end = len(self) if end is None else min(end, len(self))
        at = bytes.rfind(self, sub, start, end)
        type(self).scanned += end - (at if at >= 0 else start)
        return at


def test_the_repeated_last_id_is_read_from_a_few_bytes_whatever_the_ids_length():
    """``folds_alone`` runs on the edge's event loop: a coalesced abort body of 200,000 ids is recognised from
    the bytes around its finish reason and the ids' last few, not by a backward search for the list's ``[``
    across all its ids (a 59 MiB one took ~6 ms)."""
    ids = list(range(1000, 201000))
    meta: dict[str, Any] = {"id": RID, "finish_reason": QUEUED_ABORT, "weight_version": "default",
                            "e2e_latency": 0.75, "completion_tokens": len(ids)}
    raw = dumps({"text": "x" * len(ids) * 2, "output_ids": [*ids, ids[-1]], "meta_info": meta})
    ScanCountingBytes.scanned = 0
    assert SGLangCodec(CodecOptions(max_decompressed_bytes=1 << 24)).folds_alone(ScanCountingBytes(raw))
    assert ScanCountingBytes.scanned < 64 * 1024 < len(raw) // 10
