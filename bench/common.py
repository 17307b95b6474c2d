"""Shared benchmark plumbing: the copy bandwidth behind the floors, run metadata, JSON output.

Run metadata and the results writer live in `kernels.results` (the tile search uses them too and
the kernels package does not import the benchmarks); re-exported here for the bench scripts.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from kernels.results import RESULTS_DIR, run_info, write_json, write_results

COPY_BW = 4.22e12  # measured H200 device copy, bytes/s (read + write), docs/benchmarks.md
RESULTS = RESULTS_DIR


def save(name: str, payload: dict, out_dir: Path | None = None) -> Path:
    """Write results JSON (results/<name>.json with run metadata, and a copy under $OUT when set)."""
    return write_results(name, payload, out_dir)


def exit_rank() -> None:
    """Ends a rank's process once its work is done and its results are written, skipping the
    process group's and the interpreter's teardown: a rank that had finished and destroyed its
    gloo group was seen dying there ("terminate called without an active exception", SIGABRT),
    failing a good run. The OS frees it all."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


__all__ = ["COPY_BW", "RESULTS", "exit_rank", "run_info", "save", "write_json"]
