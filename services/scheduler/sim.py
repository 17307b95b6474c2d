"""Discrete-event simulator that drives the real scheduling policies with the cost model (no GPU).

Each simulated worker runs the iteration-level engine the way services/worker does: at every step
boundary it first applies the mode commands it received (merge / unmerge / switch cost the
cost model's switch times; the worker does not step meanwhile), then admits the requests placed
on it (copying a non-resident adapter to the device costs `load_ms`; `device_slots` adapters fit,
least recently used evicted), then runs one step over all its rows:

- a new row prefills its prompt + image tokens; a task-head request (label) is then done, a
  generation request has produced its first token;
- a running generation row decodes one token per step until its output length;
- rows whose adapter is the merged one pay no LoRA term; the others pay the unmerged term, or
  the rank-2r mixture term when an adapter is merged (the worker serves every adapter in MERGED
  and MIXTURE mode alike; the policy decides who is placed there).

`CostModel.step_ms` prices the step. The policy (`SchedulingPolicy.decide`) is called on every
arrival and every step boundary while requests wait and some worker has room, with the same
`WaitingRequest`/`WorkerView` dataclasses the dispatcher builds. The scheduler does not know
output lengths (max_new_tokens 0: the cost model's default), only prompt sizes, task kind and
the task's latency objective.

Per SLO class (`TraceRequest.slo_class`, the application) the result has latency statistics and,
for objectives, attainment counted as services/scheduler/slo.py counts it: a request is within
when it finished within its objective; one left unfinished is over.
"""

from __future__ import annotations

import heapq
import itertools
import statistics
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from services.scheduler.cost_model import CostModel
from services.scheduler.policies.base import ModeCommand, SchedulingPolicy, WaitingRequest, WorkerView
from services.common.modes import Mode
from services.scheduler.traces import TraceRequest


@dataclass
class _Seq:
    req: TraceRequest
    assigned_s: float = 0.0
    first_token_s: float | None = None
    done_s: float | None = None
    remaining: int = 0
    prefilled: bool = False


@dataclass
class _Worker:
    address: str
    max_batch: int
    device_slots: int
    mode: Mode = Mode.UNMERGED
    merged: str | None = None
    resident: OrderedDict = field(default_factory=OrderedDict)
    running: list[_Seq] = field(default_factory=list)
    admitted: list[_Seq] = field(default_factory=list)
    commands: list[ModeCommand] = field(default_factory=list)
    busy: bool = False
    switches: int = 0
    loads: int = 0
    mode_time: dict[str, float] = field(default_factory=dict)

    def load(self) -> int:
        return len(self.running) + len(self.admitted)

    def view(self) -> WorkerView:
        mode, merged = self.mode, self.merged
        if self.commands:  # optimistic, like the dispatcher after sending SetMode
            mode, merged = self.commands[-1].mode, self.commands[-1].merged_adapter
        counts: dict[str | None, int] = {}
        for s in itertools.chain(self.running, self.admitted):
            counts[s.req.adapter] = counts.get(s.req.adapter, 0) + 1
        return WorkerView(
            self.address, True, self.max_batch, self.load(), mode, merged, frozenset(self.resident), counts
        )

    def make_resident(self, adapter: str, in_use: set) -> bool:
        """True when the adapter had to be copied in."""
        if adapter in self.resident:
            self.resident.move_to_end(adapter)
            return False
        while len(self.resident) >= self.device_slots:
            victim = next((a for a in self.resident if a != self.merged and a not in in_use), None)
            if victim is None:
                break
            del self.resident[victim]
        self.resident[adapter] = True
        self.loads += 1
        return True


@dataclass
class SimResult:
    policy: str
    completed: int
    latencies_s: list[float]
    token_latencies_s: list[float]
    ttft_s: list[float]
    queue_s: list[float]
    makespan_s: float
    switches: int
    loads: int
    # Max time from arrival to placement, per adapter (fairness).
    max_queue_by_adapter: dict[str | None, float]
    unfinished: int = 0
    mode_time_s: dict[str, float] = field(default_factory=dict)
    # Per SLO class (application): n, mean/p50/p99 ms, throughput, and with an objective
    # slo_ms, within, over, attainment.
    classes: dict[str, dict] = field(default_factory=dict)

    def summary(self) -> dict:
        lat = sorted(self.latencies_s)
        return {
            "policy": self.policy,
            "completed": self.completed,
            "unfinished": self.unfinished,
            "mean_ms": 1000 * statistics.fmean(lat) if lat else float("nan"),
            "p50_ms": 1000 * _pct(lat, 0.50),
            "p99_ms": 1000 * _pct(lat, 0.99),
            "token_ms": 1000 * statistics.fmean(self.token_latencies_s) if lat else float("nan"),
            "ttft_ms": 1000 * statistics.fmean(self.ttft_s) if self.ttft_s else float("nan"),
            "throughput_rps": self.completed / self.makespan_s if self.makespan_s > 0 else 0.0,
            "switches_per_s": self.switches / self.makespan_s if self.makespan_s > 0 else 0.0,
            "max_queue_ms": 1000 * max(self.max_queue_by_adapter.values(), default=0.0),
            "classes": self.classes,
        }


