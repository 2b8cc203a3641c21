"""Render the fleet smoke run (run.sh): smoke.jsonl, the raw suite output of both stand-in
machines (~3.5 MB each with the runs' per-layer traces, kept local), becomes summary.jsonl
(every env line and record but the traces) and report.md (`kvbench report --format
markdown`: the machines side by side, then the tables per probe and strategy).

Usage: .venv/bin/python results/fleet-smoke/render.py
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvbench.store import slim

HERE = Path(__file__).parent


def main() -> None:
    slim([HERE / "smoke.jsonl"], HERE / "summary.jsonl", ())
    report = subprocess.run([sys.executable, "-m", "kvbench.cli", "report",
                             str(HERE / "summary.jsonl"), "--format", "markdown"],
                            check=True, capture_output=True, text=True).stdout
    (HERE / "report.md").write_text(report)


if __name__ == "__main__":
    main()
