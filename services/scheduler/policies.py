"""Policy registry: the `policy` setting (env VALORA_POLICY) names one of `POLICY_NAMES`."""

from __future__ import annotations

from services.scheduler.cost_model import PROFILES, CostModel
from services.scheduler.policy import AffinityLeastLoadedPolicy, SchedulingPolicy
from services.scheduler.policy_baselines import PunicaPolicy, SLoRAPolicy
from services.scheduler.policy_credit import CreditPolicy

POLICY_NAMES = ("valora", "dlora", "slora", "punica", "affinity")


def make_policy(name: str, cost: CostModel | None = None, *, theta_s: float = 1.0,
                deadlines: bool = True) -> SchedulingPolicy:
    """A fresh policy by name; `cost` is the default worker profile of the credit policies
    (CPU workers use the cpu-tiny profile); `deadlines` False has them ignore latency objectives.
    The baselines are first come first served whatever the objectives (their papers have none)."""
    if name == "valora":
        return CreditPolicy(cost, theta_s=theta_s, mixture=True, profiles=PROFILES, deadlines=deadlines)
    if name == "dlora":
        return CreditPolicy(cost, theta_s=theta_s, mixture=False, profiles=PROFILES, deadlines=deadlines)
    if name == "slora":
        return SLoRAPolicy()
    if name == "punica":
        return PunicaPolicy()
    if name == "affinity":
        return AffinityLeastLoadedPolicy()
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES)}")
