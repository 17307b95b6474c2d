"""Shared benchmark plumbing: the copy bandwidth behind the floors, run metadata, JSON output.

Run metadata and the results writer live in `kernels.results` (the tile search uses them too and
the kernels package does not import the benchmarks); re-exported here for the bench scripts.
"""

from __future__ import annotations

from pathlib import Path

from kernels.results import RESULTS_DIR, run_info, write_json, write_results

COPY_BW = 4.22e12  # measured H200 device copy, bytes/s (read + write), BENCHMARKS.md
RESULTS = RESULTS_DIR


def save(name: str, payload: dict, out_dir: Path | None = None) -> Path:
    """Write results JSON (results/<name>.json with run metadata, and a copy under $OUT when set)."""
    return write_results(name, payload, out_dir)


__all__ = ["COPY_BW", "RESULTS", "run_info", "save", "write_json"]
