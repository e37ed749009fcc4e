"""The shipped nats-server configuration (deploy/nats-server.conf) run by the tests of its trust model.

Not a test module: tests/test_trust_model.py and tests/test_control_reply.py start a real
nats-server with that file (ports and storage overridden by the test's flags) and connect as its
users.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from streamproc.sim.embedded import EmbeddedNats

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
