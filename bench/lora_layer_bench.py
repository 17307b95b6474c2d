"""What the multi-LoRA term costs on top of each projection GEMM of a decoder layer, at the engine's
shapes (docs/benchmarks.md §3: Qwen2-VL-7B, 8 rank-16 adapters mixed, a prefill of 16 x 289 tokens and
a decode step of 16 tokens), by method — the numbers behind the engine's mixed-vs-base gap.

Per projection (q|k|v and gate|up as the engine's LoraGroups, o, down) and token count, µs per
layer replayed from a CUDA graph over `--layers` copies of the weights (no L2 reuse between
layers, as in the model):
- base:       the projection GEMM alone (F.linear, bias where Qwen2 has one);
- atmm:       base, then ATMM over the group's block-diagonal factors (what the engine runs);
- atmm_parts: base, then ATMM per part into column views (no zero blocks);
- dense:      base, then t = x·[A_1..A_n] (one GEMM), t *= row mask, y += t·[s·B_1; ..; s·B_n]
              (cuBLAS; per part for groups);
- dense_pre:  y = t·[s·B] (+ bias) written first, then y += x·W^T with cuBLAS' beta = 1 (the LoRA
              term is never read back separately: the base GEMM's epilogue reads it).
Each method's output is checked against the fp32 reference.

    python -m bench.lora_layer_bench            # H200: results/lora_layer-<commit>.json
"""

from __future__ import annotations

import argparse

import torch

from bench.common import save
from kernels.atmm import AtmmPlan, atmm_, lora_weights_from_lists
from kernels.reference import SegmentPlan
from kernels.results import git_commit
from kernels.timing import time_graph
from services.worker.lora import AdapterEntry, group_tensors

# name -> (h_in, part widths, bias)  (Qwen2-VL-7B)
PROJECTIONS = {
    "qkv": (3584, (3584, 512, 512), True),
    "o": (3584, (3584,), False),
    "gate_up": (3584, (18944, 18944), False),
    "down": (18944, (3584,), False),
}


