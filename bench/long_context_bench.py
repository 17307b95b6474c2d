"""Short streams beside one long request in one engine (issue 19's long-context check).

`--short` image requests stream `--short-tokens` new tokens each; once every one has its first
token (or one has ended), one `--long-tokens`-token text request joins them (batch `--batch`). Its prompt is prefilled
in chunks of `--max-prefill-tokens` beside the streams (mixed steps: they decode in those
forwards). Everything must finish without a failure and inside the KV pool. Reported: each
stream's longest gap between two tokens while the long prompt was prefilled (what its chunks
stall a stream), the long request's time to first token, the peak KV bytes against the pool, the
failures (the exit status is 1 when any request failed).

    python -m bench.long_context_bench                       # 7B shape, random weights, cuda
    python -m bench.long_context_bench --arch tiny --device cpu --long-tokens 3000   # a smoke run
"""

from __future__ import annotations

import argparse
import faulthandler
import queue
import signal
import sys
import threading
import time
from pathlib import Path

from bench.common import RESULTS, save
from services.worker.engine import Engine, EngineConfig
from services.worker.model import ensure_shape_model, ensure_tiny_model
from services.worker.requests import Failed, Finished, WorkRequest
from services.worker.testing import random_image


def long_prompt(eng: Engine, tokens: int) -> tuple[str, int]:
    """A text prompt of about `tokens` tokens and its exact count (the engine's own intake's)."""
    probe = lambda words: eng.prepare(WorkRequest("probe", "lorem " * words, [], max_new_tokens=1)).prompt_tokens
    fixed = probe(0)  # the chat template's own tokens
    words = max(1, round((tokens - fixed) / ((probe(100) - fixed) / 100)))
    return "lorem " * words, probe(words)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen2-vl-7b", help="a shape model (random weights) or tiny")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--short", type=int, default=31)
    ap.add_argument("--short-tokens", type=int, default=96)
    ap.add_argument("--long-tokens", type=int, default=16000)
    ap.add_argument("--long-new", type=int, default=16)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-prefill-tokens", type=int, default=8192)
    ap.add_argument("--no-mixed-steps", action="store_true")
    ap.add_argument("--timeout-s", type=float, default=300)
    ap.add_argument("--model-dir", type=Path, default=None, help="default: ~/.cache/valora/<arch>")
    ap.add_argument("--name", default=None)
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    # a run its caller times out (SIGTERM) leaves every thread's stack in the log: where it stood
    faulthandler.register(signal.SIGTERM, file=sys.stderr, all_threads=True, chain=True)

    model_dir = args.model_dir or Path(f"~/.cache/valora/{args.arch}").expanduser()
    tiny = args.arch == "tiny"
    ensure_tiny_model(model_dir) if tiny else ensure_shape_model(model_dir, args.arch)
    cuda = args.device.startswith("cuda")
    eng = Engine(
        EngineConfig(
            model_path=model_dir,
            device=args.device,
            dtype="bfloat16" if cuda else "float32",
            load_format="auto" if tiny else "dummy",
            max_batch_size=args.batch,
            max_prefills_per_step=4,
            max_prefill_tokens=args.max_prefill_tokens,
            mixed_steps=not args.no_mixed_steps,
            max_new_tokens_limit=max(1024, args.short_tokens),
            decode_graphs="auto" if cuda else "static",
        )
    )
    eng.eos_ids = set()  # every stream runs its full length (random weights)
    eng.start()
    times: dict[str, list[float]] = {}
    ended: queue.Queue = queue.Queue()
    failures: dict[str, str] = {}

    def submit(r: WorkRequest) -> None:
        def sink(ev):  # token times from the result: a random-weights stream's text may lag its tokens
            if isinstance(ev, Finished):
                times[r.request_id] = ev.result.token_times
            elif isinstance(ev, Failed):
                failures[r.request_id] = repr(ev.error)[:300]
            if isinstance(ev, (Finished, Failed)):
                ended.put(r.request_id)

        eng.submit(eng.prepare(r), sink)

    peak = [0]
    polling = threading.Event()

    def poll() -> None:
        last = time.monotonic()
        while not polling.is_set():
            st = eng.stats()
            peak[0] = max(peak[0], st.kv_cache_bytes)
            if time.monotonic() - last > 5:  # a stalled run shows where it stands in the log
                last = time.monotonic()
                print(
                    f"progress: steps {eng.steps}, running {st.running}, waiting {st.waiting}, "
                    f"ended {ended.qsize()}, last step {st.last_step_ms:.1f} ms, alive {st.alive}",
                    flush=True,
                )
            time.sleep(0.002)

    threading.Thread(target=poll, daemon=True).start()
    try:
        text, prompt = long_prompt(eng, args.long_tokens)
        # warm-up: one short and one long-ish request, so graph captures stay out of the measured run
        for r in (
            WorkRequest("warm-short", "Describe it.", [random_image(99)], max_new_tokens=4),
            WorkRequest("warm-long", text[: len(text) // 4], [], max_new_tokens=2),
        ):
            submit(r)
            ended.get(timeout=args.timeout_s)
        failures.clear()
        peak[0] = 0
        t0 = time.monotonic()
        for i in range(args.short):
            submit(
                WorkRequest(f"short-{i}", f"Describe image {i}.", [random_image(i)], max_new_tokens=args.short_tokens)
            )
        deadline = time.monotonic() + args.timeout_s

        def decoding() -> int:  # streams with a token (a read of the engine's list: a bench's peek)
            return sum(1 for s in list(eng.sched.running) if s.tokens and s.req.request_id.startswith("short-"))

        while decoding() < args.short and not ended.qsize() and time.monotonic() < deadline:
            time.sleep(0.001)
        t_long = time.monotonic()
        submit(WorkRequest("long", text, [], max_new_tokens=args.long_new))
        for _ in range(args.short + 1):
            ended.get(timeout=args.timeout_s)
        wall = time.monotonic() - t0
    finally:
        polling.set()
        eng.stop()
    long_first = times["long"][0] if times.get("long") else None
    window = (t_long, long_first or t_long)  # while the long prompt was prefilled
    gaps = []
    for rid, ts in times.items():
        if not rid.startswith("short-"):
            continue
        inside = [b - a for a, b in zip(ts, ts[1:]) if b >= window[0] and a <= window[1]]
        gaps.append(max(inside, default=0.0) * 1e3)
    pool = eng.kv_pool.num_blocks * eng.kv_pool.block_bytes
    result = {
        "workload": {
            k: getattr(args, k)
            for k in (
                "arch",
                "device",
                "short",
                "short_tokens",
                "long_tokens",
                "long_new",
                "batch",
                "max_prefill_tokens",
            )
        },
        "mixed_steps": not args.no_mixed_steps,
        "long_prompt_tokens": prompt,
        "finished": sum(1 for r in times if r.startswith(("short-", "long"))) - len(failures),
        "failures": failures,
        "wall_s": round(wall, 3),
        "long_ttft_ms": None if long_first is None else round((long_first - t_long) * 1e3, 1),
        "short_max_gap_ms": {"p50": round(sorted(gaps)[len(gaps) // 2], 1), "max": round(max(gaps), 1)},
        "kv_peak_bytes": peak[0],
        "kv_pool_bytes": pool,
        "kv_peak_share": round(peak[0] / pool, 4),
        "kv_used_after": eng.kv.used_blocks,
    }
    save(args.name or f"long-context-{args.arch}", result, args.out_dir)
    print(result)
    if failures or result["kv_used_after"]:
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
