"""Shared benchmark plumbing: CUDA-event/graph timing, run metadata, JSON output."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
from pathlib import Path

import torch

COPY_BW = 4.22e12  # measured H200 device copy, bytes/s (read + write), BENCHMARKS.md
RESULTS = Path(__file__).resolve().parent / "results"


def run_info() -> dict:
    """Date, GPU, torch/CUDA/triton versions, git commit."""
    repo = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                                check=False).stdout.strip() or os.environ.get("VALORA_GIT_COMMIT", "unknown")
    except OSError:
        commit = os.environ.get("VALORA_GIT_COMMIT", "unknown")
    info = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(), "git_commit": commit}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sm=f"{p.major}{p.minor}", sms=p.multi_processor_count,
                    driver=_driver_version())
    try:
        import triton  # noqa: PLC0415

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def _driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.mem", "--format=csv,noheader"],
                             capture_output=True, text=True, check=False, timeout=20)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"




def save(name: str, payload: dict, out_dir: Path | None = None) -> Path:
    """Write results JSON (results/<name>.json, and a copy under $OUT when set)."""
    payload = {"info": run_info(), **payload}
    paths = [(out_dir or RESULTS) / f"{name}.json"]
    if os.environ.get("OUT"):
        paths.append(Path(os.environ["OUT"]) / f"{name}.json")
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    return paths[-1]
