"""The engine's choice of next tokens for a batch of sequences, on the device (sampling.py does
the tensor work): greedy when every row is, else one batched sampling call with the rows'
parameters, penalties' histories and seeds' counters; and their log-probabilities when a row asks.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog
import torch

from kernels import sampling as sampling_kernels
from services.worker.sampling import RowSampling, sample, token_logprobs
from services.worker.sequence import Sequence

log = structlog.get_logger()


def sampling_kernel_usable(device: torch.device) -> bool:
    """Whether the one-launch sampler (kernels/sampling.py) runs here (its self_check on CUDA)."""
    if device.type != "cuda":
        return False
    problem = sampling_kernels.self_check(device)
    if problem is not None:
        log.warning("sampling_kernel_unusable", reason=problem)
    log.info("sampling", op="triton" if problem is None else "torch_reference")
    return problem is None


class TokenChooser:
    """Next tokens and log-probabilities of a forward's rows, from their logits, on `device`."""

    def __init__(self, device: torch.device, upload: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """`upload`: a small host tensor on the device without a wait (ModelRunner.upload)."""
        self.device, self.upload = device, upload
        self.kernel = sampling_kernel_usable(device)

    def choose(
        self,
        rows: list[Sequence],
        greedy: torch.Tensor,
        logits: torch.Tensor,
        counters: list[int],
        pending: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The rows' next tokens on the device: `greedy` (the argmax) when every row is greedy and
        none has penalties, else sampled in one batched call (sampling.py; `counters`: the
        positions the tokens take; `pending`: each row's last token when it is still only on the
        device, a pipelined step's)."""
        params = [s.req.sampling for s in rows]
        if all(p.plain_greedy for p in params):
            return greedy
        rs = RowSampling.of(params, self.device)
        history = None if rs.penalties is None else self._history(rows, logits.shape[-1], pending)
        return sample(logits[: len(rows)], rs, self.upload(torch.tensor(counters)), history, kernel=self.kernel)

    def _history(
        self, rows: list[Sequence], vocab: int, pending: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The penalties' inputs on the device: each row's output token counts (rows, vocab) and
        which tokens its prompt or output holds (bool), from the tokens the host has and `pending`."""
        n = len(rows)
        width = max(1, max(len(s.tokens) for s in rows))
        out = torch.full((n, width), vocab, dtype=torch.long)  # column `vocab`: padding, dropped below
        for i, s in enumerate(rows):
            if s.tokens:
                out[i, : len(s.tokens)] = torch.tensor(s.tokens)
        counts = torch.zeros(n, vocab + 1, device=self.device)
        counts.scatter_add_(1, self.upload(out), torch.ones(n, width, device=self.device))
        if pending is not None:
            counts[:, :vocab].scatter_add_(1, pending[:n].view(-1, 1).long(), torch.ones(n, 1, device=self.device))
        prompt_width = max(s.prep.prompt_tokens for s in rows)
        prompt = torch.full((n, prompt_width), vocab, dtype=torch.long)
        for i, s in enumerate(rows):
            prompt[i, : s.prep.prompt_tokens] = s.prep.inputs["input_ids"][0]
        seen = torch.zeros(n, vocab + 1, dtype=torch.bool, device=self.device)
        seen.scatter_(1, self.upload(prompt), True)
        counts = counts[:, :vocab]
        return counts, seen[:, :vocab] | (counts > 0)

    def logprobs(self, rows: list[Sequence], logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor | None:
        """The rows' packed token log-probabilities (sampling.token_logprobs, as many alternatives
        as the row asking most wants) on the device, or None when no row asks."""
        top = max(s.req.logprobs for s in rows)
        return None if top < 0 else token_logprobs(logits[: len(rows)], tokens[: len(rows)], top)
