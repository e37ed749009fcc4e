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
import ssl
import subprocess
import termios
import time
import urllib.request
from pathlib import Path
from typing import Callable

import pytest

from conftest import CLI, run_cli_process
from helpers import clean_env, free_port
from nats_auth import openssl
from streamproc.sim.embedded import EmbeddedNats

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


class OnATerminal:
    """``argv`` with a pseudo-terminal as its controlling terminal and stdio (where OpenSSL's prompt
    reads), as under ``docker run -t``; :meth:`read` collects its output while the test acts."""

    def __init__(self, argv: list[str]) -> None:
        self.primary, secondary = pty.openpty()

        def take_terminal() -> None:  # the new session's controlling terminal: /dev/tty is the pty
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen(argv, stdin=secondary, stdout=secondary, stderr=secondary, env=clean_env(),
                                     start_new_session=True, preexec_fn=take_terminal)
        os.close(secondary)
        self.out = bytearray()

    @property
    def text(self) -> str:
        return self.out.decode(errors="replace")

    def read(self, timeout: float, until: Callable[[], bool] = lambda: False) -> int | None:
        """Collect output for ``timeout`` seconds, or until the process ends or ``until()``; its exit
        code, None while it runs."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not until():
            ready, _, _ = select.select([self.primary], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(self.primary, 65536)
                except OSError:  # EIO: every holder of the terminal's other side closed it
                    chunk = b""
                self.out += chunk
                if not chunk and self.proc.poll() is not None:
                    break
            elif self.proc.poll() is not None:
                break
        return self.proc.poll()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        os.close(self.primary)


def run_on_a_terminal(argv: list[str], timeout: float) -> tuple[int | None, str]:
    """(exit code or None if still running at ``timeout``, output) of ``argv`` on a terminal."""
    terminal = OnATerminal(argv)
    try:
        code = terminal.read(timeout)
    finally:
        terminal.close()
    return code, terminal.text


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


def _healthz_over_tls(port: int) -> bool:
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # the test's self-signed certificate
    try:
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", context=context, timeout=1) as answer:
            return answer.status == 200
    except OSError:  # not serving yet (URLError is an OSError)
        return False


def test_the_edge_serves_the_tls_key_it_checked_when_the_file_turns_encrypted_while_nats_is_away(tmp_path):
    """The edge checks --tls-key-file at start-up, then waits for NATS; the key it serves with is the
    one it checked. Before, Uvicorn read the file again once NATS answered, with no password callback:
    a key replaced meanwhile by an encrypted one (a rotation, a mistake) made OpenSSL prompt on the
    terminal, and the edge hung there, connected to NATS and serving nothing."""
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
            "key.pem", "-out", "cert.pem", "-days", "2", "-subj", "/CN=localhost", cwd=tmp_path)
    (tmp_path / "auth.key").write_text("k" * 48)
    port = free_port()
    server = EmbeddedNats(jetstream=False).start()
    try:
        server.kill()  # its address is known; the edge waits for it
        terminal = OnATerminal([*CLI, "edge", "--auth-key-file", str(tmp_path / "auth.key"), "--tls-cert-file",
                                str(tmp_path / "cert.pem"), "--tls-key-file", str(tmp_path / "key.pem"),
                                "--port", str(port), "--nats-url", server.url, "--connect-timeout", "0"])
        try:
            terminal.read(30, until=lambda: "nats_error" in terminal.text)  # past the check, connecting
            assert terminal.proc.poll() is None, terminal.text
            openssl("pkey", "-in", "key.pem", "-out", "key.pem.new", "-aes256", "-passout", f"pass:{PASSPHRASE}",
                    cwd=tmp_path)
            os.replace(tmp_path / "key.pem.new", tmp_path / "key.pem")
            server.start()
            terminal.read(30, until=lambda: _healthz_over_tls(port))
            assert _healthz_over_tls(port), f"the edge does not serve (exit {terminal.proc.poll()}):\n{terminal.text}"
            assert PROMPT not in terminal.text.lower(), terminal.text
        finally:
            terminal.close()
    finally:
        server.stop()
