"""DecodeBatch re-packs against a reference: rows join (from a prefill's batch cache), stay (moved
from the current stack in runs), leave and change order between decode steps that append a
token to every row, with a headroom small enough that the stack outgrows its arena."""

import random

import pytest
import torch
from transformers import Qwen2Config

from services.worker import kv_batch
from services.worker.kv_batch import DecodeBatch, _runs, new_cache, split_rows

LAYERS, HEADS, DIM = 3, 2, 4


def _config() -> Qwen2Config:
    return Qwen2Config(num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=HEADS,
                       hidden_size=4 * DIM, intermediate_size=16, vocab_size=32)


def _prefill(lengths: list[int], gen: torch.Generator):
    """A right-padded batch cache as a prefill fills it (one update per layer), split into rows."""
    cache = new_cache(_config())
    for layer in range(LAYERS):
        k = torch.randn(len(lengths), HEADS, max(lengths), DIM, generator=gen)
        cache.update(k, torch.randn(k.shape, generator=gen), layer)
    return split_rows(cache, lengths)


def _check(batch: DecodeBatch, ref: dict[int, list[list[torch.Tensor]]]) -> None:
    """Every layer: row i right-aligned at the batch width, zeros before it."""
    w = batch.width
    for layer, cache_layer in enumerate(batch.cache.layers):
        for which, got in ((0, cache_layer.keys), (1, cache_layer.values)):
            assert got.shape == (len(batch.rows), HEADS, w, DIM)
            for i, sid in enumerate(batch.rows):
                own = ref[sid][layer][which]
                n = own.shape[1]
                assert torch.equal(got[i, :, w - n:], own), (sid, layer, which)
                assert torch.count_nonzero(got[i, :, :w - n]) == 0


def test_runs_group_rows_consecutive_in_both_stacks():
    assert _runs([]) == []
    assert _runs([(0, 2), (1, 3), (2, 4), (4, 5), (5, 0)]) == [(0, 2, 3), (4, 5, 1), (5, 0, 1)]


@pytest.mark.parametrize("seed", range(4))
def test_repacks_match_the_reference(seed):
    gen, rnd = torch.Generator().manual_seed(seed), random.Random(seed)
    batch = DecodeBatch(_config(), headroom=2)
    batch.MIN_CAPACITY = 8  # the stack outgrows its arena: eager growth, then re-packs from grown buffers
    ref: dict[int, list[list[torch.Tensor]]] = {}  # sid -> per layer [keys, values] (heads, n, dim)
    joining: dict[int, list] = {}
    next_id = 0
    for _ in range(25):
        if rnd.random() < 0.6 or not ref:  # a prefill: 1-3 rows join
            lengths = [rnd.randint(1, 9) for _ in range(rnd.randint(1, 3))]
            for kv in _prefill(lengths, gen):
                joining[next_id] = kv
                ref[next_id] = [[k[0].clone(), v[0].clone()] for k, v in kv]
                next_id += 1
        rows = [sid for sid in ref if sid in joining or rnd.random() < 0.85]  # some leave
        rnd.shuffle(rows) if rnd.random() < 0.3 else rows.sort()  # mostly in order: runs; sometimes shuffled
        batch.pack(rows, {sid: joining[sid] for sid in rows if sid in joining},
                   {sid: ref[sid][0][0].shape[1] for sid in rows})
        joining = {}
        ref = {sid: ref[sid] for sid in rows}
        if not rows:
            assert batch.cache is None
            continue
        _check(batch, ref)
        for _ in range(rnd.randint(1, 4)):  # eager decode steps: every row gets one token per layer
            for layer, cache_layer in enumerate(batch.cache.layers):
                k = torch.randn(len(rows), HEADS, 1, DIM, generator=gen)
                v = torch.randn(k.shape, generator=gen)
                cache_layer.update(k, v)
                for i, sid in enumerate(rows):
                    ref[sid][layer][0] = torch.cat([ref[sid][layer][0], k[i]], dim=1)
                    ref[sid][layer][1] = torch.cat([ref[sid][layer][1], v[i]], dim=1)
            batch.advance()
        _check(batch, ref)


def test_staying_rows_move_in_one_copy_per_run_and_layer(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    batch = DecodeBatch(_config())
    first = dict(enumerate(_prefill([4, 6, 5, 3], gen)))
    batch.pack(list(first), first, {0: 4, 1: 6, 2: 5, 3: 3})
    runs = []
    real = kv_batch._runs
    monkeypatch.setattr(kv_batch, "_runs", lambda pairs: runs.extend(real(pairs)) or real(pairs))
    new = {9: _prefill([7], gen)[0]}
    batch.pack([0, 1, 9, 3], new, {0: 4, 1: 6, 9: 7, 3: 3})  # row 2 left, 9 joined between
    assert runs == [(0, 0, 2), (3, 3, 1)]


def test_buffers_key_names_each_arena_allocation_not_its_address(monkeypatch):
    # A freed arena's address can come back as a new arena's first layer (the other layers
    # elsewhere); a captured graph keyed by that address would replay into stale addresses.
    # Every address reads the same here: only the allocation may tell arenas apart.
    monkeypatch.setattr(torch.Tensor, "data_ptr", lambda self: 4096)
    gen = torch.Generator().manual_seed(0)
    batch = DecodeBatch(_config(), headroom=2)
    batch.MIN_CAPACITY = 16
    keys, ids = [], iter(range(1000))

    def repack(n: int) -> tuple:
        new = {next(ids): kv for kv in _prefill([3] * n, gen)}
        batch.pack(list(new), new, {sid: 3 for sid in new})
        keys.append((batch.buffers_key(), batch._arenas[batch._current][0][0].shape))
        return keys[-1][0]

    first = repack(2)  # arena slot A, 2 rows
    repack(2)  # slot B
    assert repack(2) == first  # slot A again, the same allocation: its graphs replay
    repack(2)
    repack(8)  # slot A is too small: reallocated
    assert keys[-1][1][2] == keys[0][1][2]  # same capacity (and, here, same address) ...
    assert keys[-1][0] != first  # ... yet another key
    assert len({k for k, _ in keys}) == 3  # two first allocations + the reallocation
