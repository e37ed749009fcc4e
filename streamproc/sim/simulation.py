"""Deterministic ground truth for one generation, and the interface of a simulated worker.

A :class:`Truth` says what an uninterrupted, aggregated run of one request produced: prompt,
output tokens, per-position routed-expert rows and logprobs. A format's simulated worker renders
it as native chunks for the aggregated, prefill and decode legs, including the artefacts of real
disaggregated serving (stale decode prompt rows, missing prompt logprobs). Because every leg is a
function of the same truth, tests can check that the P/D join reproduces the aggregated run.
"""

from __future__ import annotations

import enum
import random
import struct
from abc import ABC, abstractmethod
from typing import ClassVar

import msgspec


class Truth(msgspec.Struct, frozen=True):
    """What the model produced for one request, independent of any wire format.

    ``experts`` holds int32 little-endian rows for token positions ``[0, prompt + output - 1)``
    (SGLang's coverage: the last sampled token is never forwarded), each row
    ``num_layers * top_k`` values.
    """

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    chunk_sizes: list[int]  # output tokens per streaming chunk; each >= 1, sum == len(output_ids)
    num_layers: int
    top_k: int
    num_experts: int
    experts: bytes
    prompt_logprobs: list[float]  # one per prompt position; position 0 has none on the wire
    output_logprobs: list[float]
    return_logprob: bool = True
    return_experts: bool = True
    finish: str = "length"  # "length" or "stop"
    stale: str = "garbage"  # decode's stale prompt rows: "garbage" or "zeros"
    decode_omits_one_token_experts: bool = False  # SGLang #39146: one-token decode may drop the field
    decode_coverage: str = "full"  # vLLM decode rows: "full" (stale prompt prefix) or "suffix" (post-prompt only)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_len(self) -> int:
        return len(self.output_ids)

    @property
    def row_bytes(self) -> int:
        return 4 * self.num_layers * self.top_k

    @property
    def rows(self) -> int:
        return self.prompt_len + self.output_len - 1

    def expert_rows(self, start: int, end: int) -> bytes:
        """Raw int32 bytes of rows ``[start, end)``."""
        return self.experts[start * self.row_bytes:end * self.row_bytes]

    def token_text(self, token_id: int) -> str:
        return f" t{token_id}"

    def chunk_spans(self) -> list[tuple[int, int]]:
        """``[start, end)`` output-token spans of the streaming chunks."""
        spans, start = [], 0
        for size in self.chunk_sizes:
            spans.append((start, start + size))
            start += size
        return spans

    def resumed(self, emitted: int) -> Truth:
        """What the model produces for the request a migration sends after ``emitted`` output tokens.

        Its prompt is the original prompt plus those tokens and its output the rest; expert rows index
        absolute positions, so they are the same bytes. The replayed tokens' prompt logprobs are their
        sampling logprobs (same prefix, same token). A chunk that straddles ``emitted`` is split.
        """
        if not 0 <= emitted < self.output_len:
            raise ValueError(f"emitted must be in [0, {self.output_len}), got {emitted}")
        if emitted == 0:
            return self
        sizes = [end - max(start, emitted) for start, end in self.chunk_spans() if end > emitted]
        return msgspec.structs.replace(
            self,
            prompt_ids=self.prompt_ids + self.output_ids[:emitted],
            output_ids=self.output_ids[emitted:],
            chunk_sizes=sizes,
            prompt_logprobs=self.prompt_logprobs + self.output_logprobs[:emitted],
            output_logprobs=self.output_logprobs[emitted:],
        )


def make_truth(
    seed: int,
    *,
    request_id: str | None = None,
    prompt_len: int | None = None,
    output_len: int | None = None,
    num_layers: int = 4,
    top_k: int = 2,
    num_experts: int = 64,
    **overrides: object,
) -> Truth:
    """A reproducible truth from a seed (used by the demo, the simulator CLI and the benchmarks)."""
    rng = random.Random(seed)
    prompt_len = prompt_len if prompt_len is not None else rng.randint(1, 24)
    output_len = output_len if output_len is not None else rng.randint(1, 24)
    rows = prompt_len + output_len - 1
    n = rows * num_layers * top_k
    # A router picks top_k distinct experts per (position, layer); codecs reject rows that repeat one.
    ids = (e for _ in range(rows * num_layers) for e in rng.sample(range(num_experts), top_k))
    experts = struct.pack(f"<{n}i", *ids)
    sizes: list[int] = []
    left = output_len
    while left:
        size = min(left, rng.randint(1, 4))
        sizes.append(size)
        left -= size
    fields = dict(
        request_id=request_id or f"req-{seed}",
        prompt_ids=[rng.randrange(1, 32000) for _ in range(prompt_len)],
        output_ids=[rng.randrange(1, 32000) for _ in range(output_len)],
        chunk_sizes=sizes,
        num_layers=num_layers,
        top_k=top_k,
        num_experts=num_experts,
        experts=experts,
        prompt_logprobs=[round(-rng.random() * 8, 4) for _ in range(prompt_len)],
        output_logprobs=[round(-rng.random() * 8, 4) for _ in range(output_len)],
    )
    fields.update(overrides)
    return Truth(**fields)


