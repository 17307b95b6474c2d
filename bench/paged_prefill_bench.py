"""Prefill attention of one layer on the GPU: the paged Triton kernel for chunked prefill
(kernels/paged_prefill.py) vs torch SDPA over contiguous K/V, µs per layer call and TFLOP/s.

Workload: Qwen2-VL-7B heads (28 query, 4 KV, D 128), bf16. Cases: one row of a chunk of
`--chunks` (512, 2048) query tokens after a cached prefix of `--prefixes` (0, 2k, 8k) tokens; and
a mixed batch: `--mixed-decode-rows` (32) decode rows (one query token, contexts random in
300..1200) followed by one `--mixed-chunk` (1024) token chunk after a `--mixed-prefix` (2k)
prefix. Every method reads the same tokens; each of `--layers` (8) calls in one CUDA graph reads
its own layer's q and KV, the graph is replayed `--reps` times, median µs per call. Methods:

    paged_bs{16,64}          ours, default config (kernels.paged_prefill.default_config), pages
                             shuffled in the pool
    paged_bs16_m{M}_n{N}_w{W}_s{S}  ours at forced tiles (`--configs`: BLOCK_M x TILE_N x warps x stages)
    paged_split_bs16         mixed case only: paged_decode_attention (split-KV) on the decode rows +
                             ours on the chunk row, two launches
    sdpa_causal              prefix-0 cases: SDPA is_causal over the chunk's contiguous K/V
                             (enable_gqa: no K/V copy; the flash backend) -- the contiguous ideal
    sdpa_mask                SDPA with an explicit offset-causal mask over each row's contiguous K/V
                             (gathered beforehand, untimed), K/V heads repeated (repeat_kv) inside the
                             timed call as HF's SDPA path does; one call a row
    gather_sdpa_mask         the same plus the page gather (pool -> contiguous) timed: what a paged
                             engine pays without a paged prefill kernel

Every method is checked against kernels.paged_prefill.paged_prefill_attention_reference (layer 0)
before it is timed. FLOPs: 4 * H * D * (query, key) pairs attended (causal: query j of a row
after c cached tokens sees c + j + 1 keys); TFLOP/s of useful work (H200 dense bf16 peak ~989).

    python -m bench.paged_prefill_bench            # bench/results/paged-prefill-<commit>.json (+ $OUT)
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

from bench.common import save
from bench.paged_attention_bench import _sync, add_common_args, check_common_args, make_lengths, measure, paged_pools
from kernels.results import git_commit

PEAK_TFLOPS = 989.0  # H200 dense bf16 tensor-core peak


def parse_config(text: str) -> dict:
    """ "128x64x8x3" -> {block_m, tile_n, num_warps, num_stages}."""
    parts = [int(x) for x in text.lower().split("x")]
    if len(parts) != 4:
        raise argparse.ArgumentTypeError(f"config {text!r} is not BLOCK_MxTILE_NxWARPSxSTAGES")
    return dict(zip(("block_m", "tile_n", "num_warps", "num_stages"), parts))


def config_name(cfg: dict) -> str:
    return "m{block_m}_n{tile_n}_w{num_warps}_s{num_stages}".format(**cfg)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, "paged-prefill")
    ap.add_argument("--chunks", type=int, nargs="+", default=[512, 2048], help="query tokens of the chunk row")
    ap.add_argument("--prefixes", type=int, nargs="+", default=[0, 2048, 8192], help="cached tokens before the chunk")
    ap.add_argument("--mixed-decode-rows", type=int, default=32, help="decode rows of the mixed case (0: none)")
    ap.add_argument("--mixed-chunk", type=int, default=1024)
    ap.add_argument("--mixed-prefix", type=int, default=2048)
    ap.add_argument("--decode-min-len", type=int, default=300)
    ap.add_argument("--decode-max-len", type=int, default=1200)
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[16, 64], help="the first is the headline")
    ap.add_argument(
        "--configs",
        type=parse_config,
        nargs="*",
        default=[
            parse_config(c)
            for c in ("64x64x4x2", "64x64x4x3", "128x32x8x3", "128x64x4x3", "128x64x8x2", "128x128x8x2", "256x32x8x2")
        ],
        help="forced BLOCK_MxTILE_NxWARPSxSTAGES timed at the first block size",
    )
    ap.add_argument("--layers", type=int, default=8, help="calls (layers) per captured graph")
    ap.add_argument("--reps", type=int, default=20, help="graph replays; the median is reported")
    args = ap.parse_args(argv)
    check_common_args(ap, args)
    if not 1 <= args.decode_min_len <= args.decode_max_len:
        ap.error("need 1 <= --decode-min-len <= --decode-max-len")
    return args


def make_cases(args: argparse.Namespace) -> list[dict]:
    """Each case: name, n (query tokens a row), prefix (cached tokens before them a row)."""
    cases = [{"name": f"chunk{c}_prefix{p}", "n": [c], "prefix": [p]} for c in args.chunks for p in args.prefixes]
    if args.mixed_decode_rows > 0:
        lens = make_lengths(args.mixed_decode_rows, args.decode_min_len, args.decode_max_len, args.seed)
        cases.append(
            {
                "name": f"mixed{args.mixed_decode_rows}dec_chunk{args.mixed_chunk}_prefix{args.mixed_prefix}",
                "n": [1] * len(lens) + [args.mixed_chunk],
                "prefix": [n - 1 for n in lens] + [args.mixed_prefix],
            }
        )
    return cases


def attended_pairs(n: list[int], prefix: list[int]) -> int:
    """(query, key) pairs of causal attention: query j of a row after c cached tokens sees c + j + 1."""
    return sum(q * c + q * (q + 1) // 2 for q, c in zip(n, prefix))


def attention_flops(n: list[int], prefix: list[int], heads: int, head_dim: int) -> int:
    return 4 * heads * head_dim * attended_pairs(n, prefix)  # QK^T and PV, 2 FLOPs a multiply-add


def offset_causal_mask(n: int, context: int, device) -> torch.Tensor:
    """(n, context) bool, True where query j (position context - n + j) may see the key."""
    pos = context - n + torch.arange(n, device=device)
    return torch.arange(context, device=device)[None, :] <= pos[:, None]


def tflops(flops: int, us: float | None) -> float | None:
    return None if not us else round(flops / (us * 1e-6) / 1e12, 2)


def format_table(cases: list[dict]) -> str:
    lines = [f"{'case':34s} {'method':30s} {'us':>9s} {'TFLOP/s':>8s} {'max err':>9s}  note"]
    for c in cases:
        for r in sorted(c["rows"], key=lambda r: (r.get("us") is None, r.get("us") or 0)):
            us, tf, err = r.get("us"), r.get("tflops"), r.get("max_abs_err")
            lines.append(
                f"{c['name']:34s} {r['method']:30s} {'-' if us is None else f'{us:9.1f}':>9s} "
                f"{'-' if tf is None else f'{tf:8.1f}':>8s} {'-' if err is None else f'{err:9.2e}':>9s}  "
                f"{r.get('note', '')}"
            )
    return "\n".join(lines)


# ---- GPU part --------------------------------------------------------------------------------


def run_case(case: dict, args: argparse.Namespace) -> dict:
    from kernels.paged_attention import paged_decode_attention
    from kernels.paged_prefill import (
        default_config,
        paged_prefill_attention,
        paged_prefill_attention_reference,
        paged_prefill_attention_triton,
    )

    dev, dtype = torch.device("cpu" if args.dry_run else "cuda"), torch.bfloat16
    h, kvh, d, n_layers = args.heads, args.kv_heads, args.head_dim, args.layers
    group, scale = h // kvh, d**-0.5
    n, prefix = case["n"], case["prefix"]
    lens = [a + b for a, b in zip(n, prefix)]
    t, r = sum(n), len(n)
    flops = attention_flops(n, prefix, h, d)
    g = torch.Generator(device=dev).manual_seed(args.seed)
    qs = [torch.randn(t, h, d, device=dev, generator=g).to(dtype) for _ in range(n_layers)]
    ks = [torch.randn(sum(lens), kvh, d, device=dev, generator=g).to(dtype) for _ in range(n_layers)]  # packed
    vs = [torch.randn(sum(lens), kvh, d, device=dev, generator=g).to(dtype) for _ in range(n_layers)]
    cu_q = torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32, device=dev)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    rows, ref = [], None

    def record(method, fns, got, note=""):
        row, us = measure(method, fns, got, ref, args, note)
        row["tflops"] = tflops(flops, us)
        rows.append(row)
        print(
            f"  {case['name']:34s} {method:30s} {row['us'] if row['us'] is not None else '-':>9} us "
            f"{row['tflops'] if row['tflops'] is not None else '-':>7} TFLOP/s  err {row['max_abs_err']:.2e} "
            f"{row['note']}",
            flush=True,
        )

    def pools(bs):
        return paged_pools(lens, ks, vs, bs, args.seed, dev)

    def time_ours(bi, bs):
        nonlocal ref
        kp, vp, bt = pools(bs)
        if ref is None:
            ref = paged_prefill_attention_reference(qs[0], kp[0], vp[0], bt, cu_q, seq_lens, scale)
        outs = [torch.empty_like(q) for q in qs]
        variants = [(f"paged_bs{bs}", None, config_name(default_config(dtype, d, group)))]
        if bi == 0:
            variants += [(f"paged_bs{bs}_{config_name(c)}", c, "") for c in args.configs]
        for method, cfg, note in variants:

            def op(i, cfg=cfg):
                if cfg is None or args.dry_run:  # dry run: the dispatcher (the reference on CPU)
                    paged_prefill_attention(qs[i], kp[i], vp[i], bt, cu_q, seq_lens, scale, out=outs[i])
                else:
                    paged_prefill_attention_triton(qs[i], kp[i], vp[i], bt, cu_q, seq_lens, scale, out=outs[i], **cfg)

            try:
                op(0)
                _sync(dev)
            except Exception as e:  # a forced config that does not build is reported
                _sync(dev)
                rows.append(
                    {
                        "method": method,
                        "us": None,
                        "ok": False,
                        "note": f"failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}",
                    }
                )
                continue
            record(method, [lambda i=i, op=op: op(i) for i in range(n_layers)], outs[0].clone(), note)
        if bi == 0 and r > 1 and all(x == 1 for x in n[:-1]):  # mixed: decode kernel + ours on the chunk
            outs_dec = [torch.empty(r - 1, h, d, dtype=dtype, device=dev) for _ in qs]
            cu_chunk = torch.tensor([0, n[-1]], dtype=torch.int32, device=dev)

            def split(i):
                paged_decode_attention(
                    qs[i][: r - 1], kp[i], vp[i], bt[: r - 1], seq_lens[: r - 1], scale, out=outs_dec[i]
                )
                paged_prefill_attention(
                    qs[i][r - 1 :], kp[i], vp[i], bt[r - 1 :], cu_chunk, seq_lens[r - 1 :], scale, out=outs[i][r - 1 :]
                )

            split(0)
            got = torch.cat([outs_dec[0], outs[0][r - 1 :]])
            record(
                f"paged_split_bs{bs}",
                [lambda i=i: split(i) for i in range(n_layers)],
                got,
                "split-KV decode kernel on the decode rows + ours on the chunk: two launches",
            )

    for bi, bs in enumerate(args.block_sizes):
        time_ours(bi, bs)  # its pools are freed on return
        torch.cuda.empty_cache()

    if not args.no_peers:
        starts = list(itertools.accumulate(lens, initial=0))
        contig = [
            [
                (k[a : a + length].transpose(0, 1), v[a : a + length].transpose(0, 1))  # (KVH, L, D) views
                for a, length in zip(starts, lens)
            ]
            for k, v in zip(ks, vs)
        ]
        masks = [offset_causal_mask(x, length, dev) for x, length in zip(n, lens)]
        q_starts = list(itertools.accumulate(n, initial=0))  # host ints: no device read inside a timed call
        q_rows = [[q[a:b].transpose(0, 1) for a, b in zip(q_starts, q_starts[1:])] for q in qs]  # (H, n, D) views
        outs = [torch.empty_like(q) for q in qs]

        def write(i, j, o):  # (H, n, D) -> the row's tokens of out
            outs[i][q_starts[j] : q_starts[j + 1]] = o.transpose(0, 1)

        if all(p == 0 for p in prefix) and r == 1:

            def causal(i):
                k, v = contig[i][0]
                o = torch.nn.functional.scaled_dot_product_attention(
                    q_rows[i][0][None], k[None], v[None], is_causal=True, scale=scale, enable_gqa=True
                )
                write(i, 0, o[0])

            causal(0)
            record(
                "sdpa_causal",
                [lambda i=i: causal(i) for i in range(n_layers)],
                outs[0].clone(),
                "contiguous K/V, enable_gqa",
            )

        def masked(i, kvs):
            for j, (k, v) in enumerate(kvs):
                o = torch.nn.functional.scaled_dot_product_attention(
                    q_rows[i][j][None],
                    k.repeat_interleave(group, dim=0)[None],
                    v.repeat_interleave(group, dim=0)[None],
                    attn_mask=masks[j],
                    scale=scale,
                )
                write(i, j, o[0])

        masked(0, contig[0])
        record(
            "sdpa_mask",
            [lambda i=i: masked(i, contig[i]) for i in range(n_layers)],
            outs[0].clone(),
            f"{r} SDPA call(s), K/V contiguous (untimed gather), repeat_kv timed",
        )
        del contig
        kp, vp, bt = pools(args.block_sizes[0])
        bs = args.block_sizes[0]
        pages = [bt[j, : -(-length // bs)].long() for j, length in enumerate(lens)]

        def gathered(i):
            masked(
                i,
                [
                    (
                        kp[i][p].reshape(-1, kvh, d)[:length].transpose(0, 1),
                        vp[i][p].reshape(-1, kvh, d)[:length].transpose(0, 1),
                    )
                    for p, length in zip(pages, lens)
                ],
            )

        gathered(0)
        record(
            "gather_sdpa_mask",
            [lambda i=i: gathered(i) for i in range(n_layers)],
            outs[0].clone(),
            f"page gather (bs {bs}) + sdpa_mask, timed together",
        )
        del kp, vp
        torch.cuda.empty_cache()

    return {
        "name": case["name"],
        "heads": h,
        "kv_heads": kvh,
        "head_dim": d,
        "dtype": "bfloat16",
        "n": n,
        "prefix": prefix,
        "tokens": t,
        "rows_in_batch": r,
        "context_tokens": sum(lens),
        "attended_pairs": attended_pairs(n, prefix),
        "flops": flops,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from kernels import paged_prefill

    if not args.dry_run and not paged_prefill.available("cuda"):
        print("needs CUDA and triton (or --dry-run)", file=sys.stderr)
        return 2
    cases = []
    for case in make_cases(args):
        cases.append(run_case(case, args))
        torch.cuda.empty_cache()
    print(format_table(cases))
    config = {**vars(args), "configs": [config_name(c) for c in args.configs]}
    name = args.name or f"paged-prefill-{git_commit()[:7]}"
    path = save(
        name,
        {"config": config, "peak_tflops": PEAK_TFLOPS, "cases": cases},
        Path(args.out_dir) if args.out_dir else None,
    )
    print(f"wrote {path}")
    wrong = [
        f"{c['name']} {r['method']}"
        for c in cases
        for r in c["rows"]
        if r["method"].startswith("paged_") and r.get("ok") is False and "failed" not in r.get("note", "")
    ]
    if wrong:
        print("WRONG RESULTS:", ", ".join(wrong), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
