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

import nkeys
import pytest

from conftest import CLI
from helpers import clean_env, wait_ready
from nats_auth import new_keypair
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


def _hand_over(fifo, content: bytes) -> threading.Thread:
    """A sidecar writing ``content`` into the FIFO once (its open waits for the reader)."""
    def write_once() -> None:
        with open(fifo, "wb") as f:
            f.write(content)

    writer = threading.Thread(target=write_once, daemon=True)
    writer.start()
    return writer


@pytest.mark.anyio
async def test_a_library_connect_reads_a_new_fifo_even_where_an_earlier_one_s_inode_is_reused(tmp_path):
    """``streamproc.connect(user_credentials=<FIFO>)`` in a long-lived application: each connect's
    FIFO is what it reads. 681587d kept every pipe's bytes for the process by (device, inode) only,
    and ext4 gives a FIFO made after another was removed the same inode: the second connect, handed a
    stranger's credentials, signed in with the first one's (and every FIFO's secret stayed in memory)."""
    from nats_auth import Operator
    from streamproc import connect
    from streamproc.config import _PIPED
    from streamproc.nats.connection import read_creds

    kept = dict(_PIPED)
    operator = Operator()
    good, stranger = tmp_path / "good.creds", tmp_path / "stranger.creds"
    operator.creds(good)
    stranger_account, _ = new_keypair(nkeys.PREFIX_BYTE_ACCOUNT)  # an account the operator never signed
    operator.creds(stranger, account_seed=stranger_account)
    with EmbeddedNats(jetstream=False, config=operator.server_config()) as server:
        first = tmp_path / "first.fifo"
        os.mkfifo(first)
        inode = first.stat().st_ino
        _hand_over(first, good.read_bytes())
        nc = await connect(server.url, user_credentials=str(first), allow_reconnect=False, connect_timeout=3)
        await nc.close()
        first.unlink()
        second = tmp_path / "second.fifo"
        os.mkfifo(second)
        if second.stat().st_ino != inode:
            pytest.skip("this file system gave the new FIFO a new inode: nothing to confuse")
        writer = _hand_over(second, stranger.read_bytes())
        with pytest.raises(Exception) as refused:
            nc = await connect(server.url, user_credentials=str(second), allow_reconnect=False, connect_timeout=3)
            await nc.close()
        writer.join(timeout=1)
        if writer.is_alive():  # the connect never opened the FIFO: release the writer's open
            with open(second, "rb") as f:
                f.read()
        assert "authorization" in str(refused.value).lower(), repr(refused.value)
        assert read_creds(str(good), "good")[1] not in repr(refused.value).encode()
    assert _PIPED == kept  # a library connect keeps no pipe's secret for the process
