"""The worker's watchdog: health follows the engine thread, a tensor-parallel worker's follower
processes and the engine loop's heartbeat; each period it also samples the engine's gauges
(worker_metrics.py). Started once the engine is loaded (startup.py)."""

from __future__ import annotations

import asyncio
import time

import structlog

from services.common.server import Service
from services.worker import worker_metrics

log = structlog.get_logger()


async def watch_engine(service: Service, servicer, stall_s: float, period_s: float = 0.5) -> None:
    """Health follows the engine thread (and a tensor-parallel worker's follower processes):
    as soon as one dies, NOT_SERVING and the process fails (it drains and exits non-zero, so its
    supervisor starts it again). An engine loop that began no step for `stall_s` seconds (a hung
    device, a deadlock) is NOT_SERVING until it beats again (0: not watched). `servicer`: the
    WorkerServicer (server.py) whose engine, followers and worker_name it reads."""
    stalled, steps_seen, lora_info = False, (0, 0), None
    while True:
        await asyncio.sleep(period_s)
        if servicer.engine is not None:  # nothing here takes the engine's lock: a stuck engine may hold it
            engine, name = servicer.engine, servicer.worker_name
            lora_info = worker_metrics.lora_requests_info(engine, name, lora_info)
            worker_metrics.engine_gauges(engine, name)
            steps_seen = worker_metrics.engine_step_metrics(engine, name, steps_seen)
        if servicer.engine is not None and not servicer.engine.alive:
            await service.set_serving(False)
            service.fail("the engine thread died")
            return
        dead = servicer.followers.dead() if servicer.followers is not None else []
        if dead:  # rank 0's engine fails at its next collective with the lost rank, or at the group timeout
            log.error("tp_follower_died", followers=dead)
            await service.set_serving(False)
            service.fail(f"tensor-parallel followers died: {dead}")
            return
        if servicer.engine is not None and stall_s > 0:
            idle = time.monotonic() - servicer.engine.beat
            if idle > stall_s and not stalled and service.serving:
                stalled = True
                log.error("engine_stalled", seconds=round(idle, 1))
                await service.set_serving(False)
            elif idle <= stall_s and stalled:
                stalled = False
                log.warning("engine_resumed")
                if not service.stopping:
                    await service.set_serving(True)
