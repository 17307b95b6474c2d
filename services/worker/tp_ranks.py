"""Starting a tensor-parallel worker's ranks (VALORA_TP_SIZE > 1; tensor_parallel.py, engine.py).

The worker process is rank 0: it serves gRPC and drives its Engine as the group's leader. It
spawns ranks 1..N-1 as processes (multiprocessing "spawn": a fresh interpreter, no forked
threads or CUDA state); each joins the group (`init_tp_group` on loopback: gloo on CPU, NCCL +
a gloo event group on CUDA), builds its Engine over its shard on its device (`cuda` → cuda:i,
`cuda:N` → cuda:N+i, `cpu` → cpu), reports ready through a pipe, and runs until its engine
loop ends — when rank 0's stop reaches it, or when a collective fails (rank 0 gone: the
loopback connections close). Followers open no port and ignore SIGINT/SIGTERM: the worker's
stop (rank 0's engine stop, broadcast at the next step) is what ends them, so a Ctrl-C on the
terminal's process group does not kill them mid-collective.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import multiprocessing.connection
import signal
import time
import traceback

import structlog
import torch.distributed as dist

from services.common.server import freeze_startup_heap

log = structlog.get_logger()


def rank_device(device: str, rank: int) -> str:
    """The device of `rank`: cpu for every rank, cuda[:N] → cuda:(N + rank)."""
    kind, _, index = device.partition(":")
    if kind == "cpu":
        return "cpu"
    return f"cuda:{int(index or 0) + rank}"


def init_rank(settings, rank: int):
    """Joins the group as `rank` (blocks until every rank joined, up to the group timeout)."""
    import torch

    from services.worker.tensor_parallel import init_tp_group

    device = torch.device(rank_device(settings.device, rank))
    return init_tp_group(rank, settings.tp_size, settings.tp_port, device=device, timeout_s=settings.tp_timeout_s)


def build_rank_engine(settings, rank: int, tp, worker_name: str = ""):
    """The rank's Engine (not started): rank_device's device, this rank's TPGroup."""
    from services.worker.engine import Engine
    from services.worker.config import engine_config, prepare_kernels

    prepare_kernels(settings)
    config = engine_config(settings, worker_name)
    return Engine(dataclasses.replace(config, device=rank_device(settings.device, rank), tp=tp))


def install_leader_table(settings, rank: int, table_json: dict | None) -> None:
    """Installs, for this rank's device, the ATMM tile table rank 0 got from the adapter store
    (every rank of a group runs on the same GPU model, so one fetch serves them all); None: the
    rank keeps the committed table, as rank 0 did."""
    if table_json is None:
        return
    import torch

    from kernels import atmm
    from kernels.tile_table import TileTable

    atmm.use_table(rank_device(settings.device, rank), getattr(torch, settings.dtype), TileTable.from_json(table_json))


def _follower(settings, rank: int, conn, table_json: dict | None = None) -> None:
    """A follower process: join, build, report ready (None) or the error (str), run, exit."""
    from services.common.logging import configure_logging

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(f"worker-tp{rank}", settings.log_level, settings.log_json)
    try:
        install_leader_table(settings, rank, table_json)
        tp = init_rank(settings, rank)
    except BaseException:
        conn.send(traceback.format_exc())
        raise
    try:
        try:
            engine = build_rank_engine(settings, rank, tp)
            engine.start()
        except BaseException:
            conn.send(traceback.format_exc())
            raise
        conn.send(None)
        log.info("heap_frozen", objects=freeze_startup_heap())
        engine.stop(timeout=None)  # a follower's loop ends on rank 0's stop (or a failed collective)
        log.info("tp_follower_stopped", rank=rank, error=repr(engine._error) if engine._error else "")
        if engine._error is not None:
            raise SystemExit(1)
    finally:
        dist.destroy_process_group()


class Followers:
    """Ranks 1..N-1 of this worker, as processes."""

    def __init__(self, settings, table_json: dict | None = None) -> None:
        """table_json: the tile table rank 0 installed from the store (install_leader_table)."""
        ctx = mp.get_context("spawn")
        self._conns = []
        self.procs = []
        for rank in range(1, settings.tp_size):
            parent, child = ctx.Pipe(duplex=False)
            # daemon: if rank 0 exits without its shutdown (a crash), multiprocessing's atexit
            # terminates them instead of joining processes blocked in a collective with it.
            p = ctx.Process(
                target=_follower, args=(settings, rank, child, table_json), name=f"valora-tp{rank}", daemon=True
            )
            p.start()
            child.close()
            self.procs.append(p)
            self._conns.append(parent)

    def wait_ready(self, timeout_s: float) -> None:
        """Returns once every follower built and started its engine; raises RuntimeError (and stops
        them) if one failed, exited or is not ready within timeout_s."""
        pending = dict(zip(self._conns, self.procs))
        deadline = time.monotonic() + timeout_s
        while pending:
            # A follower's pipe is readable once it reported, or at EOF once it exited.
            ready = mp.connection.wait(list(pending), max(deadline - time.monotonic(), 0))
            if not ready:
                self.terminate()
                raise RuntimeError(
                    f"tensor-parallel followers not ready after {timeout_s:.0f} s: "
                    f"{', '.join(p.name for p in pending.values())}"
                )
            for conn in ready:
                proc = pending.pop(conn)
                try:
                    error = conn.recv()
                except EOFError:
                    proc.join(5)
                    error = f"exited with code {proc.exitcode}"
                if error is not None:
                    self.terminate()
                    raise RuntimeError(f"tensor-parallel follower {proc.name} failed at start-up: {error}")

    def dead(self) -> list[str]:
        """Followers that exited, as 'name (exit code)'."""
        return [f"{p.name} (exit code {p.exitcode})" for p in self.procs if not p.is_alive()]

    def join(self, timeout_s: float) -> None:
        """Waits for the followers to exit (their loop ends on rank 0's stop); terminates stragglers."""
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(deadline - time.monotonic(), 0))
        stragglers = [p.name for p in self.procs if p.is_alive()]
        if stragglers:
            log.warning("tp_followers_terminated", followers=stragglers)
        self.terminate()

    def terminate(self) -> None:
        """Kills the followers still running (SIGKILL: they ignore SIGTERM) and reaps them."""
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join()
        for conn in self._conns:
            conn.close()
