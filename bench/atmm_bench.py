"""ATMM vs peers on the GPU (docs/benchmarks.md §1): µs per op, error vs fp32 reference, floor, ratios.

Three timings per shape and method: eager (events around one call), graph1 (one op per CUDA graph
replay) and amortized (20 ops in one graph over rotating inputs and weights, the headline).
Per-step metadata preparation (AtmmPlan.update, host side + one async copy) is timed separately:
it runs once per engine step, not per layer.

    python -m bench.atmm_bench --suite headline     # results/atmm_<suite>_<run>.json + atmm-<run>.json

Two files per run: the detailed one (every timing, tile choice, error) and the flat rows of
issue #5 (`bench/export_rows.py`'s schema, one row per case and method) as atmm-<run>.json next
to it. <run> is --suffix, else the last "_" part of --name, else the short git commit.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import statistics
import time
import traceback

import torch

from bench.common import COPY_BW, save, write_json
from bench.export_rows import atmm_rows, rows_name, run_id
from bench.peers import PEERS, Case
from kernels.atmm import AtmmPlan, atmm_, default_table, lora_weights_from_lists
from kernels.reference import SegmentPlan, multi_lora_reference_
from kernels.results import git_commit
from kernels.tile_table import fused_heuristic_config, heuristic_config, shape_key
from kernels.timing import time_eager, time_graph

SHAPES = {
    "4096": (4096, 4096),
    "3584": (3584, 3584),
    "11008to4096": (11008, 4096),
    "4096to11008": (4096, 11008),
    "18944": (18944, 18944),
}
RANKS = {"8": [8], "16": [16], "32": [32], "64": [64], "128": [128], "mixed": [8, 16, 32, 64]}
# published peer numbers (vLLM 0.33 Triton lora_shrink+expand, h=4096 r=16, amortized), docs/benchmarks.md
VLLM = {
    (8, 16): 8.8,
    (8, 64): 9.7,
    (8, 256): 13.7,
    (8, 1024): 21.8,
    (8, 4096): 64.4,
    (64, 16): 12.7,
    (64, 64): 26.4,
    (64, 256): 35.4,
    (64, 1024): 66.6,
    (64, 4096): 201,
}


def suite(name: str) -> list[dict]:
    cases = []
    if name in ("headline", "headline_ranks", "full", "quick"):
        ts = [16, 64, 256, 1024, 4096] if name != "quick" else [16, 1024]
        for n in (8, 64):
            for t in ts:
                cases.append(dict(shape="4096", rank="16", T=t, N=n, mix="uniform"))
    if name == "headline_ranks":  # headline + the rank/shape cases where a Triton SGMV led
        cases += [
            dict(shape="4096", rank="mixed", T=1024, N=64, mix="zipf"),
            dict(shape="4096", rank="64", T=256, N=8, mix="distinct"),
            dict(shape="4096", rank="128", T=1024, N=8, mix="zipf"),
            dict(shape="11008to4096", rank="32", T=1024, N=64, mix="uniform"),
            dict(shape="4096", rank="16", T=8192, N=8, mix="uniform"),
        ]
    if name == "full":
        cases += [
            dict(shape="4096", rank="16", T=1, N=1, mix="same"),
            dict(shape="4096", rank="16", T=8192, N=8, mix="uniform"),
            dict(shape="4096", rank="mixed", T=64, N=8, mix="uniform"),
            dict(shape="4096", rank="mixed", T=1024, N=64, mix="zipf"),
            dict(shape="4096", rank="64", T=256, N=8, mix="distinct"),
            dict(shape="4096", rank="128", T=1024, N=8, mix="zipf"),
            dict(shape="4096", rank="8", T=16, N=64, mix="distinct"),
            dict(shape="3584", rank="16", T=256, N=8, mix="zipf"),
            dict(shape="11008to4096", rank="16", T=64, N=8, mix="uniform"),
            dict(shape="4096to11008", rank="16", T=64, N=8, mix="uniform"),
            dict(shape="11008to4096", rank="32", T=1024, N=64, mix="uniform"),
            dict(shape="18944", rank="16", T=16, N=8, mix="uniform"),
            dict(shape="18944", rank="16", T=1024, N=8, mix="zipf"),
            dict(shape="4096", rank="16", T=4096, N=1, mix="same"),
        ]
    return cases


def token_slots(t: int, n: int, mix: str, rng: random.Random) -> list[int]:
    if mix == "same":
        s = [0] * t
    elif mix == "distinct":
        s = [i % n for i in range(t)]
    elif mix == "uniform":
        s = [rng.randrange(n) for _ in range(t)]
    elif mix == "zipf":
        w = [1 / (k + 1) ** 1.5 for k in range(n)]
        s = rng.choices(range(n), weights=w, k=t)
    else:
        raise ValueError(mix)
    return sorted(s)


def floor_us(c: Case, used: set[int], with_y_read: bool = False) -> float:
    t = len(c.token_slots)
    byts = 2 * t * (c.h_in + c.h_out * (2 if with_y_read else 1))
    byts += sum(2 * (c.h_in + c.h_out) * c.a[k].shape[1] for k in used)
    return byts / COPY_BW * 1e6


def run_case(spec: dict, methods: list[str], dtype=torch.bfloat16, seed: int = 0) -> dict:
    rng = random.Random(seed)
    h_in, h_out = SHAPES[spec["shape"]]
    ranks_pool = RANKS[spec["rank"]]
    n, t = spec["N"], spec["T"]
    ranks = [ranks_pool[k % len(ranks_pool)] for k in range(n)]
    slots = token_slots(t, n, spec["mix"], rng)
    used = set(slots)
    dev = torch.device("cuda")
    set_bytes = 2 * t * (h_in + h_out) + sum(2 * (h_in + h_out) * r for r in ranks) * 3
    nsets = int(min(20, max(2, math.ceil(200e6 / set_bytes)), max(1, 6e9 // set_bytes)))
    g = torch.Generator(device=dev).manual_seed(seed)
    sets = []
    for _ in range(nsets):
        a = [(torch.randn(h_in, r, device=dev, generator=g) / h_in**0.5).to(dtype) for r in ranks]
        b = [(torch.randn(r, h_out, device=dev, generator=g) / r**0.5).to(dtype) for r in ranks]
        sc = [1.0 + 0.5 * (k % 3) for k in range(n)]
        x = torch.randn(t, h_in, device=dev, generator=g).to(dtype)
        y = torch.randn(t, h_out, device=dev, generator=g).to(dtype)
        sets.append((Case(a, b, sc, slots, h_in, h_out), x, y))
    c0, x0, y0 = sets[0]
    ref = y0.float().clone()
    multi_lora_reference_(
        ref,
        x0.float(),
        SegmentPlan.from_token_slots(slots),
        [u.float() for u in c0.a],
        [u.float() for u in c0.b],
        c0.scales,
    )
    delta_ref = ref - y0.float()

    res = {
        **spec,
        "h_in": h_in,
        "h_out": h_out,
        "nsets": nsets,
        "segments": len(used),
        "floor_us": floor_us(c0, used),
        "floor_rw_us": floor_us(c0, used, True),
    }
    res["goal_us"] = max(2 * res["floor_us"], res["floor_us"] + 4)
    if spec["shape"] == "4096" and spec["rank"] == "16" and (n, t) in VLLM:
        res["vllm_triton_published_us"] = VLLM[(n, t)]

    plan = AtmmPlan(max_segments=max(64, n), max_tokens=max(t, 16), device=dev)
    p = SegmentPlan.from_token_slots(slots)
    ws = [lora_weights_from_lists(c.a, c.b, c.scales) for c, _, _ in sets]
    plan.update(p.seg_starts, p.seg_slots, ws[0].ranks)
    torch.cuda.synchronize()
    upd = []
    for _ in range(20):
        t0 = time.perf_counter()
        plan.update(p.seg_starts, p.seg_slots, ws[0].ranks)
        upd.append((time.perf_counter() - t0) * 1e6)
    res["plan_update_host_us"] = statistics.median(upd)
    table = default_table(dev, dtype)
    cfg = table.lookup(h_in, h_out, plan.rank_stride, t, plan.active_segments)
    res["tile_config"] = cfg.__dict__
    res["tile_backend"] = cfg.backend
    res["tile_from_table"] = cfg == table.entries.get(shape_key(h_in, h_out, plan.rank_stride, t, plan.active_segments))

    builders = {}
    for m in methods:
        if m == "atmm":
            builders[m] = [lambda x, y, w=w: atmm_(y, x, plan, w, config=cfg) for w in ws]
        elif m == "atmm_cutlass":  # our CUDA shrink, CUTLASS grouped-GEMM expand forced
            base = (
                cfg
                if cfg.backend != "triton"
                else heuristic_config(h_in, h_out, plan.rank_stride, t, plan.active_segments)
            )
            gcfg = dataclasses.replace(base, grouped="grouped_bf16_m64n128")
            builders[m] = [lambda x, y, w=w: atmm_(y, x, plan, w, config=gcfg) for w in ws]
        elif m == "atmm_nopdl":
            builders[m] = [lambda x, y, w=w: atmm_(y, x, plan, w, config=cfg, pdl=False) for w in ws]
        elif m == "atmm_fused":  # the fused single-launch kernel forced at its heuristic config
            fcfg = fused_heuristic_config(h_out, plan.rank_stride, t, plan.active_segments)
            if fcfg is None:
                res[m] = {"error": f"no fused kernel for rank stride {plan.rank_stride} (> 64)"}
                continue
            res["fused_config"] = fcfg.__dict__
            builders[m] = [lambda x, y, w=w: atmm_(y, x, plan, w, config=fcfg) for w in ws]
        else:
            try:
                builders[m] = [PEERS[m](c) for c, _, _ in sets]
            except Exception as e:  # a peer that cannot run this shape is reported
                res[m] = {"error": f"{type(e).__name__}: {e}"[:300]}
    for m, fns in builders.items():
        try:
            out = y0.clone()
            fns[0](x0, out)
            torch.cuda.synchronize()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            derr = ((out.float() - y0.float() - delta_ref).norm() / delta_ref.norm()).item()
            ys = [y.clone() for _, _, y in sets]
            calls = [lambda f=fns[i % nsets], x=sets[i % nsets][1], y=ys[i % nsets]: f(x, y) for i in range(20)]
            eager = time_eager(calls[0], reps=30)
            g1 = time_graph(calls[:1], reps=50)
            am = time_graph(calls, reps=20)
            res[m] = {"eager_us": eager, "graph1_us": g1, "amortized_us": am, "rel_err_y": err, "rel_err_delta": derr}
        except Exception as e:
            res[m] = {"error": f"{type(e).__name__}: {e}"[:300], "trace": traceback.format_exc()[-600:]}
        torch.cuda.synchronize()
    ours = res.get("atmm", {}).get("amortized_us")
    if ours:
        res["ours_over_floor"] = ours / res["floor_us"]
        best = min(
            (v["amortized_us"] for k, v in res.items() if k in PEERS and isinstance(v, dict) and "amortized_us" in v),
            default=None,
        )
        if res.get("vllm_triton_published_us"):
            best = min(best or 1e9, res["vllm_triton_published_us"])
        if best:
            res["best_peer_over_ours"] = best / ours
    del sets, ws
    torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--suite", default="headline", choices=["quick", "headline", "headline_ranks", "full"])
    ap.add_argument(
        "--methods",
        default="atmm,atmm_nopdl,atmm_cutlass,atmm_fused," + ",".join(PEERS),
        help="atmm = table-dispatched (any backend); atmm_fused = the fused kernel at its heuristic "
        "config; triton_sgmv = the Triton backend at one fixed default config, like vLLM's",
    )
    ap.add_argument("--name", default=None, help="detailed results file (default atmm_<suite>_<run>)")
    ap.add_argument("--suffix", default=None, help="run id of the flat rows file atmm-<run>.json")
    args = ap.parse_args()
    suffix = args.suffix or (run_id(args.name) if args.name and "_" in args.name else None)
    if not suffix:
        commit = git_commit()
        suffix = commit[:7] if commit != "unknown" else args.suite
    name = args.name or f"atmm_{args.suite}_{suffix}"
    methods = args.methods.split(",")
    rows = []
    for spec in suite(args.suite):
        t0 = time.time()
        r = run_case(spec, methods)
        rows.append(r)
        cols = " ".join(
            f"{m}={r[m]['amortized_us']:.1f}" if "amortized_us" in r.get(m, {}) else f"{m}=ERR"
            for m in methods
            if m in r
        )
        print(
            f"{spec['shape']:>12} r{spec['rank']:>5} N={spec['N']:>3} T={spec['T']:>5} {spec['mix']:>8} "
            f"[{r.get('tile_backend', '?')}] "
            f"floor={r['floor_us']:.2f} goal={r['goal_us']:.1f} {cols} ({time.time() - t0:.1f}s)",
            flush=True,
        )
    payload = {"suite": args.suite, "methods": methods, "cases": rows}
    path = save(name, payload)
    flat = write_json(rows_name("atmm", suffix), atmm_rows(payload))[-1]
    print(f"wrote {path} and {flat}")


if __name__ == "__main__":
    main()
