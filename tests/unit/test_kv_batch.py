"""DecodeBatch re-packs: rows of stacked caches (a prefill's `new_cache(stacked=True)`, the
arenas) move with one copy for all layers; per-layer caches take the per-layer path; both give
the same right-aligned, zero-padded stack."""

import random

import torch
from transformers import Qwen2Config

from services.worker.kv_batch import DecodeBatch, all_layers, new_cache, split_rows

LAYERS, HEADS, DIM = 5, 2, 8


def _config() -> Qwen2Config:
    return Qwen2Config(num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=HEADS,
                       hidden_size=4 * DIM, intermediate_size=16, vocab_size=32)


def _prefill(lengths: list[int], stacked: bool, gen: torch.Generator):
    """A right-padded batch cache as a prefill fills it (every layer one update), its rows split."""
    cache = new_cache(_config(), stacked=stacked)
    width = max(lengths)
    for layer in range(LAYERS):
        k = torch.randn(len(lengths), HEADS, width, DIM, generator=gen)
        cache.update(k, torch.randn(k.shape, generator=gen), layer)
    return split_rows(cache, lengths)


def _expected(batch: DecodeBatch, rows: dict[int, list[tuple[torch.Tensor, torch.Tensor]]]):
    """Each layer's (rows, heads, width, dim) keys and values: row i right-aligned, zeros before."""
    w = batch.width
    out = []
    for layer in range(LAYERS):
        ks, vs = torch.zeros(len(batch.rows), HEADS, w, DIM), torch.zeros(len(batch.rows), HEADS, w, DIM)
        for i, sid in enumerate(batch.rows):
            k, v = rows[sid][layer]
            n = k.shape[2]
            ks[i, :, w - n:], vs[i, :, w - n:] = k[0], v[0]
        out.append((ks, vs))
    return out


def _check(batch: DecodeBatch, rows) -> None:
    for (k, v), layer in zip(_expected(batch, rows), batch.cache.layers):
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)


def test_all_layers_views_stacked_rows_only():
    gen = torch.Generator().manual_seed(0)
    stacked = _prefill([3, 5], True, gen)
    view = all_layers(stacked[1])
    assert view is not None and view.shape == (2, LAYERS, 1, HEADS, 5, DIM)
    for layer, (k, v) in enumerate(stacked[1]):
        assert torch.equal(view[0, layer], k) and torch.equal(view[1, layer], v)
    assert all_layers(_prefill([3, 5], False, gen)[0]) is None  # one buffer per layer
    kv = [(torch.randn(1, HEADS, 4, DIM), torch.randn(1, HEADS, 4, DIM)) for _ in range(LAYERS)]
    assert all_layers(kv) is None


def test_repacks_of_stacked_and_per_layer_rows_match_the_reference():
    gen = torch.Generator().manual_seed(1)
    rnd = random.Random(1)
    batch = DecodeBatch(_config(), headroom=4)
    copies = {}  # sequence id -> its (own, cloned) per-layer keys and values: the reference
    kvs = {}
    next_id = 0
    for step in range(6):
        lengths = [rnd.randint(1, 12) for _ in range(rnd.randint(1, 3))]
        for kv in _prefill(lengths, stacked=step % 2 == 0, gen=gen):  # both kinds of new rows
            kvs[next_id] = kv
            copies[next_id] = [(k.clone(), v.clone()) for k, v in kv]
            next_id += 1
        keep = [sid for sid in copies if rnd.random() < 0.8]  # some leave, the order changes
        rnd.shuffle(keep)
        old = batch.unpack()
        if old and batch.rows:  # rows still in the arena: one view over every layer
            assert all(all_layers(old[sid]) is not None for sid in batch.rows)
        for sid, kv in old.items():
            kvs[sid] = kv
        batch.pack(keep, {sid: kvs[sid] for sid in keep}, {sid: copies[sid][0][0].shape[2] for sid in keep})
        copies = {sid: copies[sid] for sid in keep}
        kvs = {}
        if not keep:
            assert batch.cache is None
            continue
        _check(batch, copies)
        # the arena's spare positions and rows hold zeros (finite under the mask)
        for layer in batch.cache.layers:
            assert torch.count_nonzero(layer.kbuf[:, :, batch.width:]) == 0
