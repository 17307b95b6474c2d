"""Next-token choice for a batch of rows, on the device: greedy (temperature 0) or temperature /
top-k / top-p / min-p sampling, seeded per request, after OpenAI's logit bias (`add_bias`) and the
repetition, frequency and presence penalties (vLLM's and OpenAI's meanings: `penalize`), in
vLLM's order.

`sample` takes a step's logits (rows, vocab) and each row's parameters as device tensors and
returns the tokens as a device tensor: no host copy of logits, no per-row work on the host, so a
sampled row can feed the next decode step without a round trip (pipelined decode); on CUDA the
choice is one launch for the batch (kernels/sampling.py: thresholds by bisection, no sort). Top-k
and top-p keep every token tied with the last one kept.

Randomness is counter-based: row i's uniform for vocabulary entry v is a hash of (its seed, the
position its token will take, v), and the token is the Gumbel-max choice argmax(log p + g) with
g = -log(-log u) — an exact sample from p. The same seed therefore gives the same tokens however
the request is batched, pipelined, preempted and recomputed, or sharded over tensor-parallel
ranks (every rank computes the same noise). Greedy rows, and rows whose temperature is below
MIN_TEMPERATURE (1/T would overflow), take the argmax — of the biased and penalized logits: only a
batch whose rows are all `plain_greedy` may take the raw logits' argmax instead.
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass

import torch

from kernels.sampling import MIN_TEMPERATURE, sample_tokens, uniforms  # noqa: F401 - uniforms: this module's API


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0  # 0: a random seed (drawn once, when the request is prepared)
    min_p: float = 0.0  # drop tokens below min_p x the most likely one's probability (0: off)
    presence_penalty: float = 0.0  # subtracted from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted once per time a token was generated
    repetition_penalty: float = 1.0  # divides positive (multiplies negative) logits of prompt and output tokens
    # OpenAI's logit_bias: (token id, bias) pairs, each bias added to its token's logit first
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that changes the logits (no bias, no penalty): the token is the raw
        logits' argmax, which the decode step computes anyway."""
        return self.greedy and not self.penalized and not self.logit_bias

    @property
    def filtered(self) -> bool:
        """Whether top-k, top-p or min-p drops part of the vocabulary (the sampler then sorts)."""
        return self.top_k > 0 or 0.0 < self.top_p < 1.0 or self.min_p > 0.0

    def seeded(self) -> "SamplingParams":
        """These parameters with a seed: their own, or a random one."""
        if self.greedy or self.seed:
            return self
        return dataclasses.replace(self, seed=secrets.randbits(62) or 1)


@dataclass
class RowSampling:
    """A batch's sampling parameters as device tensors (rows,): temperature, top-p, top-k and
    min-p (0: off), seed; `filtered`: some row uses top-k, top-p or min-p; `bias`: the rows'
    logit biases as (token ids, biases), each (rows, most entries of a row), padded with
    (0, 0.0)."""

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    seed: torch.Tensor
    filtered: bool
    min_p: torch.Tensor
    penalties: torch.Tensor | None = None  # (3, rows): repetition, frequency, presence; None: no row has any
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # None: no row has a logit bias

    @classmethod
    def of(cls, params: list[SamplingParams], device: torch.device) -> "RowSampling":
        pin = device.type == "cuda"
        floats = torch.tensor(
            [[p.temperature for p in params], [p.top_p for p in params], [p.min_p for p in params]],
            dtype=torch.float32,
            pin_memory=pin,
        ).to(device, non_blocking=True)
        longs = torch.tensor(
            [[p.top_k for p in params], [p.seed for p in params]], dtype=torch.int64, pin_memory=pin
        ).to(device, non_blocking=True)
        penalties = None
        if any(p.penalized for p in params):
            penalties = torch.tensor(
                [
                    [p.repetition_penalty for p in params],
                    [p.frequency_penalty for p in params],
                    [p.presence_penalty for p in params],
                ],
                dtype=torch.float32,
                pin_memory=pin,
            ).to(device, non_blocking=True)
        bias = None
        if any(p.logit_bias for p in params):
            width = max(len(p.logit_bias) for p in params)
            pad = [(0, 0.0)] * width
            pairs = [list(p.logit_bias) + pad[len(p.logit_bias) :] for p in params]
            ids = torch.tensor([[t for t, _ in row] for row in pairs], dtype=torch.int64, pin_memory=pin)
            values = torch.tensor([[b for _, b in row] for row in pairs], dtype=torch.float32, pin_memory=pin)
            bias = ids.to(device, non_blocking=True), values.to(device, non_blocking=True)
        return cls(
            floats[0],
            floats[1],
            longs[0],
            longs[1],
            any(p.filtered for p in params if not p.greedy),
            floats[2],
            penalties,
            bias,
        )


def add_bias(logits: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """fp32 logits with OpenAI's logit bias: row i's `values[i, j]` added to its token `ids[i, j]`
    (RowSampling.bias; the padding adds 0 to token 0)."""
    return logits.float().scatter_add(1, ids, values)


def penalize(logits: torch.Tensor, penalties: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """fp32 logits after the penalties (3, rows) of RowSampling: a token of the prompt or the
    output (`seen`, rows x vocab bool) has its logit divided by the repetition penalty when
    positive, multiplied when negative (HF's and vLLM's repetition_penalty); then each token's
    logit loses frequency x its count in the output (`counts`) and presence x (count > 0)
    (OpenAI's frequency and presence penalties). Penalties of 1, 0 and 0 change nothing."""
    out = logits.float()
    rep, freq, pres = (p[:, None] for p in penalties)
    out = torch.where(seen, torch.where(out > 0, out / rep, out * rep), out)
    return out - freq * counts - pres * (counts > 0).float()


def sample(
    logits: torch.Tensor,
    rows: RowSampling,
    counters: torch.Tensor,
    history: tuple[torch.Tensor, torch.Tensor] | None = None,
    kernel: bool = False,
) -> torch.Tensor:
    """(rows,) long tokens for (rows, vocab) logits. `counters` (rows,) long: the position each
    row's token will take (the noise's counter). `history`: (output counts, prompt-or-output
    seen) per row and vocabulary entry, when rows.penalties is set. The logit bias (`add_bias`),
    then the penalties (`penalize`) apply first: the greedy rows' argmax is the biased and
    penalized logits'. The choice itself is kernels/sampling.py's (`kernel`: its one-launch
    Triton kernel where it runs, else its torch reference; the same tokens)."""
    if rows.bias is not None:
        logits = add_bias(logits, *rows.bias)
    if rows.penalties is not None:
        logits = penalize(logits, rows.penalties, *history)
    return sample_tokens(
        logits,
        rows.temperature,
        rows.top_p,
        rows.top_k,
        rows.min_p,
        rows.seed,
        counters,
        kernel=kernel,
        filtered=rows.filtered,
    )


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> torch.Tensor:
    """(rows, 1 + 2 * top) float32 on the device: each row's chosen token's log-probability under
    softmax(logits) (the model's distribution, before temperature and filters), then the `top`
    largest log-probabilities and their token ids (as floats: exact below 2^24). One batched
    call, copied to the host with the tokens."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, tokens.view(-1, 1).long())
    if top <= 0:
        return chosen
    values, ids = lp.topk(top, dim=-1)
    return torch.cat([chosen, values, ids.float()], dim=1)


def unpack_logprobs(token: int, row: list[float], top: int):
    """A row of token_logprobs' output, as (token, logprob, the first `top` (id, logprob))."""
    k = (len(row) - 1) // 2
    return token, row[0], tuple((int(row[1 + k + i]), row[1 + i]) for i in range(min(top, k)))
