"""Shared helpers of the migration tests (core mode in ``test_migration_nats.py``, durable mode and
processor crashes in ``test_migration_crash.py``): simulated workers serving one request's attempts,
and the check that a client's stream equals the uninterrupted run."""

from __future__ import annotations

from streamproc.catalog import codec_names, worker_for
from streamproc.codec import UNAVAILABLE_SUFFIX, OmissionReason
from streamproc.client.migration import Resumed
from streamproc.client.publisher import ChunkPublisher
from streamproc.client.results import ResultInfo
from streamproc.simulation import Truth
from streamproc.wire import MigrateRequest, Subjects, decode_migrate_reply, encode_control


# The formats with a simulated worker here (sglang-zstd only when its external codec is installed).
WORKER_FORMATS = [f for f in ("sglang", "sglang-zstd", "vllm") if f in codec_names()]


def emitted_in(truth: Truth, request: bytes) -> int:
    """How many output tokens a rebuilt request says were already sent (and that it says it right),
    read by the worker of the one format whose request shape it has."""
    readings = {fmt: worker_for(fmt).emitted_in(truth, request) for fmt in WORKER_FORMATS}
    read = {k for k in readings.values() if k is not None}  # sglang and sglang-zstd share a request shape
    assert len(read) == 1, (request, readings)
    return read.pop()


class SimulatedPool:
    """Simulated workers publishing one request's legs for a given attempt, optionally dying early."""

    def __init__(self, publisher: ChunkPublisher, fmt: str, truth: Truth, *, pd: bool) -> None:
        self.publisher = publisher
        self.worker = worker_for(fmt)
        self.truth = truth
        self.pd = pd

    def legs(self, emitted: int) -> list[tuple[str, list[bytes]]]:
        w, t = self.worker, self.truth
        if self.pd:
            return [("prefill", w.prefill_resumed(t, emitted, stream=True)),
                    ("decode", w.decode_resumed(t, emitted, stream=True))]
        return [("agg", w.agg_resumed(t, emitted, stream=True))]

    async def publish(self, role: str, bodies: list[bytes], attempt: int, start: int = 0,
                      stop: int | None = None) -> None:
        last = len(bodies) - 1
        for seq in range(start, len(bodies) if stop is None else stop):
            await self.publisher.publish(self.truth.request_id, role, seq, bodies[seq], final=seq == last,
                                         attempt=attempt)

    async def serve(self, resumed: Resumed) -> None:
        """``send`` for the Migrator: a fresh worker (pair) serves the rebuilt request to the end."""
        assert resumed.emitted_tokens == emitted_in(self.truth, resumed.body)
        for role, bodies in self.legs(resumed.emitted_tokens):
            await self.publish(role, bodies, resumed.attempt)


# SGLang 0.5.23's timing keys (``TokenizerManager._handle_batch_output``), written here from upstream,
# not read from the codec: every body with --enable-metrics (``SchedulerReqTimeStats.
# convert_to_output_meta_info``), the finished one (``e2e_latency`` always; with --enable-metrics
# ``APIServerReqTimeStats.convert_to_output_meta_info``), the first sent (``generate_request``).
SGLANG_0523_TIMINGS = (
    "storage_prefetch_wait", "storage_staging_wait", "forward_entry_time", "prefill_finished_time", "queue_time",
    "e2e_latency", "request_received_ts", "first_token_latency", "api_server_dispatch_finish_ts",
    "response_sent_to_client_ts", "request_finished_ts", "decode_throughput",
)


def without_timings(doc: object) -> object:
    """A parsed SGLang body without its timings (``SGLANG_0523_TIMINGS``): their values, or the
    ``stitch_incomplete`` markers a resumed attempt's bodies carry instead (pinned in
    ``test_migration_codecs.py``), so the rest of a stitched stream compares with the uninterrupted run."""
    meta = doc.get("meta_info") if isinstance(doc, dict) else None
    if isinstance(meta, dict):
        for key in SGLANG_0523_TIMINGS:
            meta.pop(key, None)
            assert meta.pop(key + UNAVAILABLE_SUFFIX, OmissionReason.STITCH_INCOMPLETE) == OmissionReason.STITCH_INCOMPLETE
    return doc


# ``Req.retraction_count`` under its 0.5.23 and older names (``_handle_batch_output``): one ``Req``'s
# count on one worker, so a resumed attempt's bodies omit it once tokens were emitted before the seal.
SGLANG_RETRACTION_COUNTS = ("num_retractions", "total_retractions")


def without_attempt_values(doc: object) -> object:
    """``without_timings``, and without the retraction count: its value, or the ``stitch_incomplete``
    marker a resumed attempt's bodies carry instead (pinned in ``test_sglang_0523_migration_by_hand.py``)."""
    meta = doc.get("meta_info") if isinstance(doc, dict) else None
    if isinstance(meta, dict):
        for key in SGLANG_RETRACTION_COUNTS:
            meta.pop(key, None)
            assert meta.pop(key + UNAVAILABLE_SUFFIX, OmissionReason.STITCH_INCOMPLETE) == OmissionReason.STITCH_INCOMPLETE
    return without_timings(doc)


def assert_uninterrupted(fmt: str, truth: Truth, results: list[ResultInfo]) -> None:
    w = worker_for(fmt)
    expected = w.agg(truth, stream=True)
    assert [r.seq for r in results] == list(range(len(expected)))
    assert [r.final for r in results] == [False] * (len(expected) - 1) + [True]
    assert all(r.error is None for r in results), [r.body for r in results if r.error]
    assert [w.canonical(r.body) for r in results] == [w.canonical(b) for b in expected]
    assert w.expert_view(results[-1].body) == (truth.experts, None)


async def ask_migrate(client, subjects: Subjects, rid: str, **request: object):
    """One migrate request, answered by whoever owns ``rid`` (no retry, unlike the Migrator)."""
    msg = await client.request(subjects.migrate(rid), encode_control(MigrateRequest(**request)), timeout=5)
    return decode_migrate_reply(msg.data)
