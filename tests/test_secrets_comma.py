"""Found by an attack (2026-12-03): a password holding a comma, in --nats-url or STREAMPROC_NATS_URL. The URL is split on
commas (a server list) before its credentials are found, so the part of the password before the
comma was printed in the error (and the part after it taken for a token and redacted). The list is
now read with such a comma inside the userinfo (config._servers_as_written) for redaction."""

from __future__ import annotations

import pytest
from conftest import run_cli_process

from streamproc.config import redact_url, url_secrets

SECRET = "Hunter2,Tail-9c1"


@pytest.mark.parametrize("command", ["run", "edge"])
@pytest.mark.parametrize("url", [f"nats://app:{SECRET}@127.0.0.1:4222", f"app:{SECRET}@127.0.0.1:4222",
                                 f"nats://{SECRET}@127.0.0.1:4222"])
def test_no_part_of_a_password_with_a_comma_is_printed(command, url):
    args = [command, "--print-config"] if command == "run" else [command, "--insecure-demo", "--print-config"]
    proc = run_cli_process(*args, env={"STREAMPROC_NATS_URL": url}, timeout=30)
    out = proc.stdout + proc.stderr
    assert "Hunter2" not in out and "Tail-9c1" not in out, out


def test_a_password_with_two_commas_shows_no_part_of_it():
    """Found by a review of the first version: a part without '@' was joined only to the *one* part
    after it, so with two commas in the password the first piece was its own 'server' and printed."""
    proc = run_cli_process("run", "--print-config",
                           env={"STREAMPROC_NATS_URL": "nats://app:Hunter2,Mid,Tail@127.0.0.1:4222"}, timeout=30)
    assert "Hunter2" not in proc.stdout + proc.stderr, proc.stderr
    for value in ("nats://app:Hunter2,Mid,Tail@127.0.0.1:4222", "app:Hunter2,Mid,Tail@127.0.0.1:4222"):
        shown = redact_url(value)
        assert "Hunter2" not in shown, shown
        assert "Hunter2" in url_secrets(value), url_secrets(value)


def test_a_legitimate_server_list_is_redacted_as_before():
    """Found by the same review: only redaction was meant to change, yet a working list whose second
    server has credentials was read as one server: the first server's port becomes a 'secret' (scrubbed from every startup
    error: 'cannot connect to NATS at h1:<redacted>@h2:<redacted>'), the first host is shown as a user
    name, and the real password is no longer among the secrets alone. Both hold again."""
    value = "h1:4222,user:pw@h2:4222"
    assert redact_url(value) == "h1:4222,user:<redacted>@h2:4222"
    assert url_secrets(value) == ["pw"]
    value = "nats://h1:4222,user:pw@h2:4222"
    assert redact_url(value) == "nats://h1:4222,user:<redacted>@h2:4222"
    assert "4222" not in url_secrets(value)
