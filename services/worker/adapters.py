"""Adapter weights on a worker: parsing a PEFT bundle, and the host/device pool with LRU slots.

A bundle (services/common/adapter_format.py) stores lora_A (r, in) and lora_B (out, r); we
transpose once at load into A (in, r), B (r, out), the multi-LoRA op's layout, at exact rank.
The pool keeps every loaded adapter in host memory by version name and copies up to
`device_slots` of them to the device; slots are recycled least-recently-used among adapters no
running request holds. On a CPU device the host and device copies are the same tensors.
Slot indices stay inside the worker.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from safetensors.torch import load as load_safetensors

from services.common.adapter_format import (
    TARGET_MODULES,
    BaseModelShapes,
    lora_key,
    validate_bundle,
)
from services.common.errors import AdapterNotFound, FailedPrecondition

LayerModule = tuple[int, str]  # (layer index, module name e.g. "q_proj")


@dataclass
class AdapterWeights:
    """One adapter version in host memory, in the multi-LoRA op's layout."""

    name: str  # "adapters/{a}/versions/{v}"
    sha256: str
    rank: int
    scale: float  # lora_alpha / r
    a: dict[LayerModule, torch.Tensor]  # (in, r)
    b: dict[LayerModule, torch.Tensor]  # (r, out)
    heads: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)
    labels: dict[str, list[str]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        n = sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b.values()))
        for w, b in self.heads.values():
            n += w.numel() * w.element_size() + (b.numel() * b.element_size() if b is not None else 0)
        return n

    def head_labels(self, head: str) -> list[str]:
        w, _ = self.heads[head]
        labels = self.labels.get(head) or []
        if len(labels) != w.shape[0]:
            labels = [f"label_{i}" for i in range(w.shape[0])]
        return labels


def parse_bundle(
    name: str,
    sha256: str,
    data: bytes,
    config_json: str,
    shapes: BaseModelShapes,
    max_rank: int = 256,
    head_labels: dict[str, list[str]] | None = None,
) -> AdapterWeights:
    """Validates a bundle against the base model and loads it (host memory, fp32 kept as stored)."""
    info = validate_bundle(data, config_json, shapes, max_rank)
    tensors = load_safetensors(data)
    a: dict[LayerModule, torch.Tensor] = {}
    b: dict[LayerModule, torch.Tensor] = {}
    for layer in info.layers:
        for module in TARGET_MODULES:
            ka, kb = lora_key(layer, module, "A"), lora_key(layer, module, "B")
            if ka in tensors:
                a[(layer, module)] = tensors[ka].t().contiguous()
                b[(layer, module)] = tensors[kb].t().contiguous()
    heads = {}
    for head in info.heads:
        heads[head] = (tensors[f"heads.{head}.weight"], tensors.get(f"heads.{head}.bias"))
    return AdapterWeights(
        name=name, sha256=sha256, rank=info.rank, scale=info.lora_alpha / info.rank, a=a, b=b,
        heads=heads, labels=dict(head_labels or {}),
    )


@dataclass
class DeviceAdapter:
    """Device copy of an adapter: what the LoRA layers read through a slot."""

    weights: AdapterWeights
    a: dict[LayerModule, torch.Tensor]
    b: dict[LayerModule, torch.Tensor]


class AdapterPool:
    """Host adapters by version name + `device_slots` device copies with LRU reuse.

    Thread-safe: the server adds/removes host adapters; the engine thread acquires/releases
    device slots at step boundaries. A slot held by a running request is never evicted.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype, device_slots: int,
                 on_swap: Callable[[str], None] | None = None) -> None:
        """on_swap("in" | "out") is told about every host->device copy and eviction (metrics)."""
        if device_slots < 1:
            raise ValueError("device_slots must be at least 1")
        self.device = device
        self.dtype = dtype
        self.num_slots = device_slots
        self._lock = threading.RLock()
        self._host: dict[str, AdapterWeights] = {}
        self._slots: list[DeviceAdapter | None] = [None] * device_slots
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # LRU order, most recent last
        self._pins: dict[str, int] = {}
        self._on_swap = on_swap or (lambda direction: None)

    # -- host side -------------------------------------------------------------------------
    def add(self, weights: AdapterWeights) -> bool:
        """Adds to host memory; False when that version was already there."""
        with self._lock:
            if weights.name in self._host:
                return False
            self._host[weights.name] = weights
            return True

    def get(self, name: str) -> AdapterWeights:
        with self._lock:
            try:
                return self._host[name]
            except KeyError:
                raise AdapterNotFound(f"adapter {name} is not loaded on this worker",
                                      reason="ADAPTER_NOT_LOADED") from None

    def has(self, name: str) -> bool:
        with self._lock:
            return name in self._host

    def remove(self, name: str) -> None:
        """Drops the adapter from device and host; FAILED_PRECONDITION while requests hold it."""
        with self._lock:
            if self._pins.get(name):
                raise FailedPrecondition(f"adapter {name} is in use by {self._pins[name]} request(s)",
                                         reason="ADAPTER_IN_USE")
            if name not in self._host:
                raise AdapterNotFound(f"adapter {name} is not loaded on this worker", reason="ADAPTER_NOT_LOADED")
            slot = self._slot_of.pop(name, None)
            if slot is not None:
                self._slots[slot] = None
            del self._host[name]

    def host_names(self) -> list[str]:
        with self._lock:
            return sorted(self._host)

    def resident_names(self) -> list[str]:
        with self._lock:
            return sorted(self._slot_of)

    # -- device side -----------------------------------------------------------------------
    def to_device(self, name: str) -> int | None:
        """Makes `name` resident (evicting the LRU unheld adapter if needed); its slot, or None
        when every slot is held by running requests."""
        with self._lock:
            if name in self._slot_of:
                self._slot_of.move_to_end(name)
                return self._slot_of[name]
            weights = self.get(name)
            slot = next((i for i, s in enumerate(self._slots) if s is None), None)
            if slot is None:
                victim = next((n for n in self._slot_of if not self._pins.get(n)), None)
                if victim is None:
                    return None
                slot = self._slot_of.pop(victim)
                self._on_swap("out")
            conv = dict(device=self.device, dtype=self.dtype, non_blocking=True)
            self._slots[slot] = DeviceAdapter(
                weights=weights,
                a={k: t.to(**conv) for k, t in weights.a.items()},
                b={k: t.to(**conv) for k, t in weights.b.items()},
            )
            self._slot_of[name] = slot
            self._on_swap("in")
            return slot

    def acquire(self, name: str) -> int | None:
        """Resident + held by one more request (never evicted while held); None if no slot."""
        with self._lock:
            slot = self.to_device(name)
            if slot is not None:
                self._pins[name] = self._pins.get(name, 0) + 1
            return slot

    def release(self, name: str) -> None:
        with self._lock:
            n = self._pins.get(name, 0) - 1
            if n <= 0:
                self._pins.pop(name, None)
            else:
                self._pins[name] = n

    def slot(self, index: int) -> DeviceAdapter | None:
        return self._slots[index]

    def slot_of(self, name: str) -> int | None:
        with self._lock:
            return self._slot_of.get(name)

    def device_bytes(self) -> int:
        with self._lock:
            return sum(s.weights.nbytes for s in self._slots if s is not None)
