"""Where does the time go at large sizes? Times shrink / expand / switch alone under each grid
policy (persistent, one item per CTA, k CTAs per SM) and, with --once, launches each kernel once
for `ncu --clock-control none` to profile.

    python -m bench.profile_kernels            # policy sweep table
    ncu --clock-control none -k regex:'atmm|switch' python -m bench.profile_kernels --once
"""

from __future__ import annotations

import argparse

import torch

from bench.common import COPY_BW, save
from kernels.timing import time_graph
from kernels.atmm import AtmmPlan, config_id, extension, lora_weights_from_lists
from kernels.switch import LoraTerm, SwitchPlan


def graph_us(fn, ops=10, reps=10):
    """Median µs per call of `fn` repeated `ops` times in one CUDA graph."""
    return time_graph([fn] * ops, reps=reps, warmup=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--once", action="store_true")
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args()
    ext = extension()
    dev = torch.device("cuda")
    t, h, n, r = args.tokens, 4096, 8, 16
    a = [(torch.randn(h, r, device=dev) / 64).bfloat16() for _ in range(n)]
    b = [torch.randn(r, h, device=dev).bfloat16() for _ in range(n)]
    w = lora_weights_from_lists(a, b, [1.0] * n)
    plan = AtmmPlan(64, t, dev).update_from_token_slots(sorted(i % n for i in range(t)), w.ranks)
    x = torch.randn(t, h, device=dev).bfloat16()
    y = torch.randn(t, h, device=dev).bfloat16()
    common = (y, x, plan.meta, plan.seg_cap, w.a_ptrs, w.b_ptrs, w.rank_table, w.scale_table, plan.workspace)
    sh = config_id("shrink_bf16_bt64_bk64_s4_r2")
    sh32 = config_id("shrink_bf16_bt32_bk128_s3_r2")
    ex = config_id("expand_bf16_bt16_bn256")
    ex64 = config_id("expand_bf16_bt64_bn128")
    kernels = {
        "shrink_bt64_split4": lambda: ext.atmm_shrink(*common, sh, 4, 16, plan.tiles[64], True),
        "shrink_bt32_bk128_split4": lambda: ext.atmm_shrink(*common, sh32, 4, 16, plan.tiles[32], True),
        "expand_bt16_bn256": lambda: ext.atmm_expand(*common, ex, 4, 16, plan.tiles[16], True),
        "expand_bt64_bn128": lambda: ext.atmm_expand(*common, ex64, 4, 16, plan.tiles[64], True),
    }
    shapes = [(o, i) for _ in range(4) for o, i in [(4096, 4096)] * 4 + [(11008, 4096)] * 2 + [(4096, 11008)]]
    ws = [torch.randn(o, i, device=dev).bfloat16() for o, i in shapes]
    terms = [
        LoraTerm(
            (torch.randn(i, 16, device=dev) * 0.02).bfloat16(), (torch.randn(16, o, device=dev) * 0.02).bfloat16(), 1.0
        )
        for o, i in shapes
    ]
    wbytes = sum(o * i * 2 for o, i in shapes)
    for cfg in ("switch_bf16_bm128_bn64", "switch_bf16_bm64_bn128"):
        sp = SwitchPlan(ws, terms, [LoraTerm(tt.a, tt.b, -1.0) for tt in terms], config=cfg)
        kernels[cfg] = sp.run
    bytes_ = {
        "shrink_bt64_split4": t * h * 2,
        "shrink_bt32_bk128_split4": t * h * 2,
        "expand_bt16_bn256": 2 * t * h * 2,
        "expand_bt64_bn128": 2 * t * h * 2,
        "switch_bf16_bm128_bn64": 2 * wbytes,
        "switch_bf16_bm64_bn128": 2 * wbytes,
    }
    if args.once:
        for k, f in kernels.items():
            f()
        torch.cuda.synchronize()
        return
    rows = {}
    for pol in (0, -1, 1, 2, 4, 8):
        ext.set_grid_policy(pol)
        for k, f in kernels.items():
            try:
                us = graph_us(f, ops=4 if k.startswith("switch") else 10)
                rows[f"{k}/policy{pol}"] = {
                    "us": us,
                    "TBps": bytes_[k] / us / 1e6,
                    "floor_us": bytes_[k] / COPY_BW * 1e6,
                }
            except RuntimeError as e:
                rows[f"{k}/policy{pol}"] = {"error": str(e)[:200]}
    ext.set_grid_policy(0)
    for k, v in rows.items():
        print(
            f"{k:40s} "
            + (f"{v['us']:9.2f} us {v['TBps']:.2f} TB/s (floor {v['floor_us']:.2f})" if "us" in v else v["error"])
        )
    save("profile_kernels", {"tokens": t, "rows": rows})


if __name__ == "__main__":
    main()
