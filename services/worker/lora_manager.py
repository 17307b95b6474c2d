"""The adapters of one worker and its mode: the one owner of an adapter's way host -> resident
(a device slot, AdapterPool) -> pinned (held by running requests) -> merged (folded into the base
weights by the switcher, in MERGED or MIXTURE mode).

Every change is a `Command` (a method of LoraManager by name, and its arguments): the engine runs
adapter-pool changes at once in one process, and on its thread at a step boundary when tensor
parallel (every rank applies the same commands in the same order, so slots and LRU order stay
alike); mode changes always on its thread, between fully processed steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.adapter_format import BaseModelShapes
from services.common.errors import FailedPrecondition, invalid_field
from services.worker.adapter_weights import AdapterWeights, parse_bundle
from services.worker.adapter_pool import AdapterPool
from services.worker.lora_plans import LoraPlanner
from services.common.modes import Mode
from services.worker.switcher import Switcher
from services.worker.tensor_parallel import GroupBroken, TPGroup
from services.worker.tp_sharding import shard_adapter


@dataclass(frozen=True)
class Command:
    """One change to the adapters or the mode: LoraManager.`name`(*args). What rank 0 broadcasts
    to tensor-parallel followers."""

    name: str
    args: tuple = ()


COMMANDS = ("load", "add", "to_device", "offload", "apply_mode", "switch")


class LoraManager:
    def __init__(
        self,
        pool: AdapterPool,
        planner: LoraPlanner,
        lora_layers: dict,
        shapes: BaseModelShapes,
        max_rank: int,
        switch_strategy: str,
        tp: TPGroup | None,
    ) -> None:
        self.pool, self.planner, self.lora_layers = pool, planner, lora_layers
        self.shapes, self.max_rank, self.switch_strategy, self.tp = shapes, max_rank, switch_strategy, tp
        self.mode = Mode.UNMERGED
        self._switcher: Switcher | None = None

    @property
    def merged(self) -> str | None:
        return self.planner.merged

    def run(self, command: Command):
        """Applies `command`. Tensor parallel (on the engine thread, every rank at the same step):
        the ranks agree on its outcome; one that failed on some ranks only left their adapters or
        modes different, which no later step can undo: GroupBroken (the engine stops; the worker
        goes NOT_SERVING)."""
        if self.tp is None:
            return self.apply(command)
        error = result = None
        try:
            result = self.apply(command)
        except Exception as exc:  # the ranks agree first
            error = exc
        verdict = self.tp.agree(error)
        if verdict.failed and len(verdict.failed) < self.tp.world_size:
            raise GroupBroken(
                f"command {command.name} failed on tensor-parallel rank(s) {sorted(verdict.failed)} "
                f"only, the ranks' adapters or modes now differ: {verdict.failed}"
            ) from error
        if error is not None:
            raise error
        return result

    def apply(self, command: Command):
        """LoraManager.`command.name`(*command.args), here (no agreement)."""
        if command.name not in COMMANDS:
            raise ValueError(f"unknown adapter command {command.name!r}")
        return getattr(self, command.name)(*command.args)

    # -- the pool ----------------------------------------------------------------------------
    def load(
        self,
        name: str,
        sha256: str,
        data: bytes,
        config_json: str,
        head_labels: dict[str, list[str]] | None,
        to_device: bool,
        evict: tuple[str, ...] = (),
    ) -> bool:
        """Validates and adds an adapter bundle; False if that version was already loaded.
        `evict`: host adapters to drop first to keep the host pool in its budget (chosen where
        the load was asked, so that every tensor-parallel rank drops the same ones); one that a
        request holds or that is merged by now stays."""
        if self.pool.has(name):
            if to_device:
                self.pool.to_device(name)
            return False
        for victim in evict:
            if victim != self.merged and self.pool.has(victim) and not self.pool.pinned(victim):
                self.pool.remove(victim)
        weights = parse_bundle(name, sha256, data, config_json, self.shapes, self.max_rank, head_labels)
        added = self.add(weights)  # validated at full shape, then (tensor parallel) this rank's shard
        if to_device:
            self.pool.to_device(name)
        return added

    def add(self, weights: AdapterWeights) -> bool:
        """Adds full-shape adapter weights (tensor parallel: this rank's shard)."""
        return self.pool.add(weights if self.tp is None else shard_adapter(weights, self.tp))

    def to_device(self, name: str) -> int | None:
        return self.pool.to_device(name)

    def offload(self, name: str) -> None:
        if name == self.merged:
            raise FailedPrecondition(
                f"adapter {name} is merged into the base weights; change mode first", reason="ADAPTER_MERGED"
            )
        self.pool.remove(name)

    # -- modes -------------------------------------------------------------------------------
    def check_mode(self, mode: Mode, merged: str | None) -> str | None:
        """The adapter a mode change merges (None: unmerged), or INVALID_ARGUMENT / NOT_FOUND."""
        if mode not in (Mode.UNMERGED, Mode.MERGED, Mode.MIXTURE):
            raise invalid_field("mode", f"cannot switch to {mode.value}")
        if mode == Mode.UNMERGED:
            return None
        if not merged:
            raise invalid_field("merged_adapter", f"{mode.value} needs the adapter to merge")
        self.pool.get(merged)
        return merged

    def switch(self, to: str, expected: str | None) -> bool:
        """Replaces the merged adapter by `to`, keeping the mode; False when it is merged already."""
        if self.merged == to:
            return False
        if self.merged is None:
            raise FailedPrecondition("no adapter is merged; merge one first", reason="NOTHING_MERGED")
        if expected is not None and self.merged != expected:
            raise FailedPrecondition(f"{self.merged} is merged, not {expected}", reason="MERGED_ADAPTER_MISMATCH")
        self.apply_mode(self.mode, to)
        return True

    def apply_mode(self, mode: Mode, merged: str | None) -> None:
        """UNMERGED, or MERGED/MIXTURE with `merged` folded into the base weights (in place, by the
        switcher); the merged adapter holds its device slot while merged."""
        previous = self.merged
        target = None
        if merged is not None:
            slot = self.pool.acquire(merged)
            if slot is None:
                raise FailedPrecondition(
                    "every device slot is held by running requests; cannot merge",
                    reason="NO_DEVICE_SLOT",
                    retry_after_s=0.5,
                )
            target = self.pool.slot(slot)
            target.wait()  # the switch kernels read the slot after its upload
        try:
            if self._switcher is None and target is not None:
                self._switcher = Switcher(self.lora_layers, strategy=self.switch_strategy)
            if self._switcher is not None:
                self._switcher.set(target)
        except BaseException:
            if merged is not None:
                self.pool.release(merged)
            raise
        if previous is not None:
            self.pool.release(previous)
        self.planner.merged, self.mode = merged, mode
        self.planner.drop_stale()
