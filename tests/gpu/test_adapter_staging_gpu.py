"""Adapter staging on CUDA: pinned packed host copies made by `add`, one upload per swap on the
pool's copy stream (never the current stream, never waited for by the host), and
DeviceAdapter.wait() ordering a reading stream after it, also across many swaps with eviction
while earlier reads are still queued. Skipped without CUDA (needs no kernels extension).

Ordering is shown by holding a stream with torch.cuda._sleep for about a second, far longer than
the few host calls made meanwhile; nothing asserts a duration."""

from __future__ import annotations

import threading

import pytest
import torch

from services.worker.adapter_weights import AdapterWeights
from services.worker.adapter_staging import PinnedCopyStreamStaging
from services.worker.adapter_pool import AdapterPool

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

DEV = torch.device("cuda", torch.cuda.current_device())
DT = torch.bfloat16
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
FIN, FOUT = 512, {"q_proj": 512, "k_proj": 128, "v_proj": 128, "o_proj": 512}
HOLD = 2_000_000_000  # GPU cycles: about a second at an H200's clock
LAG = 5_000_000  # a few milliseconds: delays one read past the next uploads and evictions


def adapter(name: str, rank: int = 16, seed: int = 0, layers: int = 4) -> AdapterWeights:
    """fp32 on the pageable host, as parse_bundle gives it."""
    g = torch.Generator().manual_seed(seed)
    a = {(i, m): torch.randn(FIN, rank, generator=g) for i in range(layers) for m in MODULES}
    b = {(i, m): torch.randn(rank, FOUT[m], generator=g) for i in range(layers) for m in MODULES}
    return AdapterWeights(name=name, sha256="x", rank=rank, scale=2.0 / rank, a=a, b=b)


def assert_device_copy(dev, held: AdapterWeights) -> None:
    """dev's factors (read on the current stream, which waited) equal the host copy's."""
    assert dev.a.keys() == held.a.keys() and dev.b.keys() == held.b.keys()
    for side, host in (("a", held.a), ("b", held.b)):
        for key, h in host.items():
            d = getattr(dev, side)[key]
            assert d.device == DEV and d.dtype == DT and d.shape == h.shape and d.is_contiguous(), key
            assert d.untyped_storage().data_ptr() == dev.buffer.untyped_storage().data_ptr(), key
            assert torch.equal(d.cpu(), h), (side, key)


def test_add_keeps_one_pinned_packed_buffer_in_the_pool_dtype():
    pool = AdapterPool(DEV, DT, device_slots=2)
    assert isinstance(pool._staging, PinnedCopyStreamStaging)
    w = adapter("adapters/a/versions/1")
    loader = threading.Thread(target=pool.add, args=(w,))  # the server's loading thread
    loader.start()
    loader.join()
    held = pool.get(w.name)
    assert held is not w and (held.name, held.rank, held.scale) == (w.name, w.rank, w.scale)
    assert pool.resident_names() == []  # packed and pinned by add, before any upload
    packed = pool._host[w.name].packed
    assert packed.is_pinned() and packed.dtype == DT and packed.dim() == 1
    for side, orig in (("a", w.a), ("b", w.b)):
        for key, t in orig.items():
            h = getattr(held, side)[key]
            assert h.is_pinned() and h.dtype == DT and h.shape == t.shape, key
            assert h.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr(), key
            assert torch.equal(h, t.to(DT)), key
    assert pool.device_bytes() == 0


def test_to_device_then_wait_gives_the_host_values():
    swaps = []
    pool = AdapterPool(DEV, DT, device_slots=2, on_swap=swaps.append)
    w = adapter("adapters/a/versions/1")
    pool.add(w)
    slot = pool.acquire(w.name)
    dev = pool.slot(slot)
    assert swaps == ["in"] and dev.buffer.numel() == pool._host[w.name].packed.numel()
    dev.wait()
    assert_device_copy(dev, pool.get(w.name))
    assert dev.ready() and pool.device_bytes() == pool.get(w.name).nbytes
    assert pool.to_device(w.name) == slot and pool.slot(slot) is dev  # resident: no new copy
    pool.release(w.name)


