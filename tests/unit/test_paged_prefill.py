"""kernels.paged_prefill on CPU: the torch reference vs a naive per-row causal attention on fresh
random inputs (R 1..4 rows, 1..40 query tokens a row after prefixes of 0..60, decode rows of one
token mixed with chunk rows, block sizes 8/16, GQA groups 1/2/4/7, shuffled page tables, garbage in
the unused table slots), the reference vs the decode reference when every row is a decode row, the
CPU dispatch and the input checks; and, when triton is installed, the Triton kernel itself under
the Triton interpreter (a subprocess: TRITON_INTERPRET=1 must be set before triton is imported),
fp32 and fp16 (the interpreter's bf16 tl.dot is wrong, see test_paged_attention.py; bf16 is in
tests/gpu/test_paged_prefill_gpu.py).
"""

from __future__ import annotations

import itertools
import json
import random
import sys
from pathlib import Path

import pytest
import torch

from test_paged_attention import (  # the decode tests' pool builders and harness (tests/unit is on sys.path)
    block_major,
    check_self_check,
    interpreter_rows,
    make_case,
    needs_triton,
)

from kernels.paged_attention import paged_decode_attention_reference
from kernels.paged_prefill import paged_prefill_attention, paged_prefill_attention_reference

REPO = Path(__file__).resolve().parents[2]


def make_prefill(seed, n, prefix, block_size, kv_heads, group, head_dim, dtype=torch.float32, garbage="random", pad=0):
    """Rows of n[i] query tokens after prefix[i] cached ones: the pool and tables of `make_case`
    for contexts n + prefix, packed q (sum(n) + pad, H, D), cu_q, seq_lens."""
    lens = [a + b for a, b in zip(n, prefix)]
    _, k, v, tables, seq_lens = make_case(
        seed, lens, block_size, kv_heads, group, head_dim, dtype=dtype, garbage=garbage
    )
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(n) + pad, kv_heads * group, head_dim, generator=g).to(dtype)
    cu_q = torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32)
    return q, k, v, tables, cu_q, seq_lens


