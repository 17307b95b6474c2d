"""How the step scheduler packs mixed-vision prefills into forwards (CPU, no model): per setting
(max_prefills_per_step, max_prefill_tokens, prefill_fill_padding), the tokens a step prefills,
the tokens its forward runs (its graph bucket, prefill_graphs.bucket_tokens), the padding share,
the requests split into chunks and the steps a request's prefill spans. The real
`StepScheduler.take_prefills` over a prefill queue kept full (a closed loop's worker), with the
contexts of docs/workloads.md's mix (`bench.serve_bench.request_mix`'s images, prompt lengths
and image counts; a request's context = prompt + its images' tokens + the chat template's).

    python -m bench.prefill_packing --name prefill-packing-<commit>
"""

from __future__ import annotations

import argparse
import collections
import threading
from types import SimpleNamespace

from bench.common import run_info, save
from services.worker.prefill_graphs import bucket_tokens
from services.worker.step_scheduler import StepScheduler

IMAGE_TOKENS = {448: 256, 640: 529}  # Qwen2-VL: (side rounded to 28 px / 28)^2 tokens an image
NO_OBJECTIVE = SimpleNamespace(slo_left_s=None)  # the requests' WorkRequest: no latency objective
TEMPLATE = 28  # chat template and system turn tokens, plus 2 vision markers an image (below)


def contexts(n: int) -> list[int]:
    """The mix's request contexts in order (docs/workloads.md: sizes, image counts, prompts)."""
    import random

    rng = random.Random(0)
    out = []
    for i in range(n):
        b = i // 16
        size = (448, 640)[(i + b) % 2]
        images = 3 if (i + b // 4) % 8 == 7 else 1
        out.append(rng.randint(20, 60) + TEMPLATE + images * (IMAGE_TOKENS[size] + 2))
    return out


def simulate(rows: int, budget: int, fill: bool, requests: int) -> dict:
    config = SimpleNamespace(
        max_prefills_per_step=rows, max_prefill_tokens=budget, prefill_fill_padding=fill, mixed_steps=False
    )
    sched = StepScheduler(config, None, None, threading.Condition(), padded=bucket_tokens)
    pending = collections.deque(
        SimpleNamespace(context=c, prefilled=0, prefill_to=0, steps=0, req=NO_OBJECTIVE) for c in contexts(requests)
    )
    done, steps, tokens, run = [], 0, 0, 0
    while pending or sched.prefill:
        while pending and len(sched.prefill) < 4 * rows:  # a closed loop keeps the queue full
            sched.prefill.append(pending.popleft())
        batch = sched.take_prefills(0.0)
        n = sum(s.prefill_to - s.prefilled for s in batch)
        steps, tokens, run = steps + 1, tokens + n, run + bucket_tokens(n)
        for s in batch:
            s.prefilled, s.steps = s.prefill_to, s.steps + 1
            if s.prefilled == s.context:
                sched.prefill.remove(s)
                done.append(s)
    return {
        "max_prefills_per_step": rows,
        "max_prefill_tokens": budget,
        "prefill_fill_padding": fill,
        "steps": steps,
        "tokens_per_step": round(tokens / steps, 1),
        "run_per_step": round(run / steps, 1),
        "padding_share": round(1 - tokens / run, 4),
        "chunked_requests": round(sum(s.steps > 1 for s in done) / len(done), 4),
        "requests_per_step": round(len(done) / steps, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=768)
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    settings = [
        (2, 8192, False),
        (4, 8192, False),
        (8, 8192, False),
        (4, 8192, True),
        (8, 2048, False),
        (8, 2048, True),
        (8, 3072, True),
        (16, 2048, True),
        (16, 4096, True),
    ]
    rows = [simulate(r, b, f, args.requests) for r, b, f in settings]
    for r in rows:
        print(r)
    print(save(args.name or f"prefill-packing-{run_info()['git_commit']}", {"config": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()
