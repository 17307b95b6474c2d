"""Summarises an engine step trace (VALORA_STEP_TRACE, services/worker/step_trace.py): for steps
with a prefill and for decode-only steps, how many there were, what they held and each phase's
mean host and device time; and what the queues held when steps began (an engine that often
starts a step with nothing queued is waiting for work upstream).

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


def summarize(records: list[dict], start: float = 0.0, duration: float = float("inf")) -> dict:
    """The summary of trace `records` (one per step) that began in [start, start + duration)
    (epoch seconds, as the records' "t")."""
    records = [r for r in records if start <= r["t"] < start + duration]
    if not records:
        return {"steps": 0}
    wall_s = records[-1]["t"] - records[0]["t"]
    out: dict = {"steps": len(records), "wall_s": round(wall_s, 3)}
    for kind, steps in (("prefill", [r for r in records if r["prefill_rows"]]),
                        ("decode_only", [r for r in records if not r["prefill_rows"]])):
        out[kind] = {
            "steps": len(steps),
            "prefill_rows": _mean(r["prefill_rows"] for r in steps),
            "prefill_tokens": _mean(r["prefill_tokens"] for r in steps),
            "decode_rows": _mean(r["decode_rows"] for r in steps),
            "host_ms": _phases(steps, "host_ms"),
            "gpu_ms": _phases(steps, "gpu_ms"),
        }
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
    p.add_argument("--start", type=float, default=0.0, help="Steps from this time on (epoch seconds), e.g. when a "
                   "measured run began.")
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
