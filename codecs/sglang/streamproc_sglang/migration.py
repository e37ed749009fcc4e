"""SGLang request migration: read what the client has seen, rebuild the request, stitch the stream.

Reference notes §6.2. After a worker is lost at ``k`` emitted tokens, the resumed request is the
original one with ``input_ids = prompt + emitted`` and ``max_new_tokens - k``; SGLang then reports
that attempt in its own terms (``prompt_tokens = prompt + k``, counts from 0, input logprobs over
the extended prompt). :class:`SGLangMigrationSession.stitch` turns each of its bodies back into the
original request's terms so the client reads one uninterrupted stream:

=================================  ===========================================================
field                              stitched value
=================================  ===========================================================
``text``, ``output_ids``           incremental streams: unchanged (deltas; nothing is replayed),
                                   but an abort body (``native.from_abort_req``) with one id gets
                                   the client's text in front of the attempt's whole one;
                                   cumulative streams: what the client saw, then the attempt's
                                   (an abort body's ids only when it has them all,
                                   ``native.abort_restates_ids``: SGLang 0.5.23's cumulative one)
``output_*logprobs``               cumulative streams: the client's lists, then the attempt's;
                                   incremental: the client's in front of that abort body's
                                   (``ABORT_RESTATED_FIELDS``, each when the client had one entry
                                   per emitted token)
``meta_info.id``                   the id the client saw first
``prompt_tokens``                  the original prompt's (attempt's value − k)
``completion_tokens``,             + k (cumulative counts continue)
``output_token_logprobs_length``
``reasoning_tokens``               + the last value the client saw; omitted (``stitch_incomplete``)
                                   when the client was told it was unavailable (a P/D attempt)
``cached_tokens``,                 the values the client was sent: SGLang 0.5.23 counts the prompt's
``cached_tokens_details``          cache hits once, at prefill, and repeats them on every chunk, so
                                   the uninterrupted stream never changes them; when no published
                                   body had them, the final attempt's count, at most the original
                                   prompt length, and its details capped alike when one tier holds
                                   every hit (hits split over tiers past the cap: omitted,
                                   ``length_mismatch``)
``finish_reason``                  the final attempt's; ``{"type": "length", "length": n}`` gets + k
``input_*logprobs``                the original prompt's as the client saw them (also in place of a P/D
                                   attempt's ``input_logprobs_unavailable_reason``); else the attempt's
                                   list without its last k entries (the replayed output tokens); the
                                   flat form (``return_flat_raw_top_logprobs``) the same way
``weight_versions``, ``spec_*``,   omitted (``stitch_incomplete``) when tokens were emitted before the
``num_retractions``                seal (``ATTEMPT_FIELDS``): values over the attempt's own work (its
                                   own ``Req``'s retractions), and the lost attempt never published
                                   (all of) its share
``e2e_latency``, the metrics       omitted (``stitch_incomplete``) on every resumed body, also with
timings (``TIMING_FIELDS``)        nothing emitted: measured from the attempt's own receipt
``routed_experts``                 the attempt's array covers every position (its prompt is the
                                   original prompt plus the emitted tokens); rows an earlier
                                   attempt already published replace its leading rows
=================================  ===========================================================

Cumulative streams (SGLang's default, see ``native.restates``) are recognised from the bodies; until
a second token-carrying chunk shows the mode, the codec option ``streaming`` (default incremental)
decides. P/D attempts are joined within their attempt first (their prefill leg covers the extended prompt),
then stitched. What the processor can check from bodies alone: every published body is a JSON
object with integer ``output_ids`` (else the emitted tokens are unknown), is not a batch (a JSON
array: ``n > 1``), and carries no ``hidden_states``. Guided decoding, ``n > 1``, beam search
(``beam_width`` > 1) and session requests are visible in the request only: :func:`check_request`
refuses them for the serving layer's helper.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Any, Sequence

import msgspec
import numpy as np

from streamproc.codec import CorruptPayload, Emitted, MigrationRefused, MigrationSession, SequenceCodec
from streamproc.codec import UNAVAILABLE_SUFFIX
from streamproc.codec import OmissionReason as Omit
from streamproc.codec import check_resumed_prompt, check_sampling_params, keep_emitted, restated_prompt, resumed_budget
from streamproc.decompress import decode_base64, encode_base64
from streamproc.wire import Verdict

from . import native
from .native import (
    ABORT_RESTATED_FIELDS,
    CUMULATIVE,
    COMPLETION_TOKENS,
    EXPERT_DTYPE_SIZES,
    FINISH_REASON,
    INPUT_LOGPROB_FIELDS,
    INPUT_LOGPROBS_UNAVAILABLE,
    INPUT_TOKEN_LOGPROBS,
    OUTPUT_DELTA_FIELDS,
    OUTPUT_IDS,
    OUTPUT_TOKEN_LOGPROBS_LENGTH,
    OUTPUT_TOP_LOGPROBS,
    TEXT,
    PROMPT_TOKENS,
    REASONING_TOKENS,
    ROUTED_EXPERTS,
    ROUTED_EXPERTS_UNAVAILABLE,
)

if TYPE_CHECKING:
    from .codec import SGLangCodec

INPUT_IDS = "input_ids"
SAMPLING_PARAMS = "sampling_params"
SESSION_PARAMS = "session_params"
SAMPLES = "n"  # parallel samples per request (SamplingParams.n)
# 0.5.23 beam search: ``SamplingParams.beam_width`` > 1 (``BeamCoordinator.request_beam_width``:
# ``beam_width or 1``), ``n`` then the number of returned sequences. Nothing of it is streamed before
# the final body (``_GenerationStreamAccumulator._beam_admits``: the group's leader, once finished;
# ``_wait_one_response`` skips unfinished beam outputs), and that body's ``meta_info.beam_results``
# repeat the attempt's meta_info per beam, which the stitch does not restate; prompt + emitted tokens
# would not be the same search either. Refused (check_request).
BEAM_WIDTH = "beam_width"
MAX_NEW_TOKENS = "max_new_tokens"
MIN_NEW_TOKENS = "min_new_tokens"
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's SamplingParams default when the request gives none
# 0.5.23: [{"version", "start", "end"}] over the output tokens, on a finished body only
# (utils/weight_versions.py add_weight_versions_to_meta_info). A resumed attempt's spans cover its own
# tokens; which weights produced the k tokens before the seal was never published (the lost attempt
# did not finish), so the stitched request has no exact value.
WEIGHT_VERSIONS = native.WEIGHT_VERSIONS
# 0.5.23's speculative-decoding counters (``TokenizerManager._calculate_spec_decoding_metrics``, on a
# finished body only): ``spec_accept_rate``, ``spec_accept_length`` (``completion_tokens[i] /
# spec_verify_ct[i]``, the attempt's own count), ``spec_num_correct_drafts``, ``spec_num_proposed_drafts``,
# ``spec_verify_ct``, ``spec_cap_length``, ``spec_block_accept_length`` and the histograms, read from
# counters ``batch_result_processor`` adds per verify step of the ``Req`` (``req.spec_verify_ct += 1``);
# earlier trees' aliases (``spec_accepted_drafts``, ``spec_proposed_drafts``, ``spec_accept_histogram``)
# alike. A resumed attempt's cover its own steps; the lost attempt's were never published.
SPEC_PREFIX = "spec_"
# ``num_retractions`` (``total_retractions`` before 0.5.23), on every body: ``Req.retraction_count``, which
# ``reset_for_retract`` adds to, is one ``Req``'s on one worker; a resumed attempt's starts at 0, and
# the lost worker's retractions after its last body were never published.
# Values that describe the attempt, not the request: with tokens emitted before the seal no exact
# whole-request value exists, so each is omitted (stitch_incomplete).
ATTEMPT_FIELDS = (WEIGHT_VERSIONS, *native.RETRACTION_COUNTS)
ATTEMPT_PREFIXES = (SPEC_PREFIX,)
# Timings, measured by the attempt's own worker from its own receipt of the request (0.5.23, all in
# ``TokenizerManager._handle_batch_output`` unless said):
# - finished bodies: ``e2e_latency`` (always: ``state.time_stats.get_e2e_latency()``) and, with
#   ``--enable-metrics``, ``APIServerReqTimeStats.convert_to_output_meta_info``: ``request_received_ts``,
#   ``first_token_latency``, ``api_server_dispatch_finish_ts``, ``response_sent_to_client_ts``,
#   ``request_finished_ts``, ``decode_throughput``;
# - the first body sent (``_stream_one_response``, always): ``response_sent_to_client_ts``;
# - every body, with ``--enable-metrics`` (``SchedulerReqTimeStats.convert_to_output_meta_info``):
#   ``queue_time``, ``forward_entry_time``, ``prefill_finished_time``, ``storage_prefetch_wait``,
#   ``storage_staging_wait``.
# The request's clock started on the lost worker, whose share was never published, and the resumed
# attempt's queueing, prefill and decode rate are of another run: no body of a resumed attempt has
# the request's value, even with nothing emitted before the seal, so each is omitted
# (stitch_incomplete) on every stitched body, never restated from what the client saw.
TIMING_FIELDS = (
    "e2e_latency", "request_received_ts", "first_token_latency", "api_server_dispatch_finish_ts",
    native.RESPONSE_SENT_TS, "request_finished_ts", "decode_throughput",
    "queue_time", "forward_entry_time", "prefill_finished_time", "storage_prefetch_wait", "storage_staging_wait",
)
# Every streamed chunk's meta_info (``TokenizerManager._handle_batch_output``: ``"cached_tokens":
# recv_obj.cached_tokens[i]``, then ``cached_tokens_details``), from ``req.cached_tokens``, which
# ``ScheduleBatch.prepare_for_extend`` counts once ("Only calculate cached_tokens once") with its tier
# split (``split_cached_prefix_by_tier``, first chunk only): constant over a request's stream. A
# resumed attempt counts hits over the original prompt plus the emitted tokens on another worker.
CACHED_TOKENS = "cached_tokens"
CACHED_TOKENS_DETAILS = "cached_tokens_details"
# ``OutputStreamer.get_cached_tokens_details``: ``{"device", "host"}`` (+ ``storage`` and
# ``storage_backend`` with HiCache storage) from ``split_cached_prefix_by_tier`` over the request's cached
# prefix (tiers summing to it; device first, the host- and storage-loaded spans in an order the body
# does not tell), or ``{"device": req.cached_tokens, "host": 0}``; ``None`` without a hit.
CACHE_TIERS = ("device", "host", "storage")
HIDDEN_STATES = "hidden_states"
# Grammar-constrained decoding: the grammar state is not transferable (replaying the emitted tokens
# as prompt restarts the FSM at the schema root), so such requests are never migrated.
GUIDED_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")
# The dead P/D pair's KV-transfer rendezvous; the serving layer assigns the new pair's.
BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
STATE_PROMPT_TOKENS = "prompt_tokens"



def _is_count(value: object) -> bool:
    return type(value) is int


class _Base(msgspec.Struct):
    """What the stitch adds back, frozen when an attempt is sealed."""

    emitted: int = 0
    prompt: int | None = None  # the original prompt's count, as the client was sent it (None: unknown)
    reasoning: int | None = 0  # None: an earlier attempt's count was omitted (no leg had it)
    rid: Any = None
    input_logprobs: dict[str, Any] = {}
    rows: Any = None  # encoded routed_experts an earlier attempt published
    cumulative: bool = False  # the stream restates its output on every chunk
    ids: list[int] = []  # cumulative streams: what the client saw, restated before the attempt's
    text: str = ""
    output_logprobs: dict[str, Any] = {}
    cache: dict[str, Any] = {}  # cached_tokens (and its details) as the client was sent them
    # incremental streams: the text (UTF-8) and ABORT_RESTATED_FIELDS' items (JSON, comma-separated)
    # the client was sent, with each list's entry count
    told_text: bytes = b""
    told_lists: dict[str, bytes] = {}
    told_counts: dict[str, int] = {}


class SGLangMigrationSession(MigrationSession):
    def __init__(self, codec: SGLangCodec) -> None:
        self._experts: SequenceCodec = codec.stitch_experts()  # never the joins' instance (codec.py)
        self._ids = array("q")  # 8 bytes a token: the compact progress state
        self._rid: Any = None
        self._prompt_tokens: int | None = None
        self._reasoning: int | None = 0  # None: the client was told it is unavailable
        self._input_logprobs: dict[str, Any] = {}
        self._rows: Any = None
        self._cumulative = False
        self._decided = False  # a chunk after a token-carrying one has shown the stream's mode
        # How the workers stream when a request shows no mode yet (``--format-option streaming=``).
        self._assume_cumulative = codec.streaming == CUMULATIVE
        self._text = ""
        self._output_logprobs: dict[str, Any] = {}
        self._cache: dict[str, Any] = {}
        # Incremental streams: everything the client was sent of the text and the lists an abort body
        # restates (``_handle_abort_req``), kept compact (UTF-8, JSON items) for that body's stitch.
        self._told_text = bytearray()
        self._told_lists: dict[str, bytearray] = {}
        self._told_counts: dict[str, int] = {}
        self._base = _Base()
        self._restated = False
        # Sizes of the bodies whose parsed parts are kept (text and output lists of the last one,
        # input logprobs, routed_experts): each is bounded by one body, unlike the token ids.
        self._last_bytes = self._input_bytes = self._rows_bytes = 0

    # ------------------------------------------------------------ what was sent

    def absorb(self, bodies: Sequence[bytes]) -> None:
        for body in bodies:
            doc = native.parse(body)
            if doc is None:
                if body.lstrip()[:1] == b"[":
                    raise MigrationRefused("a batched response (n > 1 or several prompts) cannot be resumed")
                raise MigrationRefused("a published body is not a JSON object, so the emitted tokens are unknown")
            ids = doc.get(OUTPUT_IDS)
            if not isinstance(ids, list) or not all(_is_count(t) for t in ids):
                raise MigrationRefused("a published body has no integer output_ids, so the emitted tokens "
                                       "are unknown")
            meta = native.meta_of(doc)
            if meta is not None:
                self._absorb_meta(meta, len(body))
            if self._ids and not self._decided:
                self._decided = True
                self._cumulative = native.restates(doc, self._ids)
            if self._cumulative and native.restates(doc, self._ids):
                del self._ids[:]
            keep_emitted(self._ids, ids)
            # The last body's text and output lists: everything so far when the stream is cumulative.
            text = doc.get(TEXT)
            self._text = text if isinstance(text, str) else ""
            self._last_bytes = len(body)
            if meta is not None:
                self._output_logprobs = {f: meta[f] for f in OUTPUT_DELTA_FIELDS if isinstance(meta.get(f), list)}
            self._tell(text, meta)

    def _tell(self, text: Any, meta: dict[str, Any] | None) -> None:
        """An incremental body's text and restated lists, appended to what the client was told (a
        cumulative stream keeps its last body's, above: nothing here)."""
        if self._decided and self._cumulative:
            if self._told_text or self._told_lists:
                self._told_text, self._told_lists, self._told_counts = bytearray(), {}, {}
            return
        if isinstance(text, str):
            self._told_text += text.encode()
        for field in ABORT_RESTATED_FIELDS if meta is not None else ():
            value = meta.get(field)  # type: ignore[union-attr]
            if isinstance(value, list) and value:
                told = self._told_lists.setdefault(field, bytearray())
                if told:
                    told += b","
                told += native.encode(value)[1:-1]
                self._told_counts[field] = self._told_counts.get(field, 0) + len(value)

    def _absorb_meta(self, meta: dict[str, Any], size: int) -> None:
        if meta.get(HIDDEN_STATES) is not None:
            raise MigrationRefused("hidden states (return_hidden_states) cannot be carried to another worker")
        if self._rid is None and meta.get("id") is not None:
            self._rid = meta["id"]
        prompt_tokens = meta.get(PROMPT_TOKENS)
        if _is_count(prompt_tokens):
            self._prompt_tokens = prompt_tokens  # published bodies are already in the original terms
        if _is_count(meta.get(CACHED_TOKENS)):
            self._cache = {key: meta[key] for key in (CACHED_TOKENS, CACHED_TOKENS_DETAILS) if key in meta}
        reasoning = meta.get(REASONING_TOKENS)
        if _is_count(reasoning):
            self._reasoning = reasoning
        elif REASONING_TOKENS + UNAVAILABLE_SUFFIX in meta:  # a P/D attempt's count no leg had (join.py)
            self._reasoning = None
        for field in INPUT_LOGPROB_FIELDS:
            value = meta.get(field)
            if isinstance(value, list) and value:
                self._input_logprobs[field] = value
                self._input_bytes = size
        if isinstance(meta.get(native.INPUT_TOP_SHAPE), list):  # the flat form, all its fields together
            for field in native.INPUT_TOP_FLAT_FIELDS:
                if field in meta:
                    self._input_logprobs[field] = meta[field]
            self._input_bytes = size
        if meta.get(ROUTED_EXPERTS) is not None:
            self._rows = meta[ROUTED_EXPERTS]
            self._rows_bytes = size

    def seal(self) -> Emitted:
        cumulative = self._cumulative if self._decided else self._assume_cumulative
        restated = (self._ids.tolist(), self._text, dict(self._output_logprobs)) if cumulative else ([], "", {})
        told = (bytes(self._told_text), {f: bytes(v) for f, v in self._told_lists.items()},
                dict(self._told_counts)) if not cumulative else (b"", {}, {})
        self._base = _Base(len(self._ids), self._prompt_tokens, self._reasoning, self._rid, dict(self._input_logprobs),
                           self._rows, cumulative, *restated, dict(self._cache), *told)
        state = {STATE_PROMPT_TOKENS: self._prompt_tokens} if self._prompt_tokens is not None else {}
        return Emitted(self._ids.tolist(), state)

    def progress_bytes(self) -> int:
        """8 bytes a token id in ``_ids``; ~40 a token in a sealed cumulative stream's restated list
        (a pointer and an int object); the bodies whose parts are kept, at their encoded size. The
        sealed base shares the other parts (text, logprob lists, rows) with the live state."""
        base = self._base
        told = len(self._told_text) + sum(map(len, self._told_lists.values()))
        told += len(base.told_text) + sum(map(len, base.told_lists.values()))  # copies, not shared
        return (self._ids.itemsize * len(self._ids) + 40 * len(self._base.ids)
                + self._last_bytes + self._input_bytes + self._rows_bytes + told)

    # ---------------------------------------------------------------- stitching

    def stitch(self, body: bytes, final: bool) -> tuple[bytes, Verdict] | None:
        base = self._base
        doc = native.parse(body)
        meta = native.meta_of(doc) if doc is not None else None
        if meta is None:
            return None  # not SGLang-shaped: nothing in it can be restated
        before = dict(meta)
        k = base.emitted
        self._restate(doc, meta, base)
        if base.rid is not None and meta.get("id") is not None:
            meta["id"] = base.rid
        prompt = meta.get(PROMPT_TOKENS)
        original_prompt = restated_prompt(prompt, k, base.prompt) if _is_count(prompt) else None
        if original_prompt is not None:
            meta[PROMPT_TOKENS] = original_prompt
        for field in (COMPLETION_TOKENS, OUTPUT_TOKEN_LOGPROBS_LENGTH):
            if _is_count(meta.get(field)):
                meta[field] += k
        verdict = Verdict.STITCHED
        incomplete = [key for key, value in meta.items() if value is not None and _attempt_scoped(key, k)]
        if _is_count(meta.get(REASONING_TOKENS)):
            if base.reasoning is not None:
                meta[REASONING_TOKENS] += base.reasoning
            else:  # what the earlier attempts counted is known to no one: the sum cannot be made
                incomplete.append(REASONING_TOKENS)
        if incomplete:
            _mark(meta, incomplete, Omit.STITCH_INCOMPLETE)
            verdict = Verdict.OMITTED
        cached = meta.get(CACHED_TOKENS)
        if _is_count(cached) and k and CACHED_TOKENS in base.cache:
            for key, value in base.cache.items():
                if key in meta:
                    meta[key] = value
        elif _is_count(cached) and original_prompt is not None and cached > original_prompt:
            meta[CACHED_TOKENS] = original_prompt  # emitted tokens replayed as prompt are not prompt cache hits
            details = meta.get(CACHED_TOKENS_DETAILS)
            if isinstance(details, dict):
                capped = _capped_details(details, original_prompt)
                if capped is None:
                    _mark(meta, [CACHED_TOKENS_DETAILS], Omit.LENGTH_MISMATCH)
                    verdict = Verdict.OMITTED
                else:
                    meta[CACHED_TOKENS_DETAILS] = capped
        finish = meta.get(FINISH_REASON)
        if isinstance(finish, dict) and finish.get("type") == "length" and _is_count(finish.get("length")):
            meta[FINISH_REASON] = {**finish, "length": finish["length"] + k}
        if INPUT_LOGPROBS_UNAVAILABLE in meta and INPUT_TOKEN_LOGPROBS not in meta \
                and base.input_logprobs.get(INPUT_TOKEN_LOGPROBS) is not None:
            meta = doc[native.META] = _restore_input_logprobs(meta, base.input_logprobs)
        for field in INPUT_LOGPROB_FIELDS:
            value = meta.get(field)
            if isinstance(value, list):
                original = base.input_logprobs.get(field)
                meta[field] = original if original is not None else value[:max(0, len(value) - k)]
        if isinstance(meta.get(native.INPUT_TOP_SHAPE), list):
            _restate_flat_top(meta, base.input_logprobs, k)
        if base.rows is not None and meta.get(ROUTED_EXPERTS) is not None:
            if self._stitch_rows(meta, base.rows) is Verdict.OMITTED:
                verdict = Verdict.OMITTED
        if meta == before and not self._restated:
            return None  # the joined body as it is, with the join's verdict
        # The verdict is the body's: any marker left, the join's included (the stitch may have put the
        # client's prompt logprobs in the place of one), makes it ``omitted`` (docs/protocol.md).
        if any(key.endswith(UNAVAILABLE_SUFFIX) for key in meta):
            verdict = Verdict.OMITTED
        return native.encode(doc), verdict

    def _restate(self, doc: dict[str, Any], meta: dict[str, Any], base: _Base) -> None:
        """In a cumulative stream, put what the client already saw in front of the attempt's output."""
        self._restated = False
        ids = doc.get(OUTPUT_IDS)
        if not isinstance(ids, list) or not base.emitted:
            return
        if not base.cumulative:
            if len(ids) == 1 and native.from_abort_req(meta):
                self._restate_abort(doc, meta, base)
            return
        if not native.from_abort_req(meta) or native.abort_restates_ids(doc):
            doc[OUTPUT_IDS] = base.ids + ids  # (an older abort body's one id repeats the last: not restated)
        if isinstance(doc.get(TEXT), str):
            doc[TEXT] = base.text + doc[TEXT]
        for field in OUTPUT_DELTA_FIELDS:
            if isinstance(meta.get(field), list):
                meta[field] = list(base.output_logprobs.get(field, [])) + meta[field]
        self._restated = True

    def _restate_abort(self, doc: dict[str, Any], meta: dict[str, Any], base: _Base) -> None:
        """An incremental stream's ``_handle_abort_req`` body restates its engine's whole text and
        lists, which for the resumed attempt are its own tokens only: the client's go in front, as
        the uninterrupted engine's body has them. Exact only with one id (``[last]``): chunks coalesced
        in front of the body (``_coalesce_streaming_chunks``, more ids) put their text and lists before
        the restatement, where the client's cannot be placed (a known limit, left as sent). A list the
        client did not get one entry per emitted token of is left as the attempt's."""
        if isinstance(doc.get(TEXT), str):
            doc[TEXT] = base.told_text.decode() + doc[TEXT]
        for field in ABORT_RESTATED_FIELDS:
            value = meta.get(field)
            if isinstance(value, list) and base.told_counts.get(field) == base.emitted:
                meta[field] = native.decode(b"[" + base.told_lists[field] + b"]") + value
        self._restated = True

    def _stitch_rows(self, meta: dict[str, Any], earlier_value: Any) -> Verdict:
        """Rows an earlier attempt published were computed by the passes that sampled those tokens:
        they win over the resumed attempt's recomputation of the same positions."""
        try:
            earlier = self._experts.decode(earlier_value)
            current = self._experts.decode(meta[ROUTED_EXPERTS])
        except CorruptPayload:
            return _omit(meta, Omit.STITCH_CORRUPT)
        dtype = native.expert_dtype(meta)
        size = EXPERT_DTYPE_SIZES[dtype] if dtype is not None else 0
        if not size or len(earlier) % size or len(current) % size or len(current) < len(earlier):
            return _omit(meta, Omit.LENGTH_MISMATCH)
        # numpy compares and copies without the GIL; ``current[:n] != earlier`` (a bytes slice, then
        # memcmp) and ``bytes.join`` with a memoryview part hold it throughout (benchmarks/join_gil.py).
        earlier_ids, current_ids = np.frombuffer(earlier, np.uint8), np.frombuffer(current, np.uint8)
        if not np.array_equal(current_ids[:len(earlier)], earlier_ids):
            meta[ROUTED_EXPERTS] = self._experts.encode(np.concatenate((earlier_ids, current_ids[len(earlier):])))
        return Verdict.STITCHED


