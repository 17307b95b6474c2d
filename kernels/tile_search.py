"""Offline tile search: time every precompiled ATMM configuration per shape bucket, keep the best.

For each bucket (h_in, h_out, rank stride, token bucket, segment bucket) a representative batch
is built (T tokens spread uniformly over S adapters) and every shrink kernel of the menu that
fits (rank block, shared-memory limit, BK multiple of 64, split-K with K chunks >= BK and a
workspace that fits) is timed in a CUDA graph over rotating inputs; then every expand kernel
with the winning split-K, and alone on given x·A (the engine's folded projections' launch, which
picks the own expand's tiles), and that pair is timed. The Triton backend's menu
(`kernels.triton_sgmv.TRITON_MENU`, each at its default split-K, then other split-Ks for the
best shape) is timed the same way (whole shrink+expand through `atmm_`, in a CUDA graph). For
token counts up to --fused-max-tokens the fused single-launch kernels (`fused_*` entries of the
menu: BT x BN x rank block x cluster size) are timed too: every one whose shared memory fits and
whose token tile suits the segments, at the column-group count that gives about one CTA per SM,
then every useful group count for the two fastest. The fastest op of any backend wins the
bucket. The winners form the tile table, written as JSON keyed by GPU/arch/dtype
(kernels/tile_tables/). A validation pass times shapes between buckets exhaustively and reports
the gap between the table's pick (and the heuristic's) and the true best.

    python -m kernels.tile_search --budget-s 120
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch

from kernels import triton_sgmv
from kernels.atmm import (
    AtmmPlan,
    atmm_,
    config_id,
    extension,
    fused_launch_args,
    lora_weights_from_lists,
    triton_available,
)
from kernels.results import write_results
from kernels.timing import time_graph
from kernels.tile_table import (
    FMA_EXPAND_MAX_TOKENS,
    FMA_EXPAND_MIN_BN,
    FUSED_MAX_RANK_BLOCK,
    SPLIT_K_MENU,
    TABLE_DIR,
    TileConfig,
    TileTable,
    default_fused_groups,
    find_table,
    fused_group_options,
    heuristic_config,
    rank_block,
    segment_bucket,
    shape_key,
    table_filename,
)

# Qwen2-VL-7B (q/o, k/v, gate/up, down) and LLaMA-7B projections
MODEL_SHAPES = [(4096, 4096), (4096, 11008), (11008, 4096), (3584, 3584), (3584, 512), (3584, 18944), (18944, 3584)]


class Bench:
    """One representative batch (rotating input sets) and timers for shrink/expand candidates."""

    def __init__(self, h_in, h_out, rank, tokens, segments, dtype, seed=0):
        self.ext = extension()
        dev = torch.device("cuda")
        rng = random.Random(seed)
        slots = sorted(rng.randrange(segments) for _ in range(tokens))
        slots[: min(tokens, segments)] = list(range(min(tokens, segments)))  # every adapter used
        slots.sort()
        set_bytes = 2 * tokens * (h_in + h_out) + 2 * segments * rank * (h_in + h_out)
        self.nsets = int(min(8, max(2, math.ceil(120e6 / set_bytes))))
        g = torch.Generator(device=dev).manual_seed(seed)
        self.sets = []
        for _ in range(self.nsets):
            a = [(torch.randn(h_in, rank, device=dev, generator=g) / h_in**0.5).to(dtype) for _ in range(segments)]
            b = [torch.randn(rank, h_out, device=dev, generator=g).to(dtype) for _ in range(segments)]
            w = lora_weights_from_lists(a, b, [1.0] * segments)
            self.sets.append(
                (
                    w,
                    torch.randn(tokens, h_in, device=dev, dtype=dtype, generator=None),
                    torch.randn(tokens, h_out, device=dev, dtype=dtype),
                )
            )
        # x·A as the folded projections get it (extra columns of the base GEMM's output, slot k at k * rank)
        self.xa = [torch.randn(tokens, segments * rank, device=dev, dtype=dtype) for _ in range(self.nsets)]
        self.xa_cols = torch.tensor([k * rank for k in range(self.sets[0][0].num_slots)], dtype=torch.int32, device=dev)
        self.plan = AtmmPlan(max_segments=max(64, segments), max_tokens=tokens, device=dev)
        self.plan.update_from_token_slots(slots, self.sets[0][0].ranks)
        self.h_in, self.tokens = h_in, tokens
        torch.cuda.synchronize()

    def _time(self, launch, ops=10, reps=10) -> float:
        """Median µs per op of `ops` launches over rotating input sets, replayed from one CUDA graph."""
        return self._time_sets(lambda i: launch(*self.sets[i]), ops, reps)

    def _time_sets(self, launch, ops=10, reps=10) -> float:
        """As `_time`, for a launch that takes the input set's index (to reach per-set extras)."""
        return time_graph([lambda i=i: launch(i % self.nsets) for i in range(ops)], reps=reps, warmup=1)

    def _args(self, w, x, y, split_k):
        p = self.plan
        return (y, x, p.meta, p.seg_cap, w.a_ptrs, w.b_ptrs, w.rank_table, w.scale_table, p.workspace)

    def time_shrink(self, cfg: dict, split_k: int) -> float:
        p = self.plan
        return self._time(
            lambda w, x, y: self.ext.atmm_shrink(
                *self._args(w, x, y, split_k), cfg["id"], split_k, p.rank_stride, p.tiles[cfg["bt"]], True
            )
        )

    def time_expand(self, cfg: dict, split_k: int) -> float:
        p = self.plan
        return self._time(
            lambda w, x, y: self.ext.atmm_expand(
                *self._args(w, x, y, split_k), cfg["id"], split_k, p.rank_stride, p.tiles[cfg["bt"]], True
            )
        )

    def time_expand_xa(self, cfg: dict) -> float:
        """The expand alone on given x·A (atmm_expand_xa): what the engine's folded projections run."""
        p = self.plan
        return self._time_sets(
            lambda i: self.ext.atmm_expand_xa(
                self.sets[i][2],
                self.xa[i],
                self.xa_cols,
                p.meta,
                p.seg_cap,
                self.sets[i][0].b_ptrs,
                self.sets[i][0].rank_table,
                self.sets[i][0].scale_table,
                p.workspace,
                cfg["id"],
                p.rank_stride,
                p.tiles[cfg["bt"]],
                True,
            )
        )

    def time_grouped(self, cfg: dict, split_k: int) -> float:
        p = self.plan
        return self._time(
            lambda w, x, y: self.ext.atmm_grouped_expand(
                *self._args(w, x, y, split_k), p.aux, cfg["id"], split_k, p.rank_stride
            )
        )

    def time_fused(self, tc: TileConfig, cfg_id: int, h_out: int) -> float:
        """One fused launch (shrink + expand) per op, as kernels.atmm launches it."""
        p = self.plan
        groups, tiles = fused_launch_args(tc, h_out, p)
        return self._time(
            lambda w, x, y: self.ext.atmm_shrink(
                *self._args(w, x, y, groups), cfg_id, groups, p.rank_stride, tiles, True
            )
        )

    def time_pair(self, tc: TileConfig, dtype: str) -> float:
        p = self.plan
        if tc.backend in ("triton", "fused"):
            return self._time(lambda w, x, y: atmm_(y, x, p, w, config=tc))
        sid = config_id(tc.shrink_name(dtype, rank_block(p.rank_stride)))
        eid = config_id(tc.expand_name(dtype))
        split_k = tc.split_k
        while split_k > 1 and split_k * self.tokens * p.rank_stride > p.workspace.numel():
            split_k //= 2  # as kernels.atmm does: the workspace bounds split-K
        if tc.grouped:
            gid = config_id(tc.grouped)
            return self._time(
                lambda w, x, y: self.ext.atmm_grouped(
                    *self._args(w, x, y, split_k), p.aux, sid, gid, split_k, p.rank_stride, p.tiles[tc.shrink_bt], True
                )
            )
        return self._time(
            lambda w, x, y: self.ext.atmm(
                *self._args(w, x, y, split_k),
                sid,
                eid,
                split_k,
                p.rank_stride,
                p.tiles[tc.shrink_bt],
                p.tiles[tc.expand_bt],
                True,
            )
        )


