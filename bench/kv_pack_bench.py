"""DecodeBatch.pack: one copy per row for all layers (stacked caches) against two per layer.

A serving worker re-packs its decode batch whenever a request joins or leaves. The bench packs
`--rows` rows of the 7B shape (28 layers, 4 KV heads of 128) — half staying from the arena,
half new from a stacked prefill cache — then the same with the per-layer path forced
(`all_layers` answering None), and reports the host time of a pack and the time until its
copies finished on the device.

    python -m bench.kv_pack_bench --device cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import Qwen2Config

from services.worker import kv_batch
from services.worker.kv_batch import DecodeBatch, new_cache, split_rows

RESULTS = Path(__file__).resolve().parent / "results"


def _setup(args, device):
    config = Qwen2Config(num_hidden_layers=args.layers, num_attention_heads=28, num_key_value_heads=args.heads,
                         hidden_size=28 * args.dim, intermediate_size=64, vocab_size=32)
    gen = torch.Generator(device=device).manual_seed(0)
    half = args.rows // 2
    lengths = [max(8, args.length - 7 * i) for i in range(args.rows)]

    def prefill(ls):
        cache = new_cache(config, stacked=True)
        for layer in range(args.layers):
            k = torch.randn(len(ls), args.heads, max(ls), args.dim, generator=gen, device=device, dtype=torch.bfloat16)
            cache.update(k, k.clone(), layer)
        return split_rows(cache, ls)

    batch = DecodeBatch(config)
    first = dict(enumerate(prefill(lengths[:half])))
    batch.pack(list(first), first, dict(enumerate(lengths[:half])))
    new = {half + i: kv for i, kv in enumerate(prefill(lengths[half:]))}
    return batch, new, dict(enumerate(lengths))


def _time(batch: DecodeBatch, new: dict, lengths: dict, reps: int, device) -> tuple[float, float]:
    host, total = [], []
    rows = sorted(lengths)
    for _ in range(reps):
        kvs = {**batch.unpack(), **new}
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        batch.pack(rows, kvs, lengths)
        t1 = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        host.append((t1 - t0) * 1e3)
        total.append((time.perf_counter() - t0) * 1e3)
        half = len(rows) // 2
        keep = rows[:half]  # back to the staying half for the next rep
        batch.pack(keep, {s: kvs[s] for s in keep}, {s: lengths[s] for s in keep})
    return statistics.median(host), statistics.median(total)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.kv_pack_bench")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--length", type=int, default=320, help="The longest row's cached tokens.")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--name", default="")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    rows = {}
    for path, forced in (("one copy per row", None), ("two copies per layer and row", lambda kv: None)):
        batch, new, lengths = _setup(args, device)
        original = kv_batch.all_layers
        if forced is not None:
            kv_batch.all_layers = forced
        try:
            _time(batch, new, lengths, 3, device)  # warm-up (allocations)
            host, total = _time(batch, new, lengths, args.reps, device)
        finally:
            kv_batch.all_layers = original
        rows[path] = {"host_ms": round(host, 3), "until_done_ms": round(total, 3)}
        print(f"{path:30s} host {host:8.3f} ms   until done {total:8.3f} ms")
    from bench.common import run_info

    out = {"info": {**run_info(), "bench": "kv_pack", **vars(args)}, "rows": rows}
    if args.name:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{args.name}.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
