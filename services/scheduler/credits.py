"""Credits of waiting requests (VaLoRA Alg. 1): credit = waiting time + estimated execution time.

A request whose credit passes the starvation threshold θ is *starving*: the credit policy serves
it through mixture mode (or unmerged mode when more than half a batch starves) instead of
leaving it behind a merged adapter.

A request with a latency objective (its task's slo_ms, `WaitingRequest.slo_s`) brings its own
bound: it is due at arrival + objective, and it starves once its credit passes `SLO_URGENT_SHARE`
of the objective (when that is tighter than θ). While its credit is still within the objective
(run now, it would finish in time: `claims_deadline`) a starving one goes before every other
starving request; once the objective is lost it is one more starving request in credit order. A
request without one is due at arrival + θ, so with no objectives anywhere earliest-due is first
come first served and every threshold is θ: the paper's rule unchanged.
(services/scheduler/slo.py counts whether objectives were met.)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from services.scheduler.cost_model import CostModel


@dataclass(frozen=True)
class Credit:
    request_id: str
    wait_s: float
    exec_s: float

    @property
    def value_s(self) -> float:
        return self.wait_s + self.exec_s


# Characters per prompt token: about 4 for English text through BPE tokenizers (Qwen2's included).
CHARS_PER_TOKEN = 4.0


def estimate_prompt_tokens(prompt: str) -> int:
    """Prompt tokens estimated from the text before tokenization (the scheduler has no tokenizer);
    0 for an empty prompt (the cost model's default then applies). Image tokens are added by the
    cost model from the image count."""
    return math.ceil(len(prompt) / CHARS_PER_TOKEN) if prompt else 0


def estimate_exec_s(
    cost: CostModel, *, prompt_tokens: int, images: int, max_new_tokens: int, label: bool, lora: bool = True
) -> float:
    """The request's estimated run time in seconds (unmerged: the pessimistic mode)."""
    return cost.request_ms(prompt_tokens, images, max_new_tokens, label=label, lora=lora) / 1000.0


def credit_of(req, now_s: float, cost: CostModel) -> Credit:
    """`req` is a policy `WaitingRequest` (duck-typed to keep this module free of the policy)."""
    exec_s = estimate_exec_s(
        cost,
        prompt_tokens=getattr(req, "prompt_tokens", 0),
        images=req.images,
        max_new_tokens=req.max_new_tokens,
        label=req.label,
    )
    return Credit(req.request_id, max(0.0, now_s - req.arrival_s), exec_s)


# Share of its objective a request may spend (waiting + estimated run) before it starves: the
# rest is the room to run it once placed (a mixture step is slower than a merged one, the run
# estimate is a mean). At 1.0 it would starve only once it can no longer make it.
SLO_URGENT_SHARE = 0.5


def threshold_s(req, theta_s: float) -> float:
    """The credit past which `req` starves: θ, or the tighter of θ and SLO_URGENT_SHARE of its
    latency objective when it has one."""
    slo_s = getattr(req, "slo_s", 0.0)
    return min(theta_s, SLO_URGENT_SHARE * slo_s) if slo_s > 0 else theta_s


def due_s(req, theta_s: float) -> float:
    """When `req` is due: arrival + its latency objective, or arrival + θ without one (the credit
    policy's own bound, so objective-less requests keep their arrival order among themselves)."""
    slo_s = getattr(req, "slo_s", 0.0)
    return req.arrival_s + (slo_s if slo_s > 0 else theta_s)


def claims_deadline(req, credit_s: float) -> bool:
    """Whether `req` (starving) is served by its deadline ahead of the credit order: it has an
    objective and, run now, would still meet it (credit = wait + estimated run within it). A
    request past that point is late whatever happens; putting it first would make the ones
    still in time late too (EDF's domino under overload)."""
    slo_s = getattr(req, "slo_s", 0.0)
    return 0 < slo_s and credit_s <= slo_s


def starving(credits: Iterable[Credit], theta_s: float) -> list[Credit]:
    """Credits past θ, highest first."""
    return sorted((c for c in credits if c.value_s > theta_s), key=lambda c: (-c.value_s, c.request_id))
