"""What request preprocessing on the worker's threads costs its engine thread (CPU only).

An engine-like loop (Python plus small CPU torch ops, as the engine thread's host work) is timed
alone, then while K threads prepare 448 px images for the Qwen2-VL-7B processor in a loop (the
worker's default), then while a `Preprocessor` of K processes does the same work
(VALORA_PREPROCESS_PROCESSES). Reported: the loop's speed as a fraction of alone. Keep K below the
machine's cores so that the loop is slowed by the GIL, not by a shared core.

    python -m bench.prepare_gil --threads 1 --name prepare-gil-<commit>
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import save
from bench.scale_bench import random_png
from services.worker.model import load_processor
from services.worker.preprocess import Preprocessor, process_request, work_request_from_pb
from services.worker.tiny_model import ensure_shape_model
from valora_protos.internal.v1 import work_pb2
from valora_protos.v1 import types_pb2


def engine_like_loop(seconds: float) -> int:
    x, n, end = torch.zeros(8), 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(100):
            x = x + 1
        n += 1
    return n


def png_items(n: int, size: int) -> list[work_pb2.WorkItem]:
    return [
        work_pb2.WorkItem(
            request_id=f"r{i}",
            prompt="Describe the image.",
            images=[types_pb2.Image(data=random_png(np.random.default_rng(i), size))],
        )
        for i in range(n)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="K: preparing threads, then processes")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--image-size", type=int, default=448)
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    model = ensure_shape_model(Path(tempfile.mkdtemp()) / "qwen2-vl-7b", "qwen2-vl-7b")
    processor = load_processor(model)
    items = png_items(8, args.image_size)
    t0 = time.perf_counter()
    for it in items:
        process_request(processor, work_request_from_pb(it, None), torch.bfloat16)
    prepare_ms = (time.perf_counter() - t0) * 1e3 / len(items)
    alone = engine_like_loop(args.seconds)

    stop = threading.Event()
    done = [0]

    def preparer():
        i = 0
        while not stop.is_set():
            process_request(processor, work_request_from_pb(items[i % len(items)], None), torch.bfloat16)
            i += 1
            done[0] += 1

    threads = [threading.Thread(target=preparer) for _ in range(args.threads)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    n0 = done[0]
    beside_threads = engine_like_loop(args.seconds)
    thread_rate = (done[0] - n0) / args.seconds
    stop.set()
    for t in threads:
        t.join()

    pre = Preprocessor(model, args.threads, torch.bfloat16)
    result = {}

    async def pooled():
        await pre.start()
        busy, count = True, [0]

        async def feed(k):
            i = k
            while busy:
                await pre.prepare(items[i % len(items)], None)
                count[0] += 1
                i += args.threads

        tasks = [asyncio.create_task(feed(k)) for k in range(args.threads)]
        await asyncio.sleep(0.3)
        c0 = count[0]
        loop = asyncio.get_running_loop()
        result["loop"] = await loop.run_in_executor(None, engine_like_loop, args.seconds)
        result["rate"] = (count[0] - c0) / args.seconds
        busy = False
        await asyncio.gather(*tasks)

    try:
        asyncio.run(pooled())
    finally:
        pre.close()
    out = {
        "image_size": args.image_size,
        "k": args.threads,
        "prepare_ms_per_image": round(prepare_ms, 2),
        "loop_alone": alone,
        "loop_beside_threads": round(beside_threads / alone, 3),
        "threads_images_per_s": round(thread_rate, 1),
        "loop_beside_processes": round(result["loop"] / alone, 3),
        "processes_images_per_s": round(result["rate"], 1),
    }
    print(out)
    save(args.name or "prepare-gil", out)


if __name__ == "__main__":
    main()
