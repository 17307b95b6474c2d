"""EventRelay: events from several threads reach their asyncio queues, each queue in put order."""

from __future__ import annotations

import asyncio
import threading

from services.worker.relay import EventRelay


def test_events_from_threads_arrive_in_order_per_queue():
    async def main():
        loop = asyncio.get_running_loop()
        relay = EventRelay(loop)
        queues = [asyncio.Queue() for _ in range(6)]

        def producer(k: int) -> None:  # thread k owns queues k and k + 3
            for i in range(500):
                relay.put(queues[k], i)
                relay.put(queues[k + 3], -i)
            relay.put(queues[k], None)
            relay.put(queues[k + 3], None)

        threads = [threading.Thread(target=producer, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()

        async def drain(q):
            out = []
            while (item := await q.get()) is not None:
                out.append(item)
            return out

        got = await asyncio.wait_for(asyncio.gather(*(drain(q) for q in queues)), 30)
        for t in threads:
            t.join()
        return got

    got = asyncio.run(main())
    assert got[:3] == [list(range(500))] * 3 and got[3:] == [[-i for i in range(500)]] * 3
