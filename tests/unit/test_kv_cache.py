"""The paged KV cache (kv_cache.py): block accounting, table writes, and the tiny Qwen2-VL decoding
over the pool — sequences joining, leaving and being preempted (blocks freed, prefilled again
over prompt + generated tokens) in random orders — equal to each sequence alone on HF's
contiguous DynamicCache (fp32, CPU)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import DynamicCache

from services.worker.attention import use_grouped_decode_attention
from services.worker.decode_graphs import DecodeGraphs, DecodeRow, bucket_rows
from services.worker.kv_cache import NULL_BLOCK, BlockManager, KVPool, OutOfBlocks, PagedCache
from services.worker.lora import LoraRuntime
from services.worker.model import load_model


def test_blocks_open_grow_close_and_table_writes():
    m = BlockManager(num_blocks=6, block_size=4, rows=2, max_blocks=3, device=torch.device("cpu"))
    assert (m.usable_blocks, m.free_blocks) == (5, 5)
    assert m.open(1, 5)  # 2 blocks
    assert m.blocks(1) == [1, 2] and m.row(1) == 0
    m.grow(1, 8)  # still 2 blocks
    assert m.blocks(1) == [1, 2]
    m.grow(1, 9)
    assert m.blocks(1) == [1, 2, 3] and m.free_blocks == 2
    with pytest.raises(ValueError):
        m.grow(1, 13)  # past the table's 3 blocks
    assert m.open(2, 8) and m.free_blocks == 0
    assert not m.open(3, 1)  # no block (and no row) left: nothing taken
    with pytest.raises(OutOfBlocks):
        m.grow(2, 9)
    assert m.blocks(2) == [4, 5]  # a failed grow takes nothing
    assert m.slot(1, 9) == 3 * 4 + 1 and m.slots(2, 3, 6).tolist() == [4 * 4 + 3, 5 * 4, 5 * 4 + 1]
    m.sync()
    assert m.tables[0].tolist() == [1, 2, 3] and m.tables[1].tolist() == [4, 5, 0]
    assert m.tables[m.null_row].tolist() == [0, 0, 0]
    m.close(1)
    assert m.free_blocks == 3 and not m.holds(1)
    assert m.open(3, 12) and m.row(3) == 0  # the freed row and blocks are reused
    assert sorted(m.blocks(3)) == [1, 2, 3] and NULL_BLOCK not in m.blocks(3)
    m.close(3)
    m.close(2)
    m.close(2)  # a no-op
    assert m.free_blocks == m.usable_blocks == 5 and m.used_blocks == 0


def test_bucket_rows():
    assert [bucket_rows(n) for n in range(1, 18)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16, 16, 16, 16, 24]


def _reference_logits(model, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """Logits after the prompt and after each of `tokens`, one sequence on HF's contiguous cache."""
    lm = model.model.language_model
    cache = DynamicCache(config=lm.config)
    n = len(prompt)
    h = lm(
        input_ids=torch.tensor([prompt]),
        position_ids=torch.arange(n).view(1, 1, n).expand(3, 1, n),
        past_key_values=cache,
        use_cache=True,
    ).last_hidden_state
    out = [model.lm_head(h[0, -1])]
    for i, t in enumerate(tokens[:-1]):
        h = lm(
            input_ids=torch.tensor([[t]]),
            position_ids=torch.full((3, 1, 1), n + i),
            past_key_values=cache,
            use_cache=True,
        ).last_hidden_state
        out.append(model.lm_head(h[0, -1]))
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_paged_decode_equals_contiguous_under_join_leave_preempt(model_path, seed):
    torch.manual_seed(seed)
    rnd = random.Random(seed)
    model = load_model(model_path)
    use_grouped_decode_attention(model.config.text_config)
    tc = model.config.text_config
    d = tc.hidden_size // tc.num_attention_heads
    pool = KVPool(tc.num_hidden_layers, 9, 8, tc.num_key_value_heads, d, torch.float32, torch.device("cpu"))
    blocks = BlockManager(9, 8, rows=6, max_blocks=8, device=torch.device("cpu"))
    graphs = DecodeGraphs(model, LoraRuntime(), pool, blocks, torch.device("cpu"), capture=False)
    lm = model.model.language_model
    n_seqs = 9
    prompts = [[rnd.randrange(10, 400) for _ in range(rnd.randint(2, 14))] for _ in range(n_seqs)]
    gen = [[rnd.randrange(10, 400) for _ in range(rnd.randint(3, 12))] for _ in range(n_seqs)]  # fed tokens
    want = [_reference_logits(model, p, g) for p, g in zip(prompts, gen)]
    got: dict[int, list[torch.Tensor]] = {i: [] for i in range(n_seqs)}
    done = [0] * n_seqs  # generated tokens fed so far
    running: list[int] = []
    waiting = list(range(n_seqs))
    preempted = 0

    def prefill(i: int) -> None:
        ctx = prompts[i] + gen[i][: done[i]]
        n = len(ctx)
        assert blocks.open(i, n)
        cache = PagedCache(tc, pool, blocks.slots(i, 0, n))
        h = lm(
            input_ids=torch.tensor([ctx]),
            position_ids=torch.arange(n).view(1, 1, n).expand(3, 1, n),
            past_key_values=cache,
            use_cache=True,
        ).last_hidden_state
        logits = model.lm_head(h[0, -1])
        if not got[i]:
            got[i].append(logits)
        else:  # recompute: the same logits as the decode step it replaces
            torch.testing.assert_close(logits, want[i][done[i]], rtol=1e-4, atol=1e-4)
        running.append(i)

    with torch.inference_mode():
        while waiting or running:
            while waiting and rnd.random() < 0.7 and len(running) < 6:
                i = waiting.pop(rnd.randrange(len(waiting)))
                if blocks.blocks_for(len(prompts[i]) + done[i]) > blocks.free_blocks:
                    waiting.append(i)
                    break
                prefill(i)
            if not running:
                continue
            rnd.shuffle(running)  # any row order
            for i in list(running):
                while i in running:
                    try:
                        blocks.grow(i, len(prompts[i]) + done[i] + 1)
                        break
                    except OutOfBlocks:
                        victim = running[-1]  # preempt: blocks back, prefilled again later
                        running.remove(victim)
                        blocks.close(victim)
                        waiting.append(victim)
                        preempted += 1
            if not running:
                continue
            rows = [
                DecodeRow(
                    token=gen[i][done[i]],
                    position=len(prompts[i]) + done[i],
                    slot=blocks.slot(i, len(prompts[i]) + done[i]),
                    length=len(prompts[i]) + done[i] + 1,
                    table_row=blocks.row(i),
                )
                for i in running
            ]
            _, logits = graphs.step(rows, None, bucket_rows(len(rows)))
            for i, row_logits in zip(list(running), logits):
                done[i] += 1
                got[i].append(row_logits.clone())
                if done[i] == len(gen[i]):  # leaves
                    running.remove(i)
                    blocks.close(i)
    for i in range(n_seqs):
        assert len(got[i]) == len(gen[i]) + 1
        for step, (a, b) in enumerate(zip(got[i][: len(want[i])], want[i])):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"sequence {i} step {step}")
    assert blocks.free_blocks == blocks.usable_blocks
    assert preempted > 0  # 8 blocks for up to 6 rows of up to 4 blocks: the pool runs out
    assert {k[0] for k in graphs.entries} <= {bucket_rows(n) for n in range(1, 7)}


def test_runs_of_blocks_come_from_the_top_and_go_back():
    m = BlockManager(num_blocks=12, block_size=8, rows=2, max_blocks=4, device=torch.device("cpu"))
    assert m.open(1, 16) and m.blocks(1) == [1, 2]  # sequences from the bottom
    assert m.take_run(4) == 8  # runs from the top: blocks 8..11
    assert (m.free_blocks, m.run_blocks, m.used_blocks) == (5, 4, 2)
    assert m.take_run(6) is None  # 5 free, and no 6 in a row
    assert m.take_run(5) == 3 and m.free_blocks == 0  # 3..7, consecutive
    m.give_run(3, 5)
    m.close(1)
    assert m.take_run(3) == 5  # the highest free run of 3: 5..7 (8..11 still lent)
    assert m.open(2, 8) and m.blocks(2) == [1]  # sequences still take the lowest first
    m.give_run(5, 3)
    m.give_run(8, 4)
    m.close(2)
    assert (m.free_blocks, m.run_blocks, m.used_blocks) == (11, 0, 0)
    assert m.take_run(11) == 1  # all of it in one run again (never the null block)
