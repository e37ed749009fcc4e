"""Run every benchmark in one go (``make bench``): each prints its figures beside its baseline."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

for script in ("join.py", "passthrough.py", "durable.py", "tracing.py"):
    print(f"== {script}", flush=True)
    subprocess.run([sys.executable, str(HERE / script)], check=True)
