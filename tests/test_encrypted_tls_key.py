"""A passphrase-protected TLS key stops start-up at once, naming the cause, and never prompts.

Found by an attack (2026-12-06): ``ssl.SSLContext.load_cert_chain`` without a password callback lets
OpenSSL ask for an encrypted key's passphrase on the controlling terminal. ``streamproc edge
--tls-key-file`` and ``streamproc run --nats-tls-key-file`` with such a key then hung at start-up
under a terminal (``docker run -t``, an operator's shell: ``Enter PEM pass phrase:``, waiting for ever);
without one, OpenSSL read stdin, printed the prompt and the error said ``[Errno 22] Invalid argument``.
"""

from __future__ import annotations

import fcntl
import os
import pty
import select
import subprocess
import termios
import time
from pathlib import Path

import pytest

from conftest import CLI, run_cli_process
from helpers import clean_env
from nats_auth import openssl

PASSPHRASE = "key-pass-5b7e-never-printed"
PROMPT = "pass phrase"


@pytest.fixture(scope="module")
def encrypted_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(certificate, its key encrypted with PASSPHRASE, an HS256 capability key for the edge)."""
    directory = tmp_path_factory.mktemp("encrypted-key")
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-keyout", "key.pem",
            "-out", "cert.pem", "-days", "2", "-subj", "/CN=localhost", "-passout", f"pass:{PASSPHRASE}",
            cwd=directory)
    assert b"ENCRYPTED" in (directory / "key.pem").read_bytes()
    auth_key = directory / "auth.key"
    auth_key.write_text("k" * 48)
    return directory / "cert.pem", directory / "key.pem", auth_key


def commands(cert: Path, key: Path, auth_key: Path) -> dict[str, list[str]]:
    return {
        "edge": ["edge", "--auth-key-file", str(auth_key), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
                 "--port", "0", "--nats-url", "127.0.0.1:1", "--connect-timeout", "2"],
        "run": ["run", "--nats-url", "tls://127.0.0.1:1", "--nats-tls-cert-file", str(cert), "--nats-tls-key-file",
                str(key), "--connect-timeout", "2"],
    }


def run_on_a_terminal(argv: list[str], timeout: float) -> tuple[int | None, str]:
    """``argv`` with a pseudo-terminal as its controlling terminal and stdio (where OpenSSL's
    prompt reads), as under ``docker run -t``; (exit code or None if still running at ``timeout``, output)."""
    primary, secondary = pty.openpty()

    def take_terminal() -> None:  # the new session's controlling terminal: /dev/tty is the pty
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(argv, stdin=secondary, stdout=secondary, stderr=secondary, env=clean_env(),
                            start_new_session=True, preexec_fn=take_terminal)
    os.close(secondary)
    out = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([primary], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(primary, 65536)
                except OSError:  # EIO: every holder of the terminal's other side closed it
                    chunk = b""
                out += chunk
                if not chunk and proc.poll() is not None:
                    break
            elif proc.poll() is not None:
                break
        code = proc.poll()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        os.close(primary)
    return code, out.decode(errors="replace")


@pytest.mark.parametrize("command", ["edge", "run"])
def test_an_encrypted_tls_key_on_a_terminal_stops_start_up_without_a_prompt(encrypted_pair, command):
    code, out = run_on_a_terminal([*CLI, *commands(*encrypted_pair)[command]], timeout=20)
    assert code == 2, f"exit {code} (None: still waiting at start-up):\n{out}"
    assert PROMPT not in out.lower(), out
    assert "encrypted" in out and "passphrase" in out, out
    assert PASSPHRASE not in out


@pytest.mark.parametrize("command", ["edge", "run"])
def test_an_encrypted_tls_key_without_a_terminal_is_refused_naming_the_cause(encrypted_pair, command):
    proc = run_cli_process(*commands(*encrypted_pair)[command], timeout=30)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert PROMPT not in (proc.stdout + proc.stderr).lower(), proc.stderr
    assert "Invalid argument" not in proc.stderr and "encrypted" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr  # one line, no traceback
