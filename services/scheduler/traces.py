"""Request traces for the scheduling simulator: synthetic (Poisson / gamma-bursty arrivals,
Zipf adapter popularity, task-head + generation mix), the Azure LLM inference trace CSV, and the
paper's two applications at once (`two_app_trace`: video streams + visual retrieval).

A `TraceRequest` is what a client would send: arrival time, adapter, prompt tokens, images,
tokens to generate (1 for a task-head request, which answers from one forward pass), and the
latency objective of the task it names, if any (valora.v1.Task.slo_ms / slo_class).
"""

from __future__ import annotations

import csv
import datetime as dt
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TraceRequest:
    request_id: str
    arrival_s: float
    adapter: str | None
    prompt_tokens: int
    images: int
    output_tokens: int
    # A vision task-head request (classification, counting): one forward, no decoding.
    label: bool = False
    # The task's latency objective in seconds (0 = none) and its SLO class.
    slo_s: float = 0.0
    slo_class: str = ""


def adapter_names(n: int) -> list[str]:
    return [f"adapters/a{i:03d}/versions/1" for i in range(n)]


def video_adapter_names(n: int) -> list[str]:
    """The task-head adapters of `two_app_trace`'s video streams (stream i uses name i mod n)."""
    return [f"adapters/video{i}/versions/1" for i in range(n)]


def zipf_weights(n: int, alpha: float) -> list[float]:
    """Popularity of ranks 1..n under Zipf(α): p_i ∝ i^-α (α = 0: uniform)."""
    w = [1.0 / (i**alpha) for i in range(1, n + 1)]
    total = sum(w)
    return [x / total for x in w]


def arrivals(n: int, rate: float, *, burst_cv: float = 1.0, rng: random.Random) -> list[float]:
    """`n` arrival times at mean `rate` per second. Inter-arrival gaps are gamma distributed with
    coefficient of variation `burst_cv`: 1 is Poisson, > 1 is bursty (shape k = 1/cv²)."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    shape = 1.0 / (burst_cv * burst_cv)
    scale = 1.0 / (rate * shape)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.gammavariate(shape, scale)
        out.append(t)
    return out


def synthetic_trace(
    *,
    n: int,
    rate: float,
    alpha: float,
    adapters: int = 64,
    burst_cv: float = 1.0,
    task_head_fraction: float = 0.3,
    images: int = 1,
    prompt_tokens: tuple[int, int] = (16, 64),
    mean_output_tokens: float = 32.0,
    max_output_tokens: int = 256,
    seed: int = 0,
) -> list[TraceRequest]:
    """`n` requests: gamma/Poisson arrivals at `rate`/s, adapters drawn by Zipf(`alpha`) over
    `adapters` names, a `task_head_fraction` of task-head requests (1 output token), the rest
    generation requests whose output length is geometric-like (exponential, mean
    `mean_output_tokens`, clamped to [2, max_output_tokens])."""
    rng = random.Random(seed)
    times = arrivals(n, rate, burst_cv=burst_cv, rng=rng)
    names = adapter_names(adapters)
    picks = rng.choices(names, weights=zipf_weights(adapters, alpha), k=n)
    out = []
    for i, (t, a) in enumerate(zip(times, picks, strict=True)):
        label = rng.random() < task_head_fraction
        tokens = 1 if label else min(max_output_tokens, max(2, round(rng.expovariate(1.0 / mean_output_tokens))))
        out.append(TraceRequest(f"r{i}", t, a, rng.randint(*prompt_tokens), images, tokens, label))
    return out


def two_app_trace(
    *,
    seconds: float,
    streams: int,
    retrieval_rate: float,
    video_tasks: int = 4,
    frames: int = 4,
    video_slo_ms: float = 1000.0,
    retrieval_slo_ms: float = 0.0,
    retrieval_adapters: int = 64,
    alpha: float = 1.0,
    prompt_tokens: tuple[int, int] = (16, 64),
    mean_output_tokens: float = 32.0,
    max_output_tokens: int = 256,
    seed: int = 0,
) -> list[TraceRequest]:
    """Issue 23's two applications for `seconds`:

    - video analytics: `streams` cameras, each sending one chunk of `frames` frames per second
      (its own phase, ±5% jitter) to one of `video_tasks` task-head adapters (stream i → task
      i mod video_tasks); class "video", objective `video_slo_ms` (the chunk period: an answer
      later than the next chunk is of no use; 0: none);
    - visual retrieval: Poisson arrivals at `retrieval_rate`/s of image + question generation
      requests to Zipf(`alpha`) text adapters; class "retrieval", objective `retrieval_slo_ms`
      (0: none, the throughput application).

    Here the class names the application even without an objective (the simulator reports per
    class); the store keeps a class only with an objective."""
    rng = random.Random(seed)
    video_names = video_adapter_names(video_tasks)
    out: list[TraceRequest] = []
    for s in range(streams):
        t = rng.random()  # phase
        k = 0
        while t < seconds:
            out.append(
                TraceRequest(
                    f"v{s}-{k}",
                    t,
                    video_names[s % video_tasks],
                    rng.randint(*prompt_tokens),
                    frames,
                    1,
                    True,
                    video_slo_ms / 1000.0,
                    "video",
                )
            )
            t += 1.0 * (1.0 + rng.uniform(-0.05, 0.05))
            k += 1
    names = adapter_names(retrieval_adapters)
    weights = zipf_weights(retrieval_adapters, alpha)
    t, i = 0.0, 0
    while True:
        t += rng.expovariate(retrieval_rate)
        if t >= seconds:
            break
        tokens = min(max_output_tokens, max(2, round(rng.expovariate(1.0 / mean_output_tokens))))
        out.append(
            TraceRequest(
                f"q{i}",
                t,
                rng.choices(names, weights=weights, k=1)[0],
                rng.randint(*prompt_tokens),
                1,
                tokens,
                False,
                retrieval_slo_ms / 1000.0,
                "retrieval",
            )
        )
        i += 1
    out.sort(key=lambda r: (r.arrival_s, r.request_id))
    return out


def _parse_time(text: str) -> float:
    """Seconds: a number, or an ISO-like timestamp ("2023-11-16 18:15:46.6805900", 7 digits ok)."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    if "." in text:
        head, frac = text.split(".", 1)
        digits = "".join(ch for ch in frac if ch.isdigit())
        tail = frac[len(digits) :]
        text = f"{head}.{digits[:6].ljust(6, '0')}{tail}"
    stamp = dt.datetime.fromisoformat(text)
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=dt.timezone.utc)
    return stamp.timestamp()


