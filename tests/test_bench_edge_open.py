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
