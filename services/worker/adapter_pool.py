"""The host/device adapter pool with LRU slots, over the weights of adapter_weights.py.

The pool keeps every loaded adapter in host memory by version name and copies up to
`device_slots` of them to the device; slots are recycled least-recently-used among adapters no
running request holds. Slot indices stay inside the worker. How the copies are made (pinned
packed buffers and a copy stream on CUDA) is adapter_staging.py's.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

import torch

from services.common.errors import AdapterNotFound, FailedPrecondition
from services.worker.adapter_staging import DeviceAdapter, HostCopy, staging_for
from services.worker.adapter_weights import AdapterWeights


class DeviceMemory(Protocol):
    """Memory resident adapters can live in (kv_cache.PoolMemory: the KV pool's blocks)."""

    def take(self, numel: int, dtype: torch.dtype) -> tuple[object, torch.Tensor] | None:
        """A lease and a flat (numel,) tensor of `dtype`, or None when there is no room."""

    def give(self, lease: object) -> None:
        """The lease's memory back."""


class AdapterPool:
    """Host adapters by version name + `device_slots` device copies with LRU reuse.

    Thread-safe: the server adds/removes host adapters; the engine thread acquires/releases
    device slots at step boundaries. A slot held by a running request is never evicted.
    On CUDA a slot's copy may still be in flight when `to_device`/`acquire` return: its reader
    calls `slot(i).wait()` first (see DeviceAdapter.wait).
    """

    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype,
        device_slots: int,
        on_swap: Callable[[str], None] | None = None,
        memory: DeviceMemory | None = None,
    ) -> None:
        """on_swap("in" | "out") is told about every host->device copy and eviction (metrics).
        `memory`: where resident adapters live (the engine's KV pool, kv_cache.PoolMemory): an
        upload takes a lease of it, evicting idle resident adapters while it has no room, and
        falls back to memory of its own when even that does not make room."""
        if device_slots < 1:
            raise ValueError("device_slots must be at least 1")
        self.device = device
        self.dtype = dtype
        self.num_slots = device_slots
        self._staging = staging_for(device, dtype)
        self._lock = threading.RLock()
        self._host: OrderedDict[str, HostCopy] = OrderedDict()  # LRU order (added or used), most recent last
        self._slots: list[DeviceAdapter | None] = [None] * device_slots
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # LRU order, most recent last
        self._pins: dict[str, int] = {}
        self._on_swap = on_swap or (lambda direction: None)
        self.memory = memory
        self.outside_memory = 0  # uploads that found no room in `memory` (their own allocation)

    @property
    def copy_stream(self) -> torch.cuda.Stream | None:
        """The stream host-to-device uploads run on (CUDA; None on CPU)."""
        return self._staging.stream()

    # -- host side -------------------------------------------------------------------------
    def add(self, weights: AdapterWeights) -> bool:
        """Adds to host memory; False when that version was already there. On CUDA the pool keeps
        a packed pinned copy in its dtype (made here, in the caller's thread): `get` returns that."""
        with self._lock:
            if weights.name in self._host:
                return False
        host = self._staging.host_copy(weights)  # outside the lock: copying and pinning take a while
        with self._lock:
            if weights.name in self._host:
                return False
            self._host[weights.name] = host
            return True

    def touch(self, name: str) -> None:
        """Marks a host adapter used now (host LRU order: what `host_victims` evicts last)."""
        with self._lock:
            if name in self._host:
                self._host.move_to_end(name)

    def host_bytes(self) -> int:
        with self._lock:
            return sum(h.nbytes for h in self._host.values())

    def host_victims(self, incoming: int, budget: int, keep: set[str]) -> list[str]:
        """Host adapters to drop, least recently used first, so that `incoming` more bytes fit
        in `budget` (0: unbounded): never one held by a request or in `keep`. Fewer (all there
        are) when even that does not make room."""
        if budget <= 0:
            return []
        with self._lock:
            used = self.host_bytes()
            out = []
            for name, host in self._host.items():
                if used + incoming <= budget:
                    break
                if self._pins.get(name) or name in keep:
                    continue
                out.append(name)
                used -= host.nbytes
            return out

    def get(self, name: str) -> AdapterWeights:
        with self._lock:
            return self._host_copy(name).weights

    def _host_copy(self, name: str) -> HostCopy:
        try:
            return self._host[name]
        except KeyError:
            raise AdapterNotFound(f"adapter {name} is not loaded on this worker", reason="ADAPTER_NOT_LOADED") from None

    def has(self, name: str) -> bool:
        with self._lock:
            return name in self._host

    def pinned(self, name: str) -> bool:
        """Whether a request holds the adapter (it is then never evicted or removed)."""
        with self._lock:
            return bool(self._pins.get(name))

    def remove(self, name: str) -> None:
        """Drops the adapter from device and host; FAILED_PRECONDITION while requests hold it."""
        with self._lock:
            if self._pins.get(name):
                raise FailedPrecondition(
                    f"adapter {name} is in use by {self._pins[name]} request(s)", reason="ADAPTER_IN_USE"
                )
            if name not in self._host:
                raise AdapterNotFound(f"adapter {name} is not loaded on this worker", reason="ADAPTER_NOT_LOADED")
            slot = self._slot_of.pop(name, None)
            if slot is not None:
                self._vacate(slot)
            del self._host[name]

    def host_names(self) -> list[str]:
        with self._lock:
            return sorted(self._host)

    def resident_names(self) -> list[str]:
        with self._lock:
            return sorted(self._slot_of)

    def counts(self) -> tuple[int, int]:
        """(resident, host) adapters, without the lock (metrics poll it while the engine may be stuck)."""
        return len(self._slot_of), len(self._host)

    # -- device side -----------------------------------------------------------------------
    def to_device(self, name: str) -> int | None:
        """Makes `name` resident (evicting the LRU unheld adapter if needed); its slot, or None
        when every slot is held by running requests. On CUDA it only enqueues the upload: readers
        call `slot(i).wait()` before using the slot."""
        with self._lock:
            if name in self._slot_of:
                self._slot_of.move_to_end(name)
                return self._slot_of[name]
            host = self._host_copy(name)
            slot = next((i for i, s in enumerate(self._slots) if s is None), None)
            if slot is None:
                victim = next((n for n in self._slot_of if not self._pins.get(n)), None)
                if victim is None:
                    return None
                slot = self._slot_of.pop(victim)
                self._vacate(slot)  # its memory may go back before the upload
                self._on_swap("out")
            lease, buffer = self._lease(host)
            self._slots[slot] = dev = self._staging.upload(host, buffer)
            dev.lease = lease
            self._slot_of[name] = slot
            self._on_swap("in")
            return slot

    def _lease(self, host: HostCopy) -> tuple[object, torch.Tensor | None]:
        """Room in `memory` for an upload of `host`, evicting idle resident adapters (LRU) while
        there is none: (lease, device buffer; None on the CPU, where the copy is the host
        tensors), or (None, None): no `memory`, or no room even so."""
        if self.memory is None:
            return None, None
        w = host.weights  # on the CPU the lease only counts what a device copy would take
        numel = (
            host.packed.numel() if host.packed is not None else sum(t.numel() for t in (*w.a.values(), *w.b.values()))
        )
        while True:
            got = self.memory.take(numel, self.dtype)
            if got is not None:
                lease, buffer = got
                return lease, buffer if host.packed is not None else None
            if not self.evict_idle():
                self.outside_memory += 1
                return None, None

    def evict_idle(self) -> bool:
        """Evicts the least recently used resident adapter no request holds whose memory is a
        lease of `memory` (so the KV cache can have it); False when there is none."""
        with self._lock:
            victim = next(
                (n for n in self._slot_of if not self._pins.get(n) and self._slots[self._slot_of[n]].lease is not None),
                None,
            )
            if victim is None:
                return False
            self._vacate(self._slot_of.pop(victim))
            self._on_swap("out")
            return True

    def _vacate(self, slot: int) -> None:
        dev, self._slots[slot] = self._slots[slot], None
        if dev is not None and dev.lease is not None:
            self.memory.give(dev.lease)

    def acquire(self, name: str) -> int | None:
        """Resident + held by one more request (never evicted while held); None if no slot."""
        with self._lock:
            slot = self.to_device(name)
            if slot is not None:
                self._pins[name] = self._pins.get(name, 0) + 1
                self._host.move_to_end(name)
            return slot

    def release(self, name: str) -> None:
        with self._lock:
            n = self._pins.get(name, 0) - 1
            if n <= 0:
                self._pins.pop(name, None)
            else:
                self._pins[name] = n

    def slot(self, index: int) -> DeviceAdapter | None:
        """The slot's device copy; on CUDA call its `wait()` before a stream reads it."""
        return self._slots[index]

    def slot_of(self, name: str) -> int | None:
        with self._lock:
            return self._slot_of.get(name)

    def device_bytes(self) -> int:
        with self._lock:
            return sum(s.weights.nbytes for s in self._slots if s is not None)
