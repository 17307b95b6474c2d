"""Decode attention of one layer on the GPU: the paged Triton kernel (kernels/paged_attention.py) vs
today's path and torch's varlen attention, µs per layer call.

Workload: Qwen2-VL-7B heads (28 query, 4 KV, D 128), bf16, B rows in {8, 32, 64}, contexts random
in 300..1200 (one query token per row). Every method reads the same tokens; each of `--layers` (20)
calls in one CUDA graph reads its own layer's KV (a real forward's pattern: nothing stays in L2
between calls), the graph is replayed `--reps` times, median µs per call. Methods:

    paged_bs{16,32,64}    ours, default num_splits (shapes only), pages shuffled in the pool
    paged_bs16_s{S}       ours at forced splits; S = 1 is the no-split ablation
    sdpa_arena            today's path (services/worker/attention.py grouped_decode_attention): masked
                          SDPA on a contiguous (B, KVH, cap, D) arena (cap = the next power of two
                          >= the longest row, at least 256, as the old contiguous arenas were allocated),
                          a group's query heads stacked as the query length, output transposed back
    varlen_packed         torch.nn.attention.varlen.varlen_attn on packed unpadded K/V (not paged),
                          when the installed torch has it
    varlen_paged_bs{16,256}  the same with block_table / seqused_k (paged), where it accepts the block
                          size (FA2 pages in multiples of 256 tokens)

Every method is checked against kernels.paged_attention.paged_decode_attention_reference (layer 0)
before it is timed. Floor: the bytes of K and V the rows use, read once, at 4.8 TB/s (H200 HBM3e
peak); `arena_floor_us` is the same for the whole arena the SDPA path reads.

    python -m bench.paged_attention_bench            # bench/results/paged-attention-<commit>.json (+ $OUT)
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import random
import sys
from pathlib import Path

import torch

from bench.common import save
from kernels.results import git_commit

HBM_BW = 4.8e12  # H200 HBM3e peak, bytes/s
ARENA_MIN_CAPACITY = 256  # the smallest arena of the contiguous decode cache this replaced
TOL = {"max_abs": 3e-2}  # bf16 vs the fp32-softmax reference


def add_common_args(ap: argparse.ArgumentParser, name: str) -> None:
    """The options both paged-attention benches take: the attention shape, seed, peers, where the
    results go (default name `name`-<commit>), the CPU dry run."""
    ap.add_argument("--heads", type=int, default=28)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-peers", action="store_true", help="time only ours")
    ap.add_argument("--name", default=None, help=f"results file name (default {name}-<commit>)")
    ap.add_argument("--out-dir", default=None, help="results directory (default bench/results)")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU, no timing: builds every method's inputs and checks them against the reference "
        "(ours is then the reference itself; for the script's own test)",
    )


def check_common_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.heads % args.kv_heads:
        ap.error("--heads must be a multiple of --kv-heads")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, "paged-attention")
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--min-len", type=int, default=300)
    ap.add_argument("--max-len", type=int, default=1200)
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[16, 32, 64], help="the first is the headline")
    ap.add_argument(
        "--splits",
        type=int,
        nargs="*",
        default=[1, 2, 4, 8, 16],
        help="forced num_splits timed at the first block size (1 = the no-split ablation)",
    )
    ap.add_argument("--layers", type=int, default=20, help="calls (layers) per captured graph")
    ap.add_argument("--reps", type=int, default=30, help="graph replays; the median is reported")
    args = ap.parse_args(argv)
    check_common_args(ap, args)
    if not 1 <= args.min_len <= args.max_len:
        ap.error("need 1 <= --min-len <= --max-len")
    return args


def make_lengths(batch: int, lo: int, hi: int, seed: int) -> list[int]:
    """Context lengths (including the new token), uniform in [lo, hi]."""
    rnd = random.Random(seed)
    return [rnd.randint(lo, hi) for _ in range(batch)]


def make_tables(lens: list[int], block_size: int, seed: int, spare: int = 0) -> tuple[torch.Tensor, int]:
    """(block_tables (B, max_blocks) int32, num_blocks): every row's pages at shuffled places of one
    pool (a fragmented pool), random valid ids in the unused slots."""
    rnd = random.Random(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + spare
    order = list(range(num_blocks))
    rnd.shuffle(order)
    max_blocks = max(need)
    tables = torch.tensor([[rnd.randrange(num_blocks) for _ in range(max_blocks)] for _ in lens], dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(order[at : at + n], dtype=torch.int32)
        at += n
    return tables, num_blocks


def token_slots(lens: list[int], tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """(sum(lens),) long: the pool slot (page * block_size + offset) of every packed token, row by row."""
    out = []
    for i, n in enumerate(lens):
        pos = torch.arange(n)
        out.append(tables[i].long()[pos // block_size] * block_size + pos % block_size)
    return torch.cat(out)


def to_pool(packed: torch.Tensor, slots: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
    """(num_blocks, block_size, KVH, D) pool holding the packed (tokens, KVH, D) rows at `slots`."""
    pool = packed.new_zeros(num_blocks * block_size, *packed.shape[1:])
    pool[slots.to(packed.device)] = packed
    return pool.view(num_blocks, block_size, *packed.shape[1:])


def arena_cap(max_len: int) -> int:
    return max(ARENA_MIN_CAPACITY, 1 << (max_len - 1).bit_length())


def to_arena(packed: torch.Tensor, lens: list[int], cap: int) -> torch.Tensor:
    """(B, KVH, cap, D) zero-padded arena of the packed rows (left-aligned; the mask says which)."""
    arena = packed.new_zeros(len(lens), packed.shape[1], cap, packed.shape[2])
    at = 0
    for i, n in enumerate(lens):
        arena[i, :, :n] = packed[at : at + n].transpose(0, 1)
        at += n
    return arena


def kv_bytes(lens: list[int], kv_heads: int, head_dim: int, elem_bytes: int = 2) -> int:
    """Bytes of K and V the rows use."""
    return 2 * sum(lens) * kv_heads * head_dim * elem_bytes


def floor_us(nbytes: int, bw: float = HBM_BW) -> float:
    return nbytes / bw * 1e6


def format_table(cases: list[dict]) -> str:
    lines = [f"{'B':>3s}  {'method':22s} {'us':>8s} {'x floor':>8s} {'max err':>9s}  note"]
    for c in cases:
        lines.append(
            f"{c['batch']:3d}  {'floor (KV bytes)':22s} {c['floor_us']:8.2f} {1.0:8.2f} {'':>9s}  "
            f"{c['kv_bytes'] / 1e6:.1f} MB; arena floor {c['arena_floor_us']:.2f} us (cap {c['arena_cap']})"
        )
        for r in sorted(c["rows"], key=lambda r: (r.get("us") is None, r.get("us") or 0)):
            if r.get("us") is None:
                lines.append(f"{c['batch']:3d}  {r['method']:22s} {'-':>8s} {'-':>8s} {'-':>9s}  {r.get('note', '')}")
                continue
            err = r.get("max_abs_err")
            lines.append(
                f"{c['batch']:3d}  {r['method']:22s} {r['us']:8.2f} {r['us'] / c['floor_us']:8.2f} "
                f"{'-' if err is None else f'{err:9.2e}':>9s}  {r.get('note', '')}"
            )
    return "\n".join(lines)


# ---- GPU part --------------------------------------------------------------------------------


def _time(fns, reps: int) -> tuple[float, str]:
    """Median µs per call as a CUDA-graph replay; eager (per call, CUDA events) if capture fails."""
    from kernels.timing import time_eager, time_graph

    try:
        return time_graph(fns, reps=reps), "graph"
    except Exception as e:  # a peer that cannot be captured is still timed, marked
        torch.cuda.synchronize()
        us = time_eager(lambda: [f() for f in fns], reps=max(5, reps // 3)) / len(fns)
        return us, f"eager (capture failed: {type(e).__name__}: {str(e).splitlines()[0][:80]})"


def measure(
    method: str, fns, got: torch.Tensor, ref: torch.Tensor, args: argparse.Namespace, note: str = ""
) -> tuple[dict, float | None]:
    """A method's row: its output `got` checked against `ref` (TOL, finite), then — when right and
    not a dry run — `fns` (one call a layer) timed; (row, µs or None)."""
    err = (got.float() - ref.float()).abs().max().item()
    ok = err <= TOL["max_abs"] and bool(torch.isfinite(got).all())
    row = {"method": method, "max_abs_err": err, "ok": ok, "us": None}
    us = None
    if ok and args.dry_run:
        note = f"{note} dry run, not timed".strip()
    elif ok:
        us, timing = _time(fns, args.reps)
        row.update(us=round(us, 2), timing=timing)
        note = note if timing == "graph" else f"{note} {timing}".strip()
    else:
        note = f"{note} WRONG (max err {err:.2e}), not timed".strip()
    row["note"] = note
    return row, us


def paged_pools(
    lens: list[int], ks: list[torch.Tensor], vs: list[torch.Tensor], block_size: int, seed: int, dev: torch.device
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Each layer's packed keys and values (tokens, KVH, D) laid into a fragmented pool of
    `block_size` pages: (k pools, v pools, block tables on `dev`)."""
    tables, num_blocks = make_tables(lens, block_size, seed + 7 * block_size)
    slots = token_slots(lens, tables, block_size)
    return (
        [to_pool(k, slots, num_blocks, block_size) for k in ks],
        [to_pool(v, slots, num_blocks, block_size) for v in vs],
        tables.to(dev),
    )


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _varlen():
    """(torch's varlen_attn or None, whether it takes enable_gqa: torch 2.11's does not, and then
    the peer gets K/V with their heads repeated to the query heads, made outside its timing)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, False
    return varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters


def run_case(batch: int, args: argparse.Namespace) -> dict:
    from kernels.paged_attention import (
        default_num_splits,
        paged_decode_attention,
        paged_decode_attention_reference,
    )

    dev, dtype = torch.device("cpu" if args.dry_run else "cuda"), torch.bfloat16
    h, kvh, d, n_layers = args.heads, args.kv_heads, args.head_dim, args.layers
    group, scale = h // kvh, d**-0.5
    lens = make_lengths(batch, args.min_len, args.max_len, args.seed + batch)
    total = sum(lens)
    g = torch.Generator(device=dev).manual_seed(args.seed)
    qs = [torch.randn(batch, h, d, device=dev, generator=g).to(dtype) for _ in range(n_layers)]
    ks = [torch.randn(total, kvh, d, device=dev, generator=g).to(dtype) for _ in range(n_layers)]  # packed
    vs = [torch.randn(total, kvh, d, device=dev, generator=g).to(dtype) for _ in range(n_layers)]
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    rows, ref = [], None

    def heads_per_query(layers):  # K/V heads repeated to the query heads (a varlen_attn without GQA)
        return [t.repeat_interleave(group, dim=-2) for t in layers]

    def record(method, fns, got, note=""):
        row, _ = measure(method, fns, got, ref, args, note)
        rows.append(row)
        print(
            f"  B={batch:3d} {method:22s} {row['us'] if row['us'] is not None else '-':>8} us  "
            f"err {row['max_abs_err']:.2e} {row['note']}",
            flush=True,
        )

    def pools(bs):
        return paged_pools(lens, ks, vs, bs, args.seed, dev)

    def time_ours(bi, bs):
        nonlocal ref
        kp, vp, bt = pools(bs)
        if ref is None:
            ref = paged_decode_attention_reference(qs[0], kp[0], vp[0], bt, seq_lens, scale)
        outs = [torch.empty_like(q) for q in qs]
        s_default = default_num_splits(batch, kvh)
        variants = [(f"paged_bs{bs}", None, f"S={s_default}")]
        if bi == 0:
            variants += [
                (f"paged_bs{bs}_s{s}", s, "no-split ablation" if s == 1 else "") for s in args.splits if s != s_default
            ]
        for method, splits, note in variants:

            def op(i, splits=splits):
                paged_decode_attention(qs[i], kp[i], vp[i], bt, seq_lens, scale, out=outs[i], num_splits=splits)

            op(0)
            record(method, [lambda i=i, op=op: op(i) for i in range(n_layers)], outs[0].clone(), note)

    def time_varlen_paged(bs):  # FA2 pages only in multiples of 256 tokens: tried at bs and at 256
        varlen, gqa = _varlen()
        if varlen is None:
            return
        kp, vp, bt = pools(bs)
        if not gqa:
            kp, vp = heads_per_query(kp), heads_per_query(vp)
        cu_q = torch.arange(batch + 1, dtype=torch.int32, device=dev)
        cu_k = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=dev)
        extra = {"enable_gqa": True} if gqa else {}

        def paged_peer(i):
            return varlen(
                qs[i], kp[i], vp[i], cu_q, cu_k, 1, max(lens), scale=scale, seqused_k=seq_lens, block_table=bt, **extra
            )

        try:
            got = paged_peer(0)
            _sync(dev)
        except Exception as e:  # not every torch build / block size pages
            _sync(dev)
            rows.append(
                {
                    "method": f"varlen_paged_bs{bs}",
                    "us": None,
                    "note": f"unsupported: {type(e).__name__}: {str(e).splitlines()[0][:100]}",
                }
            )
            return
        record(
            f"varlen_paged_bs{bs}",
            [lambda i=i: paged_peer(i) for i in range(n_layers)],
            got,
            "FA paged" + ("" if gqa else f", K/V heads repeated x{group} (untimed)"),
        )

    for bi, bs in enumerate(args.block_sizes):
        time_ours(bi, bs)  # its pools are freed on return
        torch.cuda.empty_cache()
    if not args.no_peers:
        for bs in dict.fromkeys([args.block_sizes[0], 256]):
            time_varlen_paged(bs)
            torch.cuda.empty_cache()

    cap = arena_cap(max(lens))
    if not args.no_peers:
        arenas = [(to_arena(k, lens, cap), to_arena(v, lens, cap)) for k, v in zip(ks, vs)]
        mask = (torch.arange(cap, device=dev)[None, :] < seq_lens[:, None]).view(batch, 1, 1, cap)

        def sdpa(i):  # grouped_decode_attention's math on the arena
            k, v = arenas[i]
            q = qs[i].view(batch, kvh, group, d)
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            return o.reshape(batch, h, 1, d).transpose(1, 2).contiguous()

        record(
            "sdpa_arena",
            [lambda i=i: sdpa(i) for i in range(n_layers)],
            sdpa(0).view(batch, h, d),
            f"cap {cap}, reads the whole arena",
        )
        del arenas
        torch.cuda.empty_cache()
        varlen, gqa = _varlen()
        if varlen is None:
            rows.append({"method": "varlen_packed", "us": None, "note": "torch.nn.attention.varlen not in this torch"})
        else:
            cu_q = torch.arange(batch + 1, dtype=torch.int32, device=dev)
            cu_k = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=dev)
            kx, vx = (ks, vs) if gqa else (heads_per_query(ks), heads_per_query(vs))
            extra = {"enable_gqa": True} if gqa else {}

            def packed(i):
                return varlen(qs[i], kx[i], vx[i], cu_q, cu_k, 1, max(lens), scale=scale, **extra)

            try:
                got = packed(0)
                _sync(dev)
                record(
                    "varlen_packed",
                    [lambda i=i: packed(i) for i in range(n_layers)],
                    got,
                    "not paged" + ("" if gqa else f", K/V heads repeated x{group} (untimed)"),
                )
            except Exception as e:
                _sync(dev)
                rows.append(
                    {
                        "method": "varlen_packed",
                        "us": None,
                        "note": f"failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}",
                    }
                )

    nbytes = kv_bytes(lens, kvh, d)
    return {
        "batch": batch,
        "heads": h,
        "kv_heads": kvh,
        "head_dim": d,
        "dtype": "bfloat16",
        "lens": lens,
        "mean_len": total / batch,
        "kv_bytes": nbytes,
        "floor_us": round(floor_us(nbytes), 3),
        "arena_cap": cap,
        "arena_floor_us": round(floor_us(2 * batch * kvh * cap * d * 2), 3),
        "default_num_splits": default_num_splits(batch, kvh),
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from kernels import paged_attention

    if not args.dry_run and not paged_attention.available("cuda"):
        print("needs CUDA and triton (or --dry-run)", file=sys.stderr)
        return 2
    cases = []
    for b in args.batch:
        cases.append(run_case(b, args))
        torch.cuda.empty_cache()
    print(format_table(cases))
    name = args.name or f"paged-attention-{git_commit()[:7]}"
    path = save(
        name, {"config": vars(args), "hbm_bw": HBM_BW, "cases": cases}, Path(args.out_dir) if args.out_dir else None
    )
    print(f"wrote {path}")
    wrong = [
        f"B={c['batch']} {r['method']}"
        for c in cases
        for r in c["rows"]
        if r["method"].startswith("paged_") and r.get("ok") is False
    ]
    if wrong:
        print("WRONG RESULTS:", ", ".join(wrong), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
