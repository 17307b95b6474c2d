"""Summarises an engine step trace (VALORA_STEP_TRACE, services/worker/step_trace.py): for steps
with a prefill and for decode-only steps, how many there were, what they held and each phase's
mean host and device time; what the queues held when steps began (an engine that often
starts a step with nothing queued is waiting for work upstream); and a straight-line fit of the
prefill forward's device time on its prompt tokens (`prefill_fit`): the slope is what a prompt
token costs, the intercept what a step costs whatever it prefills — with mixed steps, mostly the
running rows' decode riding in the forward. (Dividing a step's time by its prompt tokens instead
charged the riders to the prompt: 35 µs a token at 219bdd4, where the fit says 22.)

    python -m bench.step_trace_summary trace.jsonl [--start EPOCH_S] [--duration S] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def _mean(values) -> float:
    values = list(values)
    return round(statistics.fmean(values), 3) if values else 0.0


def _phases(steps: list[dict], key: str) -> dict[str, float]:
    names = sorted({n for s in steps for n in s.get(key, {})})
    return {n: _mean(s[key].get(n, 0.0) for s in steps if key in s) for n in names}


def prefill_fit(records: list[dict]) -> dict | None:
    """A line through the prefill phase's device ms against the step's prompt tokens, over the
    steps that prefilled: {"us_per_token", "fixed_ms", "steps", "decode_rows"} (the riders' mean
    count), or None without device times or with fewer than 3 such steps of distinct sizes.
    Theil-Sen (the median of the pairwise slopes, then the median intercept): the few steps that
    warm up or capture a graph take many times a replay's time and would tilt least squares."""
    steps = [r for r in records if r["prefill_tokens"] and "prefill" in r.get("gpu_ms", {})]
    if len(steps) < 3 or len({r["prefill_tokens"] for r in steps}) < 2:
        return None
    xy = [(r["prefill_tokens"], r["gpu_ms"]["prefill"]) for r in steps][-1500:]  # O(n^2) pairs
    slope = statistics.median(
        (y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(xy) for x2, y2 in xy[i + 1 :] if x2 != x1
    )
    intercept = statistics.median(y - slope * x for x, y in xy)
    return {
        "us_per_token": round(slope * 1e3, 2),
        "fixed_ms": round(intercept, 2),
        "steps": len(steps),
        "decode_rows": _mean(r["decode_rows"] for r in steps),
    }


def summarize(records: list[dict], start: float = 0.0, duration: float = float("inf")) -> dict:
    """The summary of trace `records` (one per step) that began in [start, start + duration)
    (epoch seconds, as the records' "t")."""
    records = [r for r in records if start <= r["t"] < start + duration]
    if not records:
        return {"steps": 0}
    wall_s = records[-1]["t"] - records[0]["t"]
    out: dict = {"steps": len(records), "wall_s": round(wall_s, 3)}
    for kind, steps in (
        ("prefill", [r for r in records if r["prefill_rows"]]),
        ("decode_only", [r for r in records if not r["prefill_rows"]]),
    ):
        out[kind] = {
            "steps": len(steps),
            "prefill_rows": _mean(r["prefill_rows"] for r in steps),
            "prefill_tokens": _mean(r["prefill_tokens"] for r in steps),
            "decode_rows": _mean(r["decode_rows"] for r in steps),
            "host_ms": _phases(steps, "host_ms"),
            "gpu_ms": _phases(steps, "gpu_ms"),
        }
    fit = prefill_fit(records)
    if fit is not None:
        out["prefill_fit"] = fit
    gpu = sum(sum(r.get("gpu_ms", {}).values()) for r in records[1:]) / 1e3
    out["gpu_span_share"] = round(gpu / wall_s, 3) if wall_s > 0 else 0.0  # device spans over wall time
    out["queues"] = {
        "queued_mean": _mean(r["queued"] for r in records),
        "steps_with_none_queued": round(sum(1 for r in records if r["queued"] == 0) / len(records), 3),
        "running_mean": _mean(r["running"] for r in records),
    }
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", type=Path)
    p.add_argument(
        "--start",
        type=float,
        default=0.0,
        help="Steps from this time on (epoch seconds), e.g. when a measured run began.",
    )
    p.add_argument("--duration", type=float, default=float("inf"), help="Seconds of steps from --start.")
    p.add_argument("--json", type=Path, default=None, help="Also write the summary here.")
    args = p.parse_args(argv)
    records = [json.loads(line) for line in args.trace.read_text().splitlines() if line.strip()]
    summary = summarize(records, args.start, args.duration)
    text = json.dumps(summary, indent=1)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
