"""What handing engine events to the event loop costs the emitting thread (CPU only).

An engine-like thread emits one event per running request per step (32) into asyncio queues that
consumer tasks drain, with some Python work between steps; timed: the emitting thread's
microseconds per step with one `loop.call_soon_threadsafe` per event (the worker before) and
through `services.worker.relay.EventRelay` (one wake-up per burst).

    python -m bench.event_relay --name event-relay-<date>
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

from bench.common import save
from services.worker.relay import EventRelay


async def run(mode: str, steps: int, rows: int) -> dict:
    loop = asyncio.get_running_loop()
    queues = [asyncio.Queue() for _ in range(rows)]
    relay = EventRelay(loop)
    received = [0]

    async def consume(q: asyncio.Queue) -> None:
        while (await q.get()) is not None:
            received[0] += 1

    tasks = [asyncio.create_task(consume(q)) for q in queues]
    emit = [0.0]

    def engine() -> None:
        for _ in range(steps):
            t = time.perf_counter()
            for q in queues:
                if mode == "call_soon_threadsafe":
                    loop.call_soon_threadsafe(q.put_nowait, 1)
                else:
                    relay.put(q, 1)
            emit[0] += time.perf_counter() - t
            x = 0
            for i in range(3000):  # the rest of a step's host work
                x += i
        for q in queues:
            relay.put(q, None)

    t0 = time.perf_counter()
    thread = threading.Thread(target=engine)
    thread.start()
    await asyncio.gather(*tasks)
    thread.join()
    assert received[0] == steps * rows
    return {
        "method": mode,
        "emit_us_per_step": round(emit[0] * 1e6 / steps, 1),
        "wall_s": round(time.perf_counter() - t0, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    rows = [asyncio.run(run(m, args.steps, args.rows)) for m in ("call_soon_threadsafe", "relay") * 2]
    for r in rows:
        print(r)
    save(args.name or "event-relay", {"steps": args.steps, "rows_per_step": args.rows, "rows": rows})


if __name__ == "__main__":
    main()
