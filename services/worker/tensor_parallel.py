"""Tensor parallelism's process group: the collectives of a worker whose language model spans
`world_size` devices (tp_sharding.py shards it), and how its ranks stay in lockstep.

`TPGroup` wraps the process group (world size 1: no communication) and the gloo event group
beside NCCL on GPUs; `init_tp_group` makes it (services/worker/tp_ranks.py starts the ranks).

The engine drives a TP group (engine.py, `EngineConfig.tp`), SPMD: one process per device, each
running its own Engine over its shard. At the start of every step rank 0 broadcasts
(`broadcast_object`, on the gloo group) what arrived from outside — requests (prepared, without
their raw images), commands (mode switches, adapter loads with their bytes, offloads,
make-resident), cancellations and deadline expiries decided on its clock, the stop — and every
rank applies the same events in the same order; every other decision follows from identical state
and the all-reduced outputs. Followers emit nothing; a random sampling seed is drawn once on rank 0.
Tested on CPU (2 gloo ranks, tests/unit/test_tp_engine.py, against the single-process engine) and
on 2 H200s over NCCL (tests/gpu/test_tp_engine_gpu.py).

A failure on one rank only (an out-of-memory, a shard's bad input) stays a failure of the
requests involved, as on one device: the rank that raised inside a forward still runs the rest of
its all-reduces, over zeros (`drain`, counted by the `Ledger`), so no rank waits in a collective
its peer left; and after every unit of device work the ranks compare their outcomes (`agree`, on
the gloo event group): when any rank failed, every rank raises (`TPStepFailed`, naming the rank and
its error), so all of them retry the same rows alone and fail the same ones; rows the output code
failed on one rank are failed on every rank at the next agreement (outputs.py). A rank that cannot
go on in step with the others (a collective failed: a rank died; a command failed on some ranks
only, so their adapters or modes differ) raises `GroupBroken`, which ends its engine loop: the
worker goes NOT_SERVING and exits non-zero (server.py's watchdog), as for any dead engine.
docs/engine.md ("Tensor parallelism") lists what the ranks agree on, and where.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import socket
from collections.abc import Mapping

import torch
import torch.distributed as dist

from services.common.errors import ValoraError


class GroupBroken(BaseException):
    """The tensor-parallel group cannot go on in lockstep: a collective failed (a rank died, the
    group timed out) or the ranks' states diverged. A BaseException: nothing that fails requests
    catches it; it ends the engine loop (the worker then goes NOT_SERVING and exits non-zero)."""


class TPStepFailed(ValoraError):
    """A unit of engine work (a forward, its tokens' choice) failed on another tensor-parallel
    rank, or on some ranks only: every rank raises this one, so all of them fail or retry the
    same requests (INTERNAL, ENGINE_STEP_FAILED, naming the rank and its error)."""


@dataclasses.dataclass
class Ledger:
    """A rank's count of the all-reduces it ran (eager; not those captured in a CUDA graph):
    how a forward that raised knows how many it still owes its peers (`TPGroup.drain`)."""

    all_reduces: int = 0


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the ranks agreed on after a unit of work (`TPGroup.agree`): the ranks whose unit
    raised (rank -> its error, as text) and the rows other ranks failed since the last
    agreement (sequence id -> why, naming the rank)."""

    failed: dict[int, str] = dataclasses.field(default_factory=dict)
    rows: dict[int, str] = dataclasses.field(default_factory=dict)

    def check(self, world_size: int, error: BaseException | None) -> None:
        """Raises unless every rank's unit ran: this rank's own error when every rank raised (the
        inputs' failure, the same everywhere), else TPStepFailed on every rank."""
        if not self.failed:
            return
        if error is not None and len(self.failed) == world_size:
            raise error
        where = "; ".join(f"rank {r}: {why}" for r, why in sorted(self.failed.items()))
        raise TPStepFailed(
            f"engine step failed on tensor-parallel rank{'s' if len(self.failed) > 1 else ''} "
            f"{', '.join(map(str, sorted(self.failed)))} of {world_size} ({where})",
            reason="ENGINE_STEP_FAILED",
        ) from error


def describe(error: BaseException, limit: int = 400) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclasses.dataclass(frozen=True)
class TPGroup:
    """This rank's place in the tensor-parallel group and its collectives (None: default group)."""

    rank: int = 0
    world_size: int = 1
    group: object = None
    # The group `broadcast_object` uses (None: `group`). init_tp_group gives an NCCL group a gloo
    # one over the same ranks: broadcast_object_list over NCCL stages the pickled bytes on the
    # device and reads their size on the host, which would wait for the decode step in flight at
    # every engine step (no pipelined decode).
    object_group: object = None
    ledger: Ledger = dataclasses.field(default_factory=Ledger, compare=False, repr=False)

    @classmethod
    def from_dist(cls, group=None) -> "TPGroup":
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(t, group=self.group)
            if not (t.is_cuda and torch.cuda.is_current_stream_capturing()):  # a replay runs it, not this call
                self.ledger.all_reduces += 1
        return t

    def drain(self, remaining: int, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        """After this rank raised inside a forward: its `remaining` all-reduces of that forward
        (each of `numel` elements), over zeros, so the other ranks' forward completes instead of
        waiting in a collective this rank left (their result is garbage: the agreement after the
        forward fails it everywhere). GroupBroken when even that fails (the group is gone)."""
        if self.world_size == 1 or remaining <= 0:
            return
        try:
            if device.type == "cuda":
                torch.cuda.empty_cache()  # an out-of-memory: room for the zeros
            zeros = torch.zeros(numel, dtype=dtype, device=device)
            for _ in range(remaining):
                dist.all_reduce(zeros, group=self.group)
                zeros.zero_()
        except Exception as exc:  # the ranks cannot get back in step
            raise GroupBroken(
                f"tensor-parallel rank {self.rank} could not finish a failed forward's collectives: {describe(exc)}"
            ) from exc

    def _events(self):
        """The group of the host-side collectives (the step events, the agreements)."""
        return self.group if self.object_group is None else self.object_group

    def agree(self, error: BaseException | None = None, rows: Mapping[int, str] | None = None) -> Verdict:
        """Every rank calls it at the same point, after the same unit of work (`error`: what this
        rank's raised, or None; `rows`: the sequences this rank failed since the last agreement,
        id -> why): one small all-reduce over the event group, and only when some rank failed
        something, the reasons. Verdict.check raises when any rank's unit failed. GroupBroken
        when the collective itself fails (a rank is gone)."""
        if self.world_size == 1:
            return Verdict({0: describe(error)} if error is not None else {})
        group = self._events()
        try:
            flags = torch.tensor([int(error is not None), int(bool(rows))], dtype=torch.long)
            if dist.get_backend(group) == "nccl":
                flags = flags.cuda()
            dist.all_reduce(flags, group=group)
            if not int(flags.sum()):
                return Verdict()
            everyone: list = [None] * self.world_size
            dist.all_gather_object(
                everyone, (None if error is None else describe(error), dict(rows or {})), group=group
            )
        except Exception as exc:  # the group is gone
            raise GroupBroken(
                f"tensor-parallel rank {self.rank}: the ranks' agreement failed: {describe(exc)}"
            ) from exc
        failed = {r: why for r, (why, _) in enumerate(everyone) if why is not None}
        others: dict[int, str] = {}
        for r, (_, theirs) in enumerate(everyone):
            if r != self.rank:
                for sid, why in theirs.items():
                    others.setdefault(sid, f"failed on tensor-parallel rank {r}: {why}")
        return Verdict(failed, others)

    def broadcast_(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.world_size > 1:
            dist.broadcast(t, src=src, group=self.group)
        return t

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's picklable `obj`, on every rank (the engine's per-step events). With NCCL the
        pickled bytes travel through the current CUDA device."""
        if self.world_size == 1:
            return obj
        group = self._events()
        box = [obj if self.rank == 0 else None]
        src = 0 if group is None else dist.get_global_rank(group, 0)
        try:
            dist.broadcast_object_list(box, src=src, group=group)
        except Exception as exc:  # a rank is gone: the engine cannot go on
            raise GroupBroken(
                f"tensor-parallel rank {self.rank}: the step's broadcast failed: {describe(exc)}"
            ) from exc
        return box[0]

    def min_int(self, n: int) -> int:
        """The smallest rank's `n`."""
        if self.world_size == 1:
            return n
        group = self._events()  # gloo when there is one
        t = torch.tensor([n], dtype=torch.long)
        if dist.get_backend(group) == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        return int(t.item())

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def part(self, n: int, what: str = "features") -> tuple[int, int]:
        """(start, length) of this rank's contiguous share of n; n must divide evenly."""
        if n % self.world_size:
            raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size {self.world_size}")
        size = n // self.world_size
        return self.rank * size, size

    def narrow(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's shard of t along dim, as its own contiguous tensor (the full one can be freed)."""
        if self.world_size == 1:
            return t
        start, size = self.part(t.shape[dim])
        return t.narrow(dim, start, size).clone(memory_format=torch.contiguous_format)


class ForwardLockstep:
    """A rank's units of work in step with its peers' (one process, `tp` None: no-ops). The
    model runner wraps each unit that holds a language-model forward: `agreed` runs it and the
    ranks agree on its outcome; `around` settles what a forward that raised on this rank owes.
    `collectives`: the all-reduces of one forward (one per row-parallel layer); `forward_ran`:
    set by the runner once a forward returned inside the unit."""

    def __init__(
        self, tp: TPGroup | None, collectives: int, hidden: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.tp, self.collectives, self.hidden, self.dtype, self.device = tp, collectives, hidden, dtype, device
        self.forward_ran = False

    def agreed(self, fn, *args, tokens: int = 0, settle=None):
        """fn(*args) as a unit of work every rank runs, in step whatever raises on one rank only:
        a forward of `tokens` tokens inside it (0: none) that raised on this rank still runs this
        rank's remaining all-reduces (`around`), and then the ranks agree: when fn raised on any
        rank, it raises on every rank (TPStepFailed, or the rank's own error when every rank
        raised). `settle(ok)`: told, before that, whether every rank's fn ran. One process:
        fn(*args)."""
        if self.tp is None:
            return fn(*args)
        error, out = None, None
        try:
            with self.around(tokens):
                out = fn(*args)
        except Exception as exc:  # every rank learns of it below
            error = exc
        verdict = self.tp.agree(error)
        if settle is not None:
            settle(not verdict.failed)
        verdict.check(self.tp.world_size, error)
        return out

    @contextlib.contextmanager
    def around(self, tokens: int):
        """Around one language-model forward of `tokens` tokens (0: none) and the host work around
        it: when it raises on this rank, the all-reduces the rank still owes its peers for it are
        run over zeros (TPGroup.drain) before the error goes on."""
        if self.tp is None or not tokens:
            yield
            return
        before, self.forward_ran = self.tp.ledger.all_reduces, False
        try:
            yield
        except Exception:
            # a forward replayed from a CUDA graph ran all of them (the ledger counts eager ones)
            owed = 0 if self.forward_ran else self.collectives - (self.tp.ledger.all_reduces - before)
            self.tp.drain(owed, tokens * self.hidden, self.dtype, self.device)
            raise


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_tp_group(
    rank: int,
    world_size: int,
    port: int,
    backend: str | None = None,
    device: torch.device | None = None,
    timeout_s: float = 300.0,
) -> TPGroup:
    """Joins the default process group on loopback (one host): gloo on CPU, NCCL on CUDA
    (keep NCCL_NVLS_ENABLE=0 in the environment on the lent H200 hosts) with a gloo group beside
    it for `broadcast_object`."""
    if backend is None:
        backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
    kw = {}
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's pairs on loopback too, not the hostname's address
    if backend == "nccl" and device is not None:
        torch.cuda.set_device(device)
        kw["device_id"] = device
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **kw,
    )
    tp = TPGroup.from_dist()
    if backend == "nccl":
        tp = dataclasses.replace(tp, object_group=dist.new_group(backend="gloo"))
    return tp


__all__ = [
    "GroupBroken",
    "Ledger",
    "TPGroup",
    "TPStepFailed",
    "Verdict",
    "describe",
    "free_loopback_port",
    "init_tp_group",
]
