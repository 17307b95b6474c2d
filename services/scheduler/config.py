"""Scheduler settings (env VALORA_<FIELD>, e.g. VALORA_WORKER_ADDRESSES=host1:50061,host2:50061)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import NoDecode

from services.common.config import ServiceSettings, split_list


class SchedulerSettings(ServiceSettings):
    worker_addresses: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Static worker gRPC addresses (host:port), comma-separated or JSON list; "
        "members for the scheduler's life. More workers may join at run time through RegisterWorker.",
    )
    worker_ttl_s: float = Field(
        10.0,
        gt=0,
        description="A worker whose heartbeats stop (registered workers) or whose status polls fail "
        "for this long is lost: its requests that have not produced output are placed again.",
    )
    worker_grace_s: float = Field(
        30.0,
        ge=0,
        description="How long a lost registered worker stays listed (unhealthy) before it is removed "
        "from the pool; registering again within it (a restart) keeps its place.",
    )
    max_queue: int = Field(
        256, ge=0, description="Requests waiting for a worker; past it Submit is RESOURCE_EXHAUSTED."
    )
    retry_after_s: float = Field(1.0, gt=0, description="RetryInfo delay suggested when the queue is full.")
    status_poll_s: float = Field(
        1.0,
        gt=0,
        description="Seconds between GetWorkerStatus polls of each worker "
        "(only of those not streaming their status, see status_watch).",
    )
    status_timeout_s: float = Field(2.0, gt=0, description="Deadline of one GetWorkerStatus poll.")
    status_watch: bool = Field(
        True,
        description="Follow each worker's WatchWorkerStatus stream (status pushed on every change) instead "
        "of polling it; workers without the RPC, and any worker while its stream is down, are polled.",
    )
    status_watch_interval_ms: int = Field(
        500,
        ge=50,
        le=60_000,
        description="Longest gap the workers' status streams leave between two messages; "
        "a stream silent for 3x this (or status_timeout_s, the longer) is dropped and opened again.",
    )
    max_attempts: int = Field(
        3, ge=1, description="Workers tried for one request when they fail before the first token."
    )
    default_max_batch_size: int = Field(
        8, ge=1, description="Capacity assumed for a healthy worker that reports max_batch_size 0."
    )
    mode_switch_timeout_s: float = Field(30.0, gt=0, description="Deadline of one SetMode call to a worker.")
    dispatch_tick_s: float = Field(
        0.25, gt=0, description="Longest the dispatcher sleeps before re-checking deadlines."
    )

    policy: str = Field(
        "valora",
        description="Scheduling policy: valora (credits, merged/mixture/unmerged), dlora (credits, "
        "merge/unmerge, no mixture), slora (unmerged), punica (unmerged, FCFS, consolidating), affinity.",
    )
    starvation_theta_s: float = Field(
        1.0,
        gt=0,
        description="Starvation threshold θ: a request whose credit (waiting time + estimated run "
        "time, seconds) exceeds it is served through mixture mode (valora) or unmerged mode (dlora).",
    )
    slo_deadlines: bool = Field(
        True,
        description="valora/dlora: take requests of tasks with a latency objective (slo_ms) earliest "
        "deadline first, starving at half their objective; false ignores objectives (attainment is still counted).",
    )
    cost_profile: str = Field(
        "h200-7b",
        description="Cost model profile of the workers' GPU for run-time estimates (h200-7b, cpu-tiny); "
        "workers reporting a cpu device use cpu-tiny.",
    )
    cost_results_dir: str = Field(
        "",
        description="Directory of bench/results JSON (ATMM µs, switch ms) that refines the h200-7b profile; "
        "empty: the documented defaults.",
    )

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        from services.scheduler.policies import POLICY_NAMES

        if value not in POLICY_NAMES:
            raise ValueError(f"unknown policy {value!r}; known: {', '.join(POLICY_NAMES)}")
        return value

    @field_validator("worker_addresses", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        return split_list(value)
