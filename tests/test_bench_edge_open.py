"""benchmarks/edge_open.py's ``--load``: every event delay it reports is one event's publish to
its arrival at the SSE reader, or the figures beside the open times mean nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "edge_open.py"


def test_a_later_rounds_load_is_not_matched_with_results_an_earlier_round_stored(tmp_path):
    """In JetStream mode the edge replays a request's stored results to a new stream. The load used
    the same request ids in every round, so the second round's readers got the first round's results
    at once and matched them to their own later publishes: delays of -300 ms and less."""
    out = tmp_path / "report.json"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--mode", "jetstream", "--opens", "10", "--burst", "10", "--rounds", "2",
         "--load", "400", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    delays = json.loads(out.read_text())["edge"]["event_delay_ms"]["all"]
    assert delays["n"] > 400  # two rounds of load were read
    assert delays["min"] >= 0, delays


def test_floor_spin_adds_its_cpu_per_open_to_the_floor_in_the_same_rounds(tmp_path):
    """``--floor-spin US``: a floor that burns US us of CPU per open before its answer, beside the plain
    floor, so the open p50 of a server costing the floor plus US per open is measured in the same rounds
    (docs/benchmarks.md, "What an open may cost"). Its figures mean nothing unless the spin is spent per open."""
    out = tmp_path / "report.json"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--lifecycle", "--floor", "--floor-spin", "400", "--opens", "20", "--burst", "10",
         "--rounds", "1", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["spin400"]["open_cpu_us"] >= 400 > report["floor"]["open_cpu_us"], report
    assert "open_p50" in report["spin400/floor"], report
