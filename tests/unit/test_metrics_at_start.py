"""Series counted per event (mode switches, finished reasons, status codes, adapter swaps) are
exported at zero from start-up where their label values are known, as vLLM's are, so rate()
and increase() see them before their first event: a fresh process's scrape lists them."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRAPE = textwrap.dedent("""
    import asyncio, socket, urllib.request
    from services.common.metrics import start_metrics_server
    from services.gateway.config import GatewaySettings
    from services.gateway.server import create_server as gateway
    from services.scheduler.config import SchedulerSettings
    from services.scheduler.server import create_server as scheduler
    from services.worker.config import WorkerSettings
    from services.worker.server import create_server as worker

    async def main():
        services = [await gateway(GatewaySettings(port=0, http_enabled=False)),
                    await scheduler(SchedulerSettings(port=0)),
                    await worker(WorkerSettings(port=0, worker_name="w0"))]  # built, not started: no model
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        start_metrics_server(port)
        print(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode())
        for s in services:
            await s.stop(0)

    asyncio.run(main())
""")


def test_a_fresh_scrape_lists_event_counters_at_zero():
    out = subprocess.run([sys.executable, "-c", SCRAPE], capture_output=True, text=True, timeout=240, check=True)
    lines = set(out.stdout.splitlines())
    expected = [
        *(
            f'valora:requests_total{{code="{code}",service="{service}"}} 0.0'
            for service in ("gateway", "scheduler")
            for code in (
                "OK",
                "INVALID_ARGUMENT",
                "RESOURCE_EXHAUSTED",
                "UNAVAILABLE",
                "CANCELLED",
                "DEADLINE_EXCEEDED",
            )
        ),
        *(f'valora:mode_switches_total{{kind="{kind}",worker="w0"}} 0.0' for kind in ("merge", "unmerge", "switch")),
        *(f'valora:request_success_total{{finished_reason="{r}",worker="w0"}} 0.0' for r in ("stop", "length")),
        *(f'valora:adapter_swaps_total{{direction="{d}",worker="w0"}} 0.0' for d in ("in", "out")),
        'valora:prompt_tokens_total{worker="w0"} 0.0',
        'valora:generation_tokens_total{worker="w0"} 0.0',
        'valora:request_prompt_tokens_count{worker="w0"} 0.0',
        'valora:request_inference_time_seconds_count{worker="w0"} 0.0',
        'valora:num_preemptions_total{worker="w0"} 0.0',
        'valora:iteration_tokens_total_count{worker="w0"} 0.0',
        *(f'valora:adapter_load_seconds_count{{stage="{s}",worker="w0"}} 0.0' for s in ("fetch", "load")),
        *(f'valora:engine_step_seconds_count{{kind="{k}",worker="w0"}} 0.0' for k in ("prefill", "decode")),
    ]
    missing = [line for line in expected if line not in lines]
    assert not missing, missing
