"""Scheduling policies in the discrete-event simulator: `python bench/sched_bench.py [options]`
is `valora bench sched [options]` (see `valora bench sched --help`). Writes
bench/results/sched-<date>.json; no GPU, no torch."""

from __future__ import annotations

import sys

from valora.cli import app

if __name__ == "__main__":
    app(["bench", "sched", *sys.argv[1:]])
