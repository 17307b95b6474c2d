"""Adapter staging on CPU: the packing helper (one flat buffer, aligned views of mixed shapes and
dtypes), and a CPU pool keeping today's behaviour (same tensors, LRU eviction, wait() a no-op).
The CUDA side (pinned buffers, copy stream, events) is tests/gpu/test_adapter_staging_gpu.py."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import AdapterNotFound
from services.worker.adapter_weights import AdapterWeights
from services.worker.adapter_staging import (
    ALIGN_BYTES,
    DeviceAdapter,
    SameMemoryStaging,
    pack_tensors,
    staging_for,
    views_into,
)
from services.worker.adapter_pool import AdapterPool

MIXED = {
    "fp32 matrix": (torch.float32, (3, 5)),
    "bf16 vector": (torch.bfloat16, (7,)),
    "fp16 3-d": (torch.float16, (2, 3, 4)),
    "scalar": (torch.float32, ()),
    "empty": (torch.float32, (0, 4)),
    "wide": (torch.float32, (1, 300)),
}


def random_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=g).to(dt) for k, (dt, shape) in MIXED.items()}


def adapter(name: str, rank: int = 4, layers: int = 2, seed: int = 0, dtype=torch.float32) -> AdapterWeights:
    g = torch.Generator().manual_seed(seed)
    a = {(i, m): torch.randn(16, rank, generator=g).to(dtype) for i in range(layers) for m in ("q_proj", "v_proj")}
    b = {
        (i, m): torch.randn(rank, 8 + 4 * i, generator=g).to(dtype) for i in range(layers) for m in ("q_proj", "v_proj")
    }
    return AdapterWeights(name=name, sha256="x", rank=rank, scale=2.0 / rank, a=a, b=b)


def span(view: torch.Tensor, flat: torch.Tensor) -> range:
    """The elements of `flat` a view covers (storage offsets: an empty view has no data_ptr)."""
    start = view.storage_offset() - flat.storage_offset()
    return range(start, start + view.numel())


@pytest.mark.parametrize("dtype", [None, torch.float32, torch.bfloat16, torch.float16])
def test_pack_tensors_views_keep_shapes_and_values(dtype):
    tensors = random_tensors()
    flat, views = pack_tensors(tensors, dtype)
    want_dtype = dtype or torch.float32  # fp32, bf16 and fp16 promote to fp32
    assert flat.dim() == 1 and flat.dtype == want_dtype and not flat.is_pinned()
    assert list(views) == list(tensors)
    used = set()
    for key, t in tensors.items():
        v = views[key]
        assert v.shape == t.shape and v.dtype == want_dtype and v.is_contiguous(), key
        assert v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr(), key  # a view, not a copy
        assert torch.equal(v, t.to(want_dtype)), key
        assert span(v, flat).start * flat.element_size() % ALIGN_BYTES == 0, key
        cells = set(span(v, flat))
        assert span(v, flat).stop <= flat.numel() and not cells & used, key  # inside and disjoint
        used |= cells


def test_pack_tensors_writes_through_and_copies_its_inputs():
    tensors = random_tensors(1)
    before = {k: t.clone() for k, t in tensors.items()}
    flat, views = pack_tensors(tensors, torch.float32)
    views["fp32 matrix"].fill_(7.0)
    assert torch.equal(tensors["fp32 matrix"], before["fp32 matrix"])  # the input was copied
    assert (flat[:15] == 7.0).all()  # the first view is the buffer's start
    for key in ("bf16 vector", "fp16 3-d", "wide"):
        assert torch.equal(views[key], before[key].float())  # neighbours untouched


def test_pack_tensors_takes_non_contiguous_inputs():
    full = torch.randn(6, 8)
    parts = {"transposed": full.t(), "narrowed": full[:, 2:5], "strided": full[::2, ::3]}  # e.g. a TP shard
    _, views = pack_tensors(parts)
    for key, t in parts.items():
        assert views[key].is_contiguous() and torch.equal(views[key], t), key


def test_pack_tensors_of_nothing_and_views_into_a_copy():
    flat, views = pack_tensors({})
    assert flat.numel() == 0 and views == {}
    tensors = random_tensors(2)
    flat, views = pack_tensors(tensors, torch.bfloat16)
    other = flat.clone()
    moved = views_into(views, flat, other)
    for key, t in tensors.items():
        assert moved[key].shape == t.shape and torch.equal(moved[key], views[key]), key
        assert moved[key].untyped_storage().data_ptr() == other.untyped_storage().data_ptr(), key
    offset = flat[5:]  # a buffer that itself starts inside its storage
    assert views_into({"x": offset[3:9].view(2, 3)}, offset, offset.clone())["x"].shape == (2, 3)
    with pytest.raises(ValueError):
        views_into(views, flat, other.float())


def test_cpu_pool_keeps_tensors_as_given_and_wait_is_a_no_op():
    pool = AdapterPool(torch.device("cpu"), torch.float32, device_slots=2)
    assert isinstance(pool._staging, SameMemoryStaging) and pool.copy_stream is None
    w = adapter("adapters/a/versions/1")
    assert pool.add(w) and not pool.add(adapter("adapters/a/versions/1", seed=9))
    assert pool.get(w.name) is w  # no packing, no pinning on CPU
    slot = pool.to_device(w.name)
    dev = pool.slot(slot)
    assert isinstance(dev, DeviceAdapter) and dev.weights is w and dev.buffer is None and dev.event is None
    for key, t in w.a.items():
        assert dev.a[key] is t and dev.b[key] is w.b[key]  # same tensors, as before
    dev.wait()
    dev.wait(stream=None)
    assert dev.ready()
    assert pool.device_bytes() == w.nbytes


def test_cpu_pool_casts_to_its_dtype_at_to_device():
    pool = AdapterPool(torch.device("cpu"), torch.bfloat16, device_slots=1)
    w = adapter("adapters/a/versions/1")
    pool.add(w)
    assert pool.get(w.name).a[(0, "q_proj")].dtype == torch.float32  # host copy kept as given
    dev = pool.slot(pool.to_device(w.name))
    for key, t in w.a.items():
        assert dev.a[key].dtype == torch.bfloat16 and torch.equal(dev.a[key], t.to(torch.bfloat16))
        assert dev.b[key].shape == w.b[key].shape


def test_cpu_pool_lru_eviction_and_pins_unchanged():
    swaps = []
    pool = AdapterPool(torch.device("cpu"), torch.float32, device_slots=2, on_swap=swaps.append)
    names = [f"adapters/a{i}/versions/1" for i in range(4)]
    for i, n in enumerate(names):
        assert pool.add(adapter(n, rank=2 + i, seed=i))
    assert pool.host_names() == sorted(names)
    s0 = pool.acquire(names[0])
    s1 = pool.to_device(names[1])
    assert {s0, s1} == {0, 1} and swaps == ["in", "in"]
    assert pool.to_device(names[2]) == s1 and swaps[-2:] == ["out", "in"]  # evicts a1: a0 is held
    assert pool.resident_names() == sorted([names[0], names[2]]) and pool.slot_of(names[1]) is None
    assert pool.acquire(names[2]) == s1 and pool.acquire(names[3]) is None  # every slot held
    pool.release(names[0])
    assert pool.to_device(names[3]) == s0  # a0 released: the LRU unheld one goes
    dev = pool.slot(s0)
    assert dev.weights.name == names[3] and dev.a[(0, "q_proj")].shape == (16, 5)
    assert torch.equal(dev.b[(1, "v_proj")], pool.get(names[3]).b[(1, "v_proj")])
    assert pool.to_device(names[3]) == s0 and swaps.count("in") == 4  # resident: no copy
    pool.remove(names[3])
    assert pool.slot(s0) is None and not pool.has(names[3])
    with pytest.raises(AdapterNotFound):
        pool.to_device(names[3])


def test_staging_is_chosen_from_the_device_type():
    assert isinstance(staging_for(torch.device("cpu"), torch.float32), SameMemoryStaging)
    assert type(staging_for(torch.device("cuda", 0), torch.bfloat16)).__name__ == "PinnedCopyStreamStaging"
