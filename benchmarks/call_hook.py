"""Run a program with a function-call counter that signals switch on and off (``call_counts.py``).

``python benchmarks/call_hook.py streamproc run ...`` runs ``streamproc``'s command line;
``python benchmarks/call_hook.py path/to/script.py ...`` runs a script as ``python script.py ...``
would. Nothing is counted until SIGUSR1; SIGUSR2 stops counting and writes the counts as JSON to
``$CALL_HOOK_OUTPUT`` (written to a temporary name, then renamed: a reader never sees half
a file), ``{"python": [[file, line, name, calls], ...], "c": [[name, calls], ...]}``.

Why counts and not time: CPU time per message moves by ±10% between runs on a shared 2-core
machine, while the number of Python function calls and C calls per message depends only on the
code and on how many messages each read and write carries. Two trees compared by their counts show
what a change removed or added exactly, on a machine too noisy to show a 3% CPU change.

The profiler (``sys.setprofile``) slows the program several times over, so a counted run measures
calls, never time; the program also batches more per read and write when it runs slower. It
counts the main thread and threads started after SIGUSR1; a thread already running then (an anyio
worker thread) is not counted (``threading.setprofile`` only reaches new threads on Python 3.11).
"""

from __future__ import annotations

import asyncio
import json
import os
import runpy
import signal
import sys
import threading
from collections import Counter
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

OUTPUT_ENV = "CALL_HOOK_OUTPUT"  # not STREAMPROC_*: streamproc warns about unknown ones
# Set (non-empty): C calls are also counted by the Python function that made them ("c_callers" in
# the output: [file, line, name, C name, calls]), to tell which code makes the 17 dict.get per event.
CALLERS_ENV = "CALL_HOOK_CALLERS"


class CallCounter:
    """Counts ``call`` events by code object and ``c_call`` events by the builtin called."""

    def __init__(self) -> None:
        self.python: Counter[CodeType] = Counter()
        self.c: Counter[object] = Counter()
        self.callers: Counter[tuple[CodeType, object]] | None = Counter() if os.environ.get(CALLERS_ENV) else None

    def profile(self, frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            self.python[frame.f_code] += 1
        elif event == "c_call":
            self.c[arg] += 1
            if self.callers is not None:  # a c_call's frame is its caller's
                self.callers[frame.f_code, arg] += 1

    def start(self, *_: object) -> None:
        self.python.clear()
        self.c.clear()
        if self.callers is not None:
            self.callers.clear()
        threading.setprofile(self.profile)
        sys.setprofile(self.profile)

    def stop_and_write(self, *_: object) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        python = [[c.co_filename, c.co_firstlineno, c.co_qualname, n] for c, n in self.python.most_common()]
        c_calls: Counter[str] = Counter()
        for fn, n in self.c.items():
            c_calls[getattr(fn, "__qualname__", None) or repr(fn)] += n
        out: dict[str, Any] = {"python": python, "c": [[k, n] for k, n in c_calls.most_common()]}
        if self.callers is not None:  # by name: each future's bound done() is an object of its own
            by_name: Counter[tuple[str, int, str, str]] = Counter()
            for (code, fn), n in self.callers.items():
                name = getattr(fn, "__qualname__", None) or repr(fn)
                by_name[code.co_filename, code.co_firstlineno, code.co_qualname, name] += n
            out["c_callers"] = [[*key, n] for key, n in by_name.most_common()]
        path = os.environ[OUTPUT_ENV]
        with open(path + ".tmp", "w") as f:
            json.dump(out, f)
        os.replace(path + ".tmp", path)


async def collect(proc: Any, path: Path, name: str) -> dict:
    """For the benchmark that started ``proc`` under this hook (writing to ``path``): stop its count
    (SIGUSR2) and return what it wrote, removing the file so that the next count is read fresh."""
    proc.send_signal(signal.SIGUSR2)
    for _ in range(200):
        if path.exists():
            counts = json.loads(path.read_text())
            path.unlink()
            return counts
        await asyncio.sleep(0.05)
    raise RuntimeError(f"{name}: no call counts written to {path} within 10 s of SIGUSR2")


def main() -> None:
    if len(sys.argv) < 2 or OUTPUT_ENV not in os.environ:
        raise SystemExit(f"usage: {OUTPUT_ENV}=out.json python call_hook.py (streamproc | script.py) [args...]")
    counter = CallCounter()
    signal.signal(signal.SIGUSR1, counter.start)
    signal.signal(signal.SIGUSR2, counter.stop_and_write)
    target, args = sys.argv[1], sys.argv[2:]
    if target == "streamproc":
        from streamproc.cli import main as streamproc_main

        sys.argv = ["streamproc", *args]
        raise SystemExit(streamproc_main())
    sys.argv = [target, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # as `python script.py` does
    runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
