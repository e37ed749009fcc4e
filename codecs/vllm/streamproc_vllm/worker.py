"""A simulated vLLM worker: renders a :class:`~streamproc.simulation.Truth` as native vLLM bodies.

It reproduces what the join has to repair in real disaggregated vLLM serving: the decode leg
has no prompt logprobs, leaves the ``token`` label out of its logprob entries, and returns its
expert rows either full-length with a stale prompt prefix or as the post-prompt suffix only
(``Truth.decode_coverage``). The prefill leg is one unary body for the first sampled token. Its stream
chunks have upstream's shape (``request_id, choices, usage``, no ``model`` or ``prompt_logprobs``);
``VLLMWorker(nonupstream_chunks=True)`` renders the earlier non-upstream chunks.

``VLLMWorker(shape=upstream.Shape(...))`` renders every leg with the upstream-shaped builder instead:
``prompt_logprobs`` requested independently of ``logprobs``, stream chunks without ``model`` or
``prompt_logprobs`` and an optional usage-only final chunk (``choices: []``).
"""

from __future__ import annotations

import base64
import io
import random
import zlib

import numpy as np
from numpy.lib import format as npy_format

from streamproc.codec import CodecOptions, CorruptPayload, OmissionReason
from streamproc.simulation import Damage, SimulatedWorker, Truth, emitted_in

from .native import (
    KV_TRANSFER_PARAMS,
    OUTPUT_MODE,
    PROMPT_LOGPROBS,
    ROUTED_EXPERTS,
    choices_of,
    dump,
    label_and_clamp,
    parse,
    parse_object,
    token_label,
    unavailable_key,
)
from . import migration, upstream
from .sequence import Base64Npy, npy_bytes

MODEL = "simulated"
GARBAGE = "!!not base64!!"
WRONG_TYPE = 12345
BOMB_ROWS = 1 << 40  # declares terabytes: past any sane --max-decompressed-bytes
_ABSENT = object()  # the key is left out of the body altogether

# Reading the simulator's own output back: the size bound is moot there, because a .npy is only
# accepted when its data is actually present in the payload.
_VIEW = Base64Npy(CodecOptions(max_decompressed_bytes=1 << 40))


def expert_dtype(truth: Truth) -> np.dtype:
    """vLLM ships expert ids in the narrowest unsigned type that holds them."""
    return np.dtype(np.uint8 if truth.num_experts <= 256 else np.uint16)


def truth_rows(truth: Truth, start: int, end: int) -> np.ndarray:
    rows = np.frombuffer(truth.expert_rows(start, end), dtype="<i4")
    return rows.reshape(end - start, truth.num_layers, truth.top_k).astype(expert_dtype(truth))


def stale_rows(truth: Truth, count: int) -> np.ndarray:
    """What a decode worker's capturer holds for prompt slots it never ran: zeros or leftovers."""
    shape = (count, truth.num_layers, truth.top_k)
    if truth.stale == "zeros" or truth.num_experts < 2:
        return np.zeros(shape, dtype=expert_dtype(truth))
    rng = np.random.default_rng(zlib.crc32(f"{truth.request_id}/stale".encode()))
    shift = rng.integers(1, truth.num_experts, size=shape)  # never 0 mod num_experts: always wrong
    real = truth_rows(truth, 0, count).astype(np.int64)
    return ((real + shift) % truth.num_experts).astype(expert_dtype(truth))


def bomb_payload(truth: Truth) -> str:
    """A .npy header declaring a huge array, followed by almost no data."""
    out = io.BytesIO()
    npy_format.write_array_header_1_0(out, {
        "descr": npy_format.dtype_to_descr(expert_dtype(truth)),
        "fortran_order": False,
        "shape": (BOMB_ROWS, truth.num_layers, truth.top_k),
    })
    return base64.b64encode(out.getvalue() + b"\x00" * 16).decode("ascii")


