"""Where a served step's device time goes: the decode step, the LM prefill and the vision tower,
each on its own, by kernel category (7B architecture, random weights, mixed adapters).

The served `mixed-vision` load on one H200 is device-bound since the prefill graphs
(bench/results/serve-h200-ac5670b.json: GPU span share 0.975; a prefill step of 1.85 requests
spends ~22 ms in the vision tower, ~38 ms in the LM prefill, ~13 ms in a decode step of 57 rows).
This bench says which kernels those milliseconds are, three phases measured apart so no kernel
has to be attributed by guesswork:

    decode   `--rows` text requests with mixed adapters decoding, nothing else arriving
    lm       pairs of image requests (one new token) whose images are in the feature cache: the
             LM prefill (+ a first token) only
    vision   the same pairs with new images, less `lm`: the vision tower
    mixed    new pairs while the decode rows run, as served (per prefill step; compare with the
             sum of the three: what a served step runs beyond its phases)

Every phase runs under torch.profiler (CUDA kernels are traced by device, whatever thread
launched them) with graphs `--graphs` (static: eager kernels, each one seen; auto: replays).
Rows: per phase, device ms per step and per category (gemm, lora, attention, norm/rope/act,
copy/index, other) and the top kernels.

    python -m bench.step_profile                          # H200, results/step-profile-<commit>.json
    python -m bench.step_profile --arch tiny --device cpu  # a smoke run (no device kernels: empty rows)
"""

from __future__ import annotations

import argparse
import queue
import re
import time
from pathlib import Path

import torch
from PIL import Image

from bench.common import RESULTS, run_info, write_json
from kernels import sampling as sampling_kernel
from services.worker.model import ensure_shape_model, ensure_tiny_model
from services.worker.requests import Failed, Finished, WorkRequest
from services.worker.sampling import SamplingParams
from services.worker.testing import random_adapter_bundle

CATEGORIES = [  # first match wins
    ("lora", r"atmm|sgmv|grouped_prep"),
    ("attention", r"paged|flash|fmha|sdpa|attention|softmax"),
    ("gemm", r"nvjet|gemm|cutlass|xmma|cublas|splitKreduce|conv"),
    ("norm/rope/act", r"rms_norm|rotary|silu|gelu|layer_norm|norm"),
    ("copy/index", r"[Mm]emcpy|[Mm]emset|copy|index|gather|scatter|cat|Cat"),
]


def category(name: str) -> str:
    return next((c for c, pat in CATEGORIES if re.search(pat, name)), "other")


