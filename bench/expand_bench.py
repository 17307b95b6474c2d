"""The decode step's LoRA expand on the GPU: every compiled expand kernel vs a torch peer.

The engine's folded projections (services/worker/atmm_backend.py) get x·A from the base GEMM's
extra columns and run only the expand, `atmm_expand_xa`. This times that op at the §3 workload's
decode shapes (Qwen2-VL-7B, 8 rank-16 adapters on every projection: q|k|v at summed rank 48,
gate|up at 32, o and down at 16; 16 rows, 2 per adapter) for every expand config of the menu
(tensor-core tiles BT x BN <= 256, the CUDA-core kernels BN 512 / 1024) and for a torch peer (one
addmm per segment), each amortized over 20 ops in one CUDA graph on rotating inputs, next to the
HBM floor (B of every used adapter read once, y read and written once).

    python -m bench.expand_bench --name expand-<commit>     # bench/results/<name>.json
"""

from __future__ import annotations

import argparse

import torch

from bench.common import COPY_BW, run_info, write_json
from kernels.atmm import AtmmPlan, extension, lora_weights_from_lists
from kernels.timing import time_graph

# (name, h_in, h_out, rank): the projections (groups) of one Qwen2-VL-7B layer in the §3 workload
SHAPES = [("qkv", 3584, 4608, 48), ("o", 3584, 3584, 16), ("gate_up", 3584, 37888, 32), ("down", 18944, 3584, 16)]


def run_shape(name, h_in, h_out, rank, tokens, adapters, sets=4, ops=20, dtype=torch.bfloat16) -> dict:
    ext = extension()
    dev = torch.device("cuda")
    slots = [t * adapters // tokens for t in range(tokens)]
    cases = []
    for i in range(sets):  # rotating inputs: B and y do not stay in L2 between ops
        g = torch.Generator(device=dev).manual_seed(i)
        b = [torch.randn(rank, h_out, device=dev, generator=g).to(dtype) / rank**0.5 for _ in range(adapters)]
        a = [torch.zeros(h_in, rank, device=dev, dtype=dtype) for _ in range(adapters)]  # unused (x·A given)
        w = lora_weights_from_lists(a, b, [0.5] * adapters)
        xa = torch.randn(tokens, adapters * rank, device=dev, generator=g).to(dtype)
        y = torch.randn(tokens, h_out, device=dev, generator=g).to(dtype)
        cases.append((w, b, xa, y))
    plan = AtmmPlan(max_segments=64, max_tokens=tokens, device=dev).update_from_token_slots(slots, cases[0][0].ranks)
    cols = torch.tensor([k * rank for k in range(cases[0][0].num_slots)], dtype=torch.int32, device=dev)
    # correctness of each timed kernel on set 0 against fp32 math
    w0, b0, xa0, y_set0 = cases[0]
    y0 = y_set0.clone()  # the timed ops add into the sets' y: each check starts from this copy
    want = y0.float().clone()
    for t, k in enumerate(slots):
        want[t] += 0.5 * xa0[t, k * rank : (k + 1) * rank].float() @ b0[k].float()

    def rel(got):
        return ((got.float() - want).norm() / want.norm()).item()

    rows = []
    for cfg in [c for c in ext.configs() if c["kind"] == "expand" and c["dtype"] == "bfloat16"]:

        def op(w, b, xa, y, cfg=cfg):
            ext.atmm_expand_xa(
                y,
                xa,
                cols,
                plan.meta,
                plan.seg_cap,
                w.b_ptrs,
                w.rank_table,
                w.scale_table,
                plan.workspace,
                cfg["id"],
                plan.rank_stride,
                plan.tiles[cfg["bt"]],
                True,
            )

        got = y0.clone()
        op(w0, b0, xa0, got)
        us = time_graph([lambda i=i: op(*cases[i % sets]) for i in range(ops)])
        rows.append(
            {
                "method": cfg["name"],
                "kernel": "cuda_core" if cfg["bn"] > 256 else "tensor_core",
                "us": round(us, 2),
                "rel_err": rel(got),
            }
        )
    starts = [slots.index(k) for k in range(adapters)] + [tokens]

    def torch_op(w, b, xa, y):
        for k in range(adapters):
            r0, r1 = starts[k], starts[k + 1]
            y[r0:r1].addmm_(xa[r0:r1, k * rank : (k + 1) * rank], b[k], alpha=0.5)

    got = y0.clone()
    torch_op(w0, b0, xa0, got)
    us = time_graph([lambda i=i: torch_op(*cases[i % sets]) for i in range(ops)])
    rows.append({"method": "torch_addmm_per_segment", "kernel": "cublas", "us": round(us, 2), "rel_err": rel(got)})
    floor = (2 * adapters * rank * h_out + 2 * 2 * tokens * h_out) / COPY_BW * 1e6
    best = min(r["us"] for r in rows if r["method"] != "torch_addmm_per_segment")
    return {
        "shape": name,
        "h_in": h_in,
        "h_out": h_out,
        "rank": rank,
        "tokens": tokens,
        "adapters": adapters,
        "floor_us": round(floor, 2),
        "best_us": best,
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--name", default=None, help="results file name (bench/results/<name>.json)")
    args = ap.parse_args()
    out = []
    for name, h_in, h_out, rank in SHAPES:
        res = run_shape(name, h_in, h_out, rank, args.tokens, args.adapters)
        out.append(res)
        print(f"{name:8s} {h_in}x{h_out} r{rank}: floor {res['floor_us']:.1f} us")
        for r in sorted(res["rows"], key=lambda r: r["us"]):
            print(f"    {r['method']:28s} {r['us']:8.2f} us  err {r['rel_err']:.1e}")
    per_layer = {
        r["method"]: sum(next(x["us"] for x in s["rows"] if x["method"] == r["method"]) for s in out)
        for r in out[0]["rows"]
    }
    print(
        "per layer (sum of the 4 projections):",
        {k: round(v, 1) for k, v in sorted(per_layer.items(), key=lambda kv: kv[1])},
    )
    write_json(args.name or "expand", {"run": run_info(), "shapes": out, "per_layer_us": per_layer})


if __name__ == "__main__":
    main()
