"""The JetStream results stream (streamproc.streams) and the edge's settings."""

from __future__ import annotations

import nats
import pytest
from nats.js.api import StorageType, StreamConfig

from streamproc.edge.settings import EdgeConfigError, load
from streamproc.sim.embedded import EmbeddedNats
from streamproc.nats.streams import (
    RESULTS_STREAM,
    ResultsStreamMismatch,
    covers,
    ensure_results_stream,
    find_results_stream,
)
from streamproc.wire import Subjects


@pytest.fixture
async def js():
    with EmbeddedNats() as srv:
        nc = await nats.connect(srv.url)
        try:
            yield nc.jetstream()
        finally:
            await nc.close()


@pytest.mark.anyio
@pytest.mark.nats
async def test_ensure_results_stream_creates_it_once_and_then_only_checks(js):
    subjects = Subjects("p")
    created = await ensure_results_stream(
        js, subjects, max_age=60, duplicate_window=5, storage=StorageType.MEMORY
    )
    again = await ensure_results_stream(
        js, subjects, max_age=60, duplicate_window=5, storage=StorageType.MEMORY
    )

    assert created.config.name == again.config.name == RESULTS_STREAM
    assert created.config.subjects == ["p.results.>"]
    assert (again.config.max_age, again.config.duplicate_window) == (60, 5)
    assert await find_results_stream(js, subjects.result("some-id")) == RESULTS_STREAM
    assert await find_results_stream(js, Subjects("other").result("some-id")) is None


@pytest.mark.anyio
@pytest.mark.nats
async def test_a_differing_stream_is_reported_and_left_unchanged(js):
    subjects = Subjects("p")
    await ensure_results_stream(js, subjects, max_age=600)

    with pytest.raises(ResultsStreamMismatch) as raised:
        await ensure_results_stream(js, subjects, max_age=60, storage=StorageType.MEMORY)

    assert any("max_age" in d for d in raised.value.differences)
    assert any("storage" in d for d in raised.value.differences)
    info = await js.stream_info(RESULTS_STREAM)
    assert info.config.max_age == 600 and info.config.storage == StorageType.FILE


@pytest.mark.anyio
@pytest.mark.nats
async def test_another_stream_already_capturing_results_is_reported(js):
    await js.add_stream(StreamConfig(name="THEIRS", subjects=["p.>"]))

    with pytest.raises(ResultsStreamMismatch, match="THEIRS"):
        await ensure_results_stream(js, Subjects("p"))


@pytest.mark.anyio
@pytest.mark.nats
async def test_find_results_stream_is_none_without_jetstream():
    with EmbeddedNats(jetstream=False) as srv:
        nc = await nats.connect(srv.url)
        try:
            assert await find_results_stream(nc.jetstream(), "p.results.x") is None
        finally:
            await nc.close()


@pytest.mark.parametrize(
    ("pattern", "subject", "expected"),
    [
        ("p.results.>", "p.results.>", True),
        ("p.>", "p.results.>", True),
        ("p.*.>", "p.results.>", True),
        ("p.results.*", "p.results.>", False),
        ("p.results.>", "p.results", False),
        ("q.results.>", "p.results.>", False),
        ("p.results.abc", "p.results.abc", True),
        (">", "p.results.>", True),
    ],
)
def test_covers_is_wildcard_subset(pattern, subject, expected):
    assert covers(pattern, subject) is expected


def test_settings_come_from_flags_over_environment_over_defaults():
    env = {
        "STREAMPROC_NATS_URL": "nats://env:4222",
        "STREAMPROC_EDGE_PORT": "9000",
        "STREAMPROC_EDGE_ENSURE_RESULTS_STREAM": "true",
        "STREAMPROC_EDGE_MAX_STREAMS": "7",
        "STREAMPROC_EDGE_INSECURE_DEMO": "yes",
    }
    settings = load(env, {"port": "9100"})
    assert settings.nats_url == "nats://env:4222"
    assert settings.port == 9100
    assert settings.max_streams == 7
    assert settings.ensure_results_stream is True
    demo = {"STREAMPROC_EDGE_INSECURE_DEMO": "1"}
    assert load(demo).port == 8080 and load(demo).ensure_results_stream is False


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"STREAMPROC_EDGE_MAX_STREAMS": "0"}, "STREAMPROC_EDGE_MAX_STREAMS"),
        ({"STREAMPROC_EDGE_ENSURE_RESULTS_STREAM": "perhaps"}, "STREAMPROC_EDGE_ENSURE_RESULTS_STREAM"),
        ({"STREAMPROC_PREFIX": "a..b"}, "prefix"),
    ],
)
def test_bad_settings_fail_naming_their_source(env, names):
    with pytest.raises((EdgeConfigError, ValueError), match=names):
        load(env)


def test_the_edge_and_the_processor_read_shared_settings_from_the_same_variables():
    from streamproc import config

    env = {"STREAMPROC_RESULTS_MAX_AGE": "1800", "STREAMPROC_DUPLICATE_WINDOW": "30",
           "STREAMPROC_STREAM_STORAGE": "memory", "STREAMPROC_STREAM_REPLICAS": "3",
           "STREAMPROC_PREFIX": "tenant1", "STREAMPROC_CONNECT_TIMEOUT": "4"}
    edge, processor = load({**env, "STREAMPROC_EDGE_INSECURE_DEMO": "1"}), config.load(env)
    for name in config.CommonSettings.__struct_fields__:
        assert getattr(edge, name) == getattr(processor, name), name
    assert (edge.results_max_age, edge.stream_storage, edge.stream_replicas) == (1800.0, "memory", 3)


def test_the_edge_gives_up_on_an_unreachable_nats_after_connect_timeout():
    import subprocess
    import sys
    import time

    from helpers import free_port

    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "streamproc.edge", "--nats-url", f"nats://127.0.0.1:{free_port()}",
                           "--connect-timeout", "1", "--port", "0", "--insecure-demo"], capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0
    assert "cannot connect to NATS" in proc.stderr
    assert time.monotonic() - started < 15
