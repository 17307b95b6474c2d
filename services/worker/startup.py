"""The worker's start-up and shutdown, hooked to the service create_server builds (server.py):
the ATMM tile table from the adapter store, the model checked, the engine built (one rank, or rank
0 of a tensor-parallel group whose followers it spawns, tp_ranks.py), the preprocessing
processes, the watchdog (watchdog.py), and the registration with the scheduler. The engine,
followers and preprocessor it builds are the servicer's (`servicer.engine`, ...).
"""

from __future__ import annotations

import asyncio
import functools
import json
from pathlib import Path

import structlog
import torch.distributed as dist

from services.common.channels import client_credentials
from services.common.internal_auth import internal_token
from services.common.server import Service, channel_options
from services.worker.architectures import architecture_of
from services.worker.config import WorkerSettings, check_tp_size, engine_config, prepare_kernels
from services.worker.engine import Engine
from services.worker.preprocess import Preprocessor
from services.worker.registration import SchedulerRegistration
from services.worker.store_client import AdapterFetcher
from services.worker.tensor_parallel import free_loopback_port
from services.worker.tiny_model import ensure_tiny_model
from services.worker.tp_ranks import Followers, build_rank_engine, init_rank
from services.worker.watchdog import watch_engine

log = structlog.get_logger()


async def install_tile_table(settings: WorkerSettings, fetcher: AdapterFetcher, timeout_s: float = 10.0) -> str | None:
    """CUDA bf16/fp16 workers ask the adapter store for the ATMM tile table of their GPU name/arch
    and dtype (the key `kernels.tile_search` writes) and install it for `kernels.atmm`. Without
    one (none stored, no store configured, the store unreachable or the table invalid) the
    committed JSON or the heuristics stay; a store problem is a warning, never fatal. Returns
    where the table in use comes from ("store", "committed", "heuristics"); None on CPU/fp32
    (nothing CUDA is imported)."""
    if not settings.device.startswith("cuda") or settings.dtype not in ("bfloat16", "float16"):
        return None
    import torch  # CUDA workers only

    from kernels import atmm
    from kernels.tile_table import TABLE_DIR, TileTable, table_filename

    loop = asyncio.get_running_loop()
    gpu, arch = await loop.run_in_executor(None, atmm.gpu_key, settings.device)
    dtype = getattr(torch, settings.dtype)
    key = {"gpu": gpu, "arch": arch, "dtype": settings.dtype}
    if fetcher.store_address:
        try:
            stored = await fetcher.get_tile_table(gpu, arch, settings.dtype, timeout_s=timeout_s)
            if stored is not None:
                table = TileTable.from_json(json.loads(stored.table_json))
                atmm.use_table(settings.device, dtype, table)
                log.info("tile_table", source="store", sha256=stored.sha256, buckets=len(table.entries), **key)
                return "store"
        except Exception as exc:  # start-up goes on with the committed table
            log.warning("tile_table_fetch_failed", error=f"{type(exc).__name__}: {exc}", **key)
    committed = (TABLE_DIR / table_filename(gpu, arch, settings.dtype)).is_file()
    source = "committed" if committed else "heuristics"
    log.info("tile_table", source=source, file=table_filename(gpu, arch, settings.dtype) if committed else "", **key)
    return source


def store_table_json(settings: WorkerSettings) -> dict:
    """The tile table `install_tile_table` installed from the store, as JSON (for the TP followers)."""
    import torch

    from kernels import atmm

    return atmm.default_table(torch.device(settings.device), getattr(torch, settings.dtype)).to_json()


def build_engine(settings: WorkerSettings, servicer, table_source: str | None) -> Engine:
    """The model checked (built when it is the tiny one and allowed), then this process's engine
    (one rank, or rank 0 of a tensor-parallel group: `build_tp_leader`), started. Blocking."""
    path = Path(settings.model_path).expanduser()
    if not (path / "config.json").exists():
        if not settings.build_tiny_model:
            raise FileNotFoundError(f"no model at {path} (VALORA_MODEL_PATH)")
        ensure_tiny_model(path)
    architecture_of(path)  # an unsupported family is refused before any rank starts
    check_tp_size(settings, path)
    if settings.tp_size == 1:
        prepare_kernels(settings)
        engine = Engine(engine_config(settings, servicer.worker_name))
    else:
        engine = build_tp_leader(settings, servicer, table_source)
    engine.start()
    return engine


