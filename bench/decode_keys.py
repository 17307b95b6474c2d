"""How often a served decode batch meets a CUDA-graph key it has not seen (decode_graphs.py):
the engine on a closed loop of requests (arrivals and finishes move the batch size), static
decode steps counted as eager warm-ups (a new key), captures (its second sighting) and replays,
with and without padding the rows to a power of two (EngineConfig.pad_decode_rows). CPU, tiny
model, no capture (the static step's keys are the ones CUDA would capture).

    python -m bench.decode_keys                  # writes bench/results/decode-keys-<date>.json
"""

from __future__ import annotations

import argparse
import collections
import json
import queue
import time
from pathlib import Path

import torch

from bench.common import RESULTS, run_info
from services.worker import decode_graphs
from services.worker.engine import Engine, EngineConfig
from services.worker.requests import Failed, Finished, WorkRequest
from services.worker.testing import random_image
from valora.cluster import DEFAULT_HOME, default_model_path, ensure_model


def closed_loop(model: Path, pad: bool, concurrency: int, total: int, max_batch: int, new_tokens: int) -> dict:
    counts: collections.Counter = collections.Counter()
    lookup = decode_graphs.DecodeGraphs._lookup

    def counted(self, cache, width, step, buffers):
        key = self._key(cache, width, step, buffers)
        if key is not None:
            e = self.entries.get(key)
            counts["warm-up" if e is None else "capture" if e.seen == 1 else "replay"] += 1
        return lookup(self, cache, width, step, buffers)

    decode_graphs.DecodeGraphs._lookup = counted
    eng = Engine(EngineConfig(model_path=model, max_batch_size=max_batch, max_prefills_per_step=8,
                              decode_graphs="static", pad_decode_rows=pad))
    eng.eos_ids = set()
    eng.start()
    try:
        done: queue.Queue = queue.Queue()

        def submit(i: int) -> None:
            r = WorkRequest(f"r{i}", f"Describe picture {i}.", [random_image(i % 50)],
                            max_new_tokens=new_tokens - i % 5)  # staggered finishes
            eng.submit(eng.prepare(r), lambda ev: done.put(ev) if isinstance(ev, (Finished, Failed)) else None)

        sent = 0
        for _ in range(concurrency):
            submit(sent)
            sent += 1
        for _ in range(total):
            ev = done.get(timeout=300)
            if isinstance(ev, Failed):
                raise ev.error
            if sent < total:
                submit(sent)
                sent += 1
    finally:
        eng.stop()
        decode_graphs.DecodeGraphs._lookup = lookup
    steps = sum(counts.values())
    return {"pad_decode_rows": pad, "static_steps": steps, **{k: counts[k] for k in ("warm-up", "capture", "replay")},
            "replay_share": round(counts["replay"] / max(1, steps), 3), "keys": eng.graphs.new_keys}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=28)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--max-batch-size", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--out", type=Path, default=RESULTS / f"decode-keys-{time.strftime('%Y-%m-%d')}.json")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model = default_model_path(DEFAULT_HOME)
    ensure_model(model)
    rows = [closed_loop(model, pad, args.concurrency, args.requests, args.max_batch_size, args.new_tokens)
            for pad in (False, True)]
    for r in rows:
        print(json.dumps(r))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"info": {**run_info(), "args": {k: str(v) for k, v in vars(args).items()}},
                                    "rows": rows}, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