def seg_cache_bytes(cap: int) -> int:
    """Shared memory every ATMM kernel adds for the plan's segments (csrc/atmm_api.h)."""
    return (cap * 8 + (cap + 1) * 8 + cap * 8 + 127) & ~127


def candidates(ext, dtype: str, rank_stride: int, h_in: int, tokens: int, ws_floats: int, smem_limit: int):
    cfgs = ext.configs()
    rb = rank_block(rank_stride)
    shr = [
        c
        for c in cfgs
        if c["kind"] == "shrink"
        and c["name"].startswith("shrink_")
        and c["dtype"] == dtype
        and c["rb"] == rb
        and c["smem_r16"] <= smem_limit
        and c["bt"] <= max(16, 2 * tokens)
    ]
    exp = [
        c
        for c in cfgs
        if c["kind"] == "expand"
        and c["dtype"] == dtype
        and c["bt"] <= max(16, 2 * tokens)
        and (c["bn"] < FMA_EXPAND_MIN_BN or tokens <= FMA_EXPAND_MAX_TOKENS)
    ]
    exp += [c for c in cfgs if c["kind"] == "grouped_expand" and c["dtype"] == dtype and tokens >= 256]
    splits = [s for s in SPLIT_K_MENU if h_in // s >= 64 and s * tokens * rank_stride <= ws_floats]
    return shr, exp, splits


def fused_candidates(
    ext, dtype: str, rank_stride: int, tokens: int, segments: int, seg_cap: int, smem_limit: int
) -> list[dict]:
    """Fused menu entries worth timing for one bucket: this rank block, shared memory (body + the
    plan's segment cache for `seg_cap`) within the GPU's per-block limit, token tile no larger than
    twice the average segment (a 64-token tile over 2-token segments computes zeros)."""
    rb = rank_block(rank_stride)
    if rb > FUSED_MAX_RANK_BLOCK:
        return []
    avg = tokens / max(1, segments)
    return [
        c
        for c in ext.configs()
        if c["name"].startswith("fused_")
        and c["dtype"] == dtype
        and c["rb"] == rb
        and c["smem_r16"] + seg_cache_bytes(seg_cap) <= smem_limit
        and c["bt"] <= max(16, 2 * avg)
    ]


def search_fused(b: Bench, h_out: int, tokens: int, segments: int, dname: str, smem_limit: int):
    """Time the fused menu (each config at its default group count, then every group count for
    the two fastest configs). Returns ([(TileConfig, us)], [errors])."""
    p = b.plan
    out, errors = [], []
    cfgs = fused_candidates(b.ext, dname, p.rank_stride, tokens, segments, p.seg_cap, smem_limit)

    def one(c, groups):
        tc = TileConfig.fused(c["bt"], c["bn"], c["bm"], groups)  # bm carries the cluster size
        try:
            out.append((tc, b.time_fused(tc, c["id"], h_out), c))
        except Exception as e:  # e.g. a cluster that cannot be scheduled: pruned
            errors.append(f"{c['name']} g{groups}: {type(e).__name__}: {e}"[:300])

    for c in cfgs:
        one(c, default_fused_groups(h_out, c["bn"], c["bm"], p.tiles[c["bt"]]))
    for tc, _, c in sorted(out, key=lambda v: v[1])[:2]:
        for g in fused_group_options(h_out, c["bn"], c["bm"], p.tiles[c["bt"]]):
            if g != tc.split_k:
                one(c, g)
    return [(tc, us) for tc, us, _ in out], errors


def search_bucket(
    h_in,
    h_out,
    rank,
    tokens,
    segments,
    dtype: torch.dtype,
    smem_limit: int,
    backends: tuple[str, ...] = ("cuda", "triton", "fused"),
    fused_max_tokens: int = 256,
):
    """Best config over every backend's candidates for one bucket: our CUDA shrink with our own or
    the CUTLASS grouped expand (searched stage by stage, then the pair timed), the Triton SGMV
    menu and, up to `fused_max_tokens` tokens, the fused single-launch kernels; the fastest op
    wins. Returns (config, stats, bench)."""
    dname = "bfloat16" if dtype == torch.bfloat16 else "float16"
    b = Bench(h_in, h_out, rank, tokens, segments, dtype)
    rs = b.plan.rank_stride
    shr, exp, splits = candidates(b.ext, dname, rs, h_in, tokens, b.plan.workspace.numel(), smem_limit)
    shrink_times, expand_times = {}, {}
    for c in shr:
        for s in splits:
            try:
                shrink_times[(c["name"], s)] = (b.time_shrink(c, s), c, s)
            except RuntimeError:  # e.g. over the shared-memory limit: pruned
                pass
    (st, sc, ss) = min(shrink_times.values(), key=lambda v: v[0])
    for c in exp:
        try:
            t = b.time_grouped(c, ss) if c["kind"] == "grouped_expand" else b.time_expand(c, ss)
            expand_times[c["name"]] = (t, c)
        except RuntimeError:
            pass
    own = {k: v for k, v in expand_times.items() if v[1]["kind"] == "expand"}
    (et, ec) = min(expand_times.values(), key=lambda v: v[0])
    # the table's own-expand tiles also serve the folded projections' expand-only launch
    # (atmm_expand_xa, x·A from the base GEMM), which the engine runs wherever the table names our
    # kernels: pick them on that launch (on the workspace path above, split-K partials sums blur it)
    xa_times = {}
    for name, (_, c) in own.items():
        try:
            xa_times[name] = (b.time_expand_xa(c), c)
        except RuntimeError:
            pass
    (xt, oc) = min((xa_times or own).values(), key=lambda v: v[0])
    grouped = ec["name"] if ec["kind"] == "grouped_expand" else ""
    best = TileConfig(sc["bt"], sc["bk"], sc["stages"], ss, oc["bt"], oc["bn"], grouped)
    pair = b.time_pair(best, dname)
    stats = {
        "shrink_us": st,
        "expand_us": et,
        "expand_xa_us": xt,
        "expand_xa_config": oc["name"],
        "cuda_pair_us": pair,
        "cuda_backend": best.backend,
        "candidates": len(shrink_times) + len(expand_times),
        "tokens": tokens,
        "segments": segments,
        "rank": rank,
    }
    if "triton" in backends and triton_available():
        tri, errors = search_triton(b, h_in, h_out, tokens, segments, dname)
        stats["triton_candidates"] = len(tri)
        if errors:
            stats["triton_errors"] = errors[:3]
        if tri:
            tc, tt = min(tri, key=lambda v: v[1])
            stats["triton_us"] = tt
            stats["triton_config"] = asdict(tc)
            if tt < pair:
                best, pair = tc, tt
    if "fused" in backends and tokens <= fused_max_tokens:
        fus, errors = search_fused(b, h_out, tokens, segments, dname, smem_limit)
        stats["fused_candidates"] = len(fus)
        if errors:
            stats["fused_errors"] = errors[:3]
        if fus:
            fc, ft = min(fus, key=lambda v: v[1])
            stats["fused_us"] = ft
            stats["fused_config"] = asdict(fc)
            if ft < pair:
                best, pair = fc, ft
    stats["pair_us"] = pair
    stats["backend"] = best.backend
    return best, stats, b


def search_triton(b: Bench, h_in: int, h_out: int, tokens: int, segments: int, dname: str):
    """Time the Triton backend's menu (each at its default split-K), then other split-Ks for the
    best tile shape. Returns ([(TileConfig, us)], [errors])."""
    p = b.plan
    out, errors = [], []

    def one(shape, split):
        bm, bk, stages, bme, bn, warps = shape
        tc = TileConfig(bm, bk, stages, split, bme, bn, backend="triton", warps=warps)
        try:
            out.append((tc, b.time_pair(tc, dname)))
        except Exception as e:  # e.g. out of shared memory / registers: pruned
            errors.append(f"{tc}: {type(e).__name__}: {e}"[:300])

    shapes = triton_sgmv.candidates(h_in, h_out, p.rank_stride, tokens, segments)
    for shape in shapes:
        one(shape, triton_sgmv.default_split(h_in, p.tiles[shape[0]]))
    if out:
        tc = min(out, key=lambda v: v[1])[0]
        shape = (tc.shrink_bt, tc.shrink_bk, tc.shrink_stages, tc.expand_bt, tc.expand_bn, tc.warps)
        for split in triton_sgmv.split_candidates(h_in, tc.shrink_bk, p.tiles[tc.shrink_bt]):
            if split != tc.split_k:
                one(shape, split)
    return out, errors


def main() -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--shapes", default=",".join(f"{a}x{b}" for a, b in MODEL_SHAPES))
    ap.add_argument("--ranks", default="16,64")
    ap.add_argument("--tokens", default="16,64,256,1024,4096")
    ap.add_argument("--segments", default="16,64", help="segment buckets (representative: bucket/2 adapters)")
    ap.add_argument("--budget-s", type=float, default=150.0, help="stop searching after this many seconds")
    ap.add_argument("--name", default=None, help="results file name (bench/results/<name>.json)")
    ap.add_argument("--validate", type=int, default=12, help="off-bucket shapes to check exhaustively")
    ap.add_argument("--backends", default="cuda,triton,fused", help="backends whose candidates are timed (cuda always)")
    ap.add_argument(
        "--fused-max-tokens",
        type=int,
        default=256,
        help="time the fused single-launch kernels for token buckets up to this many tokens",
    )
    ap.add_argument(
        "--merge",
        action="store_true",
        help="start from the committed table: buckets not searched (budget spent) keep their entry",
    )
    ap.add_argument("--out", default=None, help="table path (default kernels/tile_tables/<gpu>-<arch>-<dtype>.json)")
    args = ap.parse_args()
    if extension() is None:
        raise SystemExit("needs CUDA and the built extension")
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float16
    props = torch.cuda.get_device_properties(0)
    arch = f"sm{props.major}{props.minor}"
    smem_limit = props.shared_memory_per_block_optin
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ranks = [int(r) for r in args.ranks.split(",")]
    toks = [int(t) for t in args.tokens.split(",")]
    sbs = [int(s) for s in args.segments.split(",")]
    buckets = [(hi, ho, r, t, s) for r in ranks for (hi, ho) in shapes for t in toks for s in sbs]
    backends = tuple(args.backends.split(","))
    if "triton" in backends and not triton_available():
        print("triton is not installed: the Triton backend is not searched")
    entries, stats = {}, {}
    if args.merge:  # the committed buckets keep their entries and their measurements
        committed = find_table(props.name, arch, args.dtype)
        entries.update(committed.entries)
        stats.update(committed.meta.get("bucket_stats", {}))
    t_start = time.time()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as prog:
        task = prog.add_task("tile search", total=len(buckets))
        for hi, ho, r, t, sb in buckets:
            if time.time() - t_start > args.budget_s:
                prog.update(task, description="tile search (budget spent)")
                break
            segs = max(1, min(t, sb // 2))
            if segment_bucket(segs) != sb:  # e.g. 16 tokens cannot fill the 64-segment bucket
                prog.advance(task)
                continue
            prog.update(task, description=f"{hi}x{ho} r{r} T{t} S{segs}")
            best, st, _ = search_bucket(hi, ho, r, t, segs, dtype, smem_limit, backends, args.fused_max_tokens)
            key = shape_key(hi, ho, max(16, -(-r // 16) * 16), t, segs)
            entries[key] = best
            stats[key] = st
            torch.cuda.empty_cache()
            prog.advance(task)
    won = {}
    for v in stats.values():
        won[v["backend"]] = won.get(v["backend"], 0) + 1
    print(f"backends won: {won}")
    table = TileTable(
        props.name,
        arch,
        args.dtype,
        entries,
        {
            "searched_buckets": len(stats),
            "backends_won": won,
            "backends_searched": list(backends),
            "seconds": round(time.time() - t_start, 1),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "bucket_stats": stats,
        },
    )
    path = Path(args.out) if args.out else TABLE_DIR / table_filename(props.name, arch, args.dtype)
    table.save(path)
    print(
        f"table: {len(entries)} buckets -> {path} (into the adapter store: python -m valora.tile_tables push "
        f"{path} --store HOST:PORT)"
    )

    # validation: shapes between buckets, exhaustive best vs the table's pick and the heuristic
    rng = random.Random(1)
    val = []
    for _ in range(args.validate):
        hi, ho = rng.choice(shapes)
        r = rng.choice(ranks)
        t = rng.choice([24, 48, 96, 192, 384, 768, 1536, 3072])
        segs = max(1, min(t, rng.choice([3, 6, 12, 24, 48])))
        best, st, b = search_bucket(hi, ho, r, t, segs, dtype, smem_limit, backends, args.fused_max_tokens)
        pick = table.lookup(hi, ho, b.plan.rank_stride, t, b.plan.active_segments)
        heur = heuristic_config(hi, ho, b.plan.rank_stride, t, b.plan.active_segments, dtype=args.dtype)
        dname = args.dtype
        row = {
            "h_in": hi,
            "h_out": ho,
            "rank": r,
            "tokens": t,
            "segments": segs,
            "best": best.__dict__,
            "best_us": st["pair_us"],
            "table_pick": pick.__dict__,
            "table_us": b.time_pair(pick, dname),
            "heuristic_us": b.time_pair(heur, dname),
        }
        row["table_gap"] = row["table_us"] / row["best_us"]
        row["heuristic_gap"] = row["heuristic_us"] / row["best_us"]
        val.append(row)
        print(
            f"validate {hi}x{ho} r{r} T{t} S{segs}: best {row['best_us']:.2f} us, table {row['table_us']:.2f} "
            f"({row['table_gap']:.2f}x), heuristic {row['heuristic_us']:.2f} ({row['heuristic_gap']:.2f}x)",
            flush=True,
        )
        torch.cuda.empty_cache()
    summary = {}
    if val:
        gaps = [v["table_gap"] for v in val]
        hg = [v["heuristic_gap"] for v in val]
        summary = {
            "table_gap_median": statistics.median(gaps),
            "table_gap_max": max(gaps),
            "heuristic_gap_median": statistics.median(hg),
            "heuristic_gap_max": max(hg),
        }
        print(
            f"table pick vs true best: median {summary['table_gap_median']:.3f}x, "
            f"max {summary['table_gap_max']:.3f}x;"
            f" heuristic: median {summary['heuristic_gap_median']:.3f}x, max {summary['heuristic_gap_max']:.3f}x"
        )
    write_results(
        args.name or "tile_search",
        {
            "table_path": str(path),
            "buckets": len(entries),
            "backends_won": won,
            "validation": val,
            "summary": summary,
            "bucket_stats": stats,
        },
    )
    print(json.dumps({"buckets": len(entries)}))


if __name__ == "__main__":
    main()
