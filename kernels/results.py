"""Run metadata and JSON results files for the kernel tools (tile search) and the benchmarks.

`run_info()` records what a measurement depends on (date, GPU, driver/clocks, torch/CUDA/triton
versions, git commit); `write_results()` writes `<directory>/<name>.json` with that metadata, plus a
copy under $OUT when it is set (the GPU machine's output folder). `bench.common` re-exports both,
so the kernels package never imports the benchmarks.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "bench" / "results"


def git_commit() -> str:
    """$VALORA_GIT_COMMIT when set (a copy of a tree run elsewhere, e.g. `git archive` on the GPU
    machine, may sit inside another checkout whose HEAD is not its commit), else HEAD's commit,
    else "unknown"."""
    if os.environ.get("VALORA_GIT_COMMIT"):
        return os.environ["VALORA_GIT_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--verify", "-q", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        out = ""
    return out or "unknown"


def _driver_version() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.mem", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
            timeout=20,
        )
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_info() -> dict:
    """Date, GPU, torch/CUDA/triton versions, git commit."""
    import torch

    info = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "git_commit": git_commit(),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sm=f"{p.major}{p.minor}", sms=p.multi_processor_count, driver=_driver_version())
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def write_json(name: str, obj, directory: Path | None = None) -> list[Path]:
    """Write `obj` as `<directory>/<name>.json` (default bench/results) and a copy under $OUT."""
    paths = [Path(directory or RESULTS_DIR) / f"{name}.json"]
    if os.environ.get("OUT"):
        paths.append(Path(os.environ["OUT"]) / f"{name}.json")
    text = json.dumps(obj, indent=1, default=str) + "\n"
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return paths


def write_results(name: str, payload: dict, directory: Path | None = None) -> Path:
    """`write_json` of {"info": run_info(), **payload}; returns the last path written."""
    return write_json(name, {"info": run_info(), **payload}, directory)[-1]


__all__ = ["RESULTS_DIR", "git_commit", "run_info", "write_json", "write_results"]
