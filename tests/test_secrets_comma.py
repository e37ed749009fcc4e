"""Found by an attack (2026-12-03): a password holding a comma, in --nats-url or STREAMPROC_NATS_URL. The URL is split on
commas (a server list) before its credentials are found, so the part of the password before the
comma was printed in the error (and the part after it taken for a token and redacted). The list is
now read with such a comma inside the userinfo (config._servers_as_written) for redaction."""

from __future__ import annotations

import pytest
from conftest import run_cli_process

SECRET = "Hunter2,Tail-9c1"


@pytest.mark.parametrize("command", ["run", "edge"])
@pytest.mark.parametrize("url", [f"nats://app:{SECRET}@127.0.0.1:4222", f"app:{SECRET}@127.0.0.1:4222",
                                 f"nats://{SECRET}@127.0.0.1:4222"])
def test_no_part_of_a_password_with_a_comma_is_printed(command, url):
    args = [command, "--print-config"] if command == "run" else [command, "--insecure-demo", "--print-config"]
    proc = run_cli_process(*args, env={"STREAMPROC_NATS_URL": url}, timeout=30)
    out = proc.stdout + proc.stderr
    assert "Hunter2" not in out and "Tail-9c1" not in out, out
