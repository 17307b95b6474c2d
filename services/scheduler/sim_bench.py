"""The runs of `valora bench sched` (entry point `valora.server` scheduler-sim): the simulator over
policies x popularity skews x arrival rates, for each arrival CV, starvation threshold and deadline
mode, on synthetic, Azure-CSV or two-app traces. The CLI checks the options, prints and writes."""

from __future__ import annotations

import itertools
from pathlib import Path

from services.scheduler.cost_model import CostModel, load_profile
from services.scheduler.policies import make_policy
from services.scheduler.sim import run_matrix
from services.scheduler.traces import load_azure_csv, synthetic_trace, two_app_trace

# The policies with credits, starvation thresholds θ and deadlines (the others run once per CV).
CREDIT_POLICIES = ("valora", "dlora")

__all__ = ["CREDIT_POLICIES", "CostModel", "load_profile", "matrix"]


def matrix(
    names: list[str],
    alphas: list[float],
    rates: list[float],
    cvs: list[float],
    thetas: list[float],
    modes: list[bool],
    cost: CostModel,
    *,
    workload: str,
    seconds: float,
    workers: int,
    max_batch: int,
    adapters: int,
    task_head_fraction: float,
    azure_csv: Path | None,
    video_streams: int,
    video_tasks: int,
    video_slo_ms: float,
    retrieval_slo_ms: float,
    seed: int,
) -> list[dict]:
    """One row per simulation; each carries theta_s and deadlines (None for the policies without
    credits), burst_cv and trace besides run_matrix's fields."""

    def trace_for(alpha: float, rate: float, burst_cv: float) -> list:
        if workload == "two-app":
            return two_app_trace(
                seconds=seconds,
                streams=video_streams,
                retrieval_rate=rate,
                video_tasks=video_tasks,
                video_slo_ms=video_slo_ms,
                retrieval_slo_ms=retrieval_slo_ms,
                retrieval_adapters=adapters,
                alpha=alpha,
                seed=seed,
            )
        if azure_csv is not None:
            return load_azure_csv(
                azure_csv,
                alpha=alpha,
                adapters=adapters,
                task_head_fraction=task_head_fraction,
                max_requests=int(rate * seconds),
                seed=seed,
            )
        return synthetic_trace(
            n=max(1, int(rate * seconds)),
            rate=rate,
            alpha=alpha,
            adapters=adapters,
            burst_cv=burst_cv,
            task_head_fraction=task_head_fraction,
            seed=seed,
        )

    rows: list[dict] = []
    trace_name = workload if workload == "two-app" else "azure-csv" if azure_csv is not None else "synthetic"
    for cv in cvs:
        for theta, on in itertools.product(thetas, modes):
            first = theta == thetas[0] and on == modes[0]
            run_names = names if first else [n for n in names if n in CREDIT_POLICIES]
            got = run_matrix(
                run_names,
                alphas,
                rates,
                make=lambda n, th=theta, on=on: make_policy(n, cost, theta_s=th, deadlines=on),
                cost=cost,
                trace_for=lambda a, r, cv=cv: trace_for(a, r, cv),
                workers=workers,
                max_batch=max_batch,
            )
            for r in got:
                r["theta_s"] = theta if r["policy"] in CREDIT_POLICIES else None
                r["deadlines"] = on if r["policy"] in CREDIT_POLICIES else None
                r["burst_cv"] = cv
                r["trace"] = trace_name
            rows.extend(got)
    return rows