def build_tp_leader(settings: WorkerSettings, servicer, table_source: str | None) -> Engine:
    """Spawns the followers (servicer.followers), joins the group as rank 0, builds this rank's
    engine and waits for theirs (an engine loop must not start before every rank runs one)."""
    tp_settings = settings.model_copy(update={"tp_port": settings.tp_port or free_loopback_port()})
    servicer.followers = Followers(tp_settings, store_table_json(settings) if table_source == "store" else None)
    try:
        tp = init_rank(tp_settings, 0)
        try:
            engine = build_rank_engine(tp_settings, 0, tp, servicer.worker_name)
            servicer.followers.wait_ready(tp_settings.tp_timeout_s)
        except BaseException:
            dist.destroy_process_group()
            raise
    except BaseException:
        servicer.followers.terminate()
        raise
    log.info(
        "tp_ranks_ready",
        tp_size=settings.tp_size,
        tp_port=tp_settings.tp_port,
        followers=[p.pid for p in servicer.followers.procs],
    )
    return engine


async def load_engine(
    settings: WorkerSettings, servicer, fetcher: AdapterFetcher, service: Service, watchdog: list[asyncio.Task]
) -> None:
    """The service's start: the tile table, the engine (executor), the preprocessing processes,
    then the watchdog (appended to `watchdog`)."""
    loop = asyncio.get_running_loop()
    table_source = None
    try:
        table_source = await install_tile_table(settings, fetcher)
    except Exception as exc:  # e.g. no CUDA device: the engine reports that itself
        log.warning("tile_table_failed", error=f"{type(exc).__name__}: {exc}")
    servicer.engine = await loop.run_in_executor(None, build_engine, settings, servicer, table_source)
    if settings.preprocess_processes:
        servicer.preprocessor = Preprocessor(
            Path(settings.model_path).expanduser(), settings.preprocess_processes, servicer.engine.intake.pixel_dtype
        )
        await servicer.preprocessor.start()
    log.info(
        "engine_ready",
        model=settings.model_path,
        device=settings.device,
        dtype=settings.dtype,
        tp_size=settings.tp_size,
    )
    watchdog.append(asyncio.create_task(watch_engine(service, servicer, settings.engine_stall_s)))


async def shutdown(servicer, fetcher: AdapterFetcher, watchdog: list[asyncio.Task]) -> None:
    """The service's stop: status streams ended, the watchdog cancelled, the engine (and a
    tensor-parallel group's followers), the preprocessing processes and the fetcher closed."""
    servicer.close_watches()
    for t in watchdog:
        t.cancel()
    loop = asyncio.get_running_loop()
    if servicer.engine is not None:
        # Tensor parallel: rank 0's stop reaches the followers at its loop's last step.
        await loop.run_in_executor(None, servicer.engine.stop)
    if servicer.followers is not None:
        await loop.run_in_executor(None, servicer.followers.join, 30.0)
        if dist.is_initialized():  # not when start-up failed (left already)
            dist.destroy_process_group()
    if servicer.preprocessor is not None:
        servicer.preprocessor.close()
    await fetcher.close()


def attach(service: Service, settings: WorkerSettings, servicer, fetcher: AdapterFetcher, tracing) -> None:
    """Hooks the engine's start-up and shutdown to `service` and, with a scheduler address, the
    registration with the scheduler (service.registration)."""
    watchdog: list[asyncio.Task] = []
    service.on_start.append(functools.partial(load_engine, settings, servicer, fetcher, service, watchdog))
    service.on_stop.append(functools.partial(shutdown, servicer, fetcher, watchdog))
    if settings.scheduler_address:
        # Registers once the engine is loaded; on_stop runs in reverse, so it leaves the pool first.
        registration = SchedulerRegistration(
            settings.scheduler_address,
            address=servicer.address,
            name=servicer.worker_name,
            device=settings.device,
            max_batch_size=settings.max_batch_size,
            heartbeat_s=settings.heartbeat_s,
            channel_options=channel_options(settings),
            tracer_provider=tracing,
            credentials=client_credentials(settings),
            token=internal_token(settings),
        )
        service.registration = registration
        service.on_start.append(registration.start)
        service.on_stop.append(registration.stop)
