"""Error texts a codec plugin's exception chooses, bounded where they reach a reply (not only error results).

Since 85fd236 an error result's text is cut to ``errors.MAX_ERROR_TEXT`` (512) bytes as JSON
(``cut_error_text``). Two replies still carried an exception's text whole: the edge's 500 for a unary
answer whose fold raised (``cannot fold N results: <exc>``: a 10 MB message was a 10 MB body) and a
migrate's ``refused`` reply (``codec 'x' failed: RuntimeError: <exc>``: past ``max_payload`` it was
never sent, so the migrator waited out its timeout while the request was ended anyway). A codec
distribution whose exceptions carry 10 MB (or 100,000 control characters: 600,000 bytes as JSON escapes)
is installed in the child's PYTHONPATH (helpers.loud_codec_site); real nats-server, edge and processor.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
from conftest import processor_subprocess
from edge_harness import publish_results, running_edge
from durable_helpers import durable_flags
from helpers import connection, loud_codec_site

from streamproc.core.codec import ErrorKind
from streamproc.core.errors import MAX_ERROR_TEXT
from streamproc.core.wire import (ERROR, FINAL, MigrateError, MigrateErrorCode, Subjects, chunk_headers,
                                  decode_migrate_reply, encode_control)
from streamproc.edge.app import error_response
from streamproc.edge.metrics import EdgeMetrics
from streamproc.edge.stats import StatsSource
from streamproc.sim.embedded import EmbeddedNats

pytestmark = [pytest.mark.timeout(120)]

SUBJECTS = Subjects()
SMALL = 4096  # a max_payload that takes every error result (wire.max_error_result_size)
# The most an sglang error envelope takes around its message's JSON (msgspec; the longest type)
ENVELOPE = len(b'{"error":{"message":"","type":"service_unavailable"}}')


def body(rid: str, text: str = "x") -> bytes:
    return json.dumps({"text": text, "output_ids": [1, 2, 3], "meta_info": {"id": rid}}).encode()


def loud_env(tmp_path) -> dict[str, str]:
    return {"PYTHONPATH": f"{loud_codec_site(tmp_path)}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


@pytest.mark.anyio
@pytest.mark.nats
async def test_a_fold_raising_a_huge_text_answers_a_bounded_500(server, nc, tmp_path):
    cases = {"loud-huge": (10_000_000, "x"), "loud-ctl": (100_000, "\x01")}
    with running_edge(server.url, "--format", "loud", "--ensure-results-stream",
                      env=loud_env(tmp_path)) as edge:
        for rid in cases:
            await publish_results(nc, SUBJECTS, rid, [body(rid, rid), body(rid, rid)])
        async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
            answers = {rid: await client.get(f"/v1/results/{rid}?stream=false") for rid in cases}
        assert "event=fold_failed" in edge.log()
    for rid, (length, char) in cases.items():
        answer = answers[rid]
        assert answer.status_code == 500, answer.text[:300]
        assert len(answer.content) <= ENVELOPE + MAX_ERROR_TEXT, (rid, len(answer.content))
        error = answer.json()["error"]  # still the codec's envelope, valid JSON
        assert error["type"] == "internal_error"
        text = error["message"]
        assert text.startswith("cannot fold 2 results: " + char), text[:100]
        assert text.endswith(f"... ({len('cannot fold 2 results: ') + length} characters)"), text[-100:]


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.parametrize("mode", ["core", "durable"])
async def test_a_migrate_whose_codec_raises_a_huge_text_gets_a_bounded_refusal(tmp_path, mode):
    rid = "loud-migrate"
    durable = mode == "durable"
    flags = durable_flags(partitions=1, format="loud") if durable else ["--mode", "core", "--format", "loud"]
    with EmbeddedNats(config=f"max_payload: {SMALL}", jetstream=durable) as server:
        with processor_subprocess(server.url, *flags, env=loud_env(tmp_path)) as (_proc, log_path):
            async with connection(server.url) as nc:
                results = await nc.subscribe(SUBJECTS.result(rid))
                await nc.flush()
                publish = nc.jetstream().publish if durable else nc.publish
                await publish(SUBJECTS.chunk(rid, "agg"), body(rid), headers=chunk_headers(rid, "agg", 0))
                first = await results.next_msg(timeout=10)
                assert (first.headers or {}).get(FINAL) != "true", first.headers
                reply = await nc.request(SUBJECTS.migrate(rid), b"{}", timeout=8)
                ended = await results.next_msg(timeout=10)
            log = log_path.read_text(errors="replace")
    assert len(reply.data) <= SMALL
    answer = decode_migrate_reply(reply.data)
    assert isinstance(answer, MigrateError) and answer.code is MigrateErrorCode.REFUSED, answer
    assert answer.message.startswith("codec 'loud' failed: RuntimeError: xxx"), answer.message[:100]
    assert answer.message.endswith(" characters)"), answer.message[-100:]
    assert len(answer.message) <= MAX_ERROR_TEXT, len(answer.message)
    headers = ended.headers or {}
    assert headers.get(ERROR) == ErrorKind.MIGRATION_REFUSED.value and headers.get(FINAL) == "true", headers
    text = json.loads(ended.data)["error"]["message"]
    assert text.startswith("migration refused: codec 'loud' failed"), text[:100]
    # cut once: the length it names is the whole refusal's (before, that of the refusal cut to 512 bytes)
    whole = len("codec 'loud' failed: RuntimeError: ") + 10_000_000
    assert text.endswith(f"... ({whole} characters)"), text[-100:]
    assert len(ended.data) <= ENVELOPE + MAX_ERROR_TEXT
    assert "event=control_reply_failed" not in log, log[-2000:]


@pytest.mark.parametrize("code", list(MigrateErrorCode))
def test_every_migrate_error_reply_is_cut_as_encoded(code):
    """Whoever builds it (the control shell's ``malformed migrate request: <parse error>``, durable recovery's
    ``... cannot be adopted: <exc>``): a MigrateError's text is cut where it is encoded."""
    for text in ("y" * 10_000_000, "\x01" * 100_000):
        encoded = encode_control(MigrateError("r", code, text, 3))
        reply = decode_migrate_reply(encoded)
        assert isinstance(reply, MigrateError) and reply.code is code and reply.attempt == 3
        assert reply.message.startswith(text[:10]) and reply.message.endswith(f"... ({len(text)} characters)")
        assert len(encoded) <= len(encode_control(MigrateError("r", code, "", 3))) + MAX_ERROR_TEXT
    short = MigrateError("r", code, "nothing moved", 3)
    assert decode_migrate_reply(encode_control(short)) == short