def _restore_input_logprobs(meta: dict[str, Any], seen: dict[str, Any]) -> dict[str, Any]:
    """A P/D attempt whose prefill leg failed carries ``input_logprobs_unavailable_reason`` in place of
    its prompt-side lists (join.py ``_fill_input_logprobs``). The client was sent the original
    prompt's, which the stitch restates whenever an attempt has its own: they are the answer here too,
    put where ``add_logprob_to_meta_info`` writes them (the prompt's list in the reason's place, the
    top logprobs after ``output_token_logprobs_length``, the token-ids list after the top logprobs)."""
    top = {key: seen[key] for key in ("input_top_logprobs", *native.INPUT_TOP_FLAT_FIELDS) if key in seen}
    ids = {key: seen[key] for key in ("input_token_ids_logprobs",) if key in seen}
    top_anchor = OUTPUT_TOKEN_LOGPROBS_LENGTH if OUTPUT_TOKEN_LOGPROBS_LENGTH in meta else INPUT_LOGPROBS_UNAVAILABLE
    # the output top logprobs, nested or flat (``return_flat_raw_output_top_logprobs``: shape, null prefix last)
    ids_anchor = next((key for key in (OUTPUT_TOP_LOGPROBS, "output_top_logprobs_null_prefix") if key in meta),
                      top_anchor)
    out: dict[str, Any] = {}
    for key, value in meta.items():
        if key == INPUT_LOGPROBS_UNAVAILABLE:
            out[INPUT_TOKEN_LOGPROBS] = seen[INPUT_TOKEN_LOGPROBS]
        else:
            out[key] = value
        if key == top_anchor:
            out.update(top)
        if key == ids_anchor:
            out.update(ids)
    return out


