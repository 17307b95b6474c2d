"""Where a served engine's steps spend their time: one JSON line per step (VALORA_STEP_TRACE=<file>),
for benchmarks and profiling, off by default.

A step is cut into phases at `mark(name)` calls: each phase's host time (perf_counter), and on CUDA
its device span — the time between CUDA events recorded at the phase's start and end, i.e. from
when the device finished the work queued before the phase to when it finished the phase's own.
A phase whose span is close to its host time ran at the host's launch speed (the device waited
for the host); a span well over the host time is device-bound work. Events are read once they have completed (a
later step), so tracing adds no synchronization. Each line also says what the step held: the
queues at its start, its prefill rows and tokens and its decode rows.
"""

from __future__ import annotations

import collections
import json
import time

import torch


class StepTrace:
    def __init__(self, path: str, device: torch.device) -> None:
        """`path` empty: tracing off (every call returns at once)."""
        self.on = bool(path)
        self._file = open(path, "a", buffering=1 << 16) if path else None  # closed in close()
        self._cuda = device.type == "cuda"
        self._done: collections.deque[tuple[dict, list]] = collections.deque()  # steps whose events may be pending
        self._record: dict = {}
        self._marks: list[tuple[str, float, object]] = []

    def _event(self):
        if not self._cuda:
            return None
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def begin(self, sched) -> None:
        """A step starts: the scheduler's queues as it finds them."""
        if not self.on:
            return
        self._record = {
            "t": round(time.time(), 4),
            "queued": len(sched.incoming) + len(sched.waiting),
            "prefilling": len(sched.prefill),
            "running": len(sched.running),
        }
        self._marks = [("", time.perf_counter(), self._event())]

    def mark(self, phase: str) -> None:
        """The phase `phase` of this step ends here (the next one starts)."""
        if self.on and self._marks:
            self._marks.append((phase, time.perf_counter(), self._event()))

    def taken(self, prefill: list) -> None:
        """The step's prefill pieces (their sequences, StepScheduler.take_prefills) are chosen:
        the "admit" phase ends."""
        if self.on and self._marks:
            self._record.update(
                prefill_rows=len(prefill), prefill_tokens=sum(s.prefill_to - s.prefilled for s in prefill)
            )
            self.mark("admit")

    def note(self, **fields) -> None:
        """Adds what this step did besides its phases to its line (e.g. a failed prefill batch's
        rows retried alone, prefiller.py)."""
        if self.on and self._marks:
            self._record.update(fields)

    def end(self, decode_rows: int) -> None:
        """The step ends, having decoded `decode_rows` rows."""
        if not self.on or not self._marks:
            return
        rec = self._record
        rec.update(
            decode_rows=decode_rows,
            host_ms={
                name: round((t - t_prev) * 1e3, 3) for (_, t_prev, _), (name, t, _) in zip(self._marks, self._marks[1:])
            },
        )
        self._done.append((rec, self._marks))
        self._marks = []
        self._write(wait=False)

    def _write(self, wait: bool) -> None:
        while self._done:
            rec, marks = self._done[0]
            last = marks[-1][2]
            if last is not None:
                if not wait and not last.query():
                    return
                last.synchronize()
                rec["gpu_ms"] = {
                    name: round(e_prev.elapsed_time(e), 3) for (_, _, e_prev), (name, _, e) in zip(marks, marks[1:])
                }
            self._done.popleft()
            self._file.write(json.dumps(rec) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._write(wait=True)
            self._file.close()
            self._file, self.on = None, False
