"""Placement policies: which waiting request runs on which worker, and in which mode.

The dispatcher (services/scheduler/dispatcher.py) calls `SchedulingPolicy.decide` whenever the
queue or a worker changes; the simulator (services/scheduler/sim.py) calls the same code. Policies
are pure: plain dataclasses in, a `Decision` out, no protobuf, no I/O, no clocks (the caller
passes `now_s`).

    base.py       what a policy sees and returns (WaitingRequest, WorkerView, Decision) and the
                  SchedulingPolicy interface
    affinity.py   the foundation policy: adapter affinity, then the least loaded worker
    baselines.py  the unmerged-only baselines (S-LoRA, Punica)
    credit.py     VaLoRA's credit-based mode scheduling (paper Alg. 1) and dLoRA's

Policies (the registry `POLICIES` below maps each name to its class; the `policy` setting, env
VALORA_POLICY, picks one):

- `valora` (default) — paper Alg. 1, `CreditPolicy(mixture=True)`: credits = waiting time +
  estimated execution time (services/scheduler/credits.py, cost_model.py). Per worker and round:
  no starving request → MERGED on the adapter that minimizes the mean latency of the worker's
  requests counting the switch cost; some starving (credit > θ) → MIXTURE (the merged adapter
  stays, starving requests run through the deLoRA term); more than half of max batch starving →
  UNMERGED. Requests with a latency objective (per-application SLO classes) are taken earliest
  deadline first and starve earlier (half their objective), which is what moves a worker to
  mixture for them; the workers too admit and prefill them earliest due first (`orders_workers`).
- `dlora` — `CreditPolicy(mixture=False)`: the same credits and merged choice, but starvation
  switches to UNMERGED (dLoRA's merge/unmerge switching, no mixture).
- `slora` — UNMERGED only, first come first served, adapter affinity (resident first) then least
  loaded, prefetch hints for adapters not resident.
- `punica` — UNMERGED only, first come first served, consolidating placement (the busiest worker
  with room, Punica's scheduler), no affinity, no prefetch.
- `affinity` — the foundation policy (`AffinityLeastLoadedPolicy`).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from services.scheduler.cost_model import PROFILES, CostModel
from services.scheduler.policies.affinity import AffinityLeastLoadedPolicy
from services.scheduler.policies.base import SchedulingPolicy
from services.scheduler.policies.baselines import PunicaPolicy, SLoRAPolicy
from services.scheduler.policies.credit import CreditPolicy

# The registry: a policy's name (the `policy` setting) → its class and the keyword arguments that
# make it that policy. The credit policies also take the cost model, θ and the deadline switch
# (make_policy passes them); the baselines take nothing.
POLICIES: Mapping[str, tuple[type[SchedulingPolicy], Mapping[str, object]]] = MappingProxyType(
    {
        "valora": (CreditPolicy, {"mixture": True, "orders_workers": True}),
        "dlora": (CreditPolicy, {"mixture": False}),
        "slora": (SLoRAPolicy, {}),
        "punica": (PunicaPolicy, {}),
        "affinity": (AffinityLeastLoadedPolicy, {}),
    }
)
POLICY_NAMES = tuple(POLICIES)


def make_policy(
    name: str, cost: CostModel | None = None, *, theta_s: float = 1.0, deadlines: bool = True
) -> SchedulingPolicy:
    """A fresh policy by name; `cost` is the default worker profile of the credit policies
    (CPU workers use the cpu-tiny profile); `deadlines` False has them ignore latency objectives.
    The baselines are first come first served whatever the objectives (their papers have none)."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES)}")
    cls, fixed = POLICIES[name]
    if issubclass(cls, CreditPolicy):
        return cls(cost, theta_s=theta_s, profiles=PROFILES, deadlines=deadlines, **fixed)
    return cls(**fixed)