def _restate_flat_top(meta: dict[str, Any], seen: dict[str, Any], k: int) -> None:
    """The flat prompt top logprobs (``return_flat_raw_top_logprobs``) in the original prompt's terms,
    as ``input_top_logprobs`` is restated: what the client saw; else the attempt's arrays without the
    rows of its last ``k`` prompt positions (the replayed output tokens), shape ``[rows - k, width]``."""
    if native.INPUT_TOP_SHAPE in seen:
        for field in native.INPUT_TOP_FLAT_FIELDS:
            if field in meta and field in seen:
                meta[field] = seen[field]
        return
    shape = meta[native.INPUT_TOP_SHAPE]
    if not k or len(shape) != 2 or not all(_is_count(n) and n >= 0 for n in shape):
        return
    rows, width = max(0, shape[0] - k), shape[1]
    # ``null_prefix`` leading null positions precede the rows (``flat_top_logprobs_layout``): the covered
    # range is ``null_prefix + rows`` positions, so k past the rows cuts the null positions too.
    prefix = meta.get(native.INPUT_TOP_NULL_PREFIX)
    if _is_count(prefix):
        meta[native.INPUT_TOP_NULL_PREFIX] = max(0, min(prefix, prefix + shape[0] - k))
    # Upstream's arrays hold exactly the [rows, width] the shape states (``val_arr.reshape(-1)``): one the
    # stitch cannot cut to the new shape is omitted, never left or cut under it as if whole.
    for side in ("val", "idx"):
        field = f"input_top_logprobs_{side}_flat"
        if field in meta:
            flat = meta[field]
            if not isinstance(flat, list):
                _mark(meta, [field], Omit.STITCH_CORRUPT)
            elif len(flat) != shape[0] * width:
                _mark(meta, [field], Omit.LENGTH_MISMATCH)
            else:
                meta[field] = flat[:rows * width]
        field = f"input_top_logprobs_{side}_flat_b64"
        if field not in meta:
            continue
        packed = meta[field]
        if not isinstance(packed, str) or meta.get(f"{field}_dtype") not in ("float32", "int32"):
            _mark(meta, [field], Omit.STITCH_CORRUPT)  # no width the stitch knows to cut by
            continue
        # The worker's text: strict, and exactly the values its shape states (4 bytes a value).
        size = shape[0] * width * 4
        try:
            raw = decode_base64(packed, size)
        except CorruptPayload as exc:
            _mark(meta, [field], Omit.LENGTH_MISMATCH if exc.reason == Omit.TOO_LARGE else Omit.STITCH_CORRUPT)
            continue
        if len(raw) != size:
            _mark(meta, [field], Omit.LENGTH_MISMATCH)
            continue
        meta[field] = encode_base64(raw[:rows * width * 4])
    meta[native.INPUT_TOP_SHAPE] = [rows, width]


