"""kernels.paged_attention's Triton kernels vs the torch reference on the GPU, fresh random inputs:
bf16 / fp16 / fp32, head dims 16..128, GQA groups 1..8 and the Qwen2-VL-7B shape (28 query heads,
4 KV heads, D 128) with contexts up to 4k and B up to 64, block sizes 8..256, forced and default
splits; and CUDA-graph replay: captured once, the tables' contents changed (longer and shorter
rows, other pages, a zero-length padded row), replayed, compared with the reference.
Skipped without CUDA or triton.
"""

import random

import pytest
import torch

from kernels import paged_attention
from kernels.paged_attention import default_num_splits, paged_decode_attention, paged_decode_attention_reference

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if not paged_attention.available("cuda"):
    pytest.skip("needs triton", allow_module_level=True)

DEV = torch.device("cuda")


def tolerance(dtype):
    # bf16/fp16: P is rounded to the input dtype before P.V (as in flash attention), out rounded once
    return {torch.bfloat16: (2e-2, 2e-2), torch.float16: (3e-3, 3e-3), torch.float32: (2e-5, 2e-5)}[dtype]


def make_pool(seed, lens, block_size, kv_heads, heads, head_dim, dtype, spare=16, max_blocks=None):
    """Pages of every row at shuffled places in one pool; random valid ids past each row's length."""
    rnd = random.Random(seed)
    g = torch.Generator(device=DEV).manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + spare
    order = list(range(num_blocks))
    rnd.shuffle(order)
    max_blocks = max_blocks or max(need + [1]) + 2
    tables = torch.randint(0, num_blocks, (len(lens), max_blocks), dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(order[at : at + n], dtype=torch.int32)
        at += n
    q = torch.randn(len(lens), heads, head_dim, device=DEV, generator=g).to(dtype)
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=DEV, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=DEV, generator=g).to(dtype)
    return q, k, v, tables.to(DEV), torch.tensor(lens, dtype=torch.int32, device=DEV)


REL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}  # of the whole output's norm


def check(out, ref, dtype):
    atol, rtol = tolerance(dtype)
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    rel = ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()
    assert rel < REL[dtype], rel


# (B, KVH, group, D, block_size, max_len, num_splits)
SHAPES = [
    (1, 1, 1, 16, 8, 100, None),
    (5, 2, 2, 32, 16, 300, None),
    (3, 2, 4, 64, 16, 1000, 1),
    (7, 4, 7, 128, 16, 4096, None),  # Qwen2-VL-7B heads
    (64, 4, 7, 128, 16, 4096, None),
    (64, 4, 7, 128, 32, 2048, 1),
    (16, 4, 7, 128, 64, 1200, 8),
    (9, 2, 8, 128, 256, 3000, None),
    (4, 1, 5, 96, 8, 777, 3),  # D 96 padded to 128, group 5
    (33, 8, 1, 128, 128, 2500, 16),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_kv{}_g{}_d{}_bs{}_L{}_S{}".format(*s))
def test_kernel_matches_reference(shape, dtype):
    b, kvh, group, d, bs, max_len, splits = shape
    rnd = random.Random(str(shape))
    lens = [rnd.randint(1, max_len) for _ in range(b)]
    lens[0] = max_len  # the longest row is in every case
    q, k, v, bt, seq_lens = make_pool(len(lens) + d, lens, bs, kvh, kvh * group, d, dtype)
    scale = d**-0.5
    out = paged_decode_attention(q, k, v, bt, seq_lens, scale, num_splits=splits)
    check(out, paged_decode_attention_reference(q, k, v, bt, seq_lens, scale), dtype)


def test_split_counts_agree_and_out_is_filled():
    lens = [1, 15, 16, 17, 63, 64, 65, 1000, 2049]
    q, k, v, bt, seq_lens = make_pool(5, lens, 16, 4, 28, 128, torch.float32)
    ref = paged_decode_attention_reference(q, k, v, bt, seq_lens, 0.1)
    for s in (1, 2, 3, 7, 16, 40):
        out = torch.full_like(q, float("nan"))
        assert paged_decode_attention(q, k, v, bt, seq_lens, 0.1, out=out, num_splits=s) is out
        check(out, ref, torch.float32)


def test_zero_length_row_is_zero():
    q, k, v, bt, seq_lens = make_pool(6, [40, 0, 300], 16, 2, 8, 64, torch.bfloat16)
    for s in (1, 4):
        out = paged_decode_attention(q, k, v, bt, seq_lens, 0.125, num_splits=s)
        assert torch.all(out[1] == 0)
        check(out, paged_decode_attention_reference(q, k, v, bt, seq_lens, 0.125), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("splits", [None, 1])
def test_graph_replay_follows_new_tables(dtype, splits):
    """One capture, then new lengths (longer and shorter, a zero-length padded row) and other pages
    written into the same buffers: each replay equals the reference for the new contents."""
    b, kvh, heads, d, bs, max_blocks = 16, 4, 28, 128, 16, 256  # up to 4096 tokens a row
    rnd = random.Random(42)
    lens0 = [rnd.randint(1, 300) for _ in range(b)]
    q, k, v, bt, seq_lens = make_pool(1, [4096] * b, bs, kvh, heads, d, dtype, max_blocks=max_blocks)
    num_blocks = k.shape[0]
    bt.copy_(torch.randint(0, num_blocks, bt.shape, dtype=torch.int32, device=DEV))
    seq_lens.copy_(torch.tensor(lens0, dtype=torch.int32))
    out = torch.empty_like(q)
    scale = d**-0.5
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside capture (JIT compile)
        paged_decode_attention(q, k, v, bt, seq_lens, scale, out=out, num_splits=splits)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, k, v, bt, seq_lens, scale, out=out, num_splits=splits)
    graph.replay()
    check(out, paged_decode_attention_reference(q, k, v, bt, seq_lens, scale), dtype)
    for trial in range(4):
        lens = [rnd.choice([0, 1, rnd.randint(1, 64), rnd.randint(300, 4096)]) for _ in range(b)]
        lens[trial] = 4096
        pages = torch.randperm(num_blocks, device=DEV)[: b * max_blocks].view(b, max_blocks).to(torch.int32)
        bt.copy_(pages)
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn_like(q, dtype=torch.float32).to(dtype))
        graph.replay()
        ref = paged_decode_attention_reference(q, k, v, bt, seq_lens, scale)
        check(out, ref, dtype)
        assert all(torch.all(out[i] == 0) for i, n in enumerate(lens) if n == 0)


def test_default_splits_fill_the_gpu():
    assert default_num_splits(8, 4) * 8 * 4 >= 264
    assert default_num_splits(64, 4) == 2
