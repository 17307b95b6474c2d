"""kernels.paged_prefill's Triton kernel vs the torch reference on the GPU, fresh random inputs:
bf16 / fp16 / fp32, head dims 16..128 (and 96, padded), GQA groups 1..8, block sizes 8..256, the
Qwen2-VL-7B shape (28 query heads, 4 KV heads, D 128) with a 2k-token chunk after a 4k prefix
mixed with decode rows, a 16k-token context, forced tile configs (the bench's), padding tokens and
empty rows, the decode kernel's answer for decode rows, CUDA-graph replay after new row splits and
lengths for the same (T, R), and the start-up self check. Skipped without CUDA or triton.
"""

import itertools
import random

import pytest
import torch

from kernels import paged_prefill
from kernels.paged_attention import paged_decode_attention
from kernels.paged_prefill import paged_prefill_attention, paged_prefill_attention_reference

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if not paged_prefill.available("cuda"):
    pytest.skip("needs triton", allow_module_level=True)

from test_paged_attention_gpu import DEV, check, make_pool  # the decode tests' pool and tolerances


def make_rows(seed, n, prefix, block_size, kv_heads, heads, head_dim, dtype, pad=0, max_blocks=None):
    """`make_pool` for contexts n + prefix (shuffled pages, random ids past each row), packed q
    (sum(n) + pad, H, D), cu_q and seq_lens on the GPU."""
    lens = [a + b for a, b in zip(n, prefix)]
    _, k, v, tables, seq_lens = make_pool(
        seed, lens, block_size, kv_heads, heads, head_dim, dtype, max_blocks=max_blocks
    )
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    q = torch.randn(sum(n) + pad, heads, head_dim, device=DEV, generator=g).to(dtype)
    cu_q = torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32, device=DEV)
    return q, k, v, tables, cu_q, seq_lens


def run_and_check(q, k, v, bt, cu_q, lens, dtype, **kw):
    scale = q.shape[-1] ** -0.5
    if kw:
        out = paged_prefill.paged_prefill_attention_triton(q, k, v, bt, cu_q, lens, scale, **kw)
    else:
        out = paged_prefill_attention(q, k, v, bt, cu_q, lens, scale)
    check(out, paged_prefill_attention_reference(q, k, v, bt, cu_q, lens, scale), dtype)
    return out


DECODE_CONTEXTS = [1, 17, 300, 1200, 4096, 2500, 64, 999]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_7b_chunk_after_4k_prefix_mixed_with_decode_rows(dtype):
    rnd = random.Random(1)
    n = [2048, 1, 300] + [1] * len(DECODE_CONTEXTS)
    prefix = [4096, 700, 0] + [c - 1 for c in DECODE_CONTEXTS]
    order = list(range(len(n)))
    rnd.shuffle(order)  # the chunk rows somewhere among the decode rows
    q, k, v, bt, cu_q, lens = make_rows(3, [n[i] for i in order], [prefix[i] for i in order], 16, 4, 28, 128, dtype)
    run_and_check(q, k, v, bt, cu_q, lens, dtype)


# (n, prefix, KVH, group, D, block_size)
SHAPES = [
    ([1], [0], 1, 1, 16, 8),
    ([100, 1, 37], [0, 50, 200], 2, 2, 32, 16),
    ([513], [1000], 2, 4, 64, 32),
    ([64, 64, 1, 1], [0, 64, 4000, 0], 4, 7, 128, 64),
    ([777, 5], [333, 9000], 2, 8, 128, 256),
    ([250, 1], [17, 1500], 1, 5, 96, 8),  # D 96 padded to 128, group 5
    ([129, 3, 1000], [0, 0, 128], 8, 1, 128, 128),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "R{}_kv{}_g{}_d{}_bs{}".format(len(s[0]), *s[2:]))
def test_kernel_matches_reference(shape, dtype):
    n, prefix, kvh, group, d, bs = shape
    q, k, v, bt, cu_q, lens = make_rows(sum(n) + d, n, prefix, bs, kvh, kvh * group, d, dtype)
    run_and_check(q, k, v, bt, cu_q, lens, dtype)