def load_azure_csv(
    path: str | Path,
    *,
    alpha: float = 1.0,
    adapters: int = 64,
    images: int = 1,
    task_head_fraction: float = 0.0,
    max_requests: int | None = None,
    time_scale: float = 1.0,
    seed: int = 0,
) -> list[TraceRequest]:
    """The Azure LLM inference trace format (columns TIMESTAMP, ContextTokens, GeneratedTokens):
    arrival times relative to the first row (divided by `time_scale` to replay faster), prompt and
    output lengths from the trace. The trace has no adapters: they are drawn by Zipf(`alpha`).
    Rows with GeneratedTokens ≤ 1 or picked by `task_head_fraction` become task-head requests."""
    rng = random.Random(seed)
    names = adapter_names(adapters)
    weights = zipf_weights(adapters, alpha)
    rows: list[tuple[float, int, int]] = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        fields = {name.strip().lower(): name for name in reader.fieldnames or ()}
        missing = {"timestamp", "contexttokens", "generatedtokens"} - set(fields)
        if missing:
            raise ValueError(f"{path}: not an Azure LLM trace CSV (missing {sorted(missing)})")
        for row in reader:
            rows.append(
                (
                    _parse_time(row[fields["timestamp"]]),
                    int(float(row[fields["contexttokens"]])),
                    int(float(row[fields["generatedtokens"]])),
                )
            )
            if max_requests is not None and len(rows) >= max_requests:
                break
    if not rows:
        return []
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    out = []
    for i, (t, ctx, gen) in enumerate(rows):
        label = gen <= 1 or rng.random() < task_head_fraction
        adapter = rng.choices(names, weights=weights, k=1)[0]
        out.append(
            TraceRequest(f"az{i}", (t - t0) / time_scale, adapter, max(1, ctx), images, 1 if label else gen, label)
        )
    return out


def trace_stats(trace: Sequence[TraceRequest]) -> dict:
    """Rate (req/s over the trace's span), share of the most popular adapter, task-head share."""
    if not trace:
        return {"n": 0, "rate": 0.0, "top_share": 0.0, "task_head_share": 0.0, "adapters": 0}
    span = trace[-1].arrival_s - trace[0].arrival_s
    counts: dict[str | None, int] = {}
    for r in trace:
        counts[r.adapter] = counts.get(r.adapter, 0) + 1
    return {
        "n": len(trace),
        "rate": (len(trace) - 1) / span if span > 0 else float("inf"),
        "top_share": max(counts.values()) / len(trace),
        "adapters": len(counts),
        "task_head_share": sum(r.label for r in trace) / len(trace),
    }
