"""CUDA-event timing shared by the offline tile search and the benchmarks: median µs per op,
eager or replayed from a captured CUDA graph."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch


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