def image(seed: int, size: int) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    px = torch.randint(0, 256, (size // 16, size // 16, 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(px.numpy()).resize((size, size), Image.Resampling.NEAREST)


def kernels(prof) -> dict[str, dict]:
    """Device time (µs) and calls per kernel of one profile."""
    out = {}
    for e in prof.key_averages():
        if e.self_cpu_time_total == 0 and e.self_device_time_total > 0:
            out[e.key] = {"us": e.self_device_time_total, "calls": e.count}
    return out


def summarize(k: dict[str, dict], steps: int, top: int) -> dict:
    total = sum(v["us"] for v in k.values())
    cats: dict[str, float] = {}
    for name, v in k.items():
        cats[category(name)] = cats.get(category(name), 0.0) + v["us"]
    ranked = sorted(k.items(), key=lambda kv: -kv[1]["us"])[:top]
    return {
        "steps": steps,
        "device_ms_per_step": round(total / 1e3 / max(1, steps), 3),
        "categories_ms_per_step": {c: round(us / 1e3 / max(1, steps), 3) for c, us in sorted(cats.items())},
        "top": [
            {
                "kernel": n[:160],
                "category": category(n),
                "ms_per_step": round(v["us"] / 1e3 / max(1, steps), 3),
                "calls_per_step": round(v["calls"] / max(1, steps), 1),
            }
            for n, v in ranked
        ],
    }


def difference(a: dict[str, dict], b: dict[str, dict]) -> dict[str, dict]:
    """a less b, kernel by kernel (what a runs beyond b); kernels b runs more of are dropped."""
    out = {}
    for name, v in a.items():
        us = v["us"] - b.get(name, {}).get("us", 0.0)
        if us > 0:
            out[name] = {"us": us, "calls": max(0, v["calls"] - b.get(name, {}).get("calls", 0))}
    return out


def wait(sinks: dict[str, queue.Queue], timeout: float = 300.0) -> None:
    for q in sinks.values():
        while True:
            ev = q.get(timeout=timeout)
            if isinstance(ev, Failed):
                raise ev.error
            if isinstance(ev, Finished):
                break


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen2-vl-7b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--ranks", default="8,16,32,64", help="round-robin over the adapters")
    ap.add_argument("--rows", type=int, default=56, help="decoding requests in the decode phase")
    ap.add_argument("--pairs", type=int, default=6, help="prefill steps (two image requests each) a phase")
    ap.add_argument("--sizes", default="448,644", help="the two images of a pair (px)")
    ap.add_argument("--graphs", default="static", choices=("static", "auto"))
    ap.add_argument("--decode-s", type=float, default=2.0, help="seconds of decode profiled")
    ap.add_argument(
        "--top-p-every",
        type=int,
        default=0,
        help="every Nth decode row samples (temperature 1, top-p 0.9; mixed-vision has 2), 0: all greedy",
    )
    ap.add_argument(
        "--sampler-tries",
        default="",
        help="also profile the decode phase with the sampler walking this many candidates, e.g. "
        "'6,0' (kernels/sampling.py CANDIDATE_TRIES; the same rows, one process): phases decode@N",
    )
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--name", default=None)
    args = ap.parse_args(argv)
    from torch.profiler import ProfilerActivity, profile

    from services.worker.engine import Engine, EngineConfig

    on_cuda = args.device.startswith("cuda")
    model_dir = Path(f"~/.cache/valora/{args.arch}").expanduser()
    if args.arch == "tiny":
        ensure_tiny_model(model_dir)
    else:
        ensure_shape_model(model_dir, args.arch)
    ranks = [int(r) for r in args.ranks.split(",")]
    sizes = [int(s) for s in args.sizes.split(",")]
    eng = Engine(
        EngineConfig(
            model_path=model_dir,
            device=args.device,
            dtype="bfloat16" if on_cuda else "float32",
            load_format="dummy" if args.arch != "tiny" else "auto",
            max_batch_size=args.rows + 4,
            max_prefills_per_step=2,
            device_slots=args.adapters + 1,
            decode_graphs=args.graphs,
            prefill_graphs=args.graphs,
            kv_cache_bytes=(16 << 30) if on_cuda else (256 << 20),
            max_new_tokens_limit=4096,
        )
    )
    eng.eos_ids = set()
    eng.start()
    names = []
    for i in range(args.adapters):
        b = random_adapter_bundle(
            model_dir,
            rank=ranks[i % len(ranks)],
            lora_alpha=2 * ranks[i % len(ranks)],
            seed=i + 1,
            std=0.01,
            dtype=torch.bfloat16 if on_cuda else torch.float32,
        )
        name = f"adapters/a{i}/versions/1"
        assert eng.load_adapter_bytes(name, b.sha256, b.data, b.config_json)
        names.append(name)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])

    def pairs(seed: int, n: int) -> dict[str, queue.Queue]:
        sinks = {}
        for p in range(n):
            with eng._wake:  # a pair is admitted (and prefilled) together
                for j, size in enumerate(sizes):
                    rid = f"p{seed}-{p}-{j}"
                    sinks[rid] = queue.Queue()
                    req = WorkRequest(
                        rid,
                        "Describe the image in detail.",
                        [image(seed * 1000 + 2 * p + j, size)],
                        adapter=names[(2 * p + j) % len(names)],
                        max_new_tokens=1,
                    )
                    eng.submit(eng.prepare(req), sinks[rid].put)
            wait({k: sinks[k] for k in list(sinks)[-len(sizes) :]})
        return sinks

    pairs(1, 2)  # warm-up: kernels compiled, graphs captured, the pair's images cached for `lm`
    pairs(1, 2)
    steps0 = eng.runner.prefill_graphs.static_steps
    with profile(activities=acts) as prof:
        pairs(1, 2)  # cached images: LM prefill only
    lm_steps = eng.runner.prefill_graphs.static_steps - steps0
    lm = kernels(prof)
    pairs(2, 1)
    steps0 = eng.runner.prefill_graphs.static_steps
    with profile(activities=acts) as prof:
        pairs(3, 2)  # new images: vision + LM prefill
    both_steps = eng.runner.prefill_graphs.static_steps - steps0
    both = kernels(prof)

    # decode: `rows` long requests, nothing else arriving
    def sampling(i: int) -> SamplingParams:
        top_p = args.top_p_every and i % args.top_p_every == args.top_p_every - 1
        return SamplingParams(temperature=1.0, top_p=0.9, seed=i + 1) if top_p else SamplingParams()

    handles = [
        eng.submit(
            eng.prepare(
                WorkRequest(
                    f"d{i}",
                    f"Tell a long story, number {i}.",
                    [],
                    adapter=names[i % len(names)],
                    max_new_tokens=4000,
                    sampling=sampling(i),
                )
            ),
            lambda ev: None,
        )
        for i in range(args.rows)
    ]
    while eng.running_count < args.rows:
        time.sleep(0.05)
    time.sleep(1.0)  # every row past its prefill, decode graphs warm
    while True:  # no capture left: the profiler's exit synchronizes, which a capture forbids
        captures = eng.graphs.captures
        time.sleep(1.0)
        if eng.graphs.captures == captures:
            break

    def decode_phase() -> tuple[dict, int]:
        """The decode rows' kernels over `decode_s` seconds, and the steps they took."""
        steps0 = eng.graphs.static_steps
        with profile(activities=acts) as prof:
            time.sleep(args.decode_s)
        return kernels(prof), eng.graphs.static_steps - steps0

    dec, decode_steps = decode_phase()
    sampler_ab = {}  # the same decode rows under each sampler setting (its kernel is not in the graphs)
    default_tries = sampling_kernel.CANDIDATE_TRIES
    for tries in [int(t) for t in args.sampler_tries.split(",") if t.strip()]:
        sampling_kernel.CANDIDATE_TRIES = tries
        time.sleep(0.2)  # steps launched under the old setting drain
        sampler_ab[f"decode@{tries}"] = summarize(*decode_phase(), args.top)
    sampling_kernel.CANDIDATE_TRIES = default_tries
    # served-like: the same rows decoding while pairs of new images arrive (a step: a decode step
    # beside a prefill), to compare with the phases' sum
    steps0, prefills0 = eng.graphs.static_steps, eng.runner.prefill_graphs.static_steps
    with profile(activities=acts) as prof:
        pairs(4, args.pairs)
    mixed_steps = eng.runner.prefill_graphs.static_steps - prefills0
    mixed_decode_steps = eng.graphs.static_steps - steps0
    mixed = kernels(prof)
    for h in handles:
        h.cancel()
    eng.stop()
    scale = lm_steps / max(1, both_steps)  # per-step tables: vision = both - lm (same step counts here)
    lm_scaled = {k: {"us": v["us"] / scale, "calls": v["calls"] / scale} for k, v in lm.items()} if scale else lm
    phases = {
        "decode": summarize(dec, decode_steps, args.top),
        "lm_prefill": summarize(lm, lm_steps, args.top),
        "vision": summarize(difference(both, lm_scaled), both_steps, args.top),
        "mixed": {**summarize(mixed, mixed_steps, args.top), "decode_steps": mixed_decode_steps},
        **sampler_ab,
    }
    out = {
        **run_info(),
        "bench": "step_profile",
        "arch": args.arch,
        "graphs": args.graphs,
        "rows": args.rows,
        "top_p_every": args.top_p_every,
        "adapters": args.adapters,
        "ranks": ranks,
        "sizes": sizes,
        "phases": phases,
    }
    name = args.name or "step-profile"
    write_json(name, out, RESULTS)
    for phase, s in phases.items():
        print(f"{phase}: {s['steps']} steps, {s['device_ms_per_step']} device ms a step, {s['categories_ms_per_step']}")
        for t in s["top"][:8]:
            print(f"   {t['ms_per_step']:8.3f} ms  x{t['calls_per_step']:<6} {t['category']:<14} {t['kernel'][:90]}")
    return out


if __name__ == "__main__":
    main()
