"""S-LoRA's unified pool: resident adapters' weights take runs of the KV pool's blocks
(kv_cache.PoolMemory), so KV and adapters trade memory: an adapter going to the device evicts idle
ones when the pool has no room for it, admission and decode growth evict idle adapters before
they preempt anyone, and adapters that running requests hold are never evicted (tiny Qwen2-VL,
CPU, where a lease only counts the blocks a device copy would take)."""

from __future__ import annotations

import torch

from services.worker.adapter_weights import parse_bundle
from services.worker.adapter_pool import AdapterPool
from services.worker.kv_cache import BlockManager, KVPool, PoolMemory
from services.worker.testing import random_adapter_bundle

from tests.unit.test_decode_graphs import A, run

CPU = torch.device("cpu")


def _pool_with(blocks: int, model_path, names):
    from services.common.adapter_format import BaseModelShapes
    import json

    shapes = BaseModelShapes.from_config(json.loads((model_path / "config.json").read_text()))
    kv = KVPool(2, blocks, 8, 2, 32, torch.float32, CPU)  # the tiny model's KV shape
    manager = BlockManager(blocks, 8, rows=4, max_blocks=8, device=CPU)
    pool = AdapterPool(CPU, torch.float32, device_slots=4, memory=PoolMemory(kv, manager))
    for i, name in enumerate(names):
        b = random_adapter_bundle(model_path, rank=8, seed=i + 1)
        pool.add(parse_bundle(name, b.sha256, b.data, b.config_json, shapes, 256))
    return pool, manager


def test_resident_adapters_lease_blocks_and_idle_ones_give_them_back(model_path):
    pool, blocks = _pool_with(64, model_path, ["x", "y", "z"])
    assert pool.acquire("x") is not None and pool.to_device("y") is not None
    per_adapter = blocks.run_blocks // 2
    assert per_adapter > 0 and blocks.free_blocks == 63 - 2 * per_adapter
    assert pool.evict_idle() and pool.resident_names() == ["x"]  # y: idle; x is held
    assert not pool.evict_idle() and blocks.run_blocks == per_adapter
    pool.release("x")
    assert pool.evict_idle() and blocks.run_blocks == 0 and blocks.free_blocks == 63
    # a pool with room for one adapter: the next upload evicts the idle one to make room
    pool, blocks = _pool_with(per_adapter + 4, model_path, ["x", "y"])
    pool.to_device("x")
    pool.to_device("y")
    assert pool.resident_names() == ["y"] and pool.outside_memory == 0
    pool.acquire("y")
    pool.to_device("x")  # y is held: no room in the pool, x lives outside it
    assert pool.resident_names() == ["x", "y"] and pool.outside_memory == 1
    pool.remove("x")
    assert blocks.run_blocks == per_adapter  # only y's lease


def test_kv_takes_idle_adapters_blocks_before_it_preempts(model_path):
    # A, B serve the requests; C is resident but idle. The pool holds the three adapters and too
    # few blocks for the requests' KV: their growth evicts C before it preempts anyone, A and B
    # (held by running requests) stay, and the tokens are the roomy run's.
    roomy, eng = run(model_path)
    block_bytes = eng.kv_pool.block_bytes // (eng.kv.block_size // 8)
    per_adapter = -(-eng.pool.get(A).nbytes // block_bytes)
    events: list[str] = []
    tight, eng = run(
        model_path,
        kv_block_size=8,
        kv_cache_bytes=(31 + 3 * per_adapter) * block_bytes,
        before=lambda eng: _idle_adapter_and_log(eng, events),
    )
    assert tight == roomy
    assert events and events[0] == "evict" and "C" not in eng.pool.resident_names()
    assert eng.pool.outside_memory == 0 and eng.kv.used_blocks == 0


def _idle_adapter_and_log(eng, events: list[str]) -> None:
    b = random_adapter_bundle(eng.config.model_path, rank=8, seed=9)
    eng.load_adapter_bytes("C", b.sha256, b.data, b.config_json, to_device=True)
    evict, preempt = eng.pool.evict_idle, eng.sched.preempt
    eng.pool.evict_idle = lambda: evict() and not events.append("evict")
    eng.sched.preempt = lambda s: (events.append("preempt"), preempt(s))[1]
