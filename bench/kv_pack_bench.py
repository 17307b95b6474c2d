"""DecodeBatch.pack: staying rows moved from the current stack in runs (one slice copy per run
and layer) against every row copied on its own (two copies per layer and row, as before).

A serving worker re-packs its decode batch whenever a request joins or leaves. The bench packs
--rows rows of the 7B shape (28 layers, 4 KV heads of 128): --joining new rows from a prefill,
the rest staying, then the same batch change with every row handed in as its own cache. It
reports the host time of a pack and the time until its copies finished (CUDA). On a CPU the
copies themselves dominate unless the tensors are small (--length 8 --dim 8: host overhead).

    python -m bench.kv_pack_bench --device cuda --name kv-pack-<commit>
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import Qwen2Config

from services.worker.kv_batch import KV, DecodeBatch, kv_from_cache, new_cache, split_rows

RESULTS = Path(__file__).resolve().parent / "results"


def _row_views(batch: DecodeBatch) -> dict[int, KV]:
    """Every row of the current stack as its own cache (views): the pack's per-row input."""
    kv, w = kv_from_cache(batch.cache), batch.width
    return {sid: [(k[i:i + 1, :, w - n:], v[i:i + 1, :, w - n:]) for k, v in kv]
            for i, (sid, n) in enumerate(zip(batch.rows, batch.lengths))}


def _timed(args, device, per_row: bool) -> tuple[float, float]:
    config = Qwen2Config(num_hidden_layers=args.layers, num_attention_heads=28, num_key_value_heads=args.heads,
                         hidden_size=28 * args.dim, intermediate_size=64, vocab_size=32)
    gen = torch.Generator(device=device).manual_seed(0)
    next_id = 0

    def prefill(n: int) -> dict[int, tuple[int, KV]]:
        nonlocal next_id
        lengths = [max(2, args.length - 7 * ((next_id + i) % 40)) for i in range(n)]
        cache = new_cache(config)
        for layer in range(args.layers):
            k = torch.randn(n, args.heads, max(lengths), args.dim, generator=gen, device=device).to(torch.bfloat16)
            cache.update(k, k.clone(), layer)
        out = {next_id + i: (n_, kv) for i, (n_, kv) in enumerate(zip(lengths, split_rows(cache, lengths)))}
        next_id += n
        return out

    batch = DecodeBatch(config)
    first = prefill(args.rows)
    lengths = {sid: n for sid, (n, _) in first.items()}
    batch.pack(list(first), {sid: kv for sid, (_, kv) in first.items()}, lengths)
    stay = args.rows - args.joining
    host, total = [], []
    for rep in range(args.reps + 2):  # 2 warm-up reps (both arenas allocated)
        # the change: the batch's last `joining` rows leave, as many join after the stayers' first half
        new = prefill(args.joining)
        lengths.update({sid: n for sid, (n, _) in new.items()})
        rows = batch.rows[:stay // 2] + list(new) + batch.rows[stay // 2:stay]
        kvs = {sid: kv for sid, (_, kv) in new.items()}
        if per_row:  # every row from views of its own: none stays
            kvs.update({sid: kv for sid, kv in _row_views(batch).items() if sid in rows})
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        batch.pack(rows, kvs, {sid: lengths[sid] for sid in rows})
        t1 = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if rep >= 2:
            host.append((t1 - t0) * 1e3)
            total.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(host), statistics.median(total)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.kv_pack_bench")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--joining", type=int, default=8)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--length", type=int, default=320, help="The longest row's cached tokens.")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--name", default="")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    rows = {}
    for label, per_row in (("staying rows in runs", False), ("every row on its own", True)):
        host, total = _timed(args, device, per_row)
        rows[label] = {"host_ms": round(host, 3), "until_done_ms": round(total, 3)}
        print(f"{label:22s} host {host:8.3f} ms   until done {total:8.3f} ms")
    from bench.common import run_info

    out = {"info": {**run_info(), "bench": "kv_pack", **vars(args)}, "rows": rows}
    if args.name:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{args.name}.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