def _capped_details(details: dict[str, Any], cap: int) -> dict[str, Any] | None:
    """``cached_tokens_details`` restated for a count capped at ``cap`` (the original prompt): unchanged
    when its tiers fit; with every hit in one tier, that tier capped (the hits are the prompt's leading
    positions); ``None`` when several tiers hold hits, since which of them lie past ``cap`` is unknown."""
    tiers = [key for key in CACHE_TIERS if _is_count(details.get(key))]
    if sum(details[key] for key in tiers) <= cap:
        return details
    hit = [key for key in tiers if details[key]]
    if len(hit) != 1:
        return None
    return {**details, hit[0]: cap}


def _attempt_scoped(key: str, emitted: int) -> bool:
    """A resumed attempt's value that is not the request's: a timing always, a value over the output
    tokens once tokens were emitted before the seal."""
    if key.endswith(UNAVAILABLE_SUFFIX):
        return False
    return key in TIMING_FIELDS or (emitted > 0 and (key in ATTEMPT_FIELDS or key.startswith(ATTEMPT_PREFIXES)))


def _mark(meta: dict[str, Any], fields: Sequence[str], reason: str) -> None:
    """Each of ``fields`` replaced by its ``<field>_unavailable_reason`` where it stood (key order kept)."""
    items = [(key + UNAVAILABLE_SUFFIX, reason) if key in fields else (key, value) for key, value in meta.items()]
    meta.clear()
    meta.update(items)