class Damage(enum.StrEnum):
    """Ways a leg's sequence payload (e.g. routed experts) can be missing or broken."""

    DROP = "drop"  # the field is absent
    GARBAGE = "garbage"  # not decodable at all (e.g. not base64)
    TRUNCATE = "truncate"  # decodes, but the byte length fits no row layout
    WRONG_TYPE = "wrong_type"  # a JSON number instead of a string
    BOMB = "bomb"  # decompresses (or would) past the size limit


class SimulatedWorker(ABC):
    """Renders a :class:`Truth` as one format's native chunks. Registered in ``streamproc.workers``.

    Streaming legs yield one body per ``truth.chunk_sizes`` entry (the prefill leg yields one);
    unary legs yield exactly one body.
    """

    format: ClassVar[str]

    @abstractmethod
    def agg(self, truth: Truth, *, stream: bool) -> list[bytes]:
        """The aggregated (single worker) response."""

    @abstractmethod
    def prefill(self, truth: Truth, *, stream: bool, damage: Damage | None = None) -> list[bytes]:
        """The prefill leg (one sampled token, the prompt's rows and logprobs)."""

    @abstractmethod
    def decode(self, truth: Truth, *, stream: bool, damage: Damage | None = None) -> list[bytes]:
        """The decode leg, with stale prompt rows and without prompt logprobs."""

    def streamed_unary(self, body: bytes) -> bytes:
        """The unary ``body`` as the fold of its stream has it: where the format's stream chunks never carry a
        field of the unary answer, the fold leaves it ``null`` with its reason (the format's fold docs), and
        the fold laws compare against this. By default the stream carries every field: ``body`` itself."""
        return body

    # A resumed request (after a migration at ``emitted`` tokens) is, to the engine that serves it, a
    # fresh request for the extended prompt: every leg is the plain leg of ``truth.resumed(emitted)``,
    # artefacts included (a P/D decode's stale rows now cover the extended prompt). A format whose
    # engine renders resumed requests differently overrides these.

    def agg_resumed(self, truth: Truth, emitted: int, *, stream: bool) -> list[bytes]:
        """The aggregated response to the request that resumes ``truth`` after ``emitted`` tokens."""
        return self.agg(truth.resumed(emitted), stream=stream)

    def prefill_resumed(self, truth: Truth, emitted: int, *, stream: bool,
                        damage: Damage | None = None) -> list[bytes]:
        """The prefill leg of the resumed request (its prompt covers the emitted tokens)."""
        return self.prefill(truth.resumed(emitted), stream=stream, damage=damage)

    def decode_resumed(self, truth: Truth, emitted: int, *, stream: bool,
                       damage: Damage | None = None) -> list[bytes]:
        """The decode leg of the resumed request."""
        return self.decode(truth.resumed(emitted), stream=stream, damage=damage)

    # The serving layer's side (migration): the native request a truth answers, and reading a
    # rebuilt one back. Optional; the formats that support migration implement both.

    def request(self, truth: Truth, **extra: object) -> bytes:
        """The original streaming request the serving layer sent for ``truth``, in the engine's own
        shape; ``extra`` adds or replaces top-level fields (to see that migration keeps them)."""
        raise NotImplementedError(f"format {self.format!r} renders no requests")

    def emitted_in(self, truth: Truth, request: bytes) -> int | None:
        """How many output tokens a rebuilt ``request`` says were already sent (its prompt is
        ``truth``'s plus that many output tokens, its budget that much smaller); None when it says it wrong."""
        raise NotImplementedError(f"format {self.format!r} renders no requests")

    @abstractmethod
    def opaque_agg(self, truth: Truth, *, stream: bool, rng: random.Random) -> list[bytes]:
        """Aggregated bodies whose sequence values are opaque: undecodable, odd types, raw bytes."""

    @abstractmethod
    def expert_view(self, body: bytes) -> tuple[bytes | None, str | None]:
        """(int32 LE rows of the joined sequence field or None, the omission reason or None)."""

    @abstractmethod
    def canonical(self, body: bytes) -> object:
        """Parsed body with sequence fields decoded, for semantic equality between runs."""


def emitted_in(truth: Truth, request: bytes, ids_key: str, params_key: str, budget_key: str) -> int | None:
    """How many output tokens a rebuilt request says were sent, the format naming its prompt ids
    (``ids_key``), sampling parameters (``params_key``) and token budget (``budget_key``): its prompt
    must be ``truth``'s plus the first k output tokens and its budget k smaller. None otherwise."""
    doc = msgspec.json.decode(request)
    ids = doc.get(ids_key) if isinstance(doc, dict) else None
    if not isinstance(ids, list):
        return None
    k = len(ids) - truth.prompt_len
    params = doc.get(params_key) or {}
    budget = params.get(budget_key) if isinstance(params, dict) else None
    if k < 0 or ids != truth.prompt_ids + truth.output_ids[:k] or budget != truth.output_len - k:
        return None
    return k