def experts_value(truth: Truth, rows: np.ndarray, damage: Damage | None) -> object:
    """The wire value of ``routed_experts`` (``_ABSENT`` to leave the key out)."""
    if damage is None:
        return base64.b64encode(npy_bytes(rows)).decode("ascii") if truth.return_experts else None
    if damage is Damage.DROP:
        return _ABSENT
    if damage is Damage.GARBAGE:
        return GARBAGE
    if damage is Damage.TRUNCATE:
        return base64.b64encode(npy_bytes(rows)[:-3]).decode("ascii")
    if damage is Damage.WRONG_TYPE:
        return WRONG_TYPE
    if damage is Damage.BOMB:
        return bomb_payload(truth)
    raise ValueError(f"unknown damage {damage!r}")


def logprob_content(truth: Truth, start: int, end: int, *, labels: bool) -> list[dict]:
    entries = []
    for token_id, logprob in zip(truth.output_ids[start:end], truth.output_logprobs[start:end]):
        entry: dict = {"token": token_label(token_id)} if labels else {}
        entry.update(logprob=logprob, bytes=None, top_logprobs=[])
        entries.append(entry)
    return entries


def prompt_logprobs(truth: Truth) -> list:
    """Aligned to the prompt; position 0 has nothing to be scored against."""
    scored = [
        {str(token_id): {"logprob": logprob, "rank": 1, "decoded_token": token_label(token_id)}}
        for token_id, logprob in zip(truth.prompt_ids[1:], truth.prompt_logprobs[1:])
    ]
    return [None, *scored]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class VLLMWorker(SimulatedWorker):
    format = "vllm"

    def __init__(self, *, shape: upstream.Shape | None = None, nonupstream_chunks: bool = False) -> None:
        """``nonupstream_chunks``: default-shaped stream chunks that no upstream ``GenerateStreamResponse``
        has: each carries ``model``, the first the prompt logprobs (a key only the unary body has), the
        last the usage. The default stream was so until 2026-12-07; kept for tests of how the join and
        fold treat such chunks."""
        self.shape = shape
        self.nonupstream_chunks = nonupstream_chunks

    # ---------------------------------------------------------------- legs

    def agg(self, truth: Truth, *, stream: bool) -> list[bytes]:
        if self.shape is not None:
            return upstream.agg(truth, self.shape, stream_=stream)
        experts = experts_value(truth, truth_rows(truth, 0, truth.rows), None)
        pl = prompt_logprobs(truth) if truth.return_logprob else None
        return self._render(truth, stream=stream, experts=experts, prompt_logprobs=pl, labels=True)

    def prefill(self, truth: Truth, *, stream: bool, damage: Damage | None = None) -> list[bytes]:
        if self.shape is not None:
            return self._damage_finishing(truth, upstream.prefill(truth, self.shape), damage, 0, truth.prompt_len)
        first_logprob = {"content": logprob_content(truth, 0, 1, labels=True)}
        choice: dict = {
            "index": 0,
            "logprobs": first_logprob if truth.return_logprob else None,
            "finish_reason": "length",  # prefill is run with max_tokens=1
            "token_ids": truth.output_ids[:1],
        }
        experts = experts_value(truth, truth_rows(truth, 0, truth.prompt_len), damage)
        if experts is not _ABSENT:
            choice[ROUTED_EXPERTS] = experts
        body = {
            "request_id": truth.request_id,
            "model": MODEL,
            "choices": [choice],
            "usage": usage(truth.prompt_len, 1),
            PROMPT_LOGPROBS: prompt_logprobs(truth) if truth.return_logprob else None,
            "kv_transfer_params": None,
        }
        return [dump(body)]

    def decode(self, truth: Truth, *, stream: bool, damage: Damage | None = None) -> list[bytes]:
        if self.shape is not None:
            start = truth.prompt_len if self.shape.decode_coverage == "suffix" else 0
            return self._damage_finishing(truth, upstream.decode(truth, self.shape, stream_=stream), damage,
                                          start, truth.rows)
        prompt_len, total = truth.prompt_len, truth.rows
        if truth.decode_coverage == "suffix":
            rows = truth_rows(truth, prompt_len, total)
        else:
            rows = np.concatenate([stale_rows(truth, prompt_len), truth_rows(truth, prompt_len, total)])
        experts = experts_value(truth, rows, damage)
        # Only a worker that captures experts can drop them; with capture off vLLM always sends null.
        if (damage is None and truth.return_experts and truth.decode_omits_one_token_experts
                and truth.output_len == 1):
            experts = _ABSENT
        return self._render(truth, stream=stream, experts=experts, prompt_logprobs=None, labels=False)

    def _render(self, truth: Truth, *, stream: bool, experts: object, prompt_logprobs: list | None,
                labels: bool) -> list[bytes]:
        want_logprobs = truth.return_logprob
        if not stream:
            choice: dict = {
                "index": 0,
                "logprobs": ({"content": logprob_content(truth, 0, truth.output_len, labels=labels)}
                             if want_logprobs else None),
                "finish_reason": truth.finish,
                "token_ids": list(truth.output_ids),
            }
            if experts is not _ABSENT:
                choice[ROUTED_EXPERTS] = experts
            return [dump({
                "request_id": truth.request_id,
                "model": MODEL,
                "choices": [choice],
                "usage": usage(truth.prompt_len, truth.output_len),
                PROMPT_LOGPROBS: prompt_logprobs,
                "kv_transfer_params": None,
            })]
        spans = truth.chunk_spans()
        bodies = []
        for i, (start, end) in enumerate(spans):
            last = i == len(spans) - 1
            choice = {
                "index": 0,
                "logprobs": ({"content": logprob_content(truth, start, end, labels=labels)}
                             if want_logprobs else None),
                "finish_reason": truth.finish if last else None,
                "token_ids": truth.output_ids[start:end],
            }
            if last and experts is not _ABSENT:
                choice[ROUTED_EXPERTS] = experts
            if self.nonupstream_chunks:
                chunk: dict = {"request_id": truth.request_id, "model": MODEL, "choices": [choice]}
                if last:
                    chunk["usage"] = usage(truth.prompt_len, truth.output_len)
                if i == 0 and want_logprobs:
                    chunk[PROMPT_LOGPROBS] = prompt_logprobs
                bodies.append(dump(chunk))
                continue
            # ``serve_tokens_stream_generator`` (furionw/vllm @ 9cdf7782 ``serve/disagg/serving.py``):
            #     chunk = GenerateStreamResponse(request_id=request_id, choices=[GenerateResponseStreamChoice(
            #         index=i, logprobs=logprobs, finish_reason=finish_reason,
            #         token_ids=as_list(delta_token_ids))])
            #     yield f"data: {chunk.model_dump_json()}\n\n"
            # No ``model``, no ``prompt_logprobs``; ``usage: null`` (no ``stream_options``: no usage chunk);
            # ``routed_experts`` on the finishing choice, as a later ``GenerateResponseStreamChoice``
            # declares.
            bodies.append(dump({"request_id": truth.request_id, "choices": [choice], "usage": None}))
        return bodies

    def _damage_finishing(self, truth: Truth, bodies: list[bytes], damage: Damage | None, start: int,
                          end: int) -> list[bytes]:
        """Upstream-shaped bodies with the finishing choice's ``routed_experts`` damaged."""
        if damage is None or not truth.return_experts:
            return bodies  # nothing to damage in a field that was never requested
        out = list(bodies)
        for i in range(len(out) - 1, -1, -1):
            obj = parse(out[i])
            choices = choices_of(obj)
            if choices and choices[0].get("finish_reason") is not None:
                value = experts_value(truth, truth_rows(truth, start, end), damage)
                if value is _ABSENT:
                    choices[0].pop(ROUTED_EXPERTS, None)
                else:
                    choices[0][ROUTED_EXPERTS] = value
                out[i] = dump(obj)
                break
        return out

    def opaque_agg(self, truth: Truth, *, stream: bool, rng: random.Random) -> list[bytes]:
        bodies = []
        chunks = self.agg(truth, stream=stream)
        for i, body in enumerate(chunks):
            roll = rng.random()
            if roll < 0.15:
                bodies.append(rng.choice([
                    b"\xff\xfe\x00 not json",
                    b'data: {"truncated": ',
                    b"[1, 2, 3]",
                    rng.randbytes(rng.randint(0, 64)),
                ]))
                continue
            obj = parse(body)
            last = i == len(chunks) - 1
            if last or roll < 0.5:
                obj["choices"][0][ROUTED_EXPERTS] = self._opaque_value(rng)
            bodies.append(dump(obj))
        return bodies

    @staticmethod
    def _opaque_value(rng: random.Random) -> object:
        kind = rng.randrange(8)
        if kind == 0:
            return "%%% not base64 %%%"
        if kind == 1:
            return rng.randint(-(2**40), 2**40)
        if kind == 2:
            return rng.random() * 1e6
        if kind == 3:
            return {"b64": base64.b64encode(rng.randbytes(12)).decode(), "dtype": "int32"}
        if kind == 4:
            return [rng.randrange(256) for _ in range(rng.randint(0, 8))]
        if kind == 5:
            return True
        if kind == 6:
            return ""
        return base64.b64encode(rng.randbytes(rng.randint(1, 96))).decode("ascii")

    # ------------------------------------------------------------ inspection

    # ---------------------------------------------------------------- requests (migration)

    def request(self, truth: Truth, **extra: object) -> bytes:
        """The disaggregated ``/inference/v1/generate`` request (``GenerateRequest``: ``request_id``,
        ``token_ids``, ``sampling_params.max_tokens``)."""
        doc: dict = {"request_id": truth.request_id, migration.TOKEN_IDS: truth.prompt_ids, "stream": True,
                     migration.SAMPLING_PARAMS: {migration.MAX_TOKENS: truth.output_len}}
        doc.update(extra)
        return dump(doc)

    def emitted_in(self, truth: Truth, request: bytes) -> int | None:
        return emitted_in(truth, request, migration.TOKEN_IDS, migration.SAMPLING_PARAMS, migration.MAX_TOKENS)

    def expert_view(self, body: bytes) -> tuple[bytes | None, str | None]:
        obj = parse_object(body)
        choices = choices_of(obj) if obj is not None else []
        if not choices:
            return None, None
        choice = choices[0]
        reason = choice.get(unavailable_key(ROUTED_EXPERTS))
        reason = reason if isinstance(reason, str) else None
        value = choice.get(ROUTED_EXPERTS)
        if value is None:
            return None, reason
        try:
            rows = _VIEW.decode(value)
        except CorruptPayload:
            return None, reason
        return rows.astype("<i4").tobytes(), reason

    # The unary fields no older stream chunk carries, and the reason the fold gives each (docs/formats-vllm.md
    # "Top level"). ``serve_tokens_stream_generator`` yields ``GenerateStreamResponse(request_id=request_id,
    # choices=[...])`` (furionw/vllm @ 9cdf7782); the unary ``GenerateResponse`` has a fresh ``random_uuid()``
    # ``request_id`` (moreh-dev/vllm @ 2f585f1b: the chunks' id, so the stream fits both), ``model`` /
    # ``usage`` no key or a string / object, the prompt logprobs and the connector's ``kv_transfer_params``.
    STREAM_OMITS = (("request_id", OmissionReason.FOLD_AMBIGUOUS), ("model", OmissionReason.NOT_STREAMED),
                    ("usage", OmissionReason.NOT_STREAMED), (PROMPT_LOGPROBS, OmissionReason.NOT_STREAMED),
                    (KV_TRANSFER_PARAMS, OmissionReason.NOT_STREAMED))

    def streamed_unary(self, body: bytes) -> bytes:
        """An older unary body as its stream's fold has it (``STREAM_OMITS``): the default stream's chunks
        have upstream's shape (``nonupstream_chunks`` streams are not meant to fold to it)."""
        obj = parse(body)
        if not isinstance(obj, dict):
            return body
        if OUTPUT_MODE in obj:
            raise NotImplementedError("a 0.34.0 body's fold omissions (fold._omit_unstreamed) are not modelled")
        for field, reason in self.STREAM_OMITS:
            obj[field] = None
        for field, reason in self.STREAM_OMITS:
            obj[unavailable_key(field)] = reason.value
        return dump(obj)

    def canonical(self, body: bytes) -> object:
        try:
            obj = parse(body)
        except ValueError:
            return body
        if not isinstance(obj, dict):
            return obj
        for choice in choices_of(obj):
            label_and_clamp(choice)
            value = choice.get(ROUTED_EXPERTS)
            if value is not None:
                try:
                    choice[ROUTED_EXPERTS] = _VIEW.decode(value).astype("<i4").tobytes()
                except CorruptPayload:
                    pass  # an undecodable value stays as sent, so it still compares unequal
        return obj
