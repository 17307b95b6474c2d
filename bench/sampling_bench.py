"""The batched sampler's device time: the one-launch Triton kernel (kernels/sampling.py) vs the
same kernel with its candidate walk on and off (thresholds by bisection only) vs its torch reference
(sort-free thresholds, the same tokens) vs the sort-based sampler it replaced, at the served
decode's batch sizes and Qwen2's vocabulary, half the rows greedy and half top-p 0.9 (the
mixed-vision workload, docs/workloads.md), and all rows greedy.

    python -m bench.sampling_bench        # CUDA; results/sampling-<commit>.json
"""

from __future__ import annotations

import argparse

import torch

from bench.common import run_info, save
from kernels import sampling


def sorted_sampler(logits, temperature, top_p, top_k, min_p, seed, counters):
    """The sampler before the kernel (a sort of every sampled row), kept here as the A/B's peer."""
    greedy = logits.argmax(-1)
    scores = logits.float() / temperature.clamp_min(sampling.MIN_TEMPERATURE)[:, None]
    noise = -torch.log(-torch.log(sampling.uniforms(seed, counters, logits.shape[-1])))
    scores, idx = torch.sort(scores, dim=-1, descending=True)
    ranks = torch.arange(scores.shape[-1], device=scores.device)
    drop = (top_k[:, None] > 0) & (ranks[None, :] >= top_k[:, None])
    probs = torch.softmax(scores, dim=-1)
    drop |= (top_p[:, None] > 0) & (top_p[:, None] < 1) & (torch.cumsum(probs, dim=-1) - probs > top_p[:, None])
    drop |= probs < min_p[:, None] * probs[:, :1]
    choice = (scores.masked_fill(drop, float("-inf")) + noise.gather(1, idx)).argmax(-1)
    return torch.where(temperature < sampling.MIN_TEMPERATURE, greedy, idx.gather(1, choice[:, None])[:, 0])


def timed_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="8,58,110,128")
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    out = []
    for n in map(int, args.rows.split(",")):
        g = torch.Generator(device=dev).manual_seed(n)
        logits = (torch.randn(n, args.vocab, device=dev, generator=g) * 3).to(torch.bfloat16)
        for mix in ("greedy+top_p", "greedy"):
            sampled = torch.tensor([mix != "greedy" and i % 2 == 1 for i in range(n)], device=dev)
            temperature = torch.where(sampled, 1.0, 0.0)
            top_p = torch.where(sampled, 0.9, 1.0)
            zeros_l, zeros_f = torch.zeros(n, dtype=torch.long, device=dev), torch.zeros(n, device=dev)
            seed = torch.arange(1, n + 1, device=dev)
            counters = torch.arange(n, device=dev)
            case = (logits, temperature, top_p, zeros_l, zeros_f, seed, counters)
            row = {
                "rows": n,
                "vocab": args.vocab,
                "mix": mix,
                "kernel_ms": timed_ms(lambda: sampling.sample_tokens_triton(*case), args.reps),
                # the candidate walk on (kernel_ms: the served default, CANDIDATE_TRIES), and off
                "walk_ms": timed_ms(lambda: sampling.sample_tokens_triton(*case, tries=sampling.WALK_TRIES), args.reps),
                "bisection_ms": timed_ms(lambda: sampling.sample_tokens_triton(*case, tries=0), args.reps),
                "reference_ms": timed_ms(lambda: sampling.sample_tokens_reference(*case, filtered=True), args.reps),
                "sorted_ms": timed_ms(lambda: sorted_sampler(*case), args.reps),
                "argmax_ms": timed_ms(lambda: logits.argmax(-1), args.reps),
            }
            row["agree"] = bool(
                torch.equal(sampling.sample_tokens_triton(*case), sampling.sample_tokens_reference(*case))
            )
            out.append(row)
            print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    print(save(f"sampling-{args.name or run_info()['git_commit']}", {"config": vars(args), "rows": out}))


if __name__ == "__main__":
    main()
