"""Switcher benchmark (docs/benchmarks.md §2): 7B shape, rank 16, W in one contiguous bf16 buffer.

Times, in one process on the same weights: every compiled bf16 switch kernel config (the original
`switch_bf16_bm*_bn*` and the bandwidth-oriented `*_pipe_*` / `*_regs_*` families) for the
in-place merge, the one-pass switch and the out-of-place pristine merge (W = W0 + s·B·A read from
a pristine copy, what the worker's default strategy runs); torch peers (`addmm_` merge per matrix,
two-pass unmerge+merge, one-pass concat, copy+addmm for the pristine strategy) and PEFT's
`merge()` when peft is importable; drift after `--cycles` switch cycles with the fastest config;
host->GPU pinned copy of one packed adapter. Floor: one read+write pass over W at the measured copy
bandwidth (the same for the out-of-place pass: read W0, write W).

    python -m bench.switch_bench --suffix <commit>     # results/switch_<suffix>.json (detailed)
                                                       # + results/switch-<suffix>.json (flat rows)

The flat rows are issue #5's schema: [{"op": "switch"|"merge", "impl", "ms", "floor_ms"}, ...],
impl = the kernel config name or the peer ("torch_one_pass", "torch_two_pass",
"torch_addmm_merge", "peft_merge").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
from pathlib import Path

import torch

from bench.common import COPY_BW, RESULTS, save
from kernels.switch import DEFAULT_CONFIG, LoraTerm, SwitchPlan, config_max_rank, switch_configs
from kernels.timing import time_eager

# (out, in) of the 7 projections of one Qwen/LLaMA-7B layer
LAYER = [
    ("q", 4096, 4096),
    ("k", 4096, 4096),
    ("v", 4096, 4096),
    ("o", 4096, 4096),
    ("gate", 11008, 4096),
    ("up", 11008, 4096),
    ("down", 4096, 11008),
]


def timed(fn, reps: int) -> float:
    """Median ms of one call."""
    return time_eager(fn, reps=reps, warmup=1) / 1e3


def make_adapter(shapes, r, g, dev):
    return [
        LoraTerm(
            (torch.randn(i, r, device=dev, generator=g) * 0.02).bfloat16(),
            (torch.randn(r, o, device=dev, generator=g) * 0.02).bfloat16(),
            2.0,
        )
        for o, i in shapes
    ]


def fill_buffer(total: int, g: torch.Generator, dev) -> torch.Tensor:
    buf = torch.empty(total, dtype=torch.bfloat16, device=dev)
    for off in range(0, total, 1 << 28):  # fill in chunks (randn on 6.5e9 elements at once needs fp32 temp)
        n = min(1 << 28, total - off)
        buf[off : off + n].normal_(generator=g)
    return buf


def views(buf: torch.Tensor, shapes) -> list[torch.Tensor]:
    out, off = [], 0
    for o, i in shapes:
        out.append(buf[off : off + o * i].view(o, i))
        off += o * i
    return out


def default_suffix() -> str:
    if os.environ.get("VALORA_GIT_COMMIT"):
        return os.environ["VALORA_GIT_COMMIT"][:7]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent.parent,
            capture_output=True,
            text=True,
            check=False,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out or "run"


def peft_merge_ms(ws, terms, reps: int) -> float | str:
    """PEFT's LoraLayer.merge() over every matrix (timed; unmerge between reps, untimed), or why not."""
    try:
        import inspect

        from peft import LoraConfig
        from peft.tuners.lora import Linear as PeftLinear
    except Exception as exc:  # optional peer
        return f"peft not importable: {type(exc).__name__}: {exc}"
    try:
        needs_config = "config" in inspect.signature(PeftLinear.__init__).parameters  # peft >= 0.18
        layers = []
        for w, t in zip(ws, terms):
            base = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
            base.weight = torch.nn.Parameter(w, requires_grad=False)  # a view of the buffer: no copy
            r = t.a.shape[1]
            kw = {"r": r, "lora_alpha": t.scale * r}
            if needs_config:
                kw["config"] = LoraConfig(r=r, lora_alpha=t.scale * r, lora_dropout=0.0)
            lay = PeftLinear(base, "default", **kw)
            with torch.no_grad():
                lay.lora_A["default"].weight.copy_(t.a.t())
                lay.lora_B["default"].weight.copy_(t.b.t())
            layers.append(lay)
        out = []
        with torch.no_grad():
            for rep in range(reps + 1):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                for lay in layers:
                    lay.merge()
                e.record()
                e.synchronize()
                if rep:
                    out.append(s.elapsed_time(e))
                for lay in layers:
                    lay.unmerge()
        torch.cuda.synchronize()
        return statistics.median(out)
    except Exception as exc:  # API drift across peft versions: record, do not fail the run
        return f"peft merge failed: {type(exc).__name__}: {exc}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--cycles", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--configs", default="", help="comma list of switch configs (default: every compiled bf16 one)")
    ap.add_argument("--suffix", default="", help="result file suffix (default: git short commit)")
    ap.add_argument("--no-pristine", action="store_true", help="skip the out-of-place pass (needs a 2nd copy of W)")
    ap.add_argument("--no-peft", action="store_true")
    args = ap.parse_args()
    suffix = args.suffix or default_suffix()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    shapes = [(o, i) for _ in range(args.layers) for _, o, i in LAYER]
    total = sum(o * i for o, i in shapes)
    buf = fill_buffer(total, g, dev)
    ws = views(buf, shapes)
    w0s = None if args.no_pristine else views(fill_buffer(total, g, dev), shapes)
    nbytes = total * 2
    floor_ms = 2 * nbytes / COPY_BW * 1e3
    m_ad = make_adapter(shapes, args.rank, g, dev)
    n_ad = make_adapter(shapes, args.rank, g, dev)
    neg_m = [LoraTerm(t.a, t.b, -t.scale) for t in m_ad]
    configs = [c for c in args.configs.split(",") if c] or switch_configs(torch.bfloat16)
    res = {
        "layers": args.layers,
        "rank": args.rank,
        "weight_bytes": nbytes,
        "floor_ms": floor_ms,
        "default_config": DEFAULT_CONFIG[torch.bfloat16],
        "ours": {},
    }
    print(f"W: {nbytes / 1e9:.2f} GB, floor {floor_ms:.2f} ms; configs: {', '.join(configs)}", flush=True)

    for cfg in configs:
        if 2 * -(-args.rank // 16) * 16 > config_max_rank(cfg):
            print(f"skip {cfg}: rank {args.rank} x 2 above its limit", flush=True)
            continue
        merge = SwitchPlan(ws, m_ad, config=cfg)
        sw = SwitchPlan(ws, n_ad, neg_m, config=cfg)
        tm = timed(merge.run, args.reps)
        ts = timed(sw.run, args.reps)
        row = {
            "merge_ms": tm,
            "switch_ms": ts,
            "switch_over_floor": ts / floor_ms,
            "switch_TBps": 2 * nbytes / ts / 1e9,
            "merge_TBps": 2 * nbytes / tm / 1e9,
        }
        msg = f"ours {cfg}: merge {tm:.2f} ms, one-pass switch {ts:.2f} ms ({row['switch_TBps']:.2f} TB/s)"
        if w0s is not None:
            pristine = SwitchPlan(ws, n_ad, config=cfg, sources=w0s)
            tp = timed(pristine.run, args.reps)
            row.update(pristine_merge_ms=tp, pristine_over_floor=tp / floor_ms)
            msg += f", pristine (out-of-place) merge {tp:.2f} ms"
        res["ours"][cfg] = row
        print(msg, flush=True)

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

    def torch_copy_addmm():  # the pristine strategy in torch: W = W0, then W += s B A
        for w, w0, b, a in zip(ws, w0s, bt_n, at_n):
            w.copy_(w0)
            w.addmm_(b, a, alpha=2.0)

    res["torch_addmm_merge_ms"] = timed(torch_merge, args.reps)
    res["torch_two_pass_ms"] = timed(torch_two_pass, max(3, args.reps // 2))
    res["torch_one_pass_ms"] = timed(torch_one_pass, args.reps)
    if w0s is not None:
        res["torch_copy_addmm_ms"] = timed(torch_copy_addmm, max(3, args.reps // 2))
    print(
        f"torch addmm_ merge {res['torch_addmm_merge_ms']:.2f} ms, two-pass {res['torch_two_pass_ms']:.2f} ms, "
        f"one-pass {res['torch_one_pass_ms']:.2f} ms"
        + (f", copy+addmm {res['torch_copy_addmm_ms']:.2f} ms" if w0s is not None else ""),
        flush=True,
    )
    if not args.no_peft:
        p = peft_merge_ms(ws, n_ad, max(3, args.reps // 2))
        res["peft_merge_ms" if isinstance(p, float) else "peft_merge_error"] = p
        print(f"peft merge: {p if isinstance(p, str) else f'{p:.2f} ms'}", flush=True)

    best = min(res["ours"], key=lambda c: res["ours"][c]["switch_ms"]) if res["ours"] else None
    res["best_config"] = best

    # drift: one layer, W0 + m merged; `cycles` x (switch m->n, switch n->m); compare with a fresh merge of m
    lw0 = [torch.randn(o, i, device=dev, generator=g).bfloat16() for _, o, i in LAYER]
    la_m = make_adapter([(o, i) for _, o, i in LAYER], args.rank, g, dev)
    la_n = make_adapter([(o, i) for _, o, i in LAYER], args.rank, g, dev)
    fresh = [w.clone() for w in lw0]
    SwitchPlan(fresh, la_m, config=best).run()
    ref32 = [(w.float() + 2.0 * (t.a.float() @ t.b.float()).t()) for w, t in zip(lw0, la_m)]
    drift = {}
    for impl in ("ours", "torch_one_pass"):
        cur = [w.clone() for w in fresh]
        if impl == "ours":
            to_n = SwitchPlan(cur, la_n, [LoraTerm(t.a, t.b, -t.scale) for t in la_m], config=best)
            to_m = SwitchPlan(cur, la_m, [LoraTerm(t.a, t.b, -t.scale) for t in la_n], config=best)
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
        drift[impl] = {
            "cycles": args.cycles,
            "max_abs_vs_fresh_merge": diff,
            "rel_err_vs_fp32": rel,
            "fresh_merge_rel_err_vs_fp32": rel_fresh,
            "fraction_elements_changed": changed,
        }
        if impl == "ours":
            drift[impl]["config"] = best
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
    path = save(f"switch_{suffix}", res)
    rows_path = write_rows(res, suffix)
    print(f"wrote {path} and {rows_path}")
    if best is not None:
        b = res["ours"][best]
        print(
            f"best: {best} switch {b['switch_ms']:.2f} ms = {b['switch_over_floor']:.2f}x floor "
            f"(DEFAULT_CONFIG is {res['default_config']})"
        )


def flat_rows(res: dict) -> list[dict]:
    """Issue #5's rows: every config and every peer, switch and merge."""
    floor = res["floor_ms"]
    rows = []
    for cfg, r in res["ours"].items():
        rows.append({"op": "switch", "impl": cfg, "ms": r["switch_ms"], "floor_ms": floor})
        rows.append({"op": "merge", "impl": cfg, "ms": r["merge_ms"], "floor_ms": floor})
    for op, impl, key in (
        ("switch", "torch_one_pass", "torch_one_pass_ms"),
        ("switch", "torch_two_pass", "torch_two_pass_ms"),
        ("merge", "torch_addmm_merge", "torch_addmm_merge_ms"),
        ("merge", "peft_merge", "peft_merge_ms"),
    ):
        if isinstance(res.get(key), float):
            rows.append({"op": op, "impl": impl, "ms": res[key], "floor_ms": floor})
    return rows


def write_rows(res: dict, suffix: str) -> Path:
    """bench/results/switch-<suffix>.json (and a copy under $OUT when set)."""
    text = json.dumps(flat_rows(res), indent=1) + "\n"
    paths = [RESULTS / f"switch-{suffix}.json"]
    if os.environ.get("OUT"):
        paths.append(Path(os.environ["OUT"]) / f"switch-{suffix}.json")
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return paths[0]


if __name__ == "__main__":
    main()
