"""A secret file that is a pipe (``--nats-token-file <(vault read ...)``, a FIFO a sidecar writes once)
is read once: start-up reads every secret file twice (the configuration check, then the connect).

Found by the deploy attack (2026-12-06): the second read of ``/dev/fd/63`` found the pipe drained
(``'/dev/fd/63' is empty``, exit 2), and the second open of a FIFO whose writer had written and gone
blocked for ever (``wait_for_partner``), on the event loop, deaf to SIGTERM: start-up hung until SIGKILL.
"""

from __future__ import annotations

import os
import subprocess
import threading

import pytest

from conftest import CLI
from helpers import clean_env, wait_ready
from streamproc.sim.embedded import EmbeddedNats, stop_process

pytestmark = pytest.mark.nats

TOKEN = "pipedTok-3c9e1"


@pytest.fixture(scope="module")
def token_server():
    with EmbeddedNats(jetstream=False, config=f'authorization {{ token: "{TOKEN}" }}\n') as server:
        yield server


def _run(server: EmbeddedNats, token_file: str, log, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    return subprocess.Popen([*CLI, "run", "--nats-url", server.url, "--nats-token-file", token_file,
                             "--connect-timeout", "10"], stdout=log, stderr=subprocess.STDOUT, env=clean_env(),
                            pass_fds=pass_fds)


def _started(proc: subprocess.Popen, path) -> None:
    try:
        wait_ready(lambda: "event=started" in path.read_text(), proc, "streamproc run", 20, path.read_text)
    finally:
        code = stop_process(proc, 10)
    assert code == 0, path.read_text()
    assert TOKEN not in path.read_text()


def test_a_token_file_that_is_a_shell_pipe_is_read_once(token_server, tmp_path):
    read, write = os.pipe()  # what bash's <(echo token) hands over as /dev/fd/N
    os.write(write, TOKEN.encode() + b"\n")
    os.close(write)
    path = tmp_path / "out.log"
    try:
        with open(path, "wb") as log:
            proc = _run(token_server, f"/dev/fd/{read}", log, pass_fds=(read,))
    finally:
        os.close(read)
    _started(proc, path)


def test_a_token_file_that_is_a_fifo_written_once_is_read_once(token_server, tmp_path):
    fifo = tmp_path / "token"
    os.mkfifo(fifo)

    def write_once() -> None:  # a sidecar handing the secret over once, as nothing is stored on disk
        with open(fifo, "wb") as f:
            f.write(TOKEN.encode())

    writer = threading.Thread(target=write_once, daemon=True)
    writer.start()
    path = tmp_path / "out.log"
    with open(path, "wb") as log:
        proc = _run(token_server, str(fifo), log)
    try:
        _started(proc, path)
    finally:
        if proc.poll() is None:
            proc.kill()
        writer.join(timeout=1)
        if writer.is_alive():  # the process never opened the FIFO: release the writer's open
            with open(fifo, "rb") as f:
                f.read()
