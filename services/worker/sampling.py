"""Next-token choice per sequence: greedy (temperature 0) or temperature/top-k/top-p sampling
with a per-request seeded generator (equal seeds give equal outputs)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0  # 0: a random seed

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def generator(self) -> torch.Generator | None:
        if self.greedy:
            return None
        g = torch.Generator(device="cpu")
        g.manual_seed(self.seed or secrets.randbits(63))
        return g


def choose_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits: (vocab,) of one sequence."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    scores = logits.float().cpu() / params.temperature
    if params.top_k > 0 and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if 0.0 < params.top_p < 1.0:
        sorted_scores, idx = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        cum = torch.cumsum(probs, dim=-1)
        drop = cum - probs > params.top_p  # keep the smallest set whose mass reaches top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(0, idx, sorted_scores)
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())
