"""benchmarks/server_open.py: its CPU per open is the server's, children included, or the Granian
rows (a supervisor process whose worker is a child) would read as free."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "server_open.py"


def test_every_contender_answers_every_open_and_is_charged_cpu_for_it(tmp_path):
    out = tmp_path / "report.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "1", "--bursts", "4", "--burst", "10",
                          "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    expected = {"raw", "uvicorn"}
    if importlib.util.find_spec("granian") is not None:
        expected |= {"granian-asgi", "granian-rsgi"}
    assert set(report) == expected
    for kind, figures in report.items():
        assert all(p50 > 0 for p50 in figures["open_p50_ms"]), kind
        # An open and close cost any server tens of microseconds; under 5 the wrong process was read.
        assert all(cpu > 5 for cpu in figures["cpu_us_per_open"]), (kind, figures)