def test_upload_runs_on_the_copy_stream_and_to_device_does_not_wait_for_it():
    pool = AdapterPool(DEV, DT, device_slots=1)
    w = adapter("adapters/a/versions/1")
    pool.add(w)
    copy = pool.copy_stream
    current = torch.cuda.current_stream(DEV)
    assert copy is pool.copy_stream and copy != current  # one per pool, not the current stream
    with torch.cuda.stream(copy):
        torch.cuda._sleep(HOLD)  # the copy stream is busy: an upload queued on it must wait
    dev = pool.slot(pool.to_device(w.name))
    assert not dev.ready()  # to_device returned with the copy still queued
    current.synchronize()
    assert not dev.ready()  # the current stream is idle, the copy is not on it
    dev.wait()  # device-side: the host goes on
    assert not dev.ready()
    out = {k: t.clone() for k, t in dev.a.items()}  # a kernel on the current stream, after the upload
    torch.cuda.synchronize()
    assert dev.ready()
    for key, t in out.items():
        assert torch.equal(t.cpu(), pool.get(w.name).a[key]), key


@pytest.mark.parametrize("slots", [1, 2])
def test_many_swaps_with_eviction_read_the_new_adapter(slots):
    """Each read is queued behind a lag on the current stream while later swaps evict its adapter
    and upload the next into a new buffer: the freed buffer must not be reused under it."""
    swaps = []
    pool = AdapterPool(DEV, DT, device_slots=slots, on_swap=swaps.append)
    names = [f"adapters/a{i}/versions/1" for i in range(12)]
    for i, n in enumerate(names):
        pool.add(adapter(n, rank=8 if i % 2 else 16, seed=i))
    x = torch.randn(32, FIN, device=DEV, dtype=DT)
    reads = []
    for n in names * 2:
        dev = pool.slot(pool.to_device(n))
        assert dev.weights.name == n
        dev.wait()
        torch.cuda._sleep(LAG)
        ys = {k: x.float() @ dev.a[k].float() @ dev.b[k].float() for k in dev.a}
        reads.append((n, ys, {k: t.clone() for k, t in dev.b.items()}))
        del dev  # with the eviction at a later to_device, the buffer goes back to the allocator
    torch.cuda.synchronize()
    assert swaps.count("in") == 2 * len(names) and swaps.count("out") == 2 * len(names) - slots
    for n, ys, bs in reads:
        held = pool.get(n)
        for key, y in ys.items():
            ref = x.float() @ held.a[key].to(DEV).float() @ held.b[key].to(DEV).float()
            torch.testing.assert_close(y, ref, msg=f"{n} {key}")
            assert torch.equal(bs[key].cpu(), held.b[key]), (n, key)


def test_prefetch_from_another_thread_then_wait_on_the_engine_stream():
    pool = AdapterPool(DEV, DT, device_slots=2)
    w = adapter("adapters/a/versions/1", rank=32)
    pool.add(w)
    prefetch = threading.Thread(target=pool.to_device, args=(w.name,))  # a gRPC thread
    prefetch.start()
    prefetch.join()
    dev = pool.slot(pool.slot_of(w.name))
    engine = torch.cuda.Stream(DEV)
    dev.wait(engine)
    dev.wait(engine)  # a stream that waited is ordered for good: nothing more to do
    with torch.cuda.stream(engine):
        out = {k: t.clone() for k, t in dev.b.items()}
    engine.synchronize()
    for key, t in out.items():
        assert torch.equal(t.cpu(), pool.get(w.name).b[key]), key


def test_remove_and_add_while_an_upload_is_in_flight():
    """The pinned buffer of a removed adapter is not reused while its copy is still queued."""
    pool = AdapterPool(DEV, DT, device_slots=1)
    first, second = adapter("adapters/a/versions/1", seed=1), adapter("adapters/b/versions/1", seed=2)
    pool.add(first)
    with torch.cuda.stream(pool.copy_stream):
        torch.cuda._sleep(HOLD)
    pool.to_device(first.name)
    pool.remove(first.name)  # host and device copies dropped while the copy waits
    pool.add(second)
    dev = pool.slot(pool.to_device(second.name))
    dev.wait()
    assert_device_copy(dev, pool.get(second.name))
    for key, t in second.a.items():
        assert torch.equal(pool.get(second.name).a[key], t.to(DT)), key
