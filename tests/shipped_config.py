"""The shipped nats-server configuration (deploy/nats-server.conf) run by the tests of its trust model.

Not a test module: tests/test_trust_model.py and tests/test_control_reply.py start a real
nats-server with that file (ports and storage overridden by the test's flags) and connect as its
users.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import anyio
import nats
import pytest
from conftest import processor_subprocess

from streamproc.core.wire import FINAL, chunk_headers
from streamproc.sim.embedded import EmbeddedNats
from streamproc.wire import Subjects

CONF = Path(__file__).parent.parent / "deploy" / "nats-server.conf"
PASSWORDS = {role: f"{role}-pw-{i}e7c" for i, role in enumerate(["worker", "processor", "edge", "frontend"])}


@contextlib.contextmanager
def shipped_server(config: str):
    mp = pytest.MonkeyPatch()
    for role, password in PASSWORDS.items():
        mp.setenv(f"STREAMPROC_{role.upper()}_PASSWORD", password)  # nats-server reads them from its env
    try:
        with EmbeddedNats(config=runnable(config)) as srv:
            yield srv
    finally:
        mp.undo()


def runnable(config: str) -> str:
    """The test's flags choose ports and storage; everything else is the given file."""
    stripped = config.replace("jetstream { store_dir: /data/jetstream }", "")
    assert stripped != config
    return stripped


def url(server: EmbeddedNats, role: str) -> str:
    return server.url.replace("nats://", f"nats://{role}:{PASSWORDS[role]}@")


async def requests_unanswered_under_fake_lease_members(server: EmbeddedNats, publish_members) -> tuple[list[str], str]:
    """Fake members in the lease bucket shrink a processor's fair share: with 8 partitions and 7
    fake members it serves one, and requests of the other seven wait in the chunk stream. A durable
    processor runs on ``server`` while ``publish_members(i)`` tries, every 0.5 s, to keep fake member
    ``i`` (0..6) alive; then 40 one-chunk requests are sent as the worker. Returns the requests not
    answered within 10 s and the processor's lease log lines."""
    subjects = Subjects("streamproc")
    worker = await nats.connect(url(server, "worker"), allow_reconnect=False)
    reader = await nats.connect(url(server, "frontend"), allow_reconnect=False)
    finals: set[str] = set()

    async def on_result(msg) -> None:
        if (msg.headers or {}).get(FINAL) == "true":
            finals.add(subjects.request_id_of_result(msg.subject))

    try:
        await reader.subscribe(subjects.all_results, cb=on_result)
        await reader.flush()
        with processor_subprocess(url(server, "processor"), "--mode", "durable", "--partitions", "8",
                                  "--lease-ttl", "3") as (_, log_path):
            await anyio.sleep(2.0)  # the processor owns all 8 partitions

            async def keep_fake_members() -> None:
                while True:
                    for i in range(7):
                        await publish_members(i)
                    await anyio.sleep(0.5)

            async with anyio.create_task_group() as tg:
                tg.start_soon(keep_fake_members)
                await anyio.sleep(6.0)  # two lease steps: members counted, surplus handed over
                legit = [f"legit-{i}" for i in range(40)]
                js = worker.jetstream()
                for rid in legit:
                    await js.publish(subjects.chunk(rid, "agg"), b'{"text":"hi"}',
                                     headers=chunk_headers(rid, "agg", 0, final=True))
                with anyio.move_on_after(10):
                    while len(finals & set(legit)) < len(legit):
                        await anyio.sleep(0.2)
                tg.cancel_scope.cancel()
            log = log_path.read_text()
    finally:
        await worker.close()
        await reader.close()
    lease_lines = "\n".join(line for line in log.splitlines() if "lease" in line)[-3000:]
    return sorted(set(legit) - finals), lease_lines
