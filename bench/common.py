"""Shared benchmark plumbing: CUDA-event/graph timing, run metadata, JSON output."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
from collections.abc import Callable, Sequence
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


def time_eager(fn: Callable[[], None], reps: int = 50, warmup: int = 5) -> float:
    """Median µs of one call, CUDA events around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e) * 1e3)
    return statistics.median(out)


def time_graph(fns: Sequence[Callable[[], None]], reps: int = 30, warmup: int = 3) -> float:
    """Median µs per op of a CUDA graph that runs each of `fns` once (replayed `reps` times)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in fns:  # warm-up outside capture (JIT, autotune, attribute setting)
            f()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    for _ in range(warmup):
        g.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e) * 1e3 / len(fns))
    del g
    return statistics.median(out)


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
