"""Switcher benchmark (BENCHMARKS.md §2): 7B shape, rank 16, W in one contiguous bf16 buffer.

Times: ours (merge, one-pass switch; each kernel config) vs torch `addmm_` per matrix, torch
two-pass unmerge+merge, torch one-pass concat; drift after 1000 switch cycles; host->GPU pinned
copy of one packed adapter. Floor: one read+write pass over W at the measured copy bandwidth.

    python -m bench.switch_bench          # results/switch.json
"""

from __future__ import annotations

import argparse

import torch

from bench.common import COPY_BW, save
from kernels.switch import LoraTerm, SwitchPlan
from kernels.timing import time_eager

# (out, in) of the 7 projections of one Qwen/LLaMA-7B layer
LAYER = [("q", 4096, 4096), ("k", 4096, 4096), ("v", 4096, 4096), ("o", 4096, 4096),
         ("gate", 11008, 4096), ("up", 11008, 4096), ("down", 4096, 11008)]


def timed(fn, reps: int) -> float:
    """Median ms of one call."""
    return time_eager(fn, reps=reps, warmup=1) / 1e3


def make_adapter(shapes, r, g, dev):
    return [LoraTerm((torch.randn(i, r, device=dev, generator=g) * 0.02).bfloat16(),
                     (torch.randn(r, o, device=dev, generator=g) * 0.02).bfloat16(), 2.0) for o, i in shapes]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--cycles", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    shapes = [(o, i) for _ in range(args.layers) for _, o, i in LAYER]
    total = sum(o * i for o, i in shapes)
    buf = torch.empty(total, dtype=torch.bfloat16, device=dev)
    for off in range(0, total, 1 << 28):  # fill in chunks (randn on 6.5e9 elements at once needs fp32 temp)
        n = min(1 << 28, total - off)
        buf[off:off + n].normal_(generator=g)
    ws, off = [], 0
    for o, i in shapes:
        ws.append(buf[off:off + o * i].view(o, i))
        off += o * i
    nbytes = total * 2
    floor_ms = 2 * nbytes / COPY_BW * 1e3
    m_ad = make_adapter(shapes, args.rank, g, dev)
    n_ad = make_adapter(shapes, args.rank, g, dev)
    res = {"layers": args.layers, "rank": args.rank, "weight_bytes": nbytes, "floor_ms": floor_ms, "ours": {}}
    print(f"W: {nbytes / 1e9:.2f} GB, floor {floor_ms:.2f} ms", flush=True)

    for cfg in ("switch_bf16_bm64_bn128", "switch_bf16_bm128_bn64", "switch_bf16_bm32_bn256", "switch_bf16_bm64_bn64"):
        merge = SwitchPlan(ws, m_ad, config=cfg)
        sw = SwitchPlan(ws, n_ad, [LoraTerm(t.a, t.b, -t.scale) for t in m_ad], config=cfg)
        tm = timed(merge.run, args.reps)
        ts = timed(sw.run, args.reps)
        res["ours"][cfg] = {"merge_ms": tm, "switch_ms": ts, "switch_over_floor": ts / floor_ms,
                            "switch_TBps": 2 * nbytes / ts / 1e9}
        print(f"ours {cfg}: merge {tm:.2f} ms, one-pass switch {ts:.2f} ms ({2 * nbytes / ts / 1e9:.2f} TB/s)",
              flush=True)

    bt_m = [t.b.t() for t in m_ad]  # PEFT layout views: B (out, r), A (r, in)
    at_m = [t.a.t() for t in m_ad]
    bt_n = [t.b.t() for t in n_ad]
    at_n = [t.a.t() for t in n_ad]

    def torch_merge():
        for w, b, a in zip(ws, bt_n, at_n):
            w.addmm_(b, a, alpha=2.0)

    def torch_two_pass():
        for w, b, a in zip(ws, bt_m, at_m):
            w.addmm_(b, a, alpha=-2.0)
        for w, b, a in zip(ws, bt_n, at_n):
            w.addmm_(b, a, alpha=2.0)

    cat_b = [torch.cat([bn * 2.0, -2.0 * bm], 1).contiguous() for bn, bm in zip(bt_n, bt_m)]
    cat_a = [torch.cat([an, am], 0).contiguous() for an, am in zip(at_n, at_m)]

    def torch_one_pass():
        for w, b, a in zip(ws, cat_b, cat_a):
            w.addmm_(b, a)

    res["torch_addmm_merge_ms"] = timed(torch_merge, args.reps)
    res["torch_two_pass_ms"] = timed(torch_two_pass, max(3, args.reps // 2))
    res["torch_one_pass_ms"] = timed(torch_one_pass, args.reps)
    print(f"torch addmm_ merge {res['torch_addmm_merge_ms']:.2f} ms, two-pass {res['torch_two_pass_ms']:.2f} ms, "
          f"one-pass {res['torch_one_pass_ms']:.2f} ms", flush=True)

    # drift: one layer, W0 + m merged; `cycles` x (switch m->n, switch n->m); compare with a fresh merge of m
    lw0 = [torch.randn(o, i, device=dev, generator=g).bfloat16() for _, o, i in LAYER]
    la_m = make_adapter([(o, i) for _, o, i in LAYER], args.rank, g, dev)
    la_n = make_adapter([(o, i) for _, o, i in LAYER], args.rank, g, dev)
    fresh = [w.clone() for w in lw0]
    SwitchPlan(fresh, la_m).run()
    ref32 = [(w.float() + 2.0 * (t.a.float() @ t.b.float()).t()) for w, t in zip(lw0, la_m)]
    drift = {}
    for impl in ("ours", "torch_one_pass"):
        cur = [w.clone() for w in fresh]
        if impl == "ours":
            to_n = SwitchPlan(cur, la_n, [LoraTerm(t.a, t.b, -t.scale) for t in la_m])
            to_m = SwitchPlan(cur, la_m, [LoraTerm(t.a, t.b, -t.scale) for t in la_n])
            step_n, step_m = to_n.run, to_m.run
        else:
            cb_n = [torch.cat([2.0 * n.b.t(), -2.0 * m.b.t()], 1) for n, m in zip(la_n, la_m)]
            ca_n = [torch.cat([n.a.t(), m.a.t()], 0) for n, m in zip(la_n, la_m)]
            cb_m = [torch.cat([2.0 * m.b.t(), -2.0 * n.b.t()], 1) for n, m in zip(la_n, la_m)]
            ca_m = [torch.cat([m.a.t(), n.a.t()], 0) for n, m in zip(la_n, la_m)]

            def step_n():
                for w, b, a in zip(cur, cb_n, ca_n):
                    w.addmm_(b, a)

            def step_m():
                for w, b, a in zip(cur, cb_m, ca_m):
                    w.addmm_(b, a)
        for _ in range(args.cycles):
            step_n()
            step_m()
        torch.cuda.synchronize()
        diff = max((c.float() - f.float()).abs().max().item() for c, f in zip(cur, fresh))
        rel = max(((c.float() - r).norm() / r.norm()).item() for c, r in zip(cur, ref32))
        rel_fresh = max(((f.float() - r).norm() / r.norm()).item() for f, r in zip(fresh, ref32))
        changed = sum(int((c != f).sum().item()) for c, f in zip(cur, fresh)) / sum(f.numel() for f in fresh)
        drift[impl] = {"cycles": args.cycles, "max_abs_vs_fresh_merge": diff, "rel_err_vs_fp32": rel,
                       "fresh_merge_rel_err_vs_fp32": rel_fresh, "fraction_elements_changed": changed}
        print(f"drift {impl}: {drift[impl]}", flush=True)
    res["drift"] = drift

    # host->GPU swap of one adapter (A, B of all 7 projections x layers), one packed pinned copy
    ad_bytes = sum(2 * (o + i) * args.rank for o, i in shapes)
    host = torch.empty(ad_bytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    dst = torch.empty(ad_bytes, dtype=torch.uint8, device=dev)
    ms = timed(lambda: dst.copy_(host, non_blocking=True), args.reps)
    res["h2d_adapter"] = {"bytes": ad_bytes, "ms": ms, "GBps": ad_bytes / ms / 1e6}
    print(f"h2d adapter {ad_bytes / 1e6:.1f} MB: {ms:.2f} ms ({ad_bytes / ms / 1e6:.1f} GB/s)", flush=True)
    path = save("switch", res)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