def bench_projection(name: str, tokens: int, n_adapters: int, rank: int, layers: int, dev, dt) -> dict:
    h_in, widths, has_bias = PROJECTIONS[name]
    h_out = sum(widths)
    g = torch.Generator(device=dev).manual_seed(0)
    per = tokens // n_adapters
    slots = [k for k in range(n_adapters) for _ in range(per)] + [n_adapters - 1] * (tokens - per * n_adapters)
    plan_host = SegmentPlan.from_token_slots(slots)
    scale = 2.0
    mats = []
    for _ in range(layers):
        w = torch.randn(h_out, h_in, device=dev, dtype=dt, generator=g) * h_in**-0.5
        bias = torch.randn(h_out, device=dev, dtype=dt, generator=g) if has_bias else None
        # per adapter, per part: A (h_in, r), B (r, width)
        a = [
            [torch.randn(h_in, rank, device=dev, dtype=dt, generator=g) * h_in**-0.5 for _ in widths]
            for _ in range(n_adapters)
        ]
        b = [
            [torch.randn(rank, wd, device=dev, dtype=dt, generator=g) * rank**-0.5 for wd in widths]
            for _ in range(n_adapters)
        ]
        parts_keys = tuple((0, f"p{p}") for p in range(len(widths)))  # the engine's group factors
        grp = [
            group_tensors(
                AdapterEntry(dict(zip(parts_keys, a[k])), dict(zip(parts_keys, b[k])), scale), parts_keys, widths
            )
            for k in range(n_adapters)
        ]
        grp_a = [t[0] for t in grp]
        weights = lora_weights_from_lists(grp_a, [t[1] for t in grp], [1.0] * n_adapters)
        parts = [
            lora_weights_from_lists(
                [a[k][p] for k in range(n_adapters)], [b[k][p] for k in range(n_adapters)], [scale] * n_adapters
            )
            for p in range(len(widths))
        ]
        # dense: A_all (h_in, n*Σr) with each adapter's parts adjacent; per part B_all (n*r, width), s folded
        a_all = torch.cat(grp_a, 1).contiguous()
        b_all = [
            torch.cat([(b[k][p].float() * scale).to(dt) for k in range(n_adapters)], 0).contiguous()
            for p in range(len(widths))
        ]
        mats.append(dict(w=w, bias=bias, a=a, b=b, weights=weights, parts=parts, a_all=a_all, b_all=b_all))
    x = torch.randn(tokens, h_in, device=dev, dtype=dt, generator=g)
    y = torch.empty(tokens, h_out, device=dev, dtype=dt)
    gr = rank * len(widths)
    # row mask of the dense path: token i keeps only its adapter's columns of t (n * Σr)
    mask = torch.zeros(tokens, n_adapters * gr, device=dev, dtype=dt)
    for i, k in enumerate(slots):
        mask[i, k * gr : (k + 1) * gr] = 1
    t = torch.empty(tokens, n_adapters * gr, device=dev, dtype=dt)
    plan = AtmmPlan(64, max(tokens, 16), dev)
    plan.update(plan_host.seg_starts, plan_host.seg_slots, [gr] * n_adapters)
    part_plan = AtmmPlan(64, max(tokens, 16), dev)
    part_plan.update(plan_host.seg_starts, plan_host.seg_slots, [rank] * n_adapters)
    cols = [slice(sum(widths[:p]), sum(widths[: p + 1])) for p in range(len(widths))]

    def base_only(m):
        return lambda: (
            torch.matmul(x, m["w"].t(), out=y) if m["bias"] is None else torch.addmm(m["bias"], x, m["w"].t(), out=y)
        )

    def atmm(m):
        def f():
            base_only(m)()
            atmm_(y, x, plan, m["weights"])

        return f

    def atmm_parts(m):
        def f():
            base_only(m)()
            for p, c in enumerate(cols):
                atmm_(y[:, c], x, part_plan, m["parts"][p])

        return f

    def shrink(m):
        torch.matmul(x, m["a_all"], out=t)
        t.mul_(mask)

    def t_part(p):  # the part's columns of t, adapter by adapter: (T, n*r) view via reshape of blocks
        return t.view(tokens, n_adapters, len(widths), rank)[:, :, p, :].reshape(tokens, n_adapters * rank)

    def dense(m):
        def f():
            base_only(m)()
            shrink(m)
            for p, c in enumerate(cols):
                y[:, c].addmm_(t_part(p), m["b_all"][p])

        return f

    def dense_pre(m):
        def f():
            shrink(m)
            for p, c in enumerate(cols):
                y[:, c].addmm_(t_part(p), m["b_all"][p], beta=0)  # written, not read
                if m["bias"] is not None:
                    y[:, c].add_(m["bias"][c])
            y.addmm_(x, m["w"].t())

        return f

    def reference(m):
        out = x.float() @ m["w"].float().t() + (m["bias"].float() if m["bias"] is not None else 0)
        for k in range(n_adapters):
            seg = slice(plan_host.seg_starts[k], plan_host.seg_starts[k + 1])
            for p, c in enumerate(cols):
                out[seg, c] += scale * (x[seg].float() @ m["a"][k][p].float()) @ m["b"][k][p].float()
        return out

    ref = reference(mats[0])
    row = {"projection": name, "tokens": tokens, "adapters": n_adapters, "rank": rank, "h_in": h_in, "h_out": h_out}
    for method, make in (
        ("base", base_only),
        ("atmm", atmm),
        ("atmm_parts", atmm_parts),
        ("dense", dense),
        ("dense_pre", dense_pre),
    ):
        try:
            make(mats[0])()
            torch.cuda.synchronize()
            err = ((y.float() - ref).norm() / ref.norm()).item()
            us = time_graph([make(m) for m in mats], reps=20)
            row[method] = {"us": round(us, 2), "relerr": err}
        except Exception as exc:  # one failing method must not lose the others' numbers
            row[method] = {"error": repr(exc)[:300]}
    for method in ("atmm", "atmm_parts", "dense", "dense_pre"):
        if "us" in row[method] and "us" in row["base"]:
            row[method]["lora_us"] = round(row[method]["us"] - row["base"]["us"], 2)
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="16,4624")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4, help="weight copies cycled through (defeats L2 reuse)")
    ap.add_argument("--projections", default=",".join(PROJECTIONS))
    ap.add_argument("--name", default=None)
    args = ap.parse_args(argv)
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    for tokens in (int(v) for v in args.tokens.split(",")):
        for name in args.projections.split(","):
            row = bench_projection(name, tokens, args.adapters, args.rank, args.layers, dev, dt)
            rows.append(row)
            print(
                f"T={tokens:5d} {name:8s} "
                + "  ".join(
                    f"{m} {row[m].get('us', float('nan')):8.1f}"
                    for m in ("base", "atmm", "atmm_parts", "dense", "dense_pre")
                ),
                flush=True,
            )
        per_layer = {
            m: round(sum(r[m].get("lora_us", 0.0) for r in rows if r["tokens"] == tokens), 1)
            for m in ("atmm", "atmm_parts", "dense", "dense_pre")
        }
        print(f"T={tokens:5d} LoRA µs per layer: {per_layer}  (x28 layers)", flush=True)
    save(args.name or f"lora_layer-{git_commit()[:7]}", {"rows": rows})
    return rows


if __name__ == "__main__":
    main()