def naive(q, k_cache, v_cache, tables, cu_q, seq_lens, scale):
    """Row by row, query by query, head by head: the definition, fp64 (zeros past cu_q[R])."""
    h, d = q.shape[1:]
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(tables.shape[0]):
        a, b, length = int(cu_q[i]), int(cu_q[i + 1]), int(seq_lens[i])
        ks = torch.stack([k_cache[int(tables[i, t // bs]), t % bs] for t in range(length)]).double()  # (L, KVH, D)
        vs = torch.stack([v_cache[int(tables[i, t // bs]), t % bs] for t in range(length)]).double()
        for j in range(b - a):
            p = length - (b - a) + j  # the query's position: it sees keys 0..p
            for hh in range(h):
                kv = hh // (h // kvh)
                s = ks[: p + 1, kv] @ q[a + j, hh].double() * scale
                w = torch.exp(s - s.max())
                out[a + j, hh] = (w / w.sum()) @ vs[: p + 1, kv]
    return out


def random_cases(count, seed=0):
    rnd = random.Random(seed)
    for c in range(count):
        r = rnd.randint(1, 4)
        n = [rnd.choice([1, rnd.randint(1, 40)]) for _ in range(r)]  # decode rows among chunk rows
        yield {
            "seed": seed * 1000 + c,
            "n": n,
            "prefix": [rnd.choice([0, rnd.randint(0, 60)]) for _ in range(r)],
            "block_size": rnd.choice([8, 16]),
            "kv_heads": rnd.choice([1, 2]),
            "group": rnd.choice([1, 2, 4, 7]),
            "head_dim": rnd.choice([16, 32]),
            "garbage": rnd.choice(["random", "zero"]),
        }


@pytest.mark.parametrize("seed", range(4))
def test_reference_matches_naive(seed):
    for case in random_cases(5, seed):
        q, k, v, bt, cu_q, lens = make_prefill(**case)
        scale = q.shape[-1] ** -0.5
        got = paged_prefill_attention_reference(q, k, v, bt, cu_q, lens, scale)
        assert got.dtype == q.dtype and got.shape == q.shape
        torch.testing.assert_close(
            got.double(), naive(q, k, v, bt, cu_q, lens, scale), atol=2e-6, rtol=1e-5, msg=str(case)
        )


def test_reference_is_the_decode_reference_for_decode_rows():
    for seed, (lens, bs, kvh, group, d) in enumerate(
        [([1, 37, 100, 64], 16, 2, 7, 32), ([5, 9], 8, 1, 4, 16), ([60, 1, 17], 8, 4, 1, 32)]
    ):
        q, k, v, bt, seq_lens = make_case(50 + seed, lens, bs, kvh, group, d)
        cu_q = torch.arange(len(lens) + 1, dtype=torch.int32)
        torch.testing.assert_close(
            paged_prefill_attention_reference(q, k, v, bt, cu_q, seq_lens, 0.3),
            paged_decode_attention_reference(q, k, v, bt, seq_lens, 0.3),
            atol=1e-6,
            rtol=1e-6,
        )


def test_reference_bf16_within_one_rounding_and_long_rows_chunked():
    # 300 query tokens: more than REFERENCE_QUERY_CHUNK, so the reference's query chunks are crossed
    q, k, v, bt, cu_q, lens = make_prefill(7, [300, 1, 20], [5, 40, 0], 16, 2, 7, 32, dtype=torch.bfloat16)
    got = paged_prefill_attention_reference(q, k, v, bt, cu_q, lens, 0.125)
    want = naive(q, k, v, bt, cu_q, lens, 0.125)
    assert got.dtype == torch.bfloat16
    assert torch.all((got.double() - want).abs() <= want.abs() * 2**-7 + 1e-6)  # one bf16 ulp


def test_padding_tokens_and_empty_rows_are_left_alone():
    q, k, v, bt, cu_q, lens = make_prefill(3, [4, 0, 9], [5, 7, 0], 8, 2, 2, 16, pad=3)
    assert int(cu_q[-1]) == q.shape[0] - 3
    out = torch.full_like(q, float("nan"))
    assert paged_prefill_attention(q, k, v, bt, cu_q, lens, 0.25, out=out) is out  # CPU: the reference
    assert torch.isnan(out[-3:]).all() and not torch.isnan(out[:-3]).any()
    fresh = paged_prefill_attention_reference(q, k, v, bt, cu_q, lens, 0.25)
    assert torch.all(fresh[-3:] == 0) and torch.equal(fresh[:-3], out[:-3])
    torch.testing.assert_close(fresh.double(), naive(q, k, v, bt, cu_q, lens, 0.25), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "bad", ["dtype", "out", "cu_q_dtype", "cu_q_rows", "cu_q_device", "short_context", "decreasing", "past_t"]
)
def test_checks_reject_bad_inputs(bad):
    """The prefill's own inputs (the pool's, q's and the tables' checks are paged_attention's, tested
    there; "dtype" and "out" show they run here too, with out being q's shape)."""
    q, k, v, bt, cu_q, lens = make_prefill(1, [4, 9], [0, 3], 8, 2, 2, 16)
    kw = {}
    if bad == "dtype":
        k = k.half()
    elif bad == "out":
        kw["out"] = torch.empty(2, 4, 16)  # decode's (rows, H, D), not q's (T, H, D)
    elif bad == "cu_q_dtype":
        cu_q = cu_q.long()
    elif bad == "cu_q_rows":
        cu_q = cu_q[:2]
    elif bad == "cu_q_device":
        cu_q = cu_q.to("meta")
    elif bad == "short_context":  # row 1's 9 query tokens in a context of 8
        lens = torch.tensor([4, 8], dtype=torch.int32)
    elif bad == "decreasing":
        cu_q = torch.tensor([0, 9, 4], dtype=torch.int32)
    elif bad == "past_t":
        cu_q = torch.tensor([0, 4, 14], dtype=torch.int32)
    with pytest.raises((ValueError, TypeError)):
        paged_prefill_attention(q, k, v, bt, cu_q, lens, 0.25, **kw)


# ---- the Triton kernel under the interpreter ---------------------------------------------------

# (n, prefix, block_size, kv_heads, group, head_dim, dtype, block_m, tile_n); None: default_config's
INTERPRETER_CASES = [
    ([1, 37, 5, 1], [20, 0, 60, 0], 8, 2, 4, 32, "float32", 32, 16),  # decode rows + chunks; strided q; padding
    ([40], [3], 16, 1, 7, 16, "float32", 32, 16),  # group 7: 4 tokens x 7 heads of 32 rows, many tiles
    ([1, 1, 12], [60, 9, 0], 16, 2, 2, 64, "float16", 32, 32),
    ([9, 0, 30], [0, 4, 33], 32, 1, 1, 128, "float32", 16, 16),  # MHA, an empty row, tile smaller than a page
    ([20, 3], [50, 0], 8, 2, 3, 48, "float32", None, None),  # D 48 padded to 64; the default config
    ([17, 1], [6, 100], 256, 1, 8, 16, "float16", 16, 64),  # group 8 (2 tokens a tile), one 256-token page
]


def _interpreter_main() -> None:
    """Runs INTERPRETER_CASES through the Triton path (TRITON_INTERPRET=1 already set) and prints
    one JSON line per case: the max abs error against the reference, whether `out` was reused and
    whether the padding rows past cu_q[R] were left alone."""
    from kernels.paged_prefill import paged_prefill_attention_triton

    for i, (n, prefix, bs, kvh, group, d, dtype, bm, tn) in enumerate(INTERPRETER_CASES):
        pad = 2 if i == 0 else 0
        q, k, v, bt, cu_q, lens = make_prefill(
            200 + i, n, prefix, bs, kvh, group, d, dtype=getattr(torch, dtype), pad=pad
        )
        if i == 0:  # a strided q (a view into a wider projection output), last dim contiguous
            wide = torch.randn(q.shape[0], q.shape[1] + 3, d).to(q.dtype)
            wide[:, : q.shape[1]] = q
            q = wide[:, : q.shape[1]]
        if i == 1:  # the engine's strides: one layer of a block-major pool (KVPool.storage)
            k, v = block_major(k, v)
        scale = d**-0.5
        out = torch.full_like(q, float("nan")).contiguous()
        got = paged_prefill_attention_triton(q, k, v, bt, cu_q, lens, scale, out=out, block_m=bm, tile_n=tn)
        want = paged_prefill_attention_reference(q, k, v, bt, cu_q, lens, scale)
        rows = int(cu_q[-1])
        print(
            json.dumps(
                {
                    "case": i,
                    "err": (got[:rows].float() - want[:rows].float()).abs().max().item(),
                    "same_out": got is out,
                    "finite": bool(torch.isfinite(got[:rows]).all()),
                    "padding_untouched": bool(torch.isnan(got[rows:]).all()),
                }
            )
        )


@needs_triton
def test_triton_kernel_under_interpreter():
    for r in interpreter_rows(__file__, len(INTERPRETER_CASES)):
        dtype = INTERPRETER_CASES[r["case"]][6]
        assert r["same_out"] and r["finite"] and r["padding_untouched"], r
        assert r["err"] < (2e-5 if dtype == "float32" else 4e-3), r


if __name__ == "__main__" and "--interpret" in sys.argv:
    _interpreter_main()


def test_self_check_reports_a_wrong_or_failing_kernel(monkeypatch):
    """The worker then prefills on the reference; the 7B shape's check inputs build."""
    from kernels import paged_prefill as pp

    check_self_check(monkeypatch, pp, "paged_prefill_attention_triton", pp.paged_prefill_attention_reference, 7)
    monkeypatch.setattr(
        pp, "paged_prefill_attention_triton", lambda *a, **kw: pp.paged_prefill_attention_reference(*a[:7])
    )
    assert pp.self_check("cpu", torch.bfloat16, 28, 4, 128, 16) is None
