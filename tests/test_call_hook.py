"""benchmarks/call_hook.py: the call counter benchmarks/call_counts.py runs each contender under.

Real subprocesses, real signals: the counts must cover exactly the calls between SIGUSR1 and
SIGUSR2, or calls per chunk would carry start-up and shutdown with them."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOOK = ROOT / "benchmarks" / "call_hook.py"

PROGRAM = textwrap.dedent("""
    import os, signal, threading

    def before(): pass
    def counted(): pass
    def in_thread(): pass

    for _ in range(50):
        before()
    os.kill(os.getpid(), signal.SIGUSR1)
    for _ in range(50):
        before()
    os.kill(os.getpid(), signal.SIGUSR1)  # a second start begins the count again
    for _ in range(1000):
        counted()
        len("ab")
    t = threading.Thread(target=lambda: [in_thread() for _ in range(7)])
    t.start()
    t.join()
    os.kill(os.getpid(), signal.SIGUSR2)
    for _ in range(50):
        counted()
""")


def run_hook(tmp_path: Path, *args: str, **extra_env: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "CALL_HOOK_OUTPUT": str(tmp_path / "counts.json"), **extra_env}
    return subprocess.run([sys.executable, str(HOOK), *args], env=env, capture_output=True, text=True, timeout=60)


def test_only_the_calls_between_the_two_signals_are_counted(tmp_path):
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    done = run_hook(tmp_path, str(script))
    assert done.returncode == 0, done.stderr
    counts = json.loads((tmp_path / "counts.json").read_text())
    python = {name: n for _, _, name, n in counts["python"]}
    c = dict(counts["c"])
    assert python.get("counted") == 1000 and "before" not in python
    assert python.get("in_thread") == 7  # a thread started while counting is counted
    assert c.get("len") == 1000 and c.get("kill") == 1  # the SIGUSR2 kill itself, not the SIGUSR1 one
    assert not (tmp_path / "counts.json.tmp").exists()
    assert "c_callers" not in counts  # only when asked for


def test_c_calls_are_also_counted_by_their_caller_when_asked(tmp_path):
    """``CALL_HOOK_CALLERS``: each C call also under the Python function that made it, by name
    (the bound methods of different objects are one row)."""
    script = tmp_path / "program.py"
    script.write_text(PROGRAM.replace('len("ab")', 'len("ab"); set().add(1)'))
    done = run_hook(tmp_path, str(script), CALL_HOOK_CALLERS="1")
    assert done.returncode == 0, done.stderr
    counts = json.loads((tmp_path / "counts.json").read_text())
    rows = {(name, c_name): n for _, _, name, c_name, n in counts["c_callers"]}
    assert rows[("<module>", "len")] == 1000 and rows[("<module>", "set.add")] == 1000
    assert dict(counts["c"])["len"] == 1000


def test_streamproc_runs_its_own_command_line_under_the_hook(tmp_path):
    done = run_hook(tmp_path, "streamproc", "--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("streamproc ")
    assert not (tmp_path / "counts.json").exists()  # no SIGUSR2, nothing written


def test_without_an_output_path_the_hook_refuses_to_run(tmp_path):
    done = subprocess.run([sys.executable, str(HOOK), "streamproc", "--version"], capture_output=True, text=True,
                          timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode != 0 and "CALL_HOOK_OUTPUT" in done.stderr