def _omit(meta: dict[str, Any], reason: str) -> Verdict:
    meta.pop(ROUTED_EXPERTS, None)
    meta[ROUTED_EXPERTS_UNAVAILABLE] = reason
    return Verdict.OMITTED


# --------------------------------------------------------------------- requests

def _request(body: bytes) -> dict[str, Any]:
    doc = native.parse(body)
    if doc is None:
        raise MigrationRefused("the request is not a JSON object")
    return doc


def check_request(body: bytes) -> dict[str, Any]:
    """The parsed request, or :class:`MigrationRefused` if it cannot be resumed on another worker."""
    doc = _request(body)
    ids = doc.get(INPUT_IDS)
    if not isinstance(ids, list) or not ids:
        if doc.get("text") is not None:
            raise MigrationRefused("a text prompt cannot be extended with token ids (send input_ids)")
        raise MigrationRefused("the request has no input_ids")
    if not all(_is_count(t) for t in ids):
        raise MigrationRefused("a batched request (several prompts) cannot be resumed")
    params = doc.get(SAMPLING_PARAMS)
    width = params.get(BEAM_WIDTH) if isinstance(params, dict) else None
    if width is not None and width != 1:  # before ``n``, which for beam search is no parallel sampling
        raise MigrationRefused(f"beam search (sampling_params.beam_width = {width}) cannot be resumed: its output "
                               "arrives only in the final body, whose beam_results a stitch cannot restate; "
                               "the client has seen nothing of it, so send the request again")
    check_sampling_params(params, guided=GUIDED_FIELDS, samples=SAMPLES)
    if doc.get("return_hidden_states"):
        raise MigrationRefused("hidden states (return_hidden_states) cannot be carried to another worker")
    session = doc.get(SESSION_PARAMS)
    # ``TokenizerManager``: ``SessionParams(**obj.session_params) if obj.session_params else None``, and
    # the scheduler looks a session up only by its ``id``. A session's prompt is the history its worker
    # holds (``Session.create_req``: the parent request's tokens, then ``input_ids``); no other worker
    # has it (``handle_generate_request``: "session id ... does not exist").
    if session and not (isinstance(session, dict) and session.get("id") is None):
        raise MigrationRefused("a session request (session_params) cannot be resumed: its prompt is the "
                               "session's history, held only by the worker that opened the session")
    return doc


def resume_request(body: bytes, emitted: Emitted) -> bytes:
    """The request that continues ``body`` after ``emitted``: prompt + emitted tokens, budget − k.

    ``logprob_start_len`` and ``routed_experts_start_len`` are absolute positions, so they stay.
    """
    doc = check_request(body)
    ids = doc[INPUT_IDS]
    check_resumed_prompt(len(ids), emitted, STATE_PROMPT_TOKENS)
    doc[SAMPLING_PARAMS] = resumed_budget(doc.get(SAMPLING_PARAMS) or {}, len(emitted.token_ids),
                                          max_key=MAX_NEW_TOKENS, min_key=MIN_NEW_TOKENS,
                                          default=DEFAULT_MAX_NEW_TOKENS)
    doc[INPUT_IDS] = ids + list(emitted.token_ids)
    for field in BOOTSTRAP_FIELDS:
        doc.pop(field, None)
    return native.encode(doc)