def test_the_edge_error_responses_are_cut():
    """``error_response`` (``not a result body: <a codec's ValueError>``, ``cannot subscribe ...: <exc>``)."""
    for text in ("z" * 10_000_000, "\x01" * 100_000):
        response = error_response(f"not a result body: {text}", "invalid_request", 400)
        assert len(response.body) <= len(error_response("", "invalid_request", 400).body) + MAX_ERROR_TEXT
        assert json.loads(response.body)["error"]["message"].endswith(" characters)")


@pytest.mark.anyio
async def test_a_scrape_answering_a_huge_invalid_line_is_named_with_a_cut_error():
    """``/v1/stats`` names each processor scrape's error: prometheus_client's parser raises ``ValueError``
    repeating the offending line (up to ``MAX_SCRAPE_BYTES``, 4 MiB). A real local HTTP server answers one of
    3 MiB (a misconfigured URL, or anything listening there)."""
    import http.server
    import threading

    line = b"m{," + b"a" * (3 << 20) + b"} 1\n"  # "Invalid labels: <the labels>"

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Length", str(len(line)))
            self.end_headers()
            self.wfile.write(line)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        source = StatsSource(EdgeMetrics(), [f"http://127.0.0.1:{httpd.server_port}/metrics"],
                             sees_all_results=False)
        [scrape] = (await source.snapshot()).processors
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert not scrape.ok and scrape.error is not None
    assert len(scrape.error) <= MAX_ERROR_TEXT and scrape.error.endswith(" characters)"), len(scrape.error)
