"""An adapter's host and device copies, as the pool (adapter_pool.py) holds them: tensors packed into
one aligned buffer, and how the copies are made, chosen once from the pool's device (`Staging`):
- CPU: the host and device copies are the same tensors (a cast where the dtypes differ).
- CUDA: `add` packs an adapter's A and B factors, cast to the pool's dtype, into one pinned host
  buffer (in the caller's thread: the server's loading thread); `to_device` only enqueues one
  host-to-device copy of that buffer into one device buffer on the pool's copy stream and records
  an event, so neither the engine thread nor the compute stream waits for it. A reader orders its
  stream after the upload with `DeviceAdapter.wait()` before reading the slot.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch

from services.worker.adapter_weights import AdapterWeights, LayerModule

K = TypeVar("K", bound=Hashable)

# Every packed view starts at a multiple of this many bytes from its buffer's start (the caching
# allocator's device blocks start 512-byte aligned), so a kernel's vector loads and TMA
# descriptors see the alignment a fresh tensor would give them.
ALIGN_BYTES = 256


# -- packing --------------------------------------------------------------------------------------
def pack_tensors(
    tensors: Mapping[K, torch.Tensor], dtype: torch.dtype | None = None, pin: bool = False
) -> tuple[torch.Tensor, dict[K, torch.Tensor]]:
    """Copies `tensors` into one new flat 1-D host buffer; returns it and, per key, a contiguous
    view into it with that tensor's shape and values (cast to `dtype`; default: the dtype all of
    them promote to). Each view starts ALIGN_BYTES-aligned from the buffer's start; views never
    overlap; the padding between them is left uninitialized. `pin`: the buffer is page-locked
    (needs CUDA), so a host-to-device copy of it can run asynchronously."""
    if dtype is None:
        dtypes = [t.dtype for t in tensors.values()]
        dtype = functools.reduce(torch.promote_types, dtypes) if dtypes else torch.float32
    step = max(1, ALIGN_BYTES // dtype.itemsize)
    offsets: dict[K, int] = {}
    numel = 0
    for key, t in tensors.items():
        offsets[key] = numel
        numel += -(-t.numel() // step) * step
    flat = torch.empty(numel, dtype=dtype, pin_memory=pin)
    views: dict[K, torch.Tensor] = {}
    for key, t in tensors.items():
        view = flat[offsets[key] : offsets[key] + t.numel()].view(t.shape)
        view.copy_(t)
        views[key] = view
    return flat, views


def views_into(views: Mapping[K, torch.Tensor], flat: torch.Tensor, other: torch.Tensor) -> dict[K, torch.Tensor]:
    """The views of `flat` (as `pack_tensors` returns them), made into `other`, a buffer of the
    same numel and dtype (e.g. its device copy): same shapes, strides and offsets."""
    if other.shape != flat.shape or other.dtype != flat.dtype:
        raise ValueError(f"buffer {tuple(other.shape)} {other.dtype} is not like {tuple(flat.shape)} {flat.dtype}")
    base, start = flat.storage_offset(), other.storage_offset()
    return {k: other.as_strided(v.shape, v.stride(), start + v.storage_offset() - base) for k, v in views.items()}


# -- device copies --------------------------------------------------------------------------------
@dataclass
class DeviceAdapter:
    """Device copy of an adapter: what the LoRA layers read through a slot.

    On CUDA, a/b are views into `buffer`, written by a copy still in flight on the pool's copy
    stream until `event` has completed: call `wait()` before any stream reads them."""

    weights: AdapterWeights
    a: dict[LayerModule, torch.Tensor]
    b: dict[LayerModule, torch.Tensor]
    buffer: torch.Tensor | None = None  # the one device buffer a/b view (CUDA); None: a/b are their own
    event: torch.cuda.Event | None = None  # recorded on the copy stream after the upload (CUDA)
    lease: object = None  # the pool memory it lives in (DeviceMemory.take), given back when it leaves
    _waited: set[tuple[int, int]] = field(default_factory=set, init=False, repr=False, compare=False)

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Orders `stream` (default: the current stream of the adapter's device) after the upload,
        on the device (stream.wait_event; the host never blocks), and marks the buffer as used by
        that stream (record_stream), so once the slot is evicted the caching allocator does not
        hand the memory to the next upload while this stream may still read it. Call it on the
        thread and stream that will read a/b, after acquiring the slot and before enqueuing the
        first read (outside CUDA-graph capture: a replay on a stream that waited is ordered).
        Cheap to repeat: a stream that already waited is ordered for good, so it returns at
        once. No-op on CPU."""
        if self.event is None:
            return
        if stream is None:
            stream = torch.cuda.current_stream(self.buffer.device)
        key = (stream.device_index, stream.cuda_stream)
        if key in self._waited:
            return
        stream.wait_event(self.event)
        self.buffer.record_stream(stream)
        self._waited.add(key)

    def ready(self) -> bool:
        """Whether the upload has finished (a non-blocking event query; always True on CPU)."""
        return self.event is None or self.event.query()