def test_16k_context():
    q, k, v, bt, cu_q, lens = make_rows(4, [512, 1], [16384 - 512, 16383], 16, 4, 28, 128, torch.bfloat16)
    run_and_check(q, k, v, bt, cu_q, lens, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "cfg",
    [
        (64, 32, 4, 2),
        (64, 64, 4, 3),
        (128, 32, 8, 3),
        (128, 64, 8, 2),
        (128, 128, 8, 2),
        (256, 32, 8, 2),
        (16, 16, 4, 1),
    ],
    ids=lambda c: "m{}_n{}_w{}_s{}".format(*c),
)
def test_forced_configs(cfg, dtype):
    if dtype == torch.float32 and (cfg[0] > 128 or cfg[1] > 64):
        pytest.skip("fp32 tiles this large are not a config anyone runs (registers, shared memory)")
    bm, tn, warps, stages = cfg
    q, k, v, bt, cu_q, lens = make_rows(5, [700, 1, 1, 90], [1300, 40, 2999, 0], 16, 4, 28, 128, dtype)
    run_and_check(q, k, v, bt, cu_q, lens, dtype, block_m=bm, tile_n=tn, num_warps=warps, num_stages=stages)


def test_padding_tokens_and_empty_rows_are_left_alone():
    q, k, v, bt, cu_q, lens = make_rows(6, [40, 0, 300, 1], [10, 77, 0, 5], 16, 2, 8, 64, torch.bfloat16, pad=37)
    out = torch.full_like(q, float("nan"))
    assert paged_prefill_attention(q, k, v, bt, cu_q, lens, 0.125, out=out) is out
    rows = int(cu_q[-1])
    assert torch.isnan(out[rows:]).all()
    check(out[:rows], paged_prefill_attention_reference(q, k, v, bt, cu_q, lens, 0.125)[:rows], torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_rows_match_the_decode_kernel(dtype):
    lens = [1, 15, 16, 17, 300, 4096, 2049, 64]
    q, k, v, bt, seq_lens = make_pool(7, lens, 16, 4, 28, 128, dtype)
    cu_q = torch.arange(len(lens) + 1, dtype=torch.int32, device=DEV)
    got = paged_prefill_attention(q, k, v, bt, cu_q, seq_lens, 0.1)
    check(got, paged_decode_attention(q, k, v, bt, seq_lens, 0.1), dtype)


def test_graph_replay_follows_new_rows():
    """The grid depends on (T, R, KVH) only: one capture, then other splits of T into the R rows
    (empty rows, padding tokens past cu_q[R]), other contexts and pages written into the same
    buffers; each replay equals the reference."""
    r, t, heads, kvh, d, bs, max_blocks = 6, 1024, 28, 4, 128, 16, 512  # up to 8192 tokens a row
    q, _, _, bt, cu_q, lens = make_rows(
        8,
        [t // r] * (r - 1) + [t - t // r * (r - 1)],
        [100] * r,
        bs,
        kvh,
        heads,
        d,
        torch.bfloat16,
        max_blocks=max_blocks,
    )
    k = torch.randn(r * max_blocks + 1, bs, kvh, d, device=DEV).to(torch.bfloat16)
    v = torch.randn_like(k)
    out = torch.empty_like(q)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside capture (JIT compile)
        paged_prefill_attention(q, k, v, bt, cu_q, lens, None, out=out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_prefill_attention(q, k, v, bt, cu_q, lens, None, out=out)
    rnd = random.Random(9)
    for trial in range(4):
        used = t - 10 * trial  # trial > 0: padding tokens at the end
        starts = [0, *sorted(rnd.randint(0, used) for _ in range(r - 1)), used]
        n = [b - a for a, b in zip(starts, starts[1:])]
        ctx = [x + rnd.choice([0, 1, rnd.randint(1, 4000), max_blocks * bs - x]) for x in n]
        cu_q.copy_(torch.tensor(starts, dtype=torch.int32))
        lens.copy_(torch.tensor(ctx, dtype=torch.int32))
        bt.copy_(torch.randperm(k.shape[0], device=DEV)[: r * max_blocks].view(r, max_blocks).to(torch.int32))
        q.copy_(torch.randn_like(q, dtype=torch.float32).to(q.dtype))
        graph.replay()
        check(out[:used], paged_prefill_attention_reference(q, k, v, bt, cu_q, lens, None)[:used], torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 256])
def test_self_check_passes_on_the_7b_shape(dtype, block_size):
    assert paged_prefill.self_check(DEV, dtype, 28, 4, 128, block_size) is None
