"""VaLoRA's credit-based mode scheduling (paper Alg. 1) and the dLoRA baseline that shares it.

Every round, for every worker with free slots (workers whose merged adapter has waiting requests
first, then the least loaded, then resident-adapter affinity), over the requests still unplaced
and allowed there:

1. credits: waiting time + estimated execution time (services/scheduler/credits.py, cost_model.py); *starving* =
   credit > θ (`theta_s`), or for a request with a latency objective credit > the tighter of θ and
   half its objective (`credits.threshold_s`). Starving requests are taken first: those whose
   objective can still be met earliest deadline first (`credits.claims_deadline`), then the
   others highest credit first; the requests not starving earliest due first (`credits.due_s`:
   arrival + objective, arrival + θ without one — first come first served when no request has
   an objective).
2. more than half of `max_batch_size` starving → UNMERGED, the batch by credit.
   (dLoRA: any starving request → UNMERGED; it has no mixture mode.)
3. some starving → MIXTURE: the merged adapter stays, starving requests first, then the merged
   adapter's own, then the rest. (A worker already unmerged stays unmerged: it serves everyone
   without a switch.)
4. none starving → MERGED on the adapter `a` minimizing the estimated latency sum of the worker's
   requests (running + eligible waiting) counting the switch cost:
       L(a) = switch_ms(current → a) · population                    (everyone waits for it)
            + left_behind(a) · round_ms                              (not served, no room elsewhere)
            + lora_step_ms(a) · horizon_steps · rows                 (LoRA term left with a merged:
                                                                      running rows of other adapters
                                                                      through the mixture term)
            + lora cost of the requests the next workers take instead
   Entering a merged state also counts the expected cost of leaving it (unmerge time weighted by
   the share of traffic that is *not* `a`, from the popularity seen so far), so one request of a
   rare adapter does not flip an idle worker. UNMERGED for everyone is a candidate too (our
   extension: a queue of many adapters is served faster unmerged than one adapter at a time);
   ties keep the current state (no thrashing).

Mode commands are sent only when the worker's (mode, merged adapter) changes. An unmerged or
mixture worker takes its share of the queue in proportion to its free slots (load balance).
Prefetch hints ask the least loaded worker to copy adapters of still-waiting requests to its
device.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from services.scheduler.cost_model import CostModel, profile_for_device
from services.scheduler.credits import claims_deadline, credit_of, due_s, threshold_s
from services.scheduler.policies.base import (
    Assignment,
    Decision,
    ModeCommand,
    SchedulingPolicy,
    WaitingRequest,
    WorkerView,
    live_workers,
    merged_of,
)
from services.common.modes import Mode
from services.scheduler.policies.baselines import prefetch_hints

_NO_ADAPTER = ""  # sort key of the base model among adapter names


class CreditPolicy(SchedulingPolicy):
    def __init__(
        self,
        cost: CostModel | None = None,
        *,
        theta_s: float = 1.0,
        mixture: bool = True,
        profiles: Mapping[str, CostModel] | None = None,
        deadlines: bool = True,
        orders_workers: bool = False,
    ) -> None:
        self.cost = cost or CostModel()
        self.theta_s = theta_s
        self.mixture = mixture
        # False: latency objectives are ignored (Alg. 1 as the paper has it), for comparisons.
        self.deadlines = deadlines
        self.orders_workers = orders_workers and deadlines  # SchedulingPolicy.orders_workers
        self.profiles = dict(profiles or {})
        # Requests seen per adapter (popularity), and the ids already counted.
        self._seen: dict[str | None, int] = {}
        self._counted: set[str] = set()

    def _cost(self, worker: WorkerView) -> CostModel:
        return profile_for_device(worker.device, self.profiles, self.cost)

    def decide(self, now_s: float, waiting: Sequence[WaitingRequest], workers: Sequence[WorkerView]) -> Decision:
        decision = Decision()
        live = live_workers(workers)
        if not waiting or not live:
            return decision
        credit = {r.request_id: credit_of(r, now_s, self.cost).value_s for r in waiting}
        for r in waiting:
            if r.request_id not in self._counted:
                self._counted.add(r.request_id)
                self._seen[r.adapter] = self._seen.get(r.adapter, 0) + 1
        if len(self._counted) > 100_000:
            self._counted.clear()

        if self.deadlines:
            limit = {r.request_id: threshold_s(r, self.theta_s) for r in waiting}
            due = {r.request_id: due_s(r, self.theta_s) for r in waiting}
        else:
            limit = dict.fromkeys(credit, self.theta_s)
            due = {r.request_id: r.arrival_s for r in waiting}
        starving_ids = {rid for rid, c in credit.items() if c > limit[rid]}

        def rank(r: WaitingRequest) -> tuple:
            # Starving requests whose objective can still be met, earliest deadline first; the
            # other starving ones, highest credit first; the rest, earliest due first.
            rid = r.request_id
            if rid not in starving_ids:
                return (2, due[rid], r.arrival_s, rid)
            if self.deadlines and claims_deadline(r, credit[rid]):
                return (0, due[rid], r.arrival_s, rid)
            return (1, -credit[rid], r.arrival_s, rid)

        remaining: dict[str, WaitingRequest] = {r.request_id: r for r in sorted(waiting, key=rank)}
        wanted: dict[str | None, int] = {}
        for r in waiting:
            wanted[r.adapter] = wanted.get(r.adapter, 0) + 1

        def order(w: WorkerView) -> tuple:
            # Affinity first (its merged adapter has waiting requests), then load balance, then
            # the most waiting requests whose adapter is resident there, then the address.
            m = merged_of(w)
            merged_wanted = 0 if m is not None and m in wanted else 1
            resident_wanted = sum(n for a, n in wanted.items() if a is not None and a in w.resident_adapters)
            return (merged_wanted, w.running / w.max_batch_size, -resident_wanted, w.address)

        running_after = {w.address: w.running for w in live}
        ordered = sorted(live, key=order)
        for k, w in enumerate(ordered):
            free = w.free_slots
            if free <= 0:
                continue
            eligible = [r for r in remaining.values() if w.address not in r.excluded_workers]
            if not eligible:
                continue
            # Slots the workers planned after this one still offer: requests this worker leaves
            # behind up to that many do not wait a round.
            spare = sum(v.free_slots for v in ordered[k + 1 :])
            mode, target, batch = self._plan(w, eligible, starving_ids, free, spare)
            if mode != Mode.MERGED and spare:
                # Load balance: a worker serving every adapter takes its share of the queue in
                # proportion to its free slots; the workers after it take the rest.
                batch = batch[: max(1, math.ceil(len(eligible) * free / (free + spare)))]
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
    def _plan(
        self, w: WorkerView, eligible: list[WaitingRequest], starving_ids: set[str], free: int, spare: int = 0
    ) -> tuple[Mode, str | None, list[WaitingRequest]]:
        """(mode, merged adapter, requests to place) for worker `w`; `eligible` starving first."""
        starving = [r for r in eligible if r.request_id in starving_ids]
        current = merged_of(w)
        if starving and (not self.mixture or len(starving) > w.max_batch_size / 2):
            return Mode.UNMERGED, None, eligible[:free]
        if starving:
            target = current
            if target is None:  # unmerged already serves every adapter: no switch for mixture
                return Mode.UNMERGED, None, eligible[:free]
            rest = [r for r in eligible if r.request_id not in starving_ids]
            ordered = starving + [r for r in rest if r.adapter == target] + [r for r in rest if r.adapter != target]
            return Mode.MIXTURE, target, ordered[:free]
        return self._best_plan(w, eligible, free, spare)

    def _best_plan(
        self, w: WorkerView, eligible: list[WaitingRequest], free: int, spare: int = 0
    ) -> tuple[Mode, str | None, list[WaitingRequest]]:
        """No request starving: MERGED on the adapter minimizing the estimated latency sum of the
        worker's requests counting the switch, or UNMERGED for everyone when that is lower still
        (a queue of many adapters, where one merged adapter would serve too few)."""
        cost = self._cost(w)
        current = merged_of(w)
        by_adapter: dict[str | None, list[WaitingRequest]] = {}
        for r in eligible:
            by_adapter.setdefault(r.adapter, []).append(r)
        population = w.running + len(eligible)
        horizon_steps = max(1, cost.default_new_tokens // 2)

        def run_ms(rs: list[WaitingRequest]) -> float:
            return sum(
                cost.request_ms(
                    r.prompt_tokens, r.images, r.max_new_tokens, label=r.label, lora=False, batch=w.running + len(rs)
                )
                for r in rs
            ) / len(rs)

        total_seen = sum(self._seen.values()) or 1
        # What a request left behind waits for: about one run of what would be served now (the
        # same for every plan, so the plans differ by what they serve, not whom).
        round_ms = run_ms(eligible[:free])

        def latency_sum(merged: str | None, served: list[WaitingRequest]) -> float:
            switch = cost.switch_cost_ms(current, merged, w.resident_adapters)
            if merged is not None and merged != current:
                # Entering a merged state is paid again when leaving it: expected for the share of
                # traffic that is not this adapter (popularity seen so far), over a batch of rows.
                share = self._seen.get(merged, 0) / total_seen
                switch += cost.unmerge_ms * (1.0 - share) * w.max_batch_size / max(1, population)
            # Rows that pay the LoRA term each step: running and served rows whose adapter is not
            # the merged one (mixture term when one is merged; base rows pay nothing unmerged).
            counts = {k: n for k, n in w.running_adapters.items() if k != merged}
            for r in served:
                if r.adapter != merged:
                    counts[r.adapter] = counts.get(r.adapter, 0) + 1
            if merged is None:
                counts.pop(None, None)
            lora_rows = sum(counts.values())
            step_extra = cost.lora_ms(lora_rows, len(counts), mixture=merged is not None)
            # Requests not served here: up to `spare` run on the next workers (paying the
            # unmerged LoRA term there), the rest wait a round.
            elsewhere = min(spare, len(eligible) - len(served))
            left_behind = len(eligible) - len(served) - elsewhere
            extra_elsewhere = cost.lora_ms(elsewhere, elsewhere) * horizon_steps * elsewhere
            return (
                switch * population
                + left_behind * round_ms
                + step_extra * horizon_steps * (w.running + len(served))
                + extra_elsewhere
            )

        plans: list[tuple[float, int, int, str, Mode, str | None, list[WaitingRequest]]] = []
        for a, rs in by_adapter.items():
            if a is None:
                continue
            served = rs[:free]
            plans.append((latency_sum(a, served), 0 if a == current else 1, -len(rs), a, Mode.MERGED, a, served))
        if current is not None and current not in by_adapter and spare == 0:
            # Staying merged and placing nothing now (a switch would cost the running rows more).
            # Only when no other worker has room: otherwise the queue would pile up over there.
            plans.append((latency_sum(current, []), 0, 0, current, Mode.MERGED, current, []))
        served = eligible[:free]
        plans.append(
            (
                latency_sum(None, served),
                0 if current is None else 1,
                -len(served),
                _NO_ADAPTER,
                Mode.UNMERGED,
                None,
                served,
            )
        )
        best = min(plans, key=lambda p: p[:4])
        return best[4], best[5], best[6]


def _mode_of(w: WorkerView) -> Mode:
    """The worker's mode as the policy compares it (BASE / UNKNOWN count as UNMERGED)."""
    return w.mode if w.mode in (Mode.MERGED, Mode.MIXTURE) else Mode.UNMERGED