def _pct(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    i = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[i]


class Simulator:
    def __init__(
        self,
        policy: SchedulingPolicy,
        cost: CostModel,
        *,
        workers: int = 2,
        max_batch: int = 16,
        device_slots: int = 16,
        name: str = "",
        horizon_s: float | None = None,
    ) -> None:
        self.policy = policy
        self.cost = cost
        self.name = name or type(policy).__name__
        self.workers = [_Worker(f"w{i}", max_batch, device_slots) for i in range(workers)]
        self.horizon_s = horizon_s
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self.waiting: dict[str, _Seq] = {}
        self.done: list[_Seq] = []
        self.now = 0.0
        self.decisions = 0

    # -- event plumbing ------------------------------------------------------------------------
    def _push(self, t: float, kind: str, payload: object) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    def run(self, trace: Iterable[TraceRequest]) -> SimResult:
        reqs = sorted(trace, key=lambda r: r.arrival_s)
        for r in reqs:
            self._push(r.arrival_s, "arrive", r)
        by_addr = {w.address: w for w in self.workers}
        while self._events:
            t, _, kind, payload = heapq.heappop(self._events)
            if self.horizon_s is not None and t > self.horizon_s:
                break
            self.now = t
            if kind == "arrive":
                r: TraceRequest = payload  # type: ignore[assignment]
                self.waiting[r.request_id] = _Seq(r, remaining=r.output_tokens)
                self._schedule()
            else:
                self._step_done(by_addr[payload])  # type: ignore[index]
        return self._result(len(reqs))

    # -- the policy ------------------------------------------------------------------------------
    def _schedule(self) -> None:
        if not self.waiting or not any(w.load() < w.max_batch for w in self.workers):
            return
        waiting = [
            WaitingRequest(
                s.req.request_id,
                s.req.arrival_s,
                s.req.adapter,
                frozenset(),
                0 if not s.req.label else 1,
                s.req.images,
                s.req.label,
                s.req.prompt_tokens,
                s.req.slo_s,
            )
            for s in self.waiting.values()
        ]
        decision = self.policy.decide(self.now, waiting, [w.view() for w in self.workers])
        self.decisions += 1
        by_addr = {w.address: w for w in self.workers}
        for cmd in decision.mode_commands:
            by_addr[cmd.worker].commands.append(cmd)
        for a in decision.assignments:
            s = self.waiting.pop(a.request_id)
            w = by_addr[a.worker]
            if w.load() >= w.max_batch:
                raise AssertionError(f"policy {self.name} overfilled {w.address}")
            s.assigned_s = self.now
            w.admitted.append(s)
        for hint in decision.prefetch:
            w = by_addr[hint.worker]
            w.make_resident(hint.adapter, {s.req.adapter for s in w.running})  # async copy: off the step
        for w in self.workers:
            if not w.busy and (w.admitted or w.commands or w.running):
                self._start_step(w)

    # -- one worker step ---------------------------------------------------------------------------
    def _start_step(self, w: _Worker) -> None:
        c = self.cost
        t_ms = 0.0
        for cmd in w.commands:
            target = cmd.merged_adapter if cmd.mode in (Mode.MERGED, Mode.MIXTURE) else None
            if target != w.merged:
                t_ms += c.switch_cost_ms(w.merged, target, w.resident)
                w.switches += 1
                if target is not None:
                    w.make_resident(target, {s.req.adapter for s in w.running})
                w.merged = target
            w.mode = cmd.mode
        w.commands.clear()
        in_use = {s.req.adapter for s in w.running} | {s.req.adapter for s in w.admitted}
        for s in w.admitted:
            if s.req.adapter is not None and s.req.adapter != w.merged and w.make_resident(s.req.adapter, in_use):
                t_ms += c.load_ms
        new, w.admitted = w.admitted, []
        w.running.extend(new)
        rows = len(w.running)
        if rows:
            prefill = lora_tokens = 0
            lora_adapters: set = set()
            for s in w.running:
                tokens = c.prompt_tokens(s.req.prompt_tokens, s.req.images) if not s.prefilled else 1
                if not s.prefilled:
                    prefill += tokens
                needs_lora = s.req.adapter != w.merged and (s.req.adapter is not None or w.merged is not None)
                if needs_lora:
                    lora_tokens += tokens
                    lora_adapters.add(s.req.adapter)
            step = c.step_ms(rows, prefill, lora_tokens, len(lora_adapters), mixture=w.merged is not None)
            key = "unmerged" if w.merged is None else ("merged" if not lora_tokens else "mixture")
            w.mode_time[key] = w.mode_time.get(key, 0.0) + step / 1000.0
            t_ms += step
        if t_ms <= 0:
            w.busy = False
            return
        w.busy = True
        self._push(self.now + t_ms / 1000.0, "step", w.address)

    def _step_done(self, w: _Worker) -> None:
        w.busy = False
        still = []
        for s in w.running:
            if not s.prefilled:
                s.prefilled = True
                s.first_token_s = self.now
                s.remaining -= 1
            else:
                s.remaining -= 1
            if s.remaining <= 0 or s.req.label:
                s.done_s = self.now
                self.done.append(s)
            else:
                still.append(s)
        w.running = still
        self._schedule()
        if not w.busy and (w.running or w.admitted or w.commands):
            self._start_step(w)

    # -- results -----------------------------------------------------------------------------------
    def _result(self, submitted: int) -> SimResult:
        done = self.done
        lat = [s.done_s - s.req.arrival_s for s in done]
        tok = [(s.done_s - s.req.arrival_s) / max(1, s.req.output_tokens) for s in done]
        ttft = [s.first_token_s - s.req.arrival_s for s in done if s.first_token_s is not None]
        queue = [s.assigned_s - s.req.arrival_s for s in done]
        max_q: dict[str | None, float] = {}
        for s in done:
            max_q[s.req.adapter] = max(max_q.get(s.req.adapter, 0.0), s.assigned_s - s.req.arrival_s)
        for s in self.waiting.values():  # never placed: waited until the end
            max_q[s.req.adapter] = max(max_q.get(s.req.adapter, 0.0), self.now - s.req.arrival_s)
        start = min((s.req.arrival_s for s in done), default=0.0)
        end = max((s.done_s for s in done), default=0.0)
        mode_time: dict[str, float] = {}
        for w in self.workers:
            for k, v in w.mode_time.items():
                mode_time[k] = mode_time.get(k, 0.0) + v
        return SimResult(
            self.name,
            len(done),
            lat,
            tok,
            ttft,
            queue,
            end - start,
            sum(w.switches for w in self.workers),
            sum(w.loads for w in self.workers),
            max_q,
            unfinished=submitted - len(done),
            mode_time_s=mode_time,
            classes=self._classes(end - start),
        )

    def _classes(self, span_s: float) -> dict[str, dict]:
        unfinished = [s.req for s in self.waiting.values()]
        unfinished += [s.req for w in self.workers for s in itertools.chain(w.running, w.admitted)]
        out: dict[str, dict] = {}
        for name in sorted(({s.req.slo_class for s in self.done} | {r.slo_class for r in unfinished}) - {""}):
            done = [s for s in self.done if s.req.slo_class == name]
            lat = sorted(s.done_s - s.req.arrival_s for s in done)
            row = {
                "n": len(done),
                "unfinished": sum(r.slo_class == name for r in unfinished),
                "mean_ms": 1000 * statistics.fmean(lat) if lat else float("nan"),
                "p50_ms": 1000 * _pct(lat, 0.50),
                "p99_ms": 1000 * _pct(lat, 0.99),
                "throughput_rps": len(done) / span_s if span_s > 0 else 0.0,
            }
            objectives = {s.req.slo_s for s in done} | {r.slo_s for r in unfinished if r.slo_class == name}
            if max(objectives, default=0.0) > 0:
                within = sum(s.done_s - s.req.arrival_s <= s.req.slo_s for s in done if s.req.slo_s > 0)
                counted = sum(s.req.slo_s > 0 for s in done) + sum(
                    r.slo_class == name and r.slo_s > 0 for r in unfinished
                )
                row |= {
                    "slo_ms": 1000 * max(objectives),
                    "within": within,
                    "over": counted - within,
                    "attainment": within / counted if counted else float("nan"),
                }
            out[name] = row
        return out


def simulate(policy: SchedulingPolicy, trace: Sequence[TraceRequest], cost: CostModel, **kwargs) -> SimResult:
    return Simulator(policy, cost, **kwargs).run(trace)


def run_matrix(
    policies: Sequence[str],
    alphas: Sequence[float],
    rates: Sequence[float],
    *,
    make: Callable[[str], SchedulingPolicy],
    cost: CostModel,
    trace_for: Callable[[float, float], list],
    workers: int = 2,
    max_batch: int = 16,
    device_slots: int = 16,
    on_row: Callable[[dict], None] | None = None,
) -> list[dict]:
    """One simulation per (alpha, rate, policy) on the same trace per (alpha, rate); rows in the
    bench/results schema plus token latency, TTFT and counters."""
    rows = []
    for alpha in alphas:
        for rate in rates:
            trace = trace_for(alpha, rate)
            for name in policies:
                res = simulate(
                    make(name), trace, cost, workers=workers, max_batch=max_batch, device_slots=device_slots, name=name
                )
                s = res.summary()
                row = {
                    "policy": name,
                    "alpha": alpha,
                    "rate": rate,
                    "mean_ms": s["mean_ms"],
                    "p50_ms": s["p50_ms"],
                    "p99_ms": s["p99_ms"],
                    "throughput_rps": s["throughput_rps"],
                    "switches_per_s": s["switches_per_s"],
                    "source": "sim",
                    "token_ms": s["token_ms"],
                    "ttft_ms": s["ttft_ms"],
                    "max_queue_ms": s["max_queue_ms"],
                    "completed": s["completed"],
                    "unfinished": s["unfinished"],
                    "mode_time_s": {k: round(v, 3) for k, v in sorted(res.mode_time_s.items())},
                }
                if res.classes:
                    row["classes"] = res.classes
                rows.append(row)
                if on_row is not None:
                    on_row(row)
    return rows