@dataclass(frozen=True)
class HostCopy:
    """What the pool holds per adapter: its weights and, on CUDA, the one pinned buffer their a/b
    view (None: the tensors are as given)."""

    weights: AdapterWeights
    packed: torch.Tensor | None = None
    nbytes: int = field(init=False)  # host bytes of the weights (the host pool's budget counts them)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", self.weights.nbytes)


class Staging(Protocol):
    """How a pool makes host and device copies; chosen once from the pool's device."""

    def host_copy(self, weights: AdapterWeights) -> HostCopy:
        """Runs in the thread that adds the adapter, outside the pool's lock."""

    def upload(self, host: HostCopy, buffer: torch.Tensor | None = None) -> DeviceAdapter:
        """Runs under the pool's lock: must only enqueue work. `buffer`: device memory of the
        packed copy's size and dtype to upload into (unified pool), else its own."""

    def stream(self) -> torch.cuda.Stream | None:
        """The stream uploads run on (None: no copy stream)."""


class SameMemoryStaging:
    """CPU: adapters stay as given; a device copy is the same tensors (cast where dtypes differ)."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype

    def host_copy(self, weights: AdapterWeights) -> HostCopy:
        return HostCopy(weights)

    def upload(self, host: HostCopy, buffer: torch.Tensor | None = None) -> DeviceAdapter:
        conv = {"device": self.device, "dtype": self.dtype, "non_blocking": True}  # the same memory: no buffer
        w = host.weights
        return DeviceAdapter(
            weights=w, a={k: t.to(**conv) for k, t in w.a.items()}, b={k: t.to(**conv) for k, t in w.b.items()}
        )

    def stream(self) -> torch.cuda.Stream | None:
        return None


class PinnedCopyStreamStaging:
    """CUDA: one pinned packed host buffer per adapter, one device buffer per resident adapter,
    uploads as one copy each on a copy stream of our own (created at the first use)."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self._stream: torch.cuda.Stream | None = None
        self._stream_lock = threading.Lock()

    def host_copy(self, weights: AdapterWeights) -> HostCopy:
        factors = {("a", k): t for k, t in weights.a.items()} | {("b", k): t for k, t in weights.b.items()}
        packed, views = pack_tensors(factors, self.dtype, pin=True)
        a = {k: views[("a", k)] for k in weights.a}
        b = {k: views[("b", k)] for k in weights.b}
        return HostCopy(dataclasses.replace(weights, a=a, b=b), packed)

    def stream(self) -> torch.cuda.Stream:
        with self._stream_lock:
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=self.device)
            return self._stream

    def upload(self, host: HostCopy, buffer: torch.Tensor | None = None) -> DeviceAdapter:
        stream = self.stream()
        # A gRPC thread need not have selected the pool's device; allocating under the copy stream
        # makes it the buffer's stream, so the allocator reuses it in order after our own copies.
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            if buffer is None:
                buffer = torch.empty(host.packed.shape, dtype=host.packed.dtype, device=self.device)
            else:  # KV pool memory: the upload comes after every step queued so far, which may read it
                stream.wait_stream(torch.cuda.default_stream(self.device))
            buffer.copy_(host.packed, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        w = host.weights
        return DeviceAdapter(
            weights=w,
            a=views_into(w.a, host.packed, buffer),
            b=views_into(w.b, host.packed, buffer),
            buffer=buffer,
            event=event,
        )


def staging_for(device: torch.device, dtype: torch.dtype) -> Staging:
    return PinnedCopyStreamStaging(device, dtype) if device.type == "cuda" else SameMemoryStaging(device, dtype)
