"""VaLoRA's credit-based mode scheduling (paper Alg. 1) and the dLoRA baseline that shares it.

Every round, for every worker with free slots (workers whose merged adapter has waiting requests
first, then the least loaded), over the requests still unplaced and allowed there:

1. credits: waiting time + estimated execution time (credits.py with the worker's cost profile);
   *starving* = credit > θ (`theta_s`).
2. more than half of `max_batch_size` starving → UNMERGED, the batch by credit (highest first).
   (dLoRA: any starving request → UNMERGED; it has no mixture mode.)
3. some starving → MIXTURE: the merged adapter stays (or the best one is merged when none is),
   starving requests first, then the merged adapter's own, then the rest by credit.
4. none starving → MERGED on the adapter `a` minimizing the estimated mean latency of the
   worker's requests (running + eligible waiting) counting the switch:
       L(a) ∝ switch_ms(current → a) · (running + eligible) + (eligible − served_a) · round_ms
   (+ the LoRA term the rows on the worker pay per step with `a` merged, over half a request's
   steps: running rows of other adapters go through the mixture term)
   where served_a = min(free slots, a's eligible requests) and round_ms is the mean estimated
   run time of those requests (what a request not served now waits for the next round). A
   switch therefore happens only when the requests it serves now outweigh the delay it puts on
   everyone; ties keep the current adapter (no thrashing). `None` stands for the base model
   (UNMERGED with nothing merged).

Mode commands are sent only when the worker's (mode, merged adapter) changes. Prefetch hints ask
the least loaded worker to copy the adapters of still-waiting requests to its device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from services.scheduler.cost_model import CostModel, profile_for_device
from services.scheduler.credits import credit_of
from services.scheduler.policy import (
    Assignment,
    Decision,
    Mode,
    ModeCommand,
    SchedulingPolicy,
    WaitingRequest,
    WorkerView,
    live_workers,
    merged_of,
)
from services.scheduler.policy_baselines import prefetch_hints

_NO_ADAPTER = ""  # sort key of the base model among adapter names


class CreditPolicy(SchedulingPolicy):
    def __init__(self, cost: CostModel | None = None, *, theta_s: float = 1.0, mixture: bool = True,
                 profiles: Mapping[str, CostModel] | None = None) -> None:
        self.cost = cost or CostModel()
        self.theta_s = theta_s
        self.mixture = mixture
        self.profiles = dict(profiles or {})

    def _cost(self, worker: WorkerView) -> CostModel:
        return profile_for_device(worker.device, self.profiles, self.cost)

    def decide(self, now_s: float, waiting: Sequence[WaitingRequest], workers: Sequence[WorkerView]) -> Decision:
        decision = Decision()
        live = live_workers(workers)
        if not waiting or not live:
            return decision
        credit = {r.request_id: credit_of(r, now_s, self.cost).value_s for r in waiting}
        remaining: dict[str, WaitingRequest] = {
            r.request_id: r for r in sorted(waiting, key=lambda r: (-credit[r.request_id], r.arrival_s,
                                                                   r.request_id))}
        wanted: dict[str | None, int] = {}
        for r in waiting:
            wanted[r.adapter] = wanted.get(r.adapter, 0) + 1

        def order(w: WorkerView) -> tuple:
            # Affinity first (merged adapter wanted, then most waiting requests whose adapter is
            # resident there), then load balance, then the address (deterministic).
            m = merged_of(w)
            merged_wanted = 0 if m is not None and m in wanted else 1
            resident_wanted = sum(n for a, n in wanted.items() if a is not None and a in w.resident_adapters)
            return (merged_wanted, -resident_wanted, w.running / w.max_batch_size, w.address)

        running_after = {w.address: w.running for w in live}
        for w in sorted(live, key=order):
            free = w.free_slots
            if free <= 0:
                continue
            eligible = [r for r in remaining.values() if w.address not in r.excluded_workers]
            if not eligible:
                continue
            mode, target, batch = self._plan(now_s, w, eligible, credit, free)
            if not batch:
                continue
            if (mode, target) != (_mode_of(w), merged_of(w)):
                decision.mode_commands.append(ModeCommand(w.address, mode, target))
            for r in batch:
                del remaining[r.request_id]
                decision.assignments.append(Assignment(r.request_id, w.address))
            running_after[w.address] += len(batch)
        decision.prefetch = prefetch_hints(list(remaining.values()), live, running_after)
        return decision

    # -- one worker ----------------------------------------------------------------------------
    def _plan(self, now_s: float, w: WorkerView, eligible: list[WaitingRequest], credit: dict[str, float],
              free: int) -> tuple[Mode, str | None, list[WaitingRequest]]:
        """(mode, merged adapter, requests to place) for worker `w`; `eligible` by credit, highest first."""
        starving = [r for r in eligible if credit[r.request_id] > self.theta_s]
        current = merged_of(w)
        if starving and (not self.mixture or len(starving) > w.max_batch_size / 2):
            return Mode.UNMERGED, None, eligible[:free]
        if starving:
            target = current if current is not None else self._best_merged(w, eligible, free)
            if target is None:  # the base model wins: nothing to merge, everything unmerged
                return Mode.UNMERGED, None, eligible[:free]
            starving_ids = {r.request_id for r in starving}
            rest = [r for r in eligible if r.request_id not in starving_ids]
            ordered = starving + [r for r in rest if r.adapter == target] + [r for r in rest if r.adapter != target]
            return Mode.MIXTURE, target, ordered[:free]
        target = self._best_merged(w, eligible, free)
        batch = [r for r in eligible if r.adapter == target][:free]
        return (Mode.UNMERGED, None, batch) if target is None else (Mode.MERGED, target, batch)

    def _best_merged(self, w: WorkerView, eligible: list[WaitingRequest], free: int) -> str | None:
        """The adapter (None = base model) minimizing the worker's mean latency estimate."""
        cost = self._cost(w)
        current = merged_of(w)
        by_adapter: dict[str | None, list[WaitingRequest]] = {}
        for r in eligible:
            by_adapter.setdefault(r.adapter, []).append(r)
        population = w.running + len(eligible)

        def run_ms(rs: list[WaitingRequest]) -> float:
            return sum(cost.request_ms(r.prompt_tokens, r.images, r.max_new_tokens, label=r.label, lora=False,
                                       batch=w.running + len(rs)) for r in rs) / len(rs)

        horizon_steps = max(1, cost.default_new_tokens // 2)

        def latency_sum(a: str | None) -> float:
            served = by_adapter.get(a, [])[:free]
            round_ms = run_ms(served or eligible[:free])
            switch = cost.switch_cost_ms(current, a, w.resident_adapters)
            # The LoRA term every row on the worker pays per step with `a` merged: running rows of
            # other adapters (known when the caller reports them) go through the mixture term.
            others: dict[str | None, int] = {k: n for k, n in w.running_adapters.items() if k != a}
            lora_rows = sum(others.values())
            if a is None:
                others.pop(None, None)
                lora_rows = sum(others.values())
            step_extra = cost.lora_ms(lora_rows, len(others) or (1 if lora_rows else 0), mixture=a is not None)
            rows = w.running + len(served)
            return (switch * population + (len(eligible) - len(served)) * round_ms
                    + step_extra * horizon_steps * rows)

        def key(a: str | None) -> tuple:
            return (latency_sum(a), 0 if a == current else 1, -len(by_adapter.get(a, ())), a or _NO_ADAPTER)

        # Staying on the current adapter is a candidate even with none of its requests waiting
        # (the switch would delay the running ones more than the waiting ones gain).
        return min({*by_adapter, current}, key=key)


def _mode_of(w: WorkerView) -> Mode:
    """The worker's mode as the policy compares it (BASE / UNKNOWN count as UNMERGED)."""
    return w.mode if w.mode in (Mode.MERGED, Mode.MIXTURE) else Mode.UNMERGED
